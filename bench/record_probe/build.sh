#!/usr/bin/env bash
# Builds the record probe against the FFI headers of the installed jaxlib (0.11.2 or newer: it
# needs xla/ffi/api/record_api.h) into .devbuild/record_probe/. Run on the GPU machine.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$HERE/../../.devbuild/record_probe"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
INCLUDE="$(python3 -c "import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))")"
[[ -f "$INCLUDE/xla/ffi/api/record_api.h" ]] || {
  echo "no xla/ffi/api/record_api.h under $INCLUDE: the probe needs jaxlib 0.11.2 or newer" >&2; exit 1; }
mkdir -p "$OUT"
"$CUDA_HOME/bin/nvcc" -cubin -arch=sm_90a -O3 "$HERE/add_kernel.cu" -o "$OUT/add.cubin"
python3 - "$OUT/add.cubin" "$OUT/add_cubin.h" <<'PY'
import sys
data = open(sys.argv[1], "rb").read()
with open(sys.argv[2], "w") as f:
    f.write("alignas(8) static const unsigned char kAddCubin[] = {%s};\n" % ",".join(map(str, data)))
PY
"$CUDA_HOME/bin/nvcc" -std=c++17 -O3 -shared -Xcompiler=-fPIC -gencode=arch=compute_90a,code=sm_90a \
  -isystem "$INCLUDE" -I "$OUT" -I "$HERE" "$HERE/probe.cu" -o "$OUT/libprobe.so"
echo "$OUT/libprobe.so"
