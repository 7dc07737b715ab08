#!/usr/bin/env bash
# On the GPU machine: builds the kernels once per (partition, unroll) setting of
# kernels/paged_attention/paged_attention_cuda.cu (sm_90a only, to build fast) and times
# paged_attention through XLA GPU for each. One JSON line per setting in $OUT/tune.jsonl.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/xla_ext_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for setting in ${SETTINGS:-512:4 512:8 256:4 256:8 128:8}; do
  partition=${setting%%:*}
  unroll=${setting##*:}
  rm -rf .devbuild/obj
  if ! CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" \
      NVCC_EXTRA_FLAGS="-DXLA_EXT_PAGED_ATTENTION_PARTITION=$partition -DXLA_EXT_PAGED_ATTENTION_UNROLL=$unroll" \
      tools/device/build_kernels.sh > "$OUT/tune-build.txt" 2>&1; then
    echo "{\"partition\": $partition, \"unroll\": $unroll, \"error\": \"build failed\"}" >> "$OUT/tune.jsonl"
    tail -20 "$OUT/tune-build.txt"
    continue
  fi
  python3 bench/decode_bench.py --only xla_ext --skip-add --reps 20 --out "$OUT/tune-$setting.json" \
    > /dev/null 2>> "$OUT/tune-errors.txt"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({'partition': $partition, 'unroll': $unroll, 'copy_gbps': r['copy_gbps'], 'rows': [(x['shape'], x['time_us'], x['pct_of_copy']) for x in r['rows']]}))" \
    "$OUT/tune-$setting.json" | tee -a "$OUT/tune.jsonl"
done
