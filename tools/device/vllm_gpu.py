"""vLLM 0.13's own engine and server through XLA and torch_xla_ext's kernels, on a GPU
(PJRT_DEVICE=GPU) or the CPU: `tools/device/torch_xla_gpu.sh run vllm` runs it on the GPU
machine, in the staged torch_xla + vLLM tree (torch_xla_closure.py stage --vllm).

    python3 tools/device/vllm_gpu.py --out FILE [--phases check,serve,speed] [--models tiny,1b]
    python3 tools/device/vllm_gpu.py --out FILE --combine PHASE_FILE... --serving SERVING_FILE...

The models are random-weight Llamas saved with save_pretrained, as a user's checkpoint: tiny
(hf.TINY, float32) and 1b (the serving benchmark's 1B-class config, bfloat16). vLLM keeps its
memory defaults: the KV cache is sized from the device's memory and gpu_memory_utilization.
Every run is a process of its own (each takes the device's memory). Each phase adds its part
to the record in FILE:

- check: greedy tokens of `LLM(...).generate`: tiny's against transformers', 1b's against our
  Engine's (torch_xla backend) on the same device, with the first divergence and vLLM's margin
  there (its top-1 minus top-2 logprob);
- serve: `vllm serve` on tiny with --skip-tokenizer-init, on loopback, checked by
  bench/vllm_serve_load.check_server (solo, streamed, 64 at once, bad requests, disconnects),
  the tokens also against transformers';
- speed: 1b with up to 64 sequences and 2k-token prompts, as bench/serving_bench.py runs our
  Engine: wall time per decode step at B = 1, 16 and 64, and per step of its mixed batch (48
  decodes at 2k beside 16 new 2k-token prompts prefilled in 512-token chunks), each the mean
  over steps of LLMEngine.step(); startup (process start to the first token, every compile
  included) cold, then again with the persistent compilation cache that start wrote;
- profile: where the time of vLLM's decode step goes: B=1 decode steps of 1b with the engine
  core in the profiled process, timed, then under cProfile with torch_xla's metrics per step;
- start: where the time of vLLM's start goes, cold and then with the persistent compilation
  cache the cold start wrote: each start to its first token under cProfile with the engine
  core in the process, with torch_xla's compile time and count, its persistent cache's hits
  and misses, and the time in torch.compile's tracing and in torch_xla's calls that compile.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 16
PROMPT_LENS = (5, 17, 40, 9)
LIMITS = {"tiny": dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64),
          "1b": dict(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=256)}
# The serve phase: long enough requests that a client leaving mid-stream is seen as an abort.
SERVE_LIMITS = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128)
# The speed phase: serving_bench's shape (2k contexts, up to 64 sequences, 512-token chunks).
SPEED_LIMITS = dict(max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=512)
CONTEXT, WARMUP, STEPS = 2048, 5, 30
BATCHES = (1, 16, 64)
# VLLM_GPU_SMOKE=1: the speed phase's code on tiny with short prompts, for a run on the CPU.
if os.environ.get("VLLM_GPU_SMOKE") == "1":
    SPEED_LIMITS, CONTEXT, STEPS = dict(SPEED_LIMITS, max_model_len=128), 48, 8
MIXED_DECODES, MIXED_PREFILLS = 48, 16


def _config(model):
    from torch_xla_ext.serving import hf

    return {"tiny": hf.TINY, "1b": hf.LLAMA_1B}[model]


def _dtype(model):
    return "float32" if model == "tiny" else "bfloat16"


def _prompts(vocab_size, lens=PROMPT_LENS, seed=7):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lens]


def save_checkpoint(model, directory):
    import torch

    from torch_xla_ext.serving import hf

    dtype = getattr(torch, _dtype(model))
    llama = hf.random_model(_config(model), seed=0, dtype=dtype)
    llama.config.torch_dtype = dtype
    llama.save_pretrained(directory)


def _since_start():
    """Seconds since the parent started this process (VLLM_GPU_T0)."""
    return round(time.time() - float(os.environ["VLLM_GPU_T0"]), 1)


# VLLM_GPU_KV_BYTES: the KV cache's size (kv_cache_memory_bytes) instead of vLLM's sizing.
KV_BYTES = {"kv_cache_memory_bytes": int(os.environ["VLLM_GPU_KV_BYTES"])} \
    if os.environ.get("VLLM_GPU_KV_BYTES") else {}


def _llm(model, directory, **limits):
    from vllm import LLM

    return LLM(model=directory, dtype=_dtype(model), skip_tokenizer_init=True, **KV_BYTES,
               **limits)


def _greedy(max_tokens, **fields):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)


def _cache(llm, model):
    config = llm.llm_engine.vllm_config
    cache, model_config = config.cache_config, config.model_config
    # vLLM's TPU layout, one per layer: [blocks, block_size, 2 x kv heads (K, V interleaved),
    # head size]; our worker keeps the head size unpadded where our kernels take it.
    shape = [cache.num_gpu_blocks, cache.block_size,
             2 * model_config.get_num_kv_heads(config.parallel_config),
             model_config.get_head_size()]
    return {"num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
            "layer_cache_shape": shape, "gpu_memory_utilization": cache.gpu_memory_utilization}


def run_vllm(model, directory):
    """In this process: vLLM's LLM on the checkpoint; its greedy tokens with the top-2 logprobs
    of each, start time and cache."""
    from vllm.platforms import current_platform

    llm = _llm(model, directory, **LIMITS[model])
    prompts = _prompts(_config(model)["vocab_size"])
    first = llm.generate([{"prompt_token_ids": prompts[0]}], _greedy(1))
    start_s = _since_start()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(MAX_TOKENS, logprobs=2))
    return {"platform": type(current_platform).__qualname__,
            "device": current_platform.get_device_name(),
            "first_token": list(first[0].outputs[0].token_ids),
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "top2_logprobs": [[sorted(([t, round(lp.logprob, 4)] for t, lp in step.items()),
                                      key=lambda x: -x[1])[:2] for step in o.outputs[0].logprobs]
                              for o in outputs],
            "start_to_first_token_s": start_s, **_cache(llm, model)}


def run_engine(model, directory):
    """In this process: our Engine (torch_xla backend) on the same checkpoint."""
    import torch
    import transformers

    from torch_xla_ext.serving import Engine

    dtype = getattr(torch, _dtype(model))
    llama = transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=dtype).eval()
    engine = Engine(llama, backend="torch_xla", dtype=dtype, page_size=16, **LIMITS[model])
    return {"tokens": engine.generate(_prompts(_config(model)["vocab_size"]), MAX_TOKENS)}


def run_transformers(model, directory):
    import torch
    import transformers

    from torch_xla_ext.serving import hf

    llama = transformers.LlamaForCausalLM.from_pretrained(directory,
                                                          torch_dtype=torch.float32).eval()
    return {"tokens": [hf.reference_generate(llama, p, MAX_TOKENS)[0]
                       for p in _prompts(_config(model)["vocab_size"])]}


def _step_until(engine, done):
    """engine.step() until done(outputs) says so; per step its wall clock and the ids of the
    requests that got tokens."""
    steps = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps.append((time.perf_counter(), {o.request_id for o in outputs
                                            if o.outputs and o.outputs[0].token_ids}))
        if done(steps[-1][1]):
            break
    return steps


def _mean_ms(times):
    return round((times[-1] - times[0]) / (len(times) - 1) * 1e3, 3) if len(times) > 1 else None


def _add(engine, name, prompts, params):
    ids = [f"{name}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    return set(ids)


def _decode_row(engine, vocab_size, batch):
    """B requests of CONTEXT-token prompts prefilled, then WARMUP + STEPS decode steps: the
    mean wall time of the timed steps, those in which every request got its next token."""
    from vllm.sampling_params import RequestOutputKind

    # The first request decodes while the others prefill: enough tokens that all of them are
    # decoding for WARMUP + STEPS steps after the last prefill (decodes take the budget first).
    prefill_steps = -(-batch * CONTEXT // (SPEED_LIMITS["max_num_batched_tokens"] - batch)) + 2
    ids = _add(engine, f"decode{batch}", _prompts(vocab_size, [CONTEXT] * batch, seed=batch),
               _greedy(prefill_steps + WARMUP + STEPS + 1, output_kind=RequestOutputKind.DELTA))
    started, decode_steps = set(), []
    for when, got in _step_until(engine, lambda got: False):
        if started >= ids and got >= ids:
            decode_steps.append(when)
        started |= got
    timed = decode_steps[WARMUP:WARMUP + STEPS]
    return {"batch": batch, "context": CONTEXT, "steps": len(timed) - 1, "ms_per_step": _mean_ms(timed)}


def _mixed_row(engine, vocab_size):
    """MIXED_DECODES requests decoding at CONTEXT while MIXED_PREFILLS new CONTEXT-token
    prompts are prefilled in chunks: the mean wall time of the steps that ran every decode."""
    from vllm.sampling_params import RequestOutputKind

    delta = RequestOutputKind.DELTA
    decodes = _add(engine, "mixed-decode", _prompts(vocab_size, [CONTEXT] * MIXED_DECODES, seed=101),
                   _greedy(1000, output_kind=delta))
    started = set()

    def decoding(got):
        started.update(got)
        return started >= decodes

    _step_until(engine, decoding)
    for _ in range(WARMUP):
        engine.step()
    prefills = _add(engine, "mixed-prefill", _prompts(vocab_size, [CONTEXT] * MIXED_PREFILLS, seed=102),
                    _greedy(1, output_kind=delta))
    prefilled = set()

    def all_prefilled(got):
        prefilled.update(got & prefills)
        return prefilled >= prefills

    steps = _step_until(engine, all_prefilled)
    engine.abort_request(list(decodes))
    while engine.has_unfinished_requests():
        engine.step()
    timed = [when for when, got in steps if got >= decodes][2:]
    return {"decodes": MIXED_DECODES, "prefills": MIXED_PREFILLS, "context": CONTEXT,
            "chunk_budget": SPEED_LIMITS["max_num_batched_tokens"], "steps": len(timed) - 1,
            "ms_per_step": _mean_ms(timed)}


def run_speed(model, directory):
    """In this process: vLLM started cold (the persistent compilation cache empty), its first
    token, then the decode rows and the mixed row."""
    llm = _llm(model, directory, **SPEED_LIMITS)
    vocab_size = _config(model)["vocab_size"]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], _greedy(1))
    record = {"start_to_first_token_s": _since_start(), **_cache(llm, model), **SPEED_LIMITS}
    engine = llm.llm_engine
    record["decode"] = [_decode_row(engine, vocab_size, batch) for batch in BATCHES]
    record["mixed"] = _mixed_row(engine, vocab_size)
    return record


def run_restart(model, directory):
    """In this process: vLLM started again, with the compilation cache the cold start wrote."""
    llm = _llm(model, directory, **SPEED_LIMITS)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], _greedy(1))
    return {"start_to_first_token_s": _since_start()}


def _per_step_metrics(steps):
    """torch_xla's metrics since they were cleared, per step: each counter's count, and each
    timed metric's count and milliseconds."""
    import torch_xla.debug.metrics as met

    counters = {name: round(met.counter_value(name) / steps, 2) for name in met.counter_names()}
    timed = {}
    for name in met.metric_names():
        data = met.metric_data(name)
        if data and name.endswith("Time"):  # (count, accumulated ns, samples)
            timed[name] = {"count": round(data[0] / steps, 2),
                           "ms": round(data[1] / 1e6 / steps, 3)}
    return {"counters": counters, "timed": timed}


def _us_per_call(call, calls=200):
    for _ in range(10):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return round((time.perf_counter() - start) / calls * 1e6, 1)


def _torch_xla_call_costs():
    """Host microseconds per call of what vLLM's TPU runner calls each step, in this process
    (its model and caches live: a sync looks at every live tensor)."""
    import torch
    import torch_xla

    device = torch_xla.device()
    ids = torch.zeros(64, dtype=torch.int32)
    ready = torch.ones(4, device=device)
    torch_xla.sync(wait=True)
    return {"sync_nothing_pending": _us_per_call(lambda: torch_xla.sync(wait=False)),
            "to_device_int32x64": _us_per_call(lambda: ids.to(device)),
            "tensor_on_device": _us_per_call(
                lambda: torch.tensor([3], dtype=torch.int32, device=device)),
            "cpu_of_a_ready_tensor": _us_per_call(lambda: ready.cpu())}


def _gpu_busy_percent(step, seconds=3.0):
    """nvidia-smi's utilization (the share of time a kernel ran) while `step()` runs for
    `seconds`, sampled every 200 ms, first and last samples dropped; None without a GPU."""
    if os.environ.get("PJRT_DEVICE") != "GPU" or not shutil.which("nvidia-smi"):
        return None
    sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu",
                                "--format=csv,noheader,nounits", "-lms", "200"],
                               stdout=subprocess.PIPE, text=True)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        step()
    sampler.terminate()
    samples = [int(line) for line in sampler.communicate()[0].split() if line.isdigit()]
    return round(sum(samples[1:-1]) / max(len(samples) - 2, 1), 1) if len(samples) > 2 else None


def run_profile(model, directory):
    """In this process, with vLLM's engine core in it too (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    B=1 decode steps at a CONTEXT-token prompt, STEPS of them timed alone, then STEPS under
    cProfile (the functions with the most time, own and cumulative) with torch_xla's metrics
    per step (transfers, executions, syncs), then 3 s of them with the GPU's utilization
    sampled; last, the host cost of single torch_xla calls the step makes."""
    import torch_xla.debug.metrics as met
    from bench.torch_xla_step_profile import profile_steps
    from vllm.sampling_params import RequestOutputKind

    llm = _llm(model, directory, **SPEED_LIMITS)
    engine = llm.llm_engine
    ids = _add(engine, "profile", _prompts(_config(model)["vocab_size"], [CONTEXT], seed=5),
               _greedy(SPEED_LIMITS["max_model_len"] - CONTEXT - 1,
                       output_kind=RequestOutputKind.DELTA))
    _step_until(engine, bool)  # until its prefill gave the first token
    for _ in range(WARMUP):
        engine.step()
    times = [time.perf_counter()]
    for _ in range(STEPS):
        engine.step()
        times.append(time.perf_counter())
    met.clear_all()
    ms_per_step, tables = profile_steps(engine.step, STEPS)
    metrics = _per_step_metrics(STEPS)
    busy = _gpu_busy_percent(engine.step)
    engine.abort_request(list(ids))
    while engine.has_unfinished_requests():
        engine.step()
    return {"steps": STEPS, "ms_per_step": _mean_ms(times),
            "ms_per_step_profiled": round(ms_per_step, 3), "torch_xla_per_step": metrics,
            "gpu_busy_percent": busy, "host_us_per_call": _torch_xla_call_costs(),
            **_cache(llm, model),
            "top": {order: [line for line in text.splitlines() if line.strip()][-26:]
                    for order, text in tables.items()}}


# Where run_start looks for a start's time: (what, the file its function is in (its name's
# end; "~" for a built-in), the function's name); each is reported with its cumulative seconds.
START_PARTS = (
    ("torch.compile's tracing (dynamo)", "convert_frame.py", "_compile"),
    ("torch_xla's dynamo bridge: graph extraction", "dynamo_bridge.py", "extract_graph_helper"),
    ("torch_xla: compile or load an executable", "~",
     "<built-in method torch_xla._XLAC._xla_warm_up_cache>"),
    ("torch_xla: run a compiled graph", "~", "<built-in method torch_xla._XLAC._run_cached_graph>"),
    ("vLLM: load the model", "tpu_model_runner.py", "load_model"),
    ("vLLM: profile run and KV cache", "worker.py", "determine_available_memory"),
    ("vLLM: warm-up compiles", "tpu_model_runner.py", "capture_model"),
)


def run_start(model, directory):
    """In this process, with vLLM's engine core in it (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    vLLM's start to its first token under cProfile (see START_PARTS), with torch_xla's
    metrics: compiles, their time, the persistent cache's hits and misses."""
    import cProfile
    import pstats

    import torch_xla.debug.metrics as met

    profile = cProfile.Profile()
    profile.enable()
    llm = _llm(model, directory, **SPEED_LIMITS)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], _greedy(1))
    profile.disable()
    first_token_s = _since_start()
    stats = pstats.Stats(profile).stats  # {(file, line, function): (cc, nc, tt, ct, callers)}
    parts = {}
    for what, file_end, name in START_PARTS:
        seconds = [ct for (file, _, function), (_, _, _, ct, _) in stats.items()
                   if function == name and file.endswith(file_end)]
        parts[what] = round(max(seconds), 1) if seconds else None
    compile_time = met.metric_data("CompileTime")  # (count, total ns, samples) or None
    return {"start_to_first_token_s": first_token_s, "cumulative_s": parts,
            "compiles": compile_time[0] if compile_time else 0,
            "compile_s": round(compile_time[1] / 1e9, 1) if compile_time else 0.0,
            "counters": {name: met.counter_value(name) for name in met.counter_names()
                         if "PersistentCache" in name or name in ("CachedCompile",)}}


CHILDREN = {"vllm": run_vllm, "engine": run_engine, "transformers": run_transformers,
            "speed": run_speed, "restart": run_restart, "profile": run_profile,
            "start": run_start}


def _child(what, model, directory, timeout, **env):
    """Runs one of CHILDREN in a process of its own."""
    tic = time.time()
    try:
        result = subprocess.run([sys.executable, __file__, "--child", what, model, directory],
                                capture_output=True, text=True, timeout=timeout,
                                env=dict(os.environ, VLLM_GPU_T0=str(tic), **env))
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout} s",
                "stderr_tail": (e.stderr or b"").decode(errors="replace").splitlines()[-20:]}
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        tail = [line for line in result.stderr.splitlines()
                if "Error" in line or "error" in line or "Traceback" in line][-12:]
        return {"error": f"exit {result.returncode}", "stderr_tail": tail or
                result.stderr.splitlines()[-20:], "wall_s": round(time.time() - tic, 1)}
    return {**json.loads(lines[-1][len("RESULT "):]), "wall_s": round(time.time() - tic, 1),
            "start_log": _start_lines(result.stdout + result.stderr, tic)}


# vLLM's log lines that time its start: weight loading, the TPU runner's warm-up compiles per
# function, the engine's initialisation.
START_LINE = re.compile(r"Loading weights took|Compiling \S+ with|Compiling the model|"
                        r"Compilation finished in|init engine .* took|KV cache size|XLA platform:")


def _start_lines(log, t0):
    """START_LINE's lines, each as "+S s message": S, the seconds since the child started, from
    vLLM's own time stamp (local time, to the second)."""
    lines = []
    for line in log.splitlines():
        if not START_LINE.search(line):
            continue
        stamp = re.search(r"(\d\d-\d\d \d\d:\d\d:\d\d)", line)
        message = re.sub(r"^.*?\] ", "", line)[:200]
        if stamp:
            year = time.localtime(t0).tm_year
            at = time.mktime(time.strptime(f"{year}-{stamp.group(1)}", "%Y-%m-%d %H:%M:%S"))
            message = f"+{round(at - t0)} s {message}"
        lines.append(message)
    return lines


def _divergence(got, want, top2=None):
    """The first (prompt, token) where two runs' tokens differ, with vLLM's top-1 minus top-2
    logprob there when known."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            k = next(k for k, (x, y) in enumerate(zip(a + [None], b)) if x != y)
            where = {"prompt": i, "token": k, "vllm": a[k] if k < len(a) else None, "other": b[k]}
            if top2 and k < len(top2[i]) and len(top2[i][k]) == 2:
                where["vllm_top2_logprobs"] = top2[i][k]
                where["vllm_margin"] = round(top2[i][k][0][1] - top2[i][k][1][1], 4)
            return where
    return None


def _checkpoint(work, model):
    directory = os.path.join(work, model)
    if not os.path.exists(os.path.join(directory, "config.json")):
        save_checkpoint(model, directory)
    return directory


def check(work, models):
    results = {}
    for model in models:
        directory = _checkpoint(work, model)
        entry = {"vllm": _child("vllm", model, directory, 900)}
        reference = "transformers" if model == "tiny" else "engine"
        entry[reference] = _child(reference, model, directory, 900)
        got, want = entry["vllm"].get("tokens"), entry[reference].get("tokens")
        entry.update(equal_to=reference, equal=got is not None and got == want,
                     first_divergence=_divergence(got, want, entry["vllm"].get("top2_logprobs"))
                     if got and want else None)
        results[model] = entry
        print(f"{'PASS' if entry['equal'] else 'FAIL'} check {model}: vLLM tokens "
              f"{'==' if entry['equal'] else '!='} {reference}'s; first divergence "
              f"{entry['first_divergence']}; start to first token "
              f"{entry['vllm'].get('start_to_first_token_s')} s; cache "
              f"{entry['vllm'].get('layer_cache_shape')}", flush=True)
    return results, all(e["equal"] for e in results.values())


def serve(work):
    """`vllm serve` on tiny, checked as its users use it."""
    from bench import vllm_serve_load

    model = "tiny"
    directory = _checkpoint(work, model)
    log_path = os.path.join(work, "serve.log")
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", directory,
               "--dtype", _dtype(model), "--skip-tokenizer-init",
               *[f"--{k.replace('_', '-')}={v}" for k, v in {**SERVE_LIMITS, **KV_BYTES}.items()]]
    record = {}
    tic = time.time()
    try:
        with vllm_serve_load.running_server(command, log_path) as (url, _):
            record["start_to_healthy_s"] = round(time.time() - tic, 1)
            vocab_size = _config(model)["vocab_size"]
            record.update(vllm_serve_load.check_server(
                url, directory, _prompts(vocab_size), vocab_size, SERVE_LIMITS["max_model_len"],
                max_tokens=MAX_TOKENS))
    except RuntimeError as e:
        record["error"] = str(e).splitlines()[0]
    record["server_log"] = [line.rstrip()[-300:] for line in open(log_path)
                            if "KV cache" in line or "ERROR" in line or "Error" in line][-20:]
    reference = _child("transformers", model, directory, 300)
    record["equal_to_transformers"] = (record.get("solo", {}).get("tokens") ==
                                       reference.get("tokens"))
    ok = record.get("ok", False) and record["equal_to_transformers"]
    print(f"{'PASS' if ok else 'FAIL'} serve {model}: "
          f"{ {k: v['ok'] for k, v in record.items() if isinstance(v, dict) and 'ok' in v} }; "
          f"equal to transformers {record['equal_to_transformers']}; healthy after "
          f"{record.get('start_to_healthy_s')} s; {record.get('error', '')}", flush=True)
    return record, ok


def speed(work):
    model = "tiny" if os.environ.get("VLLM_GPU_SMOKE") == "1" else "1b"
    directory = _checkpoint(work, model)
    cache = os.path.join(work, "xla_cache")
    shutil.rmtree(cache, ignore_errors=True)
    record = {"model": model, "cold": _child("speed", model, directory, 900,
                                             VLLM_XLA_CACHE_PATH=cache)}
    record["cold"]["cache_files"] = _count_files(cache)
    record["warm_start"] = _child("restart", model, directory, 600, VLLM_XLA_CACHE_PATH=cache)
    record["warm_start"]["cache_files"] = _count_files(cache)  # unchanged: every graph was in it
    cold = record["cold"]
    ok = "error" not in cold and "error" not in record["warm_start"]
    print(f"{'PASS' if ok else 'FAIL'} speed {model}: decode ms/step "
          f"{[(r['batch'], r['ms_per_step']) for r in cold.get('decode', [])]}, mixed "
          f"{cold.get('mixed', {}).get('ms_per_step')}; start to first token cold "
          f"{cold.get('start_to_first_token_s')} s, warm "
          f"{record['warm_start'].get('start_to_first_token_s')} s; "
          f"{cold.get('error', '')}{record['warm_start'].get('error', '')}", flush=True)
    return record, ok


def _count_files(directory):
    """The files torch_xla's persistent compilation cache holds under `directory`."""
    return sum(len(files) for _, _, files in os.walk(directory))


def _best_ms(rows, impl, shape):
    times = [r["time_per_step_ms"] for r in rows if r["impl"] == impl and r["shape"] == shape
             and r.get("time_per_step_ms")]
    return min(times) if times else None


def combine(parts, serving_runs):
    """One record from the phases' records of one lease (each call's FILE) and the serving
    benchmark's runs of the same lease (bench/serving_bench.py --out, per backend): vLLM's
    speed rows beside our Engine's best row per shape and transformers + torch.compile's."""
    record = {}
    for path in parts:
        with open(path) as f:
            record.update(json.load(f))
    rows = []
    for path in serving_runs:
        with open(path) as f:
            rows += json.load(f)["rows"]
    speed = record.get("speed", {}).get("cold", {})
    shapes = [(f"B={r['batch']},context={r['context']}", r["ms_per_step"])
              for r in speed.get("decode", [])]
    if speed.get("mixed"):
        shapes.append(("mixed", speed["mixed"]["ms_per_step"]))
    compared = []
    for shape, vllm_ms in shapes:
        ours = {impl: _best_ms(rows, impl, shape if shape != "mixed" else
                               next((r["shape"] for r in rows if r["op"] == "serving_mixed"), None))
                for impl in ("xla_ext_torchax", "xla_ext_torch_xla", "hf_compile_reduce_overhead")}
        engine_best = min((v for k, v in ours.items() if k.startswith("xla_ext") and v), default=None)
        compared.append({"shape": shape, "vllm_ms": vllm_ms, **{f"{k}_ms": v for k, v in ours.items()},
                         "vllm_over_engine_best": round(vllm_ms / engine_best, 2)
                         if vllm_ms and engine_best else None})
    record["compared"] = compared
    return record


def start(work):
    """Where vLLM's start goes, cold and warm (run_start)."""
    model = "tiny" if os.environ.get("VLLM_GPU_SMOKE") == "1" else "1b"
    directory = _checkpoint(work, model)
    cache = os.path.join(work, "xla_cache_start")
    shutil.rmtree(cache, ignore_errors=True)
    record = {}
    for start_kind in ("cold", "warm"):
        record[start_kind] = _child("start", model, directory, 900, VLLM_XLA_CACHE_PATH=cache,
                                    VLLM_ENABLE_V1_MULTIPROCESSING="0")
        record[start_kind]["cache_files"] = _count_files(cache)
    ok = all("error" not in r for r in record.values())
    for start_kind, r in record.items():
        print(f"{'PASS' if ok else 'FAIL'} start {model} {start_kind}: first token at "
              f"{r.get('start_to_first_token_s')} s; {r.get('compiles')} compiles, "
              f"{r.get('compile_s')} s; {r.get('counters')}; {r.get('cumulative_s')}; "
              f"{r.get('cache_files')} cache files {r.get('error', '')}", flush=True)
    return record, ok


def profile(work):
    """Where the host time of vLLM's decode step goes (run_profile)."""
    model = "tiny" if os.environ.get("VLLM_GPU_SMOKE") == "1" else "1b"
    record = _child("profile", model, _checkpoint(work, model), 900,
                    VLLM_ENABLE_V1_MULTIPROCESSING="0")
    ok = "error" not in record
    print(f"{'PASS' if ok else 'FAIL'} profile {model}: {record.get('ms_per_step')} ms per B=1 "
          f"step, {record.get('ms_per_step_profiled')} under cProfile; {record.get('error', '')}",
          flush=True)
    if ok:
        print("\n".join(record["top"]["tottime"]), flush=True)
        print(json.dumps({k: record[k] for k in ("torch_xla_per_step", "gpu_busy_percent",
                                                 "host_us_per_call")}), flush=True)
    return record, ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--phases", default="check,serve,speed")
    parser.add_argument("--models", default="tiny,1b", help="the check phase's")
    parser.add_argument("--work", default="/tmp/vllm_gpu")
    parser.add_argument("--child", nargs=3, metavar=("WHAT", "MODEL", "DIR"))
    parser.add_argument("--combine", nargs="+", metavar="FILE",
                        help="write to --out one record of these phase records of one lease")
    parser.add_argument("--serving", nargs="*", default=[], metavar="FILE",
                        help="with --combine: serving_bench.py records of the same lease")
    args = parser.parse_args()
    if args.combine:
        with open(args.out, "w") as f:
            json.dump(combine(args.combine, args.serving), f, indent=1)
        return 0
    sys.path.append(ROOT)  # after PYTHONPATH, which may hold another build of the package
    if args.child:
        what, model, directory = args.child
        print("RESULT " + json.dumps(CHILDREN[what](model, directory)), flush=True)
        return 0
    os.makedirs(args.work, exist_ok=True)
    record = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            record = json.load(f)
    record["pjrt_device"] = os.environ.get("PJRT_DEVICE")
    status = 0
    for phase in args.phases.split(","):
        if phase == "check":
            record[phase], ok = check(args.work, args.models.split(","))
        else:
            record[phase], ok = {"serve": serve, "speed": speed, "profile": profile,
                                 "start": start}[phase](args.work)
        status |= not ok
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
