#!/usr/bin/env bash
# Builds torch_xla_ext/lib/libxla_ext_{kernels,binder,torch,pjrt_shim}.so with nvcc and g++
# directly, for machines without Bazel (the GPU machine). Same sources as
# torch_xla_ext/lib/BUILD.bazel, nvcc flags from tools/cuda_flags.bzl (as Bazel's);
# libxla_ext_torch.so against the torch of `python3` (its headers and libraries). Run from
# anywhere; objects go to .devbuild/obj.
#
#   tools/device/build_kernels.sh [all|torch]   (torch: only libxla_ext_torch.so, again, e.g.
#                                               against another torch on PYTHONPATH)
#
#   XLA_FFI_INCLUDE  directory holding xla/ffi/api/*.h (jaxlib 0.7.1's, FFI 0.1);
#                    default .devbuild/ffi_include
#   CUDA_HOME        default /usr/local/cuda
#   JOBS             parallel compiles, default: number of CPUs
#   CUDA_GENCODE     replaces the -gencode flags (e.g. "-gencode=arch=compute_90a,code=sm_90a")
#   NVCC_EXTRA_FLAGS appended to every nvcc command (e.g. the -D flags of
#                    kernels/common/tuning.h's knobs)
#   LIB_OUT          where the libraries go, default torch_xla_ext/lib (where the package finds
#                    them first; another directory builds them without shadowing Bazel's)
set -euo pipefail
WHAT="${1:-all}"
[[ $WHAT == all || $WHAT == torch ]] || { echo "usage: $0 [all|torch]" >&2; exit 2; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
FFI_INCLUDE="${XLA_FFI_INCLUDE:-$ROOT/.devbuild/ffi_include}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
JOBS="${JOBS:-$(nproc)}"
LIB_OUT="${LIB_OUT:-torch_xla_ext/lib}"
[[ -f "$FFI_INCLUDE/xla/ffi/api/ffi.h" ]] || {
  echo "no XLA FFI headers under $FFI_INCLUDE (set XLA_FFI_INCLUDE)" >&2; exit 1; }

BUILD="$ROOT/.devbuild"
OBJ="$BUILD/obj"
# Kernels include the registry as "xla_ext/registry.h" (kernels/registry/BUILD.bazel).
mkdir -p "$OBJ" "$BUILD/include" "$LIB_OUT"
ln -sfn "$ROOT/kernels/registry" "$BUILD/include/xla_ext"

INCLUDES=(-I "$ROOT" -I "$BUILD/include" -isystem "$FFI_INCLUDE" -isystem "$CUDA_HOME/include")
# The flags Bazel uses (tools/cuda_flags.bzl: two lists of strings, read here as Python).
bzl_list() { python3 -c "exec(open('tools/cuda_flags.bzl').read()); print(' '.join($1))"; }
read -r -a CUDA_ARCH_FLAGS <<<"$(bzl_list CUDA_ARCH_FLAGS)"
read -r -a NVCC_FLAGS <<<"$(bzl_list NVCC_FLAGS)"
[[ -n "${CUDA_GENCODE:-}" ]] && read -r -a CUDA_ARCH_FLAGS <<<"$CUDA_GENCODE"
read -r -a NVCC_EXTRA <<<"${NVCC_EXTRA_FLAGS:-}"
CXXFLAGS=(-std=c++17 -O2 -fPIC -fvisibility=hidden)

compile() {  # source -> object, by extension
  local src="$1" obj="$OBJ/${1//\//_}.o"
  case "$src" in
    *.cu) "$CUDA_HOME/bin/nvcc" "${NVCC_FLAGS[@]}" "${CUDA_ARCH_FLAGS[@]}" "${NVCC_EXTRA[@]}" \
            "${INCLUDES[@]}" -c "$src" -o "$obj" ;;
    *) g++ "${CXXFLAGS[@]}" "${INCLUDES[@]}" "${TORCH_INCLUDES[@]}" -c "$src" -o "$obj" ;;
  esac
}

KERNEL_SRCS=(kernels/*/*.cu kernels/*/*_host.cc)
# torch_xla_ext/csrc: the libraries of torch_xla_ext/lib/BUILD.bazel, by their sources.
declare -A CSRC_LIBRARY=(
  [libxla_ext_binder.so]="torch_xla_ext/csrc/binder.cc torch_xla_ext/csrc/custom_call_status.cc"
  [libxla_ext_pjrt_shim.so]="torch_xla_ext/csrc/pjrt_shim.cc"
)
declare -A CSRC_EXPORTS=(
  [libxla_ext_binder.so]=torch_xla_ext/lib/exports.lds
  [libxla_ext_pjrt_shim.so]=torch_xla_ext/lib/pjrt_shim_exports.lds
)
TORCH_SRCS=(torch_xla_ext/csrc/torch_ops.cc torch_xla_ext/csrc/eager_runtime.cc)
read -r TORCH_DIR PYTHON_INCLUDE <<<"$(python3 -c "
import os, sysconfig, torch
print(os.path.dirname(torch.__file__), sysconfig.get_paths()['include'])")"
TORCH_INCLUDES=(-isystem "$TORCH_DIR/include" -isystem "$TORCH_DIR/include/torch/csrc/api/include"
                -isystem "$PYTHON_INCLUDE")
read -r -a CSRC_SRCS <<<"${CSRC_LIBRARY[*]}"
SRCS=("${KERNEL_SRCS[@]}" "${CSRC_SRCS[@]}" "${TORCH_SRCS[@]}")
[[ $WHAT == torch ]] && SRCS=("${TORCH_SRCS[@]}")
pids=()
for src in "${SRCS[@]}"; do
  while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n; done
  compile "$src" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

objects() { for src in "$@"; do echo "$OBJ/${src//\//_}.o"; done; }
LINK=(-shared -Wl,--version-script=torch_xla_ext/lib/exports.lds)
if [[ $WHAT == all ]]; then
  # --whole-archive is not needed: every object is linked, so every static registration runs.
  g++ "${LINK[@]}" -o "$LIB_OUT/libxla_ext_kernels.so" $(objects "${KERNEL_SRCS[@]}") \
    "$CUDA_HOME/lib64/libcudart_static.a" -ldl -lpthread -lrt
  for lib in "${!CSRC_LIBRARY[@]}"; do
    read -r -a lib_srcs <<<"${CSRC_LIBRARY[$lib]}"
    g++ -shared "-Wl,--version-script=${CSRC_EXPORTS[$lib]}" \
      -o "$LIB_OUT/$lib" $(objects "${lib_srcs[@]}") -ldl
  done
fi
g++ "${LINK[@]}" -o "$LIB_OUT/libxla_ext_torch.so" $(objects "${TORCH_SRCS[@]}") \
  -L "$TORCH_DIR/lib" -lc10 -lc10_cuda -ltorch_cpu -ltorch -ltorch_python
ls -l "$LIB_OUT"/*.so
