#!/usr/bin/env bash
# On the GPU machine: builds the kernels once per setting of the XLA_EXT_PAGED_ATTENTION_*
# knobs of the decode engine (kernels/common/tuning.h; sm_90a only, to build fast) and
# times paged_attention through XLA GPU (and, for mixes, the torch op in a CUDA graph) for each:
# the five uniform shapes (bench/decode_bench.py),
# or with MIXES the batch mixes of bench/decode_mixes_bench.py whose names contain one of its
# |-separated strings. One JSON line per setting in $OUT/tune.jsonl.
#
#   SETTINGS="KV_HEADS_PER_CTA=8,SHARED_KB=200 KV_HEADS_PER_CTA=4,SHARED_KB=100" \
#     tools/device/tune_paged_attention.sh
#   SETTINGS="MIN_CONSUMER_WARPS_PER_SM=1 MIN_CONSUMER_WARPS_PER_SM=8" \
#     MIXES="TP=8|TP=2|many very short|uniform 32" tools/device/tune_paged_attention.sh
# With RAGGED="B,L,H,KVH,D ...", each setting also times ragged_paged_attention on B decode
# steps at L tokens (H query heads, KVH kv heads, head size D; 64 sequence slots as the serving
# engine pads them), three calls in a CUDA graph (bench/profile_ragged_attention.py --trace):
# the decode engine as the serving step runs it, on the ragged op's K/V-interleaved cache
# (RAGGED_ARGS adds that script's arguments: "--max-q-len 1", the decode kernel alone). With
# SERVING=1 also the serving step (bench/serving_bench.py, ours, runs of decode steps, B=1,16,64).
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
  if [[ -n "${MIXES:-}" ]]; then
    python3 bench/decode_mixes_bench.py --only "$MIXES" --out "$OUT/tune-last.json" \
      > /dev/null 2>> "$OUT/tune-errors.txt"
  else
    python3 bench/decode_bench.py --only xla_ext --skip-add --reps 20 --out "$OUT/tune-last.json" \
      > /dev/null 2>> "$OUT/tune-errors.txt"
  fi
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({'setting': sys.argv[2], 'copy_gbps': r['copy_gbps'], 'rows': [(x['shape'], x.get('impl'), x.get('time_us'), x.get('pct_of_copy'), x.get('error')) for x in r['rows'] if x.get('impl') in (None, 'xla_ext', 'torch_graph', 'uniform_xla_ext')]}))" \
    "$OUT/tune-last.json" "$setting" | tee -a "$OUT/tune.jsonl"
  for decode in ${RAGGED:-}; do
    IFS=, read -r batch length heads kv_heads head_size <<< "$decode"
    python3 bench/profile_ragged_attention.py --decode "$batch,$length" \
      --heads "$heads,$kv_heads,$head_size" --max-num-seqs 64 \
      --padding-rows $(( batch < 16 ? 16 - batch : 0 )) --trace ${RAGGED_ARGS:-} \
      2>> "$OUT/tune-errors.txt" | \
      grep "calls in a CUDA graph" | sed "s/^/{$setting} ragged H=$heads KVH=$kv_heads D=$head_size: /" | \
      tee -a "$OUT/tune.jsonl"
  done
  if [[ ${SERVING:-0} == 1 ]]; then
    python3 bench/serving_bench.py --impls ours --modes runs --no-mixed --steps 24 \
      --out "$OUT/tune-serving.json" 2>> "$OUT/tune-errors.txt" | grep "tokens/s" | \
      sed "s/^/{$setting} /" | tee -a "$OUT/tune.jsonl"
  fi
done
