#!/usr/bin/env bash
# An A/B of kernel sources in one lease of the GPU machine. A variant is the working tree with
# some files replaced: .ab/NAME/ holds the replacements at their paths in the repository.
#
# Here, with git:
#   tools/device/ab_kernels.sh prepare NAME REV [PATH...]
#     .ab/NAME/ gets REV's copies of PATHs (default: the files under kernels/ and
#     torch_xla_ext/csrc/ where REV and the working tree differ).
# On the GPU machine (run with carry [".ab", ".devbuild/ffi_include"]; .ab/ is git-ignored):
#   tools/device/ab_kernels.sh build NAME...
#     builds each variant's kernels (tools/device/build_kernels.sh, sm_90a unless CUDA_GENCODE
#     says otherwise) in a copy of the tree under /tmp/ab/NAME, all at once; the name "tree"
#     is the working tree itself, built in place. Build logs: $OUT/ab-build-NAME.txt.
#   ROUNDS=2 tools/device/ab_kernels.sh run NAME... -- COMMAND...
#     runs COMMAND in each variant's copy (PYTHONPATH set to it), the variants one after another
#     and that ROUNDS times, every output line prefixed with "[NAME] ".
# Example (the kernels of the last commit against the working tree's):
#   tools/device/ab_kernels.sh prepare base HEAD
#   (GPU) tools/device/ab_kernels.sh build base tree && ROUNDS=2 tools/device/ab_kernels.sh \
#           run base tree -- python3 bench/decode_mixes_bench.py --only "many very short" --out /tmp/m.json
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
OUT="${OUT:-/tmp/xla_ext_out}"
usage() { sed -n '2,/^[^#]/{/^#/p}' "${BASH_SOURCE[0]}" >&2; exit 2; }  # the comment above

variant_dir() {  # NAME -> the tree it runs in
  if [[ $1 == tree ]]; then echo "$ROOT"; else echo "/tmp/ab/$1"; fi
}

case "${1:-}" in
  prepare)
    (( $# >= 3 )) || usage
    name=$2 rev=$3
    shift 3
    [[ $name != tree && $name =~ ^[A-Za-z0-9_.-]+$ ]] || {
      echo "prepare: NAME must be letters, digits, '_', '.' or '-', and not 'tree'; got '$name'" >&2; exit 2; }
    git rev-parse --verify -q "$rev^{commit}" > /dev/null || {
      echo "prepare: REV must name a commit; got '$rev'" >&2; exit 2; }
    paths=("$@")
    if (( ${#paths[@]} == 0 )); then
      mapfile -t paths < <(git diff --name-only "$rev" -- kernels torch_xla_ext/csrc)
    fi
    (( ${#paths[@]} )) || { echo "prepare: the working tree's kernels are $rev's; nothing to replace" >&2; exit 2; }
    rm -rf ".ab/$name"
    for path in "${paths[@]}"; do
      if ! git cat-file -e "$rev:$path" 2> /dev/null; then
        echo "prepare: $path is not in $rev (a variant replaces files; it cannot remove one)" >&2
        exit 2
      fi
      mkdir -p ".ab/$name/$(dirname "$path")"
      git show "$rev:$path" > ".ab/$name/$path"
      echo ".ab/$name/$path"
    done
    ;;
  build)
    (( $# >= 2 )) || usage
    shift
    mkdir -p "$OUT"
    jobs=$(( $(nproc) / $# ))
    (( jobs >= 1 )) || jobs=1
    for name in "$@"; do
      dir=$(variant_dir "$name")
      if [[ $name != tree ]]; then
        [[ -d .ab/$name ]] || { echo "build: no .ab/$name (prepare it, and carry .ab)" >&2; exit 2; }
        rm -rf "$dir" && mkdir -p "$dir/.devbuild"
        cp -r kernels torch_xla_ext tools bench tests "$dir/" && cp -r .devbuild/ffi_include "$dir/.devbuild/"
        cp -r ".ab/$name/." "$dir/"
      fi
      ( cd "$dir" && rm -rf .devbuild/obj && \
          JOBS=$jobs CUDA_GENCODE="${CUDA_GENCODE:--gencode=arch=compute_90a,code=sm_90a}" \
          tools/device/build_kernels.sh > "$OUT/ab-build-$name.txt" 2>&1
        echo "build $name: exit $?" ) &
    done
    wait
    ;;
  run)
    shift
    names=()
    while (( $# )) && [[ $1 != -- ]]; do names+=("$1"); shift; done
    (( $# >= 2 && ${#names[@]} >= 1 )) || usage
    shift
    for (( round = 1; round <= ${ROUNDS:-1}; ++round )); do
      for name in "${names[@]}"; do
        dir=$(variant_dir "$name")
        [[ -f $dir/torch_xla_ext/lib/libxla_ext_kernels.so ]] || {
          echo "run: $name is not built (tools/device/ab_kernels.sh build $name)" >&2; exit 2; }
        ( cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$@" 2>&1 | sed "s/^/[$name] /" )
      done
    done
    ;;
  *) usage ;;
esac
