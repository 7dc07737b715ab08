#!/usr/bin/env bash
# Builds a torch_xla wheel from the patched source of @torch_xla_<tag> (see torch_xla.bzl),
# with torch_xla_ext's kernels linked into _XLAC (patch 0005). Run through Bazel:
#
#   PYTORCH_SRC=/path/to/pytorch bazel run //patches:torch_xla_wheel_v2_9_0 [-- --force]
#
# torch_xla's own build (python setup.py bdist_wheel, Bazel 7 via bazelisk, network) does the
# work; see patches/README.md for what it needs. Arguments (given by the BUILD target):
#   $1  runfiles path of @torch_xla_<tag>//:SOURCE_DIR     $2  the tag, e.g. v2.9.0
# then the user's:  --force  replace an existing $PYTORCH_SRC/xla
# Environment:
#   PYTORCH_SRC        PyTorch source checkout of the matching release, built in place
#                      (python setup.py develop), as torch_xla's build expects it (required)
#   TORCH_XLA_EXT_SRC  torch_xla_ext checkout whose kernels/ are linked (default: this
#                      workspace)
#   WHEEL_DIR          where the wheel is copied (default: <workspace>/.whl)
#   PYTHON             interpreter that runs setup.py (default: python3)
#   anything torch_xla's setup.py reads (XLA_CUDA=1 for 2.8 CUDA builds, BAZEL_JOBS, ...)
set -euo pipefail

marker="$1"
tag="$2"
shift 2
force=0
for arg in "$@"; do
  case "${arg}" in
    --force) force=1 ;;
    *) echo "unknown argument: ${arg}" >&2; exit 2 ;;
  esac
done

# Bazel 4 names an external file external/<repo>/...; newer runfiles trees have ../<repo>/...
if [[ ! -f "${marker}" && -f "../${marker#external/}" ]]; then
  marker="../${marker#external/}"
fi
source_dir="$(head -n 1 "${marker}")"
if [[ "${source_dir}" == ERROR:* ]]; then
  echo "@torch_xla_${tag//./_} could not be prepared: ${source_dir#ERROR: }" >&2
  tail -n +2 "${marker}" >&2
  exit 1
fi

workspace="${BUILD_WORKSPACE_DIRECTORY:?run this with bazel run}"
ext_src="${TORCH_XLA_EXT_SRC:-${workspace}}"
wheel_dir="${WHEEL_DIR:-${workspace}/.whl}"
python="${PYTHON:-python3}"
pytorch_src="${PYTORCH_SRC:?set PYTORCH_SRC to a PyTorch checkout built in place}"

[[ -d "${ext_src}/kernels" ]] || { echo "${ext_src} has no kernels/" >&2; exit 1; }
[[ -f "${pytorch_src}/build/lib/libtorch.so" ]] || {
  echo "${pytorch_src}/build/lib/libtorch.so is missing: build PyTorch in place first" >&2
  exit 1
}
bazel_version="$(bazel --version 2>/dev/null || true)"
case "${bazel_version}" in
  "bazel 7."* | bazelisk*) ;;
  *) echo "torch_xla needs Bazel 7 (its .bazelversion) as \`bazel\` on PATH, e.g." \
          "bazelisk; found: ${bazel_version:-none}" >&2
     exit 1 ;;
esac

# torch_xla builds as <pytorch>/xla (its WORKSPACE finds PyTorch at ../).
target="${pytorch_src}/xla"
if [[ -e "${target}" ]]; then
  [[ "${force}" == 1 ]] || { echo "${target} exists; pass --force to replace it" >&2; exit 1; }
  rm -rf "${target}"
fi
mkdir -p "${target}"
cp -a "${source_dir}/." "${target}/"

echo "building torch_xla ${tag} (patched) in ${target}, kernels from ${ext_src}/kernels"
(cd "${target}" && TORCH_XLA_EXT_SRC="${ext_src}" "${python}" setup.py bdist_wheel)

mkdir -p "${wheel_dir}"
cp "${target}"/dist/*.whl "${wheel_dir}/"
echo "wheel(s) in ${wheel_dir}:"
ls -1 "${wheel_dir}"/*.whl
