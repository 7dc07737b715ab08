#!/usr/bin/env bash
# On the GPU machine (no Bazel): build the kernel libraries, run the kernel tests on CUDA
# through JAX, and time paged_attention. Raw outputs go to $OUT (default /tmp/xla_ext_out).
# Needs the FFI headers carried in .devbuild/ffi_include (see build_kernels.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/xla_ext_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import jax, numpy, pytest, torch; print("jax", jax.__version__, jax.devices(),
"pytest", pytest.__version__, "torch", torch.__version__)' > "$OUT/env.txt" 2>&1
cat "$OUT/gpu.txt" "$OUT/env.txt"

if ! tools/device/build_kernels.sh > "$OUT/build.txt" 2>&1; then
  grep -v -i warning "$OUT/build.txt" | tail -40
  exit 1
fi

XLA_EXT_TEST_PLATFORM=cuda python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/kernels > "$OUT/tests.txt" 2>&1
tail -25 "$OUT/tests.txt"
python3 bench/decode_bench.py --out "$OUT/bench.json" "$@" > /dev/null 2> "$OUT/bench.err"
cat "$OUT/bench.json"; tail -5 "$OUT/bench.err"
