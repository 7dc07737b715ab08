#!/usr/bin/env bash
# Makes FlashInfer 0.2.14.post1 importable on the GPU machine with no install step (its kernels
# are JIT-built through torch's cpp_extension on first use): unpacks the sdist carried in .fi/
# into /tmp/flashinfer_tree/flashinfer with the data/ layout its jit/env.py expects, and prints
# the directory to put on PYTHONPATH. The sdist is fetched once, on a machine with network
# access (pip cannot download it without building its metadata, which needs torch):
#   tools/device/flashinfer_tree.sh --fetch      # -> .fi/ (gitignored; carry it to the GPU)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
SDIST=.fi/flashinfer_python-0.2.14.post1.tar.gz
TREE=/tmp/flashinfer_tree
if [[ ${1:-} == --fetch ]]; then
  mkdir -p .fi
  python3 - "$SDIST" <<'PY'
import re, sys, urllib.request
html = urllib.request.urlopen("https://pypi.org/simple/flashinfer-python/").read().decode()
url = re.search(r'href="([^"#]*/flashinfer_python-0\.2\.14\.post1\.tar\.gz)#sha256=(\w+)', html)
data = urllib.request.urlopen(url.group(1)).read()
import hashlib
assert hashlib.sha256(data).hexdigest() == url.group(2), "sha256 mismatch"
open(sys.argv[1], "wb").write(data)
PY
  exit
fi
[[ -f $SDIST ]] || { echo "no $SDIST: run tools/device/flashinfer_tree.sh --fetch" >&2; exit 1; }
if [[ ! -d $TREE/flashinfer/data ]]; then
  rm -rf "$TREE" /tmp/flashinfer_src && mkdir -p "$TREE" /tmp/flashinfer_src
  tar xzf "$SDIST" -C /tmp/flashinfer_src
  src=(/tmp/flashinfer_src/flashinfer_python-*)
  cp -r "$src/flashinfer" "$TREE/"
  data="$TREE/flashinfer/data"
  mkdir -p "$data/cutlass/tools/util" "$data/spdlog"
  cp -r "$src/include" "$src/csrc" "$src/tvm_binding" "$data/"
  cp -r "$src/3rdparty/spdlog/include" "$data/spdlog/"
  cp -r "$src/3rdparty/cutlass/include" "$data/cutlass/"
  cp -r "$src/3rdparty/cutlass/tools/util/include" "$data/cutlass/tools/util/"
fi
echo "$TREE"
