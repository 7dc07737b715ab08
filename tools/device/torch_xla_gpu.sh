#!/usr/bin/env bash
# torch_xla 2.9 on the GPU machine, which has Python 3.12, CUDA 13, torch 2.11 and JAX 0.11
# but neither torch 2.9 nor torch_xla, and whose calls carry at most 64 MiB each.
#
#   here:  tools/device/torch_xla_gpu.sh stage
#            torch 2.9 (its CPU side; its CUDA libraries stubbed), torch_xla 2.9 and
#            jax-cuda13-pjrt 0.7.2's plugin as pieces .stage/torch_xla_gpu/1..N of at most
#            58 MiB (tools/device/torch_xla_closure.py; needs Bazel's wheel for our entry
#            points: bazel build //...). Carry each piece in a call of its own, back to back in
#            one lease (a carried path stays while the machine is warm); the last call runs:
#   there: tools/device/torch_xla_gpu.sh run [proof|legacy|vllm|bench]
#            Unpacks into /tmp/torch_xla_gpu (sha256-checked), builds our libraries
#            (SKIP_BUILD=1: keeps the kernels an earlier call built).
#            proof: with PJRT_DEVICE=GPU in the staged torch: tools/device/torch_xla_gpu_proof.py
#              check, then the torch_xla tests and the serving engine's tests; in the machine's
#              own torch and JAX: the proof's compare -> $OUT/$GPU-torch-xla-gpu.json (the
#              record), $OUT/$GPU-torch-xla-gpu.txt (the log)
#            legacy: the guides' flow (tests/user_kernel/legacy/guides_flow.py, no added line:
#              the staged wheel's entry points import torch_xla_ext) with the user's CUDA
#              kernel built by nvcc, at api_version 1, 2, 3, and a typed FFI handler by
#              capsule at 4 -> $OUT/$GPU-torch-xla-legacy.txt (proof runs it too)
#            vllm: (staged with `stage --vllm`) vLLM 0.13 through torch_xla_ext.vllm_platform
#              with PJRT_DEVICE=GPU: tools/device/vllm_gpu.py's phases (VLLM_PHASES, default
#              check,serve,speed; each fits a call of its own): `LLM` on a tiny float32
#              checkpoint against transformers and the 1B-class one in bfloat16 against our
#              Engine (VLLM_MODELS picks), `vllm serve` under load, the 1B model's step
#              times and startup, (VLLM_PHASES=profile) a cProfile of its decode step and
#              (VLLM_PHASES=start) of its start, cold and warm, with torch_xla's compile counts
#              -> $OUT/$GPU-vllm.json
#            soak: bench/engine_soak.py, 10,000 steps through torch_xla, then through torchax
#              (SOAK_BACKENDS picks) -> $OUT/$GPU-engine-soak-<backend>.json
#            failures: with XLA_EXT_DEBUG_CHECKS=1 (the CUDA handlers see bad data and fail),
#              tools/device/step_failure_probe.py, then the tests of failed graphs
#              (tests/torch_xla/failure_matrix_test.py, failed_graph_test.py, isolation_test.py,
#              tests/serving/step_failure_test.py; FAILURES_TESTS=0 leaves them out)
#              -> $OUT/$GPU-torch-xla-failures.txt
#            bench: bench/serving_bench.py --impls ours on the 1B model through torch_xla, then
#              through torchax beside transformers + torch.compile, in one lease (modes async
#              and runs) -> $OUT/$GPU-serving-torch-xla.json (both runs);
#              bench/torch_xla_step_profile.py -> $OUT/$GPU-torch-xla-step-profile.txt
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT="$PWD"
COMMAND="${1:-}"
PHASE="${2:-proof}"
TREE=/tmp/torch_xla_gpu

if [[ $COMMAND == stage ]]; then
  exec .venv/bin/python tools/device/torch_xla_closure.py stage "${@:2}"
fi
[[ $COMMAND == run && $PHASE =~ ^(proof|legacy|vllm|soak|failures|bench)$ ]] || {
  echo "usage: $0 stage [--vllm] | run [proof|legacy|vllm|soak|failures|bench]" >&2; exit 2; }

OUT="${OUT:-bench/results}"
GPU="${GPU:-h100}"
mkdir -p "$OUT"
LOG="$OUT/$GPU-torch-xla-gpu.txt"
[[ $PHASE == bench ]] && LOG=/tmp/torch-xla-bench.txt
[[ $PHASE == legacy ]] && LOG="$OUT/$GPU-torch-xla-legacy.txt"
[[ $PHASE == vllm || $PHASE == soak || $PHASE == failures ]] && LOG=/tmp/$PHASE-gpu.txt
: > "$LOG"
step() { echo "== $*" | tee -a "$LOG"; }
status=0
export PYTHONUNBUFFERED=1

step "$(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
step "unpack: tools/device/torch_xla_closure.py unpack --to $TREE"
python3 tools/device/torch_xla_closure.py unpack --to "$TREE" 2>&1 | tail -2 | tee -a "$LOG"
[[ ${PIPESTATUS[0]} == 0 ]] || exit 1
# The machine's own Python: our package from the checkout, torchax from .whl (as run.sh).
MACHINE_PATH="$ROOT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    MACHINE_PATH="$ROOT:/tmp/site"
fi
# The staged Python: torch 2.9 and torch_xla ahead of the machine's torch; the plugin's
# distribution (jax-cuda13-pjrt 0.7.2) ahead of the machine's 0.11.2, so torch_xla_ext finds
# it as a user's pip install would; JAX kept off the GPU.
STAGED=(env "PYTHONPATH=$TREE/site:$TREE/plugin:$MACHINE_PATH" PJRT_DEVICE=GPU JAX_PLATFORMS=cpu)
MACHINE=(env "PYTHONPATH=$MACHINE_PATH")

step "build: tools/device/build_kernels.sh (the machine's torch), then libxla_ext_torch.so for the staged torch"
if [[ ${SKIP_BUILD:-0} == 1 && -f torch_xla_ext/lib/libxla_ext_kernels.so ]]; then
  step "build: kept the kernels of an earlier call (SKIP_BUILD=1)"
else
  tools/device/build_kernels.sh > /tmp/build.txt 2>&1 || { tail -30 /tmp/build.txt | tee -a "$LOG"; exit 1; }
fi
build_torch_extension() {  # the python3 environment whose torch to build against
  "$@" tools/device/build_kernels.sh torch > /tmp/build-torch.txt 2>&1 || {
    tail -30 /tmp/build-torch.txt | tee -a "$LOG"; exit 1; }
}
build_torch_extension env "PYTHONPATH=$TREE/site"

legacy_flow() {  # the guides' flow with the user's kernels, built here by nvcc
  local dir=tests/user_kernel/legacy lib=/tmp/legacy_kernels log="$OUT/$GPU-torch-xla-legacy.txt"
  mkdir -p "$lib"
  [[ $log == "$LOG" ]] || : > "$log"
  local nvcc=(/usr/local/cuda/bin/nvcc --shared -Xcompiler -fPIC -O2
              -gencode=arch=compute_90,code=sm_90)
  for v in 1 2 3; do
    "${nvcc[@]}" -DAPI_VERSION=$v "$dir/simple_add_cuda.cu" -o "$lib/libsimple_add_v$v.so" 2>&1 | tee -a "$log"
  done
  "${nvcc[@]}" -std=c++17 -x cu -DUSER_FFI_CUDA -isystem .devbuild/ffi_include "$dir/ffi_add.cc" \
    -o "$lib/libffi_add.so" 2>&1 | tee -a "$log"
  for v in 1 2 3; do
    echo "== guides' flow, api_version $v, PJRT_DEVICE=GPU, platform CUDA, no added line" | tee -a "$log"
    local extra=(); [[ $v == 2 ]] && extra=(--check-failure)
    timeout 180 "${STAGED[@]}" python3 "$dir/guides_flow.py" "$lib/libsimple_add_v$v.so" $v CUDA \
      "${extra[@]}" > /tmp/legacy-$v.txt 2>&1 || status=1
    grep -v -E "^WARNING|^I0000|^E0000|^W0000" /tmp/legacy-$v.txt | tail -6 | tee -a "$log"
  done
  echo "== a typed FFI handler by capsule, api_version 4, platform GPU" | tee -a "$log"
  timeout 180 "${STAGED[@]}" python3 "$dir/guides_flow.py" "$lib/libffi_add.so" 4 GPU \
    --target user.ffi_add --symbol UserFfiAdd > /tmp/legacy-4.txt 2>&1 || status=1
  grep -v -E "^WARNING|^I0000|^E0000|^W0000" /tmp/legacy-4.txt | tail -6 | tee -a "$log"
}

if [[ $PHASE == legacy ]]; then
  legacy_flow
elif [[ $PHASE == vllm ]]; then
  step "vLLM, PJRT_DEVICE=GPU, staged torch_xla and vLLM: tools/device/vllm_gpu.py"
  timeout "${VLLM_TIMEOUT:-570}" "${STAGED[@]}" VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
    python3 tools/device/vllm_gpu.py --phases "${VLLM_PHASES:-check,serve,speed}" \
    --models "${VLLM_MODELS:-tiny,1b}" --out "$OUT/$GPU-vllm.json" > /tmp/vllm-gpu-full.txt 2>&1 || status=1
  grep -E "^(PASS|FAIL)|Error" /tmp/vllm-gpu-full.txt | tail -20 | tee -a "$LOG"
  cp /tmp/vllm-gpu-full.txt "$OUT/$GPU-vllm-log.txt"
elif [[ $PHASE == soak ]]; then
  for backend in ${SOAK_BACKENDS:-torch_xla torchax}; do
    soak=(bench/engine_soak.py --backend "$backend" --steps "${SOAK_STEPS:-10000}"
          --out "$OUT/$GPU-engine-soak-${backend/_/-}.json")
    if [[ $backend == torch_xla ]]; then
      step "soak, PJRT_DEVICE=GPU, staged torch_xla: ${soak[*]}"
      run_soak=("${STAGED[@]}")
    else
      build_torch_extension env
      step "soak, the machine's torch and JAX: ${soak[*]}"
      run_soak=("${MACHINE[@]}" JAX_PLATFORMS=cuda)
    fi
    timeout "${SOAK_TIMEOUT:-400}" "${run_soak[@]}" python3 "${soak[@]}" > "/tmp/soak-$backend.txt" 2>&1 || status=1
    grep -E "^\{\"device|^FAIL|Error" "/tmp/soak-$backend.txt" | tail -5 | tee -a "$LOG"
  done
elif [[ $PHASE == failures ]]; then
  RECORD="$OUT/$GPU-torch-xla-failures.txt"
  step "a serving step's failure, PJRT_DEVICE=GPU, XLA_EXT_DEBUG_CHECKS=1: tools/device/step_failure_probe.py" | tee "$RECORD"
  timeout 240 "${STAGED[@]}" XLA_EXT_DEBUG_CHECKS=1 python3 tools/device/step_failure_probe.py \
    2>&1 | grep -E "^(checks|step|held|a later)" | tee -a "$LOG" "$RECORD"
  if [[ ${FAILURES_TESTS:-1} != 0 ]]; then
    step "failed graphs, PJRT_DEVICE=GPU, XLA_EXT_DEBUG_CHECKS=1, staged torch_xla" | tee -a "$RECORD"
    timeout 480 "${STAGED[@]}" XLA_EXT_DEBUG_CHECKS=1 python3 -m pytest -q -p no:cacheprovider \
      -W ignore::DeprecationWarning tests/torch_xla/failure_matrix_test.py \
      tests/torch_xla/failed_graph_test.py tests/torch_xla/isolation_test.py \
      tests/serving/step_failure_test.py > /tmp/failures.txt 2>&1 || status=1
    grep -E "^(FAILED|ERROR) |^[0-9]+ (passed|failed)" /tmp/failures.txt | tee -a "$LOG"
    cat /tmp/failures.txt >> "$RECORD"
  fi
elif [[ $PHASE == proof ]]; then
  legacy_flow
  step "check, PJRT_DEVICE=GPU, staged torch_xla: tools/device/torch_xla_gpu_proof.py check"
  timeout 300 "${STAGED[@]}" python3 tools/device/torch_xla_gpu_proof.py check 2>&1 | \
    grep -E "^(PASS|FAIL)|Error|error:" | tee -a "$LOG"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  step "tests, PJRT_DEVICE=GPU: tests/torch_xla, tests/serving/engine_test.py"
  timeout 420 "${STAGED[@]}" python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/torch_xla tests/serving/engine_test.py > /tmp/torch-xla-tests.txt 2>&1 || status=1
  grep -E "^(FAILED|ERROR) |^[0-9]+ (passed|failed)" /tmp/torch-xla-tests.txt | tee -a "$LOG"
  cp /tmp/torch-xla-tests.txt "$OUT/$GPU-torch-xla-gpu-tests.txt"
  build_torch_extension env
  step "compare, the machine's torch (CUDA) and JAX: tools/device/torch_xla_gpu_proof.py compare"
  timeout 300 "${MACHINE[@]}" python3 tools/device/torch_xla_gpu_proof.py compare \
    --out "$OUT/$GPU-torch-xla-gpu.json" 2>&1 | grep -E "^(PASS|FAIL|wrote)|Error" | tee -a "$LOG"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
else
  # BENCH_BACKENDS=torch_xla, then =torchax in the next call of the lease, when both do not
  # fit one call: the second writes the record of both.
  SERVING=(bench/serving_bench.py --batches 1,16,64 --modes async,runs --profile-steps 0)
  if [[ ${BENCH_BACKENDS:-torch_xla,torchax} == *torch_xla* ]]; then
    step "serving, PJRT_DEVICE=GPU, staged torch_xla: ${SERVING[*]} --impls ours --backend torch_xla"
    timeout 420 "${STAGED[@]}" python3 "${SERVING[@]}" --impls ours --backend torch_xla --device cpu \
      --out /tmp/serving-torch-xla.json 2>&1 | grep -E "^serving|engine:|Error" | tee -a "$LOG" || status=1
    step "where a torch_xla step's host time goes: bench/torch_xla_step_profile.py"
    timeout 300 "${STAGED[@]}" python3 bench/torch_xla_step_profile.py \
      > "$OUT/$GPU-torch-xla-step-profile.txt" 2>&1 || status=1
    head -1 "$OUT/$GPU-torch-xla-step-profile.txt" | tee -a "$LOG"
  fi
  if [[ ${BENCH_BACKENDS:-torch_xla,torchax} == *torchax* ]]; then
    build_torch_extension env
    step "serving, the machine's torch and JAX: ${SERVING[*]} --impls ours,hf_compile --backend torchax"
    timeout 420 "${MACHINE[@]}" python3 "${SERVING[@]}" --impls ours,hf_compile --backend torchax \
      --out /tmp/serving-torchax.json 2>&1 | grep -E "^serving|engine:|copy|Error" | tee -a "$LOG" || status=1
  fi
  python3 - "$OUT/$GPU-serving-torch-xla.json" /tmp/serving-torch-xla.json /tmp/serving-torchax.json <<'EOF'
import json, sys
runs = {}
for path in sys.argv[2:]:
    try:
        with open(path) as f:
            run = json.load(f)
        runs[run["backend"]] = run
    except (OSError, ValueError) as e:
        runs[path] = {"error": str(e)}
with open(sys.argv[1], "w") as f:
    json.dump({"note": "the same 1B model and rows through each backend, one lease", "runs": runs},
              f, indent=1)
EOF
  cp "$LOG" "$OUT/$GPU-serving-torch-xla.txt"
fi
step "done, status $status"
exit $status
