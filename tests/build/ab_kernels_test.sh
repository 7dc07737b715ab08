#!/usr/bin/env bash
# tools/device/ab_kernels.sh prepare: a variant holds REV's copies of the changed kernel files at
# their paths, and bad arguments are refused with a message naming them. (build and run need
# nvcc and a GPU: tools/device, on the GPU machine.)
set -euo pipefail
script=$1
repo=$(mktemp -d "${TEST_TMPDIR:-/tmp}/ab_kernels.XXXXXX")
export HOME="${HOME:-$repo}"
trap 'rm -rf "$repo"' EXIT
mkdir -p "$repo/tools/device" "$repo/kernels/op" "$repo/torch_xla_ext/csrc"
cp "$script" "$repo/tools/device/ab_kernels.sh"
cd "$repo"
git init -q
git config user.email test@example.com
git config user.name test
echo "committed kernel" > kernels/op/op_cuda.cu
echo "committed header" > kernels/op/split.cuh
echo "committed binder" > torch_xla_ext/csrc/binder.cc
git add -A
git commit -q -m base
rev=$(git rev-parse HEAD)
echo "changed kernel" > kernels/op/op_cuda.cu
echo "changed binder" > torch_xla_ext/csrc/binder.cc

fail() { echo "FAIL: $*"; exit 1; }
expect_error() {  # message pattern, arguments...
  local pattern=$1 output
  shift
  if output=$(tools/device/ab_kernels.sh "$@" 2>&1); then fail "accepted: $*"; fi
  grep -q -- "$pattern" <<<"$output" || fail "for '$*' expected '$pattern', got: $output"
}

tools/device/ab_kernels.sh prepare base "$rev" > /dev/null
[[ $(cat .ab/base/kernels/op/op_cuda.cu) == "committed kernel" ]] || fail "op_cuda.cu is not REV's"
[[ $(cat .ab/base/torch_xla_ext/csrc/binder.cc) == "committed binder" ]] || fail "binder.cc is not REV's"
[[ ! -e .ab/base/kernels/op/split.cuh ]] || fail "an unchanged file was copied"
[[ $(cat kernels/op/op_cuda.cu) == "changed kernel" ]] || fail "the working tree was touched"

tools/device/ab_kernels.sh prepare one "$rev" kernels/op/split.cuh > /dev/null
[[ $(find .ab/one -type f | wc -l) == 1 && -f .ab/one/kernels/op/split.cuh ]] || fail "named paths"

expect_error "NAME must be" prepare tree "$rev"
expect_error "NAME must be" prepare "a b" "$rev"
expect_error "REV must name a commit; got 'nosuchrev'" prepare base nosuchrev
expect_error "kernels/op/new.cu is not in" prepare base "$rev" kernels/op/new.cu
expect_error "base2 is not built" run base2 -- true
expect_error "usage\|A/B" run base
git checkout -q -- .
expect_error "nothing to replace" prepare base "$rev"
echo "PASS"
