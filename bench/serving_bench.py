"""The serving loop on a GPU: decode throughput and time per step of a 1B-class Llama (random
bf16 weights, transformers' LlamaForCausalLM) at batch 1, 16 and 64 with 2k-token contexts, and
a mixed prefill + decode workload, with async scheduling off, on, and (decode rows) on with runs
of --max-decode-steps decode steps per launch; against the same model in torch eager with
transformers (sdpa, static cache) and torch.compile of it (if it compiles).
Each of our rows has its wall time per step beside its GPU time (a CUPTI trace of more steps:
bench/gpu_trace.py, which also gives our custom calls' share), the host's time per step in
each part of the engine, and the step's floor: the bytes it must read (weights and the K/V of
its tokens) at the device-to-device copy bandwidth measured eagerly at the start of the run.
The torch.compile rows run in a process of their own (torchax, imported for ours, breaks dynamo
in its process).

    python bench/serving_bench.py --out bench/results/h100-serving.json            # the GPU run
    python bench/serving_bench.py --config tiny --device cpu --batches 1,4 --context 512 --steps 5 \\
        --impls ours,hf_eager --out /tmp/serving.json                     # a CPU smoke run
    PJRT_DEVICE=GPU python bench/serving_bench.py --backend torch_xla --impls ours --device cpu \\
        --out /tmp/serving-torch-xla.json        # ours through torch_xla on the GPU (no trace)

On the GPU machine `tools/device/run.sh serving` writes bench/results/<gpu>-serving.json, `run.sh
tp` <gpu>-serving-<model>-tp<n>.json (--config 8b|1b --tensor-parallel-size N), and
`tools/device/torch_xla_gpu.sh run bench` <gpu>-serving-torch-xla.json (both backends).

Ours: torch_xla_ext.serving.Engine through torchax (each step one jax.jit executable called
directly, caches donated), or through torch_xla with --backend torch_xla (the model is made on
--device, cpu, and the engine moves it to torch_xla's device; no GPU trace, no copy bandwidth:
torch's CUDA is not there), page size 16, max_num_seqs 64, up to 8192 tokens per step while
prefilling. A decode row: B requests with CONTEXT-token random prompts are prefilled, then
WARMUP decode steps, then STEPS timed engine.step() calls, each one whole serving step
(scheduling, packing, the step on the GPU, the token ids back; with async scheduling the next
step is launched before this one is waited for); tokens/s = B / time per step. host_us: the
host's time per step in the scheduler (schedule, update), packing, the launch (the jitted call)
and the wait for the step's tokens (fetch); with async scheduling all but the wait overlap the
GPU. With runs of decode steps (the engine's max_decode_steps; rows "async+runs of K"), up to K
steps launch as one and the host's work is spread over them; STEPS should then be a multiple
of K. The mixed row: 48 sequences decode at a 2k context while 16 new 2k-token prompts are prefilled in chunks under a 512-token budget
(each timed step runs 48 decodes and a 464-token chunk). transformers: the same weights,
prefilled in one call (logits of the last position only), then STEPS decode calls of
model(...) with a StaticCache and greedy argmax, timed the same way; it has no continuous
batching, so it has no mixed row.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

from gpu_trace import COLLECTIVE_KERNEL, copy_gbps, kernel_kind  # noqa: E402
from torch_xla_ext.serving import Engine, hf  # noqa: E402

MIXED_DECODES, MIXED_PREFILLS, MIXED_BUDGET = 48, 16, 512
IMPLS = ("ours", "hf_eager", "hf_compile")


def floor_ms(engine, weight_bytes, kv_tokens, gbps):
    """A step's floor: the weights and the K/V of kv_tokens cached tokens read once, at the
    copy's rate of bytes moved (read + written: what the memory sustains), each of the
    tensor parallel devices reading its share."""
    if not gbps:
        return None
    kv_bytes = (kv_tokens * engine.shape.num_layers * 2 * engine.shape.num_kv_heads
                * engine.shape.head_dim * 2)
    return (weight_bytes + kv_bytes) / engine.shape.shards / (gbps * 1e9) * 1e3


class HostTimes:
    """Host time spent in the engine's parts, per step (wraps its methods in timers)."""
    PARTS = {"schedule": [("scheduler", "schedule"), ("scheduler", "schedule_decodes")],
             "update": [("scheduler", "update")],
             "pack": [("host_batch", "pack")],
             "launch": [("backend", "run"), ("backend", "run_decodes")],
             "fetch": [("backend", "fetch")]}

    def __init__(self, engine):
        self.reset()
        for part, methods in self.PARTS.items():
            for owner, name in methods:
                target = getattr(engine, owner)
                setattr(target, name, self._timed(part, getattr(target, name)))

    def _timed(self, part, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
        return timed

    def reset(self):
        self.seconds = dict.fromkeys(self.PARTS, 0.0)

    def per_step_us(self, steps):
        return {part: round(s * 1e6 / steps, 1) for part, s in self.seconds.items()}


def _prompts(batch, context, vocab_size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, context), generator=g).tolist()


def _run_prefill(engine):
    """Steps until every running sequence has its prompt in the cache; returns seconds."""
    start = time.perf_counter()
    while engine.scheduler.waiting or any(s.num_computed < len(s.prompt)
                                          for s in engine.scheduler.running):
        engine.step()
    return time.perf_counter() - start


def _timed_steps(engine, args, host):
    """args.warmup steps, then args.steps timed ones: (their outputs, seconds per step); the
    host's times of the timed steps in `host`."""
    for _ in range(args.warmup):
        engine.step()
    host.reset()
    start = time.perf_counter()
    outs = [engine.step() for _ in range(args.steps)]
    return outs, (time.perf_counter() - start) / args.steps


def _mode(engine):
    if engine.max_decode_steps > 1:
        return f"async+runs of {engine.max_decode_steps}"
    return "async" if engine.async_scheduling else "sync"


def _profile(engine, profile_steps, timeline=None):
    """gpu_profile of profile_steps steps; with runs of decode steps, of that many runs, each
    launched and waited for in its first step() (async scheduling off meanwhile, after the
    steps in flight are reported): the trace holds exactly their work."""
    if engine.max_decode_steps == 1:
        return gpu_profile(engine.step, profile_steps, timeline)
    engine.async_scheduling = False
    try:
        while engine._in_flight is not None or engine._unreported:
            engine.step()
        return gpu_profile(engine.step, profile_steps * engine.max_decode_steps, timeline)
    finally:
        engine.async_scheduling = True


def _impl(engine):
    return f"xla_ext_{engine.backend.name}"


def ours_decode(engine, batch, args, profile_steps, host, run):
    """A decode row; then, when profile_steps, a profile of that many more decode steps."""
    # A sequence whose prompt is done decodes while the others' chunks are prefilled: it may
    # sample one token per prefill step, so every sequence gets room for that many more.
    prefill_steps = -(-batch * args.context // engine.scheduler.max_num_batched_tokens) + 1
    for prompt in _prompts(batch, args.context, engine.shape.vocab_size, seed=batch):
        engine.add_request(prompt, max_new_tokens=prefill_steps + args.warmup + args.steps
                           + (profile_steps + 3) * engine.max_decode_steps)
    prefill_s = _run_prefill(engine)
    outs, seconds = _timed_steps(engine, args, host)
    assert all(o.num_seqs == batch and o.num_prefill_tokens == 0 for o in outs), \
        [(o.num_seqs, o.num_prefill_tokens) for o in outs]
    host_us = host.per_step_us(args.steps)
    timeline = _timeline(args, f"decode B={batch},context={args.context} {_mode(engine)}")
    profile = _profile(engine, profile_steps, timeline) if profile_steps else None
    while engine.has_unfinished():  # free the pages for the next row
        engine.step()
    return _with_floor({
        "op": "serving_decode", "impl": _impl(engine), "scheduling": _mode(engine),
        "batch": batch, "shape": f"B={batch},context={args.context}",
        "time_per_step_ms": seconds * 1e3, "tokens_per_s": batch / seconds,
        "bucket": outs[0].bucket, "prefill_s": round(prefill_s, 3), "host_us": host_us},
        profile, floor_ms(engine, run["weight_bytes"], batch * (args.context + args.warmup),
                          run["copy_gbps"])), profile


def _timeline(args, label):
    """What gpu_profile calls with a GPU's events to write them to --timeline, or None."""
    if not args.timeline:
        return None
    label = f"{args.config} model, TP={args.tensor_parallel_size}, {label}"
    return lambda events: write_timeline(args.timeline, label, events)


def _with_floor(row, profile, floor):
    """The row with its GPU time (from the profile) and its floor beside the wall time."""
    if profile:
        row["gpu_ms_per_step"] = round(profile["gpu_us_per_step"] / 1e3, 3)
        row["wall_over_gpu"] = round(row["time_per_step_ms"] / row["gpu_ms_per_step"], 3)
    if floor:
        row["floor_ms"] = round(floor, 3)
        row["wall_over_floor"] = round(row["time_per_step_ms"] / floor, 3)
    return row


def ours_mixed(engine, args, profile_steps, host, run):
    """48 decodes beside chunks of 16 new prompts; returns (row, profile of profile_steps more
    steps or None). Aborts what is left of its requests at the end."""
    for prompt in _prompts(MIXED_DECODES, args.context, engine.shape.vocab_size, seed=101):
        engine.add_request(prompt, max_new_tokens=10_000 // MIXED_DECODES)
    _run_prefill(engine)
    engine.scheduler.max_num_batched_tokens = MIXED_BUDGET
    for prompt in _prompts(MIXED_PREFILLS, args.context, engine.shape.vocab_size, seed=102):
        engine.add_request(prompt, max_new_tokens=1)
    outs, seconds = _timed_steps(engine, args, host)
    assert all(o.num_prefill_tokens > 0 and o.num_tokens - o.num_prefill_tokens >= MIXED_DECODES
               for o in outs), [(o.num_tokens, o.num_prefill_tokens) for o in outs]
    host_us = host.per_step_us(args.steps)
    timeline = _timeline(args, f"mixed {_mode(engine)}")
    profile = gpu_profile(engine.step, profile_steps, timeline) if profile_steps else None
    tokens = sum(o.num_tokens for o in outs) / args.steps
    prefill = sum(o.num_prefill_tokens for o in outs) / args.steps
    row = {"op": "serving_mixed", "impl": _impl(engine), "scheduling": _mode(engine),
           "shape": f"{MIXED_DECODES} decodes at context {args.context} + chunks of "
                    f"{MIXED_PREFILLS} new {args.context}-token prompts, budget {MIXED_BUDGET}",
           "time_per_step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
           "decode_tokens_per_s": (tokens - prefill) / seconds,
           "prefill_tokens_per_s": prefill / seconds, "bucket": outs[0].bucket,
           "host_us": host_us}
    # The K/V read: the decodes' contexts, and at most one prompt's for the chunk (its query
    # rows share each K/V tile they read).
    kv_tokens = (MIXED_DECODES + 1) * args.context
    for seq in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(seq.seq_id)
    while engine.has_unfinished():
        engine.step()
    engine.scheduler.max_num_batched_tokens = args.max_batched_tokens
    return _with_floor(row, profile, floor_ms(engine, run["weight_bytes"], kv_tokens,
                                              run["copy_gbps"])), profile


def gpu_profile(step, num_steps, timeline=None):
    """GPU time of num_steps calls of step() by kernel, and our custom calls' share (each step
    returns once its token ids are on the host, so the trace holds its work; with async
    scheduling it holds the step launched before the trace began and misses the last one
    launched, about one step's work either way). gpu_us_per_step: the time the (busiest) GPU was busy
    (kernels that run at once, as ragged attention's two kernels do, counted once);
    kernel_us_per_step: the kernels' times summed."""
    from gpu_trace import gpu_events

    start = time.perf_counter()
    events = gpu_events(lambda: [step() for _ in range(num_steps)])
    wall_us = (time.perf_counter() - start) * 1e6 / num_steps
    kernels = {}
    for e in events:
        kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us() / num_steps
    devices = {}
    for e in events:
        devices.setdefault(e.device_index, []).append(e)
    busy_us = {d: _busy_us(e) for d, e in devices.items()}
    busiest = devices[max(busy_us, key=busy_us.get)]
    gpu_us = max(busy_us.values()) / num_steps
    if timeline is not None:
        timeline(busiest)
    ours = {n: t for n, t in kernels.items() if "xla_ext" in n}
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"steps": num_steps, "wall_us_per_step": round(wall_us, 1),
            "gpu_us_per_step": round(gpu_us, 1),
            "kernel_us_per_step": round(sum(kernels.values()), 1),
            "custom_call_us_per_step": round(sum(ours.values()), 1),
            "custom_call_share_of_kernel_time": round(sum(ours.values()) / sum(kernels.values()), 4),
            "custom_call_share_of_step_time": round(sum(ours.values()) / wall_us, 4),
            "custom_call_kernels_us": {n[:120]: round(t, 1) for n, t in ours.items()},
            "top_kernels_us": {n[:120]: round(t, 1) for n, t in top},
            "idle_before_kernels_us": _idle_before(busiest, num_steps),
            "kernel_kinds_us": _kinds_us(busiest, num_steps),
            "per_device": {str(d): _device_summary(e, num_steps)
                           for d, e in sorted(devices.items())} if len(devices) > 1 else None}


def _busy_us(events):
    """Time at least one of the events runs (overlapping ones counted once)."""
    busy, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.time_range.start):
        busy += max(e.time_range.end - max(e.time_range.start, end), 0)
        end = max(end, e.time_range.end)
    return busy


def _kinds_us(events, num_steps):
    """One GPU's kernel time per step by kind (gpu_trace.KERNEL_KINDS), kernels that overlap
    each counted."""
    kinds = {}
    for e in events:
        kind = kernel_kind(e.name)
        kinds[kind] = kinds.get(kind, 0.0) + e.time_range.elapsed_us() / num_steps
    return {kind: round(us, 1) for kind, us in sorted(kinds.items())}


def _with_idle_before(events):
    """(event, the idle time just before it: none of the earlier events running; 0 for the
    first) for `events` in the order they start."""
    end = None
    for e in sorted(events, key=lambda e: e.time_range.start):
        yield e, 0.0 if end is None else max(e.time_range.start - end, 0.0)
        end = e.time_range.end if end is None else max(end, e.time_range.end)


def _idle_before(events, num_steps, top=8):
    """Where one GPU waits: per step, the idle time (no kernel running) that ends at a kernel
    of each name, for the `top` names with the most: what the GPU waited to start."""
    idle = {}
    for e, before in _with_idle_before(events):
        if before > 0:
            idle[e.name] = idle.get(e.name, 0.0) + before / num_steps
    return {n[:120]: round(t, 1) for n, t in sorted(idle.items(), key=lambda kv: -kv[1])[:top]}


def write_timeline(path, label, events, lines=400):
    """Appends to `path` `lines` consecutive kernels of one GPU's trace from its middle (a
    step's worth at most): start and end (µs from the first listed start), the idle time
    before each, and its name."""
    events = sorted(events, key=lambda e: e.time_range.start)
    middle = events[len(events) // 3:][:lines]
    origin = middle[0].time_range.start
    with open(path, "a") as f:
        f.write(f"== {label}: {len(middle)} kernels of {len(events)} in the trace\n")
        f.write(f"{'start us':>10} {'end us':>10} {'idle before':>11}  kernel\n")
        for e, idle in _with_idle_before(middle):
            f.write(f"{e.time_range.start - origin:10.1f} {e.time_range.end - origin:10.1f} "
                    f"{idle:11.1f}  {e.name[:100]}\n")


def _device_summary(events, num_steps):
    """One GPU's share of a multi-GPU trace, per step: its span (first start to last end), the
    time it is busy, in collectives (COLLECTIVE_KERNEL) and idle within the span."""
    span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    busy = _busy_us(events)
    collective = _busy_us([e for e in events if COLLECTIVE_KERNEL.search(e.name)])
    return {"span_us": round(span / num_steps, 1), "busy_us": round(busy / num_steps, 1),
            "collective_us": round(collective / num_steps, 1),
            "idle_us": round((span - busy) / num_steps, 1)}


def hf_decode(model, batch, args, compiled):
    from transformers import StaticCache

    device = next(model.parameters()).device
    ids = torch.tensor(_prompts(batch, args.context, model.config.vocab_size, seed=batch),
                       device=device)
    cache = StaticCache(config=model.config, max_cache_len=args.context + args.warmup
                        + args.steps + 1)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) \
        if compiled else model.forward
    with torch.no_grad():
        start = time.perf_counter()
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                       cache_position=torch.arange(args.context, device=device)).logits
        token = logits[:, -1].argmax(-1)
        _sync(device)
        prefill_s = time.perf_counter() - start

        def step(position):
            out = forward(input_ids=token[:, None], past_key_values=cache, use_cache=True,
                          cache_position=torch.tensor([position], device=device))
            return out.logits[:, -1].argmax(-1)

        position = args.context
        compile_start = time.perf_counter()
        for _ in range(args.warmup):
            token = step(position)
            position += 1
        _sync(device)
        warmup_s = time.perf_counter() - compile_start
        start = time.perf_counter()
        for _ in range(args.steps):
            token = step(position).clone()  # a CUDA-graph output is overwritten by the next replay
            position += 1
        _sync(device)
        seconds = (time.perf_counter() - start) / args.steps
    impl = "hf_compile_reduce_overhead" if compiled else "hf_eager_sdpa_static_cache"
    return {"op": "serving_decode", "impl": impl, "batch": batch,
            "shape": f"B={batch},context={args.context}", "time_per_step_ms": seconds * 1e3,
            "tokens_per_s": batch / seconds, "prefill_s": round(prefill_s, 3),
            "warmup_s": round(warmup_s, 1)}


def _device_name(args):
    if args.backend == "torch_xla":  # the engine's device, not --device (where the model is made)
        import torch_xla.runtime as xr

        return f"{xr.device_type()} through torch_xla"
    return torch.cuda.get_device_name() if args.device == "cuda" else args.device


def _measures_gpu(args):
    """Whether the run traces the GPU and measures its copy bandwidth: our engine through
    torchax on a machine with torch's CUDA, wherever the model was made (--device cpu keeps
    the transformers model off the GPU, as the 8B one at TP=2 must be: it left GPU 0 short of
    memory)."""
    return args.backend == "torchax" and torch.cuda.is_available()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", choices=["8b", "1b", "tiny"], default="1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--max-decode-steps", type=int, default=8,
                        help="the decode steps per launch of the 'runs' mode")
    parser.add_argument("--modes", default="sync,async,runs",
                        help="our decode rows' modes: sync, async, runs (async with runs of "
                             "--max-decode-steps decode steps)")
    parser.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True,
                        help="our mixed rows")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="our engine's devices (torchax); the floor is then per device")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma-separated, of {','.join(IMPLS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeline", metavar="PATH",
                        help="append each profile's kernel sequence (one GPU, from the middle "
                             "of its trace) to PATH")
    parser.add_argument("--backend", choices=["torchax", "torch_xla"], default="torchax",
                        help="our engine's backend")
    parser.add_argument("--compile-deadline-s", type=float, default=200.0,
                        help="start no torch.compile row after this many seconds of the run")
    args = parser.parse_args()
    run_start = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",")]
    impls = args.impls.split(",")
    if unknown := set(impls) - set(IMPLS):
        parser.error(f"--impls: expected names from {','.join(IMPLS)}, got {sorted(unknown)}")
    config = {"8b": hf.LLAMA_8B, "1b": hf.LLAMA_1B, "tiny": hf.TINY}[args.config]

    t0 = time.perf_counter()
    model = hf.random_model(config, args.seed, torch.bfloat16, args.device)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
          f"made in {time.perf_counter() - t0:.1f} s", flush=True)
    result = {"machine": platform.node(), "model": args.config, "dtype": "bfloat16",
              "backend": args.backend, "pjrt_device": os.environ.get("PJRT_DEVICE"),
              "device": _device_name(args),
              "context": args.context, "steps": args.steps,
              "tensor_parallel_size": args.tensor_parallel_size, "rows": [], "errors": [],
              "copy_gbps": copy_gbps() if "ours" in impls and _measures_gpu(args) else None,
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if result["copy_gbps"]:
        print(f"copy bandwidth: {result['copy_gbps']:.0f} GB/s (read + written)", flush=True)

    def save():  # after every row: a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    def record(row):
        result["rows"].append(row)
        save()
        extra = "".join(f" {k} {row[k]}" for k in ("gpu_ms_per_step", "floor_ms", "host_us")
                        if k in row)
        print(f"{row['op']:15} {row['impl']:28} {row.get('scheduling', ''):17} "
              f"{row['shape']:24.24} {row['time_per_step_ms']:9.2f} ms/step "
              f"{row['tokens_per_s']:10.0f} tokens/s{extra}", flush=True)

    if "ours" in impls:
        run_ours(model, batches, args, result, record)
    for compiled in (False, True):
        if ("hf_compile" if compiled else "hf_eager") not in impls:
            continue
        if compiled and "torchax" in sys.modules:
            # torchax registers a "jax" accelerator, after which dynamo fails in this process
            # ("PyTorch is not linked with support for jax devices"): a process of its own.
            hf_compile_in_child(args, run_start, result, record)
            continue
        for batch in batches:
            if compiled and time.perf_counter() - run_start > args.compile_deadline_s:
                result["errors"].append(_past_deadline(args, batch=batch))
                continue
            try:
                record(hf_decode(model, batch, args, compiled))
            except Exception as e:  # noqa: BLE001  (torch.compile may not handle this model)
                traceback.print_exc()
                result["errors"].append({"impl": "hf_compile" if compiled else "hf_eager",
                                         "batch": batch, "error": f"{type(e).__name__}: {e}"[:2000]})
                break
    for row in result["rows"]:
        for key in ("time_per_step_ms", "tokens_per_s", "decode_tokens_per_s",
                    "prefill_tokens_per_s"):
            if key in row:
                row[key] = round(row[key], 3 if key == "time_per_step_ms" else 1)
    ours = {}  # batch -> our fastest row
    for r in result["rows"]:
        if r["impl"].startswith("xla_ext_") and "batch" in r and \
                r["tokens_per_s"] > ours.get(r["batch"], {}).get("tokens_per_s", 0):
            ours[r["batch"]] = r
    for r in result["rows"]:
        if not r["impl"].startswith("xla_ext_") and r.get("batch") in ours:
            r["ours_speedup"] = round(ours[r["batch"]]["tokens_per_s"] / r["tokens_per_s"], 3)
    save()
    print(f"wrote {args.out}", flush=True)


def run_ours(model, batches, args, result, record):
    """Our rows (decode at each batch: async scheduling off, on, on with runs of decode steps;
    then mixed: async scheduling off, then on) and
    their profiles, through one engine."""
    t0 = time.perf_counter()
    engine = Engine(model, backend=args.backend, dtype=torch.bfloat16, page_size=16,
                    max_num_seqs=max(max(batches), MIXED_DECODES + MIXED_PREFILLS),
                    max_num_batched_tokens=args.max_batched_tokens,
                    max_model_len=args.context + 10_000 // MIXED_DECODES + 8,
                    tensor_parallel_size=args.tensor_parallel_size)
    print(f"engine: {engine.num_pages} pages, buckets {engine.buckets}, made in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    host = HostTimes(engine)
    # Bytes a step reads besides the K/V: every weight once (a tied embedding once, as the
    # head; its rows for the step's tokens are next to nothing).
    run = {"copy_gbps": result["copy_gbps"],
           "weight_bytes": sum(p.numel() * 2 for p in model.parameters())}
    profiled = args.profile_steps if _measures_gpu(args) else 0
    for batch in batches:
        modes = {"sync": (False, 1), "async": (True, 1), "runs": (True, args.max_decode_steps)}
        for mode, decode_steps in [modes[m] for m in args.modes.split(",")]:
            engine.async_scheduling, engine.max_decode_steps = mode, decode_steps
            row, profile = ours_decode(engine, batch, args, profiled, host, run)
            record(row)
            if profile:
                result.setdefault("profiles", {})[f"decode {row['shape']} {row['scheduling']}"] = \
                    profile
    engine.max_decode_steps = 1  # with prompts waiting, no run of decode steps would start
    for mode in (False, True) if args.mixed else ():
        engine.async_scheduling = mode
        row, profile = ours_mixed(engine, args, profiled, host, run)
        record(row)
        if profile:
            result.setdefault("profiles", {})[f"mixed {row['scheduling']}"] = profile
    result["compiled_buckets"] = sorted(engine.buckets_used)
    result["engine_s"] = round(time.perf_counter() - t0, 1)


def _past_deadline(args, **where):
    return {"impl": "hf_compile", **where, "error": f"not run: past --compile-deadline-s "
            f"{args.compile_deadline_s:.0f} s of the run"}


def hf_compile_in_child(args, run_start, result, record):
    """The torch.compile rows from a child process of this script, into result."""
    left_s = args.compile_deadline_s - (time.perf_counter() - run_start)
    if left_s <= 0:  # the child would only say so, after building the model
        result["errors"].append(_past_deadline(args))
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "hf_compile.json")
        command = [sys.executable, os.path.abspath(__file__), "--impls", "hf_compile",
                   "--out", out, "--config", args.config, "--device", args.device,
                   "--batches", args.batches, "--context", str(args.context),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--seed", str(args.seed), "--compile-deadline-s", str(left_s)]
        code = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
        if not os.path.exists(out):
            result["errors"].append({"impl": "hf_compile", "error": f"its process exited {code}"})
            return
        with open(out) as f:
            child = json.load(f)
    for row in child["rows"]:
        record(row)
    result["errors"] += child["errors"]


if __name__ == "__main__":
    main()
