#!/usr/bin/env bash
# The GPU proof, in one command on the GPU machine (no Bazel there):
#   build the kernels with its nvcc (sm_80, sm_90a, compute_90), run every GPU test (CUDA
#   handlers through JAX's XLA GPU, through torchax, through torch on CUDA tensors), the
#   compute-sanitizer memcheck and racecheck runs, the registration of our CUDA handlers into
#   JAX's CUDA PJRT plugin by our own path, the benchmark, and an ncu profile of paged attention.
# Writes <gpu>.json, <gpu>-tests.txt, <gpu>-plugin.txt, <gpu>-kernel-times.json,
# <gpu>-dispatch-command-buffers.txt, <gpu>-dispatch-record-probe.txt and <gpu>-ncu.txt to $OUT
# (default bench/results). Needs: .devbuild/ffi_include (jaxlib 0.7.1's FFI headers) and, for
# torchax, a torchax wheel in .whl/ (see bench/README.md).
#
#   tools/device/run.sh [all|tests|bench|kv_cache|ragged|sanitize_jax|serving]   (all: tests and
#   bench; each fits 10 minutes)
#   kv_cache: bench/kv_cache_bench.py through JAX and torchax -> <gpu>-kv-cache.json
#   ragged:   bench/ragged_bench.py -> <gpu>-ragged.json
#   serving:  the serving loop (torch_xla_ext/serving) through torchax against transformers on
#             this GPU: bench/serving_compare.py -> <gpu>-serving-compare.json (tokens, first
#             divergence, logit differences) and bench/serving_bench.py -> <gpu>-serving.json
#             (throughput, time per step, profile); logs in <gpu>-serving.txt. Needs the
#             transformers wheel in .whl/ too (bench/README.md)
#   sanitize_jax: compute-sanitizer over the JAX path only (also part of tests)
set -uo pipefail
PHASE="${1:-all}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-bench/results}"
GPU="${GPU:-h100}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
TESTS="$OUT/$GPU-tests.txt"

# The handlers through JAX's XLA GPU (the path users run), under memcheck and racecheck.
sanitize_jax() {
  local tool
  for tool in memcheck racecheck; do
    step "compute-sanitizer --tool $tool through JAX: kv_cache_update, simple_add, ragged attention"
    XLA_FLAGS=--xla_gpu_autotune_level=0 XLA_EXT_TEST_PLATFORM=cuda timeout 200 compute-sanitizer \
      --tool "$tool" --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
      -W ignore::DeprecationWarning tests/kernels/test_kv_cache_update.py \
      tests/kernels/test_simple_add.py tests/kernels/test_ragged_paged_attention.py \
      -k "not random and not long_rows" > "/tmp/sanitizer-jax-$tool.txt" 2>&1
    local code=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "/tmp/sanitizer-jax-$tool.txt" | tee -a "$TESTS"
    [[ $code == 0 ]] || { status=1; tail -30 "/tmp/sanitizer-jax-$tool.txt" | tee -a "$TESTS"; }
  done
}
status=0
step() { echo "== $*" | tee -a "$TESTS"; }
[[ $PHASE == bench || $PHASE == kv_cache || $PHASE == ragged || $PHASE == sanitize_jax ||
   $PHASE == serving ]] || : > "$TESTS"

step "$(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
step "build: tools/device/build_kernels.sh"
tools/device/build_kernels.sh > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt | tee -a "$TESTS"; exit 1; }

if [[ $PHASE == sanitize_jax ]]; then
  sanitize_jax
  step "done, status $status"
  exit $status
fi

if [[ $PHASE == ragged ]]; then
  step "ragged paged attention against its roofline: bench/ragged_bench.py"
  python3 bench/ragged_bench.py --out "$OUT/$GPU-ragged.json" 2>&1 | grep -E " us |copy|failed|Error" \
    | tee -a "$TESTS" || status=1
  step "done, status $status"
  exit $status
fi

if [[ $PHASE == serving ]]; then
  LOG="$OUT/$GPU-serving.txt"
  : > "$LOG"
  step "serving loop vs transformers (transformers $(python3 -c 'import transformers; print(transformers.__version__)'), torchax $(python3 -c 'import torchax; print(torchax.__version__)'))" | tee -a "$LOG"
  timeout 180 python3 bench/serving_compare.py --out "$OUT/$GPU-serving-compare.json" 2>&1 | \
    grep -v -i warn | tee -a "$LOG" | grep -E "requests equal|wrote|Error" | tee -a "$TESTS" || status=1
  step "serving loop throughput: bench/serving_bench.py" | tee -a "$LOG"
  timeout 330 python3 bench/serving_bench.py --out "$OUT/$GPU-serving.json" 2>&1 | \
    grep -v -i warn | tee -a "$LOG" | grep -E "tokens/s|wrote|Error" | tee -a "$TESTS" || status=1
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

# The sanitizers run the CUDA handlers through torch (one process, no XLA autotuning noise).
for tool in memcheck racecheck synccheck; do
  command -v compute-sanitizer > /dev/null || { step "compute-sanitizer: not installed"; break; }
  step "compute-sanitizer --tool $tool: tests/gpu/torch_cuda_test.py"
  compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    -W ignore::DeprecationWarning tests/gpu/torch_cuda_test.py -k "not opcheck" > /tmp/sanitizer.txt 2>&1
  code=$?
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" /tmp/sanitizer.txt | tee -a "$TESTS"
  [[ $code == 0 ]] || { status=1; tail -30 /tmp/sanitizer.txt | tee -a "$TESTS"; }
done

sanitize_jax

step "our CUDA handlers registered into JAX's CUDA PJRT plugin through its FFI extension"
python3 tests/gpu/plugin_registration.py > "$OUT/$GPU-plugin.txt" 2>&1 || status=1
tail -3 "$OUT/$GPU-plugin.txt" | tee -a "$TESTS"
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
