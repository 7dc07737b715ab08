#!/usr/bin/env bash
# On the GPU machine: builds the kernels once per setting of the XLA_EXT_PAGED_ATTENTION_*
# knobs of kernels/paged_attention/ (sm_90a only, to build fast) and
# times paged_attention through XLA GPU for each. One JSON line per setting in $OUT/tune.jsonl.
#
#   SETTINGS="KV_HEADS_PER_CTA=8,L2_PREFETCH_STAGES=1 KV_HEADS_PER_CTA=4,SHARED_KB=100" \
#     tools/device/tune_paged_attention.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/xla_ext_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for setting in ${SETTINGS:-PARTITION=512}; do
  flags=""
  for knob in ${setting//,/ }; do flags+=" -DXLA_EXT_PAGED_ATTENTION_$knob"; done
  rm -rf .devbuild/obj
  if ! CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" NVCC_EXTRA_FLAGS="$flags" \
      tools/device/build_kernels.sh > "$OUT/tune-build.txt" 2>&1; then
    echo "{\"setting\": \"$setting\", \"error\": \"build failed\"}" >> "$OUT/tune.jsonl"
    tail -20 "$OUT/tune-build.txt"
    continue
  fi
  python3 bench/decode_bench.py --only xla_ext --skip-add --reps 20 --out "$OUT/tune-last.json" \
    > /dev/null 2>> "$OUT/tune-errors.txt"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({'setting': sys.argv[2], 'copy_gbps': r['copy_gbps'], 'rows': [(x['shape'], x['time_us'], x['pct_of_copy']) for x in r['rows']]}))" \
    "$OUT/tune-last.json" "$setting" | tee -a "$OUT/tune.jsonl"
done
