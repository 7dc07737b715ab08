#!/usr/bin/env bash
# The GPU proof, in one command on the GPU machine (no Bazel there):
#   build the kernels with its nvcc (sm_80, sm_90a, compute_90), run every GPU test (CUDA
#   handlers through JAX's XLA GPU, through torchax, through torch on CUDA tensors; again with
#   XLA_EXT_DEBUG_CHECKS=1), the registration of our CUDA handlers into JAX's CUDA PJRT plugin
#   by our own path, the benchmark, and an ncu profile of paged attention.
# Writes <gpu>.json, <gpu>-tests.txt, <gpu>-plugin.txt, <gpu>-kernel-times.json,
# <gpu>-dispatch-command-buffers.txt, <gpu>-dispatch-record-probe.txt and <gpu>-ncu.txt to $OUT
# (default bench/results). Needs: .devbuild/ffi_include (jaxlib 0.7.1's FFI headers) and, for
# torchax, a torchax wheel in .whl/ (see bench/README.md).
#
#   tools/device/run.sh [all|tests|bench|kv_cache|ragged|decode|serving]   (all: tests and
#   bench; each fits 10 minutes). SKIP_BUILD=1: keep the libraries an earlier phase built.
#   tools/device/run.sh sanitize [memcheck|racecheck|synccheck ...]   (default: all three;
#   named tools write <gpu>-sanitize-TOOL....txt)
#   kv_cache: bench/kv_cache_bench.py through JAX and torchax -> <gpu>-kv-cache.json
#   ragged:   ragged paged attention: its GPU tests through JAX (the handler's choice, the
#             wgmma, mma.sync and CUDA-core kernels each everywhere; memcheck and
#             racecheck over the skewed batches, the handler's choice and tensor-core), then
#             bench/ragged_bench.py, with FlashInfer's paged prefill unless RAGGED_FLASHINFER=0
#             (carry .fi, as for decode); RAGGED_TESTS=0 skips the tests, RAGGED_IMPLS picks
#             the other rows -> <gpu>-ragged-tests.txt, <gpu>-ragged.json
#   decode:   paged decode attention on skewed batches: its GPU tests (both kernels, torch and
#             JAX, memcheck and racecheck), bench/decode_bench.py (the five uniform shapes) and
#             bench/decode_mixes_bench.py with FlashInfer (tools/device/flashinfer_tree.sh)
#             -> <gpu>-decode-tests.txt, <gpu>-decode-uniform.json, <gpu>-decode-mixes.json
#   sanitize: compute-sanitizer over the GPU tests, torch and JAX paths, with the debug checks
#             on and (memcheck) off -> <gpu>-sanitize.txt; not part of tests or all
#   serving:  the serving loop (torch_xla_ext/serving) through torchax against transformers on
#             this GPU: bench/serving_compare.py -> <gpu>-serving-compare.json (tokens, first
#             divergence, logit differences) and bench/serving_bench.py -> <gpu>-serving.json
#             (throughput, time per step, profile) and <gpu>-serving-timeline.txt (each
#             profile's kernels in order); logs in <gpu>-serving.txt, its summary
#             lines in <gpu>-serving-summary.txt. Needs the
#             transformers wheel in .whl/ too (bench/README.md). SERVING_COMPARE=0 runs the
#             benchmark alone (with the build, it then fits one 10-minute call); SERVING_ARGS
#             adds serving_bench.py arguments (e.g. "--impls ours --modes runs --no-mixed")
#   serving_flags: bench/serving_bench.py --impls ours again with XLA_FLAGS=$SERVING_XLA_FLAGS
#             (e.g. --xla_gpu_enable_triton_gemm=false), to set beside the serving phase's rows
#             of the same lease -> <gpu>-serving-flags.json
#   tp:       the serving engine with tensor_parallel_size 1 and 2 (TP_SIZES), 8B- and 1B-class
#             models, per-GPU traces -> <gpu>-serving-{8b,1b}-tp{1,2}.json (GPU=h100x2 on two),
#             and the kernels in order on the busiest GPU -> <gpu>-serving-tp-timeline.txt
#   tp2:      bench/tp_bench.py --tp 2 (needs two GPUs): one decoder layer's serving step with
#             heads split over 2 GPUs against 1 GPU, step times and the collective share
#             -> <gpu>-tp2.json
#   tp1:      the single-device half of it (any one GPU) -> <gpu>-tp1.json
#   ncu_ragged: Nsight Compute on the ragged attention kernels (the tiled kernel the handler
#             picks, wgmma at head_dim 128, and its combine; on the decode mix the decode steps
#             run on the decode kernel, which the regex leaves out) of two bench/ragged_bench.py
#             mixes, a decode and a prefill, then all three kernels of the mixed batch 4 chunks
#             of 256 + 60 decodes x 1024
#             (bench/profile_ragged_attention.py --mix) -> <gpu>-ncu-ragged.txt; with NCU_SASS=1
#             also each mix's first kernel per SASS instruction (executed, stall samples)
#             -> <gpu>-ncu-ragged-sass-N.csv (as for ncu_mixes)
#   clocks_ragged: the SM clock, power draw and clock-event reasons nvidia-smi samples while
#             four bench/ragged_bench.py mixes run back to back (profile_ragged_attention.py
#             --clocks) -> <gpu>-ragged-clocks.txt
#   serving_ab: the serving step of the working tree beside a baseline's in one lease: the
#             baseline is the tools/device/ab_kernels.sh variant .ab/$AB_BASE (default "base",
#             made here with `tools/device/ab_kernels.sh prepare base REV PATHS...`, PATHS the
#             kernel and Python files where REV and the tree differ; carry .ab). AB_PART picks a
#             part, each fitting a call, in this order on one warm machine:
#               build:   both variants' kernels (ab_kernels.sh build, sm_90a)
#               kernels: the tree's GPU tests of the changed ops (AB_TESTS_K: pytest's -k,
#                        below), then each variant's
#                        attention call of a decode step of the 1B model at B = 1, 16, 64
#                        (2k contexts; bench/profile_ragged_attention.py --trace, the tree's
#                        with --max-q-len 1 as its engine calls it; AB_MIN_CTA_STAGES="2 8"
#                        adds the tree with XLA_EXT_DECODE_MIN_CTA_STAGES of each) ->
#                        <gpu>-serving-ab.txt
#               ncu:     Nsight Compute on the tree's decode kernel alone at B = 1 and 16
#               sanitize: those tests (but the largest batches) under compute-sanitizer memcheck
#                        and racecheck (both appended to the same file)
#               serving: each variant's bench/serving_bench.py (ours, runs of 8 decode steps at
#                        B = 1, 16, 64 and the mixed step; SERVING_ARGS adds arguments) with its
#                        kernels in order -> <gpu>-serving.json ({"runs": {base, tree}}),
#                        <gpu>-serving-timeline.txt (both), the logs in <gpu>-serving.txt
#   layer_ops: the layer ops small_batch_linear and add_rms_norm: the build (sm_90a), then the
#             parts LAYER_OPS_PART names, in its order ("kernels bench serving" fits one
#             call with LINEAR_ARGS="--models 1b" SERVING_ARGS="--batches 1,16 --no-mixed"):
#               kernels: their GPU tests through JAX and torch (LAYER_OPS_TESTS, default both
#                        ops' files), the same under compute-sanitizer memcheck and racecheck
#                        -> <gpu>-layer-ops-tests.txt
#               bench:   bench/linear_bench.py (small_batch_linear against cuBLAS; LINEAR_ARGS
#                        adds arguments) -> <gpu>-layer-ops.json, its lines in the log
#               serving: bench/serving_bench.py (ours, runs of 8 decode steps at B = 1, 16, 64
#                        and the mixed step; SERVING_ARGS adds arguments) without and with the
#                        op LAYER_OPS_AB names: linear (the linear layers on XLA's dots, then
#                        on small_batch_linear up to LINEAR_SERVING_TOKENS, default 16, tokens)
#                        or norm (XLA's add and norm fusions, then add_rms_norm): the step times
#                        and the first layer's kernels of each, appended to
#                        <gpu>-layer-ops-tests.txt
#   decode_latency: bench/decode_latency_probe.cu (the ragged op's decode-only attention call
#             launched from CUDA alone), built plain and with the kernel's phase stamps (and
#             plain against .ab/$DECODE_LATENCY_BASE's kernel sources, if set), at B = 1, 16, 64
#             (DECODE_LATENCY_BATCHES) and each of DECODE_LATENCY_MIN_STAGES (the fewest stages
#             per CTA; DECODE_LATENCY_SETTINGS adds a plain probe per setting of the decode
#             kernel's tuning knobs, DECODE_LATENCY_STAMPS=0 leaves the stamped probe out,
#             DECODE_LATENCY_ARGS adds probe arguments, NVCC_EXTRA_FLAGS compiler flags)
#             -> <gpu>-decode-latency.txt
#   ncu_mixes: Nsight Compute on the attention and combine kernels of the decode mixes short of
#             their targets (bench/profile_paged_attention.py --mix) -> <gpu>-ncu-mixes.txt
set -uo pipefail
PHASE="${1:-all}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-bench/results}"
GPU="${GPU:-h100}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off in NCCL, torch and NVSHMEM, as the lent multi-GPU machines require.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
TESTS="$OUT/$GPU-tests.txt"
[[ $PHASE == decode ]] && TESTS="$OUT/$GPU-decode-tests.txt"
[[ $PHASE == ragged ]] && TESTS="$OUT/$GPU-ragged-tests.txt"
[[ $PHASE == serving || $PHASE == serving_flags ]] && TESTS="$OUT/$GPU-serving-summary.txt"
[[ $PHASE == tp ]] && TESTS="$OUT/$GPU-serving-tp-summary.txt"
[[ $PHASE == serving_ab ]] && TESTS="$OUT/$GPU-serving-ab.txt"
[[ $PHASE == layer_ops ]] && TESTS="$OUT/$GPU-layer-ops-tests.txt"
[[ $PHASE == decode_latency ]] && TESTS="$OUT/$GPU-decode-latency.txt"
if [[ $PHASE == sanitize ]]; then  # its tools, if named, name its file: <gpu>-sanitize-TOOL...
  shift
  SANITIZERS=("$@")
  TESTS="$OUT/$GPU-sanitize$(printf -- '-%s' "${SANITIZERS[@]}").txt"
  (( ${#SANITIZERS[@]} )) || { SANITIZERS=(memcheck racecheck synccheck); TESTS="$OUT/$GPU-sanitize.txt"; }
fi
PYTEST=(python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning)

# compute-sanitizer over the GPU tests. Each run is one process (JAX and torch share the GPU:
# no preallocation); the kernel tests that only repeat covered code paths at sizes the
# sanitizers make slow (random shapes, rows of thousands of tokens) are left out.
KERNEL_TESTS=(tests/kernels/test_kv_cache_update.py tests/kernels/test_paged_attention.py
              tests/kernels/test_ragged_paged_attention.py tests/kernels/test_reshape_and_cache.py
              tests/kernels/test_simple_add.py tests/kernels/test_small_batch_linear.py
              tests/kernels/test_add_rms_norm.py)
SANITIZER_DESELECT="not random and not long_rows and not very_long"
sanitize_run() {  # tool, debug checks (0/1), label, pytest arguments...
  local tool="$1" debug="$2" label="$3"
  shift 3
  step "compute-sanitizer --tool $tool, XLA_EXT_DEBUG_CHECKS=$debug: $label"
  XLA_EXT_DEBUG_CHECKS="$debug" XLA_FLAGS=--xla_gpu_autotune_level=0 XLA_EXT_TEST_PLATFORM=cuda \
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 compute-sanitizer --tool "$tool" \
    --error-exitcode 9 "${PYTEST[@]}" "$@" > "/tmp/sanitizer-$tool.txt" 2>&1
  local code=$?
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "/tmp/sanitizer-$tool.txt" | tee -a "$TESTS"
  [[ $code == 0 ]] || { status=1; tail -30 "/tmp/sanitizer-$tool.txt" | tee -a "$TESTS"; }
}
# Ragged attention's GPU tests again on each of its kernels, forced (the handler's choice is the
# plain run).
ragged_each_kernel() {
  local kernel
  for kernel in warpgroup tensor_core simt; do
    step "ragged, XLA_EXT_RAGGED_PAGED_ATTENTION_KERNEL=$kernel"
    XLA_EXT_RAGGED_PAGED_ATTENTION_KERNEL=$kernel XLA_EXT_TEST_PLATFORM=cuda "${PYTEST[@]}" \
      tests/kernels/test_ragged_paged_attention.py 2>&1 | tail -1 | tee -a "$TESTS" || status=1
  done
}
sanitize() {  # tools...
  command -v compute-sanitizer > /dev/null || { step "compute-sanitizer: not installed"; status=1; return; }
  local tool
  for tool in "$@"; do
    # The kernels' own handling of bad data (skip, clamp) runs only with the checks off.
    [[ $tool == memcheck ]] && sanitize_run "$tool" 0 "kernel tests through JAX" \
      "${KERNEL_TESTS[@]}" -k "$SANITIZER_DESELECT"
    # With them on: the check kernels too, on every valid call and on the bad ones; the
    # CUDA-graph cases start processes of their own, which the sanitizer would not see.
    sanitize_run "$tool" 1 "kernel tests through JAX, torch on CUDA tensors, debug checks" \
      "${KERNEL_TESTS[@]}" tests/gpu/torch_cuda_test.py tests/gpu/debug_checks_test.py \
      -k "$SANITIZER_DESELECT and not opcheck and not cuda_graph"
  done
}
status=0
step() { echo "== $*" | tee -a "$TESTS"; }
[[ $PHASE == bench || $PHASE == kv_cache || $PHASE == tp1 || $PHASE == tp2 || $PHASE == serving_flags \
   || $PHASE == ncu_mixes || $PHASE == ncu_ragged || $PHASE == clocks_ragged \
   || ( $PHASE == serving_ab && ${AB_PART:-} != kernels ) \
   || ( $PHASE == layer_ops && ${LAYER_OPS_PART:-} != kernels* ) ]] \
  || : > "$TESTS"

step "$(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
if [[ $PHASE == serving_ab ]]; then
  BASE="${AB_BASE:-base}"
  # The new and changed ops' tests (the decode-only attention call, the rotary K/V write).
  AB_TESTS_FILES=(tests/kernels/test_ragged_paged_attention.py tests/kernels/test_kv_cache_update.py)
  AB_TESTS_K="${AB_TESTS_K:-decode_only or max_q_len or rotary or pure_decode or chain}"
  case "${AB_PART:-}" in
    build)
      step "build: tools/device/ab_kernels.sh build $BASE tree"
      tools/device/ab_kernels.sh build "$BASE" tree 2>&1 | tee -a "$TESTS" | \
        grep -q "exit [1-9]" && status=1
      ;;
    kernels)
      step "the tree's GPU tests: ${AB_TESTS_FILES[*]} -k '$AB_TESTS_K'"
      XLA_EXT_TEST_PLATFORM=cuda "${PYTEST[@]}" "${AB_TESTS_FILES[@]}" -k "$AB_TESTS_K" 2>&1 | \
        tail -3 | tee -a "$TESTS" || status=1
      for batch in 1 16 64; do
        # AB_MIN_CTA_STAGES: the tree again with each of these XLA_EXT_DECODE_MIN_CTA_STAGES.
        for run in "$BASE" tree ${AB_MIN_CTA_STAGES:-}; do
          name=$run
          [[ $run =~ ^[0-9]+$ ]] && name=tree
          step "$run: the 1B model's attention call, decode B=$batch, 2k contexts (3 calls in a CUDA graph)"
          flags=(--decode "$batch,2048" --heads 32,8,64 --max-num-seqs 64
                 --padding-rows $(( batch < 16 ? 16 - batch : 0 )) --trace)
          [[ $name == tree ]] && flags+=(--max-q-len 1)
          stages=$([[ $run =~ ^[0-9]+$ ]] && echo "$run")
          XLA_EXT_DECODE_MIN_CTA_STAGES=$stages tools/device/ab_kernels.sh run "$name" -- \
            python3 bench/profile_ragged_attention.py "${flags[@]}" 2>&1 | grep -v -i warn | \
            tee -a "$TESTS"
        done
      done
      ;;
    ncu)
      command -v ncu > /dev/null || { step "ncu: not installed on this machine"; exit 1; }
      for batch in 1 16; do
        step "ncu: the tree's decode kernel alone (max_q_len 1), B=$batch, 2k contexts, 1B heads"
        ncu --clock-control none --kernel-name regex:AttendTensorCore --launch-skip 3 \
          --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy \
          --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
          python3 bench/profile_ragged_attention.py --decode "$batch,2048" --heads 32,8,64 \
          --max-num-seqs 64 --padding-rows $(( batch < 16 ? 16 - batch : 0 )) --max-q-len 1 \
          2>&1 | grep -v "^==PROF==" | sed -n '/Section: /,$p' | tee -a "$TESTS"
      done
      ;;
    sanitize)
      for tool in memcheck racecheck; do
        sanitize_run "$tool" 0 "the tree's tests above but the large decode batches" \
          "${AB_TESTS_FILES[@]}" -k "($AB_TESTS_K) and not one_long and not b64 and not head_dims"
      done
      ;;
    serving)
      LOG="$OUT/$GPU-serving.txt"
      : > "$LOG"
      for name in "$BASE" tree; do
        step "$name: bench/serving_bench.py --impls ours --modes runs" | tee -a "$LOG"
        rm -f "/tmp/serving-timeline-$name.txt"
        tools/device/ab_kernels.sh run "$name" -- timeout 280 python3 bench/serving_bench.py \
          --impls ours --modes runs --steps 24 --out "/tmp/serving-$name.json" \
          --timeline "/tmp/serving-timeline-$name.txt" ${SERVING_ARGS:-} 2>&1 | \
          grep -v -i warn | tee -a "$LOG" | grep -E "tokens/s|wrote|Error" | tee -a "$TESTS" || status=1
      done
      python3 - "$OUT/$GPU-serving.json" "$BASE" /tmp/serving-"$BASE".json tree /tmp/serving-tree.json \
        <<'PY' || status=1
import json, sys
out, runs = sys.argv[1], dict(zip(sys.argv[2::2], sys.argv[3::2]))
json.dump({"note": "one lease: the baseline variant, then the working tree",
           "runs": {name: json.load(open(path)) for name, path in runs.items()}},
          open(out, "w"), indent=1)
PY
      for name in "$BASE" tree; do
        sed "s/^== /== $name: /" "/tmp/serving-timeline-$name.txt"
      done > "$OUT/$GPU-serving-timeline.txt"
      ;;
    *) step "serving_ab: AB_PART must be build, kernels, serving, ncu or sanitize, got '${AB_PART:-}'"
       exit 2 ;;
  esac
  step "done, status $status"
  exit $status
fi
if [[ $PHASE == layer_ops ]]; then
  [[ -n ${LAYER_OPS_PART:-} ]] || { step "layer_ops: LAYER_OPS_PART must name parts: kernels, bench, serving"; exit 2; }
  step "build: tools/device/build_kernels.sh (sm_90a)"
  CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a tools/device/build_kernels.sh \
    > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt | tee -a "$TESTS"; exit 1; }
  LAYER_OPS_TESTS=(${LAYER_OPS_TESTS:-tests/kernels/test_small_batch_linear.py tests/kernels/test_add_rms_norm.py})
  for part in $LAYER_OPS_PART; do
  case "$part" in
    kernels)
      step "GPU tests: ${LAYER_OPS_TESTS[*]} (JAX, and torch on CUDA tensors)"
      XLA_EXT_TEST_PLATFORM=cuda "${PYTEST[@]}" -rs "${LAYER_OPS_TESTS[@]}" 2>&1 | tail -3 | \
        tee -a "$TESTS" || status=1
      for tool in memcheck racecheck; do
        sanitize_run "$tool" 0 "${LAYER_OPS_TESTS[*]}" "${LAYER_OPS_TESTS[@]}"
      done
      ;;
    bench)
      step "benchmark: bench/linear_bench.py against cuBLAS ${LINEAR_ARGS:-}"
      timeout 300 python3 bench/linear_bench.py --out "$OUT/$GPU-layer-ops.json" ${LINEAR_ARGS:-} \
        2>&1 | grep -v -i warn | tee -a "$TESTS" || status=1
      ;;
    serving)
      case "${LAYER_OPS_AB:-linear}" in
        linear) knob=XLA_EXT_SERVING_SMALL_BATCH_TOKENS
                variants=("xla_dots=0" "small_batch_linear=${LINEAR_SERVING_TOKENS:-16}") ;;
        norm) knob=XLA_EXT_SERVING_ADD_RMS_NORM
              variants=("xla_add_and_norm=0" "add_rms_norm=1") ;;
        *) step "layer_ops: LAYER_OPS_AB must be linear or norm, got '$LAYER_OPS_AB'"; exit 2 ;;
      esac
      for variant in "${variants[@]}"; do
        name=${variant%%=*} value=${variant#*=}
        step "$name: $knob=$value bench/serving_bench.py --impls ours --modes runs ${SERVING_ARGS:-}"
        env "$knob=$value" timeout 280 python3 bench/serving_bench.py \
          --impls ours --modes runs --steps 24 --out "/tmp/serving-$name.json" \
          --timeline "/tmp/serving-timeline-$name.txt" ${SERVING_ARGS:-} 2>&1 | \
          grep -v -i warn | grep -E "tokens/s|wrote|Error" | tee -a "$TESTS" || status=1
        # The first decoder layer of its first profile's step, kernel by kernel.
        step "$name: the first layer of a step, $(head -1 "/tmp/serving-timeline-$name.txt" | sed 's/^== //')"
        sed -n '2,16p' "/tmp/serving-timeline-$name.txt" | cut -c1-150 | tee -a "$TESTS"
      done
      ;;
    *) step "layer_ops: LAYER_OPS_PART must name parts: kernels, bench, serving; got '$LAYER_OPS_PART'"
       exit 2 ;;
  esac
  done
  step "done, status $status"
  exit $status
fi
if [[ $PHASE == decode_latency ]]; then
  # bench/decode_latency_probe.cu, built plain and with the kernel's phase stamps (and plain
  # against the kernel sources of the ab_kernels.sh variant .ab/$DECODE_LATENCY_BASE, if named),
  # at each of DECODE_LATENCY_BATCHES (default 1 16 64) with 2k contexts and 64 slots, and each
  # of DECODE_LATENCY_MIN_STAGES (XLA_EXT_DECODE_MIN_CTA_STAGES; default: the kernel's).
  nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
  probe_flags=(-std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
               -I . -isystem .devbuild/ffi_include ${NVCC_EXTRA_FLAGS:-})
  probes=()
  build_probe() {  # name, nvcc flags before the common ones (an -I goes first)...
    local name=$1
    shift
    "$nvcc" "$@" "${probe_flags[@]}" bench/decode_latency_probe.cu -o "/tmp/$name" || {
      step "build failed: $name"; exit 1; }
    probes+=("$name")
  }
  step "build: bench/decode_latency_probe.cu, plain and stamped${DECODE_LATENCY_BASE:+, and against .ab/$DECODE_LATENCY_BASE}"
  [[ -n ${DECODE_LATENCY_BASE:-} ]] && \
    build_probe "decode_probe_$DECODE_LATENCY_BASE" -I ".ab/$DECODE_LATENCY_BASE"
  build_probe decode_probe
  [[ ${DECODE_LATENCY_STAMPS:-1} == 0 ]] || \
    build_probe decode_probe_stamped -DXLA_EXT_DECODE_PHASE_STAMPS
  # DECODE_LATENCY_SETTINGS: knob settings of kernels/common/tuning.h (as
  # tune_paged_attention.sh's SETTINGS, e.g. "SHARED_KB=227 MIN_CONSUMER_WARPS_PER_SM=16"), one
  # plain probe each (named with '+' for ',': nvcc's fatbinary splits an output path at commas).
  for setting in ${DECODE_LATENCY_SETTINGS:-}; do
    flags=()
    for knob in ${setting//,/ }; do flags+=("-DXLA_EXT_PAGED_ATTENTION_$knob"); done
    build_probe "decode_probe_${setting//,/+}" "${flags[@]}"
  done
  for batch in ${DECODE_LATENCY_BATCHES:-1 16 64}; do
    for stages in ${DECODE_LATENCY_MIN_STAGES:-default}; do
      for probe in "${probes[@]}"; do
        step "$probe --batch $batch ${DECODE_LATENCY_ARGS:-}, min CTA stages: $stages"
        # shellcheck disable=SC2086
        XLA_EXT_DECODE_MIN_CTA_STAGES=${stages/default/} "/tmp/$probe" --batch "$batch" \
          ${DECODE_LATENCY_ARGS:-} 2>&1 | tee -a "$TESTS" || status=1
      done
    done
  done
  step "done, status $status"
  exit $status
fi
if [[ ${SKIP_BUILD:-0} == 1 && -f torch_xla_ext/lib/libxla_ext_kernels.so ]]; then
  step "build: skipped (SKIP_BUILD=1; the libraries of an earlier phase)"
else
  step "build: tools/device/build_kernels.sh"
  tools/device/build_kernels.sh > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt | tee -a "$TESTS"; exit 1; }
fi

if [[ $PHASE == sanitize ]]; then
  sanitize "${SANITIZERS[@]}"
  step "done, status $status"
  exit $status
fi

if [[ $PHASE == decode ]]; then
  step "paged attention through JAX on the GPU: tensor-core kernel, then CUDA-core kernel"
  XLA_EXT_TEST_PLATFORM=cuda "${PYTEST[@]}" tests/kernels/test_paged_attention.py 2>&1 | tail -3 | \
    tee -a "$TESTS" || status=1
  XLA_EXT_PAGED_ATTENTION_KERNEL=simt XLA_EXT_TEST_PLATFORM=cuda "${PYTEST[@]}" \
    tests/kernels/test_paged_attention.py 2>&1 | tail -1 | sed 's/^/CUDA-core kernel: /' | \
    tee -a "$TESTS" || status=1
  "${PYTEST[@]}" tests/gpu/torch_cuda_test.py 2>&1 | tail -1 | tee -a "$TESTS" || status=1
  step "benchmark: the five uniform shapes (bench/decode_bench.py)"
  python3 bench/decode_bench.py --skip-add --out "$OUT/$GPU-decode-uniform.json" > /tmp/bench.txt 2>&1 || \
    { status=1; tail -20 /tmp/bench.txt | tee -a "$TESTS"; }
  step "benchmark: batch mixes against FlashInfer (bench/decode_mixes_bench.py)"
  FI_TREE=$(tools/device/flashinfer_tree.sh) || status=1
  PYTHONPATH="$PYTHONPATH:$FI_TREE" FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws TORCH_CUDA_ARCH_LIST=9.0a \
    timeout 420 python3 bench/decode_mixes_bench.py --flashinfer --out "$OUT/$GPU-decode-mixes.json" \
    2>&1 | tee /tmp/mixes.txt | grep -E '"impl": "(xla_ext|flashinfer_tensor_core)"|error|Error' \
    | cut -c1-220 | tee -a "$TESTS" || status=1
  for tool in memcheck racecheck; do
    XLA_EXT_PAGED_ATTENTION_KERNEL=tensor_core sanitize_run "$tool" 0 "skewed batches, tensor-core kernel" \
      tests/kernels/test_paged_attention.py -k "skewed or zero_length"
    XLA_EXT_PAGED_ATTENTION_KERNEL=simt sanitize_run "$tool" 0 "skewed batches, CUDA-core kernel" \
      tests/kernels/test_paged_attention.py -k "skewed or zero_length"
  done
  step "done, status $status"
  exit $status
fi

if [[ $PHASE == tp ]]; then
  # The serving engine split over TP_SIZES GPUs (default 1 2), one process per size and model
  # (TP_MODELS, default 8b 1b): the
  # 8B-class model at B=1 and B=64, the 1B-class one at B=1, decode steps at 2k contexts
  # (runs of 8 decode steps; TP_MODES=async,runs adds single steps), each with its per-GPU
  # trace (busy, in collectives, idle).
  # TP_XLA_FLAGS (default below; set it empty for XLA's defaults): all-reduces through NCCL
  # inside the step's CUDA graphs. By default jaxlib 0.11's XLA runs each all-reduce as its own
  # one- or two-shot kernel, which its command buffers cannot capture, so each of a decode
  # step's 65 all-reduces splits the step's CUDA graphs; NCCL's all-reduce is captured with
  # the rest. On two H100s it took the 8B model's TP=2 step from 5.06 to 4.82 ms at B=1 and from
  # 8.81 to 8.39 ms at B=64, and the 1B model's from 1.55 to 1.49 ms.
  export XLA_FLAGS="${TP_XLA_FLAGS-"--xla_gpu_experimental_use_collective_kernels= --xla_gpu_enable_command_buffer=+COLLECTIVES"}"
  rm -f "$OUT/$GPU-serving-tp-timeline.txt"
  for tp in ${TP_SIZES:-1 2}; do
    for model in ${TP_MODELS:-8b 1b}; do
      batches=$([[ $model == 8b ]] && echo 1,64 || echo 1)
      step "serving engine, ${model} model, TP=$tp: bench/serving_bench.py"
      # The transformers model is made on the CPU: on GPU 0 it took 16 GB the split 8B engine
      # needed there.
      timeout 540 python3 bench/serving_bench.py --config "$model" --impls ours --no-mixed \
        --device cpu \
        --batches "$batches" --modes "${TP_MODES:-runs}" --steps 24 --tensor-parallel-size "$tp" \
        --out "$OUT/$GPU-serving-$model-tp$tp.json" --timeline "$OUT/$GPU-serving-tp-timeline.txt" \
        2>&1 | grep -v -i warn | \
        grep -E "tokens/s|wrote|Error" | tee -a "$TESTS"
      [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done
  done
  step "done, status $status"
  exit $status
fi

if [[ $PHASE == tp1 || $PHASE == tp2 ]]; then
  step "tensor parallel over heads, ${PHASE#tp} GPU(s): bench/tp_bench.py"
  python3 bench/tp_bench.py --tp "${PHASE#tp}" --out "$OUT/$GPU-$PHASE.json" \
    2>&1 | tail -12 | tee -a "$TESTS"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  step "done, status $status"
  exit $status
fi

# Nsight Compute on the kernels of the third of four calls, per mix, each call launching
# `launches` kernels the regex matches; at the clocks the kernels run at (not ncu's base
# clocks), with the warps' stall reasons (cycles stalled per issued instruction):
# ncu_profile <file> <kernel regex> <launches> <profile script> <mix>...
# It appends to <file>, which the phase empties first; the SASS tables are numbered over the
# phase (sass_tables).
STALL_METRICS='smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
sass_tables=0
ncu_profile() {
  local file="$1" kernels="$2" launches="$3" script="$4"
  shift 4
  command -v ncu > /dev/null || { step "ncu: not installed"; exit 1; }
  local mix
  for mix in "$@"; do
    step "ncu: $mix"
    echo "== $mix" >> "$OUT/$file"
    timeout 150 ncu --clock-control none --kernel-name "regex:$kernels" \
      --launch-skip $((2 * launches)) --launch-count "$launches" \
      --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section SourceCounters --metrics "regex:$STALL_METRICS" \
      python3 "$script" --mix "$mix" >> "$OUT/$file" 2>&1 \
      || { status=1; echo "ncu failed (see $file)" | tee -a "$TESTS"; }
    if [[ ${NCU_SASS:-0} == 1 ]]; then  # the first kernel's SASS, instruction by instruction
      local table="$OUT/${file%.txt}-sass-$((++sass_tables)).csv"
      timeout 150 ncu --clock-control none --kernel-name "regex:$kernels" \
        --launch-skip $((2 * launches)) --launch-count 1 \
        --section SourceCounters --section WarpStateStats -f -o /tmp/ncu-sass \
        python3 "$script" --mix "$mix" > /dev/null 2>&1 \
        && ncu --import /tmp/ncu-sass.ncu-rep --page source --csv --print-source sass > "$table" \
        && echo "$mix: SASS table $(basename "$table")" >> "$OUT/$file" \
        || { status=1; echo "ncu SASS table failed: $mix" | tee -a "$TESTS"; }
    fi
  done
}

# The mixes of bench/decode_mixes_bench.py short of their targets on the H100: what holds the
# attention kernel and the combine kernel of one call back.
if [[ $PHASE == ncu_mixes ]]; then
  : > "$OUT/$GPU-ncu-mixes.txt"
  ncu_profile "$GPU-ncu-mixes.txt" "AttendTensorCore|CombinePartitions" 2 \
    bench/profile_paged_attention.py "TP=8 shard (H=4, KVH=1): long tail 64" \
    "many very short: 256 x 32" "TP=2 shard (H=16, KVH=4): 1 x 32768 + 31 x 256" \
    "1 x 32768 + 31 x 256" "1B-class Llama step (D=64): 64 x 2048"
  step "done, status $status"
  exit $status
fi
# The mixed batch's three kernels (tiled, decode steps, combine) are each profiled alone, on
# the share of the SMs gpu_share.cuh gives it: ncu serialises kernels that otherwise overlap.
if [[ $PHASE == ncu_ragged ]]; then
  : > "$OUT/$GPU-ncu-ragged.txt"
  ncu_profile "$GPU-ncu-ragged.txt" "AttendKernel|CombineKernel" 2 \
    bench/profile_ragged_attention.py "decode 64 x 2048" "prefill 4 x 2048"
  ncu_profile "$GPU-ncu-ragged.txt" "AttendKernel|AttendTensorCoreKernel|CombineKernel" 3 \
    bench/profile_ragged_attention.py "mixed: 4 chunks of 256 + 60 decodes x 1024"
  step "done, status $status"
  exit $status
fi

# The SM clock and power draw while each of four mixes runs back to back: a decode row
# (streaming), prefill (tensor cores) and two mixed batches (both at once).
if [[ $PHASE == clocks_ragged ]]; then
  : > "$OUT/$GPU-ragged-clocks.txt"
  for mix in "decode 64 x 2048" "prefill 4 x 2048" "mixed: 4 chunks of 256 + 60 decodes x 1024" \
             "mixed: one 512-token chunk (of 2048) + 63 decodes x 2048"; do
    python3 bench/profile_ragged_attention.py --mix "$mix" --clocks 5 2>&1 | tail -1 \
      | tee -a "$OUT/$GPU-ragged-clocks.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  done
  step "done, status $status"
  exit $status
fi

if [[ $PHASE == ragged ]]; then
  if [[ ${RAGGED_TESTS:-1} != 0 ]]; then
    step "ragged paged attention through JAX on the GPU: the handler's choice, then each kernel everywhere"
    XLA_EXT_TEST_PLATFORM=cuda "${PYTEST[@]}" tests/kernels/test_ragged_paged_attention.py 2>&1 | \
      tail -3 | tee -a "$TESTS" || status=1
    ragged_each_kernel
    for tool in memcheck racecheck; do
      for kernel in default tensor_core; do
        XLA_EXT_RAGGED_PAGED_ATTENTION_KERNEL=$kernel sanitize_run "$tool" 0 \
          "skewed batches and bad data, $kernel kernel choice" \
          tests/kernels/test_ragged_paged_attention.py -k "skewed or bad_data or padding or window"
      done
    done
  fi
  step "ragged paged attention against its roofline and FlashInfer's paged prefill: bench/ragged_bench.py"
  FLASHINFER=()
  if [[ ${RAGGED_FLASHINFER:-1} != 0 ]]; then
    FI_TREE=$(tools/device/flashinfer_tree.sh) && FLASHINFER=(--flashinfer) || status=1
    export PYTHONPATH="$PYTHONPATH:$FI_TREE" FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws \
      TORCH_CUDA_ARCH_LIST=9.0a
  fi
  timeout "${RAGGED_BENCH_TIMEOUT:-540}" python3 bench/ragged_bench.py "${FLASHINFER[@]}" \
    --impls "${RAGGED_IMPLS:-xla_ext,xla_native}" \
    --out "$OUT/$GPU-ragged.json" 2>&1 | grep -E " us |copy|failed|Error" | tee -a "$TESTS" \
    || status=1
  step "done, status $status"
  exit $status
fi

if [[ $PHASE == serving ]]; then
  LOG="$OUT/$GPU-serving.txt"
  : > "$LOG"
  step "serving loop vs transformers (transformers $(python3 -c 'import transformers; print(transformers.__version__)'), torchax $(python3 -c 'import torchax; print(torchax.__version__)'))" | tee -a "$LOG"
  if [[ ${SERVING_COMPARE:-1} == 1 ]]; then
    timeout 180 python3 bench/serving_compare.py --out "$OUT/$GPU-serving-compare.json" 2>&1 | \
      grep -v -i warn | tee -a "$LOG" | grep -E "requests equal|wrote|Error" | tee -a "$TESTS" || status=1
  fi
  step "serving loop throughput: bench/serving_bench.py" | tee -a "$LOG"
  rm -f "$OUT/$GPU-serving-timeline.txt"
  timeout 450 python3 bench/serving_bench.py --steps 24 --compile-deadline-s 330 \
    --out "$OUT/$GPU-serving.json" --timeline "$OUT/$GPU-serving-timeline.txt" \
    ${SERVING_ARGS:-} 2>&1 | \
    grep -v -i warn | tee -a "$LOG" | grep -E "tokens/s|wrote|Error" | tee -a "$TESTS" || status=1
  step "done, status $status"
  exit $status
fi

if [[ $PHASE == serving_flags ]]; then
  step "serving loop, ours, XLA_FLAGS=${SERVING_XLA_FLAGS:?set SERVING_XLA_FLAGS}"
  XLA_FLAGS="$SERVING_XLA_FLAGS" timeout 300 python3 bench/serving_bench.py --impls ours \
    --out "$OUT/$GPU-serving-flags.json" 2>&1 | grep -v -i warn | \
    grep -E "tokens/s|wrote|Error" | tee -a "$TESTS" || status=1
  step "done, status $status"
  exit $status
fi

if [[ $PHASE == kv_cache ]]; then
  step "KV-cache write step time against cache size: bench/kv_cache_bench.py"
  python3 bench/kv_cache_bench.py --frontends jax,torchax --sizes-mib 4,64,512,2048,8192 \
    --out "$OUT/$GPU-kv-cache.json" 2>&1 | grep -E "per step|largest|copy bandwidth" | tee -a "$TESTS" || status=1
  step "done, status $status"
  exit $status
fi

if [[ $PHASE != bench ]]; then
step "CUDA handlers through JAX on the GPU, torchax on the GPU, torch on CUDA tensors"
XLA_EXT_TEST_PLATFORM=cuda python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/kernels 2>&1 | tail -3 | tee -a "$TESTS" || status=1
# The same paged-attention cases on the CUDA-core kernel (what f32 and pre-Hopper GPUs run).
XLA_EXT_PAGED_ATTENTION_KERNEL=simt XLA_EXT_TEST_PLATFORM=cuda python3 -m pytest -q -p no:cacheprovider \
  -W ignore::DeprecationWarning tests/kernels/test_paged_attention.py 2>&1 | tail -1 | \
  sed 's/^/CUDA-core kernel: /' | tee -a "$TESTS" || status=1
XLA_EXT_TEST_PLATFORM=cuda python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/frontends/torchax_test.py 2>&1 | tail -3 | tee -a "$TESTS" || status=1
python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/gpu/torch_cuda_test.py \
  2>&1 | tail -3 | tee -a "$TESTS" || status=1

# XLA_EXT_DEBUG_CHECKS=1: no valid call of the kernel tests is refused, their bad-data cases
# now expect the Host handler's errors, and tests/gpu/debug_checks_test.py checks the errors,
# the caches and the next call on both paths; then that file again with the checks off.
step "XLA_EXT_DEBUG_CHECKS=1: tests/kernels, tests/gpu/torch_cuda_test.py, tests/gpu/debug_checks_test.py"
XLA_EXT_DEBUG_CHECKS=1 XLA_EXT_TEST_PLATFORM=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false "${PYTEST[@]}" \
  tests/kernels tests/gpu/torch_cuda_test.py tests/gpu/debug_checks_test.py 2>&1 | tail -3 | \
  tee -a "$TESTS" || status=1
step "debug checks off: tests/gpu/debug_checks_test.py"
XLA_EXT_TEST_PLATFORM=cuda "${PYTEST[@]}" tests/gpu/debug_checks_test.py 2>&1 | tail -3 | \
  tee -a "$TESTS" || status=1

step "our CUDA handlers registered into JAX's CUDA PJRT plugin through its FFI extension"
python3 tests/gpu/plugin_registration.py > "$OUT/$GPU-plugin.txt" 2>&1 || status=1
tail -3 "$OUT/$GPU-plugin.txt" | tee -a "$TESTS"
ragged_each_kernel  # the handler's choice ran with tests/kernels above
fi
[[ $PHASE == tests ]] && { step "done, status $status"; exit $status; }

step "benchmark: bench/decode_bench.py"
python3 bench/decode_bench.py --out "$OUT/$GPU.json" > /tmp/bench.txt 2>&1 || { status=1; tail -20 /tmp/bench.txt | tee -a "$TESTS"; }

step "per-kernel GPU time of a call in the chain (CUPTI): bench/kernel_times.py"
for impl in xla_ext sdpa_cudnn; do
  python3 bench/kernel_times.py --impl "$impl" --out "/tmp/kernel-times-$impl.json" > /dev/null 2>&1 || status=1
done
python3 -c "import json, sys; json.dump([json.load(open(f)) for f in sys.argv[2:]], open(sys.argv[1], 'w'), indent=1)" \
  "$OUT/$GPU-kernel-times.json" /tmp/kernel-times-xla_ext.json /tmp/kernel-times-sdpa_cudnn.json || status=1

step "per-op cost with and without XLA command buffers: bench/dispatch_command_buffers.py"
python3 bench/dispatch_command_buffers.py 2>&1 | grep "us per call" > "$OUT/$GPU-dispatch-command-buffers.txt" || status=1

step "an FFI call as a Record-stage kernel node (jaxlib 0.11.2): bench/record_probe"
if bench/record_probe/build.sh > /tmp/record-probe.txt 2>&1 &&
    python3 bench/record_probe/probe.py --trace > "$OUT/$GPU-dispatch-record-probe.txt" \
      2> /tmp/record-probe.txt; then
  tail -4 "$OUT/$GPU-dispatch-record-probe.txt" | tee -a "$TESTS"
else
  status=1
  tail -5 /tmp/record-probe.txt | tee -a "$TESTS"
fi

if command -v ncu > /dev/null; then
  step "ncu: paged_attention B=32,L=4096"
  # Through torch: the same CUDA handler, in a process ncu profiles cleanly.
  ncu --kernel-name regex:AttendTensorCore --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --section SchedulerStats python3 bench/profile_paged_attention.py \
    > "$OUT/$GPU-ncu.txt" 2>&1 || echo "ncu failed (see $GPU-ncu.txt)" | tee -a "$TESTS"
else
  step "ncu: not installed on this machine"
fi
step "done, status $status"
exit $status
