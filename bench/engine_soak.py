"""A long run of the serving engine: requests arrive at random steps with random prompt lengths,
token budgets and EOS ids, some are aborted mid-way, one bad request every --bad-every steps
(a token id past the vocabulary, no prompt, max_new_tokens 0, a prompt past max_model_len) is
refused naming its argument and changes nothing, and the engine runs for --steps steps (async
scheduling, runs of decode steps when they apply). Every step checks that no token is reported
for a request after it finished or was aborted and that the pages in use are exactly those the
running sequences hold; at the end every page is free, every request got its tokens, and every
finished request's tokens equal those of the same request run alone on a second engine of the
same configuration. Host memory (RSS), the device buffers alive and, on a GPU, the device
memory in use are sampled along the way: they must stay flat once the engine has compiled its
steps.

    python bench/engine_soak.py --backend torchax --steps 10000 --out bench/results/cpu-engine-soak-torchax.json
    PJRT_DEVICE=CPU python bench/engine_soak.py --backend torch_xla --steps 10000 \\
        --out bench/results/cpu-engine-soak-torch-xla.json

On the GPU machine: `tools/device/torch_xla_gpu.sh run soak` (both backends).

Live device buffers: torchax, the JAX arrays alive (jax.live_arrays()); torch_xla, the XLA
tensors alive as its CreateXlaTensor less DestroyXlaTensor counters (offset by tensors made
without being counted, so only its change means anything; torch_xla 2.9 counts data handles
created but not those destroyed).
"""

import argparse
import collections
import json
import os
import platform
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_DEVICE", "CPU")

from torch_xla_ext.errors import TorchXlaExtError  # noqa: E402
from torch_xla_ext.serving import Engine, hf  # noqa: E402


def rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def live_buffers(backend):
    if backend == "torchax":
        import jax

        return len(jax.live_arrays())
    import torch_xla.debug.metrics as met

    return (met.counter_value("CreateXlaTensor") or 0) - \
        (met.counter_value("DestroyXlaTensor") or 0)


def device_memory_mib(backend):
    """Device memory in use on a GPU, MiB (the allocator's statistics); None on the CPU, whose
    clients keep none."""
    if backend == "torchax":
        import jax

        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform == "gpu" else None
        return None if not stats else round(stats["bytes_in_use"] / 2**20, 1)
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    if xr.device_type() == "CPU":
        return None
    return round(int(xm.get_memory_info()["bytes_used"]) / 2**20, 1)


def engine_device(backend):
    if backend == "torchax":
        import jax

        return jax.devices()[0].device_kind
    import torch_xla.runtime as xr

    return xr.device_type()


def bad_requests(vocab, max_model_len):
    """Requests Engine.add_request refuses, each with the argument its error must name."""
    return [(([1, vocab, 2], 4, None), "prompt"), (([], 4, None), "prompt"),
            (([1, 2], 0, None), "max_new_tokens"), (([1, 2], 4, vocab + 3), "eos_token_id"),
            (([1] * max_model_len, 4, None), "max_model_len")]


def _check_ended(seq_id, request, aborted):
    """A request's tokens once it ended: no more than max_new_tokens, nothing after its EOS
    token, and all of them unless it was aborted."""
    _, max_new_tokens, eos, got = request
    assert len(got) <= max_new_tokens and eos not in got[:-1], (seq_id, got)
    assert aborted or len(got) == max_new_tokens or got[-1:] == [eos], (seq_id, got)


MAX_MODEL_LEN = 256


def _engine(model, args, with_logits=False):
    return Engine(model, backend=args.backend, max_num_seqs=8, max_num_batched_tokens=64,
                  page_size=16, max_model_len=MAX_MODEL_LEN, num_pages=96,
                  max_decode_steps=args.max_decode_steps, with_logits=with_logits)


def set_matmul_precision(backend, precision):
    """XLA's precision for float32 matrix products: both backends default to one that runs
    them in TF32 on an NVIDIA GPU, whose rounding differs with the batch's shape."""
    if backend == "torchax":
        import jax

        jax.config.update("jax_default_matmul_precision", precision)
    else:
        import torch_xla.backends

        torch_xla.backends.set_mat_mul_precision(precision)


def soak(args):
    rng = random.Random(args.seed)
    model = hf.random_model(hf.TINY, seed=0)
    engine = _engine(model, args)
    vocab = model.config.vocab_size
    bad = bad_requests(vocab, MAX_MODEL_LEN)
    # The requests not ended yet: seq_id -> (prompt, max_new_tokens, eos, tokens so far). An
    # ended one is checked and dropped; a finished one is kept for its solo rerun.
    live, abort_at, finished = {}, {}, []
    counts = collections.Counter()
    samples = []

    def state():  # what a refused request must leave as it was: pages, queues
        return (engine.allocator.num_free, len(engine.scheduler.running),
                len(engine.scheduler.waiting))

    def refuse(request, argument):
        before = state()
        try:
            engine.add_request(*request)
        except TorchXlaExtError as e:
            assert argument in str(e), (argument, str(e))
        else:
            raise AssertionError(f"a bad request was accepted: {request!r:.200}")
        assert state() == before, "a refusal changed the engine"
        counts["refused"] += 1

    def abort(seq_id):
        if engine.abort_request(seq_id):
            _check_ended(seq_id, live.pop(seq_id), aborted=True)
            counts["aborted"] += 1

    def take(out):
        for seq_id, token in out.new_tokens.items():
            assert seq_id in live, f"a token for request {seq_id} after its end"
            live[seq_id][3].append(token)
        for seq_id, generated in out.finished.items():
            request = live.pop(seq_id)
            assert generated == request[3], seq_id
            _check_ended(seq_id, request, aborted=False)
            finished.append(request)
            counts["finished"] += 1
        counts["tokens"] += len(out.new_tokens)

    start = time.perf_counter()
    for step in range(args.steps):
        if rng.random() < args.arrival_rate:
            max_new_tokens = rng.randint(1, 100)
            eos = rng.randrange(vocab) if rng.random() < 0.3 else None
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
            seq_id = engine.add_request(prompt, max_new_tokens, eos)
            live[seq_id] = (prompt, max_new_tokens, eos, [])
            counts["requests"] += 1
            if rng.random() < args.abort_rate:
                abort_at[seq_id] = step + rng.randint(0, 60)
        for seq_id in [s for s, when in abort_at.items() if when <= step]:
            del abort_at[seq_id]
            if seq_id in live:
                abort(seq_id)
        if args.bad_every and step % args.bad_every == args.bad_every - 1:
            refuse(*bad[step // args.bad_every % len(bad)])
        if not engine.has_unfinished():
            counts["idle_steps"] += 1
            continue
        take(engine.step())
        counts["steps"] += 1
        held = sum(len(engine.allocator.table(s.seq_id)) for s in engine.scheduler.running)
        assert engine.num_pages - engine.allocator.num_free == held, step
        if step % args.sample_every == 0:
            samples.append({"step": step, "seconds": round(time.perf_counter() - start, 2),
                            "rss_mib": round(rss_mib(), 1),
                            "live_buffers": live_buffers(args.backend),
                            "device_mib": device_memory_mib(args.backend),
                            "running": len(engine.scheduler.running),
                            "waiting": len(engine.scheduler.waiting)})
            print(samples[-1], flush=True)
    for seq_id in list(abort_at):  # those due to be aborted are, now; the rest finish
        if seq_id in live:
            abort(seq_id)
    while engine.has_unfinished():
        take(engine.step())
    assert not live, f"requests that never ended: {sorted(live)}"
    assert engine.allocator.num_free == engine.num_pages, "pages left in use at the end"
    seconds = time.perf_counter() - start
    return engine, counts, samples, seconds, solo_mismatches(
        _engine(model, args), _engine(model, args, with_logits=True), finished)


def solo_mismatches(engine, with_logits, finished):
    """Each finished request run alone on `engine`: those whose tokens differ from the soak's.
    For each, where they first differ and the margin there: the logit of the solo run's token
    less that of the soak's, from the request run alone once more on `with_logits` (an engine
    that reports logits, one step at a time). A margin within the numerics of a different batch
    (its GEMMs tile and sum in another order) is a near-tie, not a wrong token."""
    mismatches = []
    for prompt, max_new_tokens, eos, got in finished:
        alone = engine.generate([prompt], max_new_tokens, eos_token_id=eos)[0]
        if alone == got:
            continue
        rows = []
        again = with_logits.generate([prompt], max_new_tokens, eos_token_id=eos,
                                     on_step=lambda out: rows.extend(out.logits.values()))[0]
        at = next(i for i, (a, b) in enumerate(zip(again + [None], got + [None])) if a != b)
        margin = (float(rows[at][again[at]] - rows[at][got[at]])
                  if at < min(len(again), len(got)) else None)
        mismatches.append({"prompt_len": len(prompt), "max_new_tokens": max_new_tokens,
                           "eos": eos, "soak": got, "solo": alone, "first_difference": at,
                           "margin": margin})
    return mismatches


def flatness(samples, key, skip):
    """The change of `key` over the samples after the first `skip` of them (compiles and the
    first arrivals settle there), its largest value and where that was."""
    kept = samples[skip:]
    values = [s[key] for s in kept]
    return {"first": values[0], "last": values[-1], "max": max(values),
            "change": round(values[-1] - values[0], 1),
            "max_at_step": kept[values.index(max(values))]["step"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["torchax", "torch_xla"], default="torchax")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--arrival-rate", type=float, default=0.15, help="per step")
    parser.add_argument("--abort-rate", type=float, default=0.2, help="per request")
    parser.add_argument("--max-decode-steps", type=int, default=4)
    parser.add_argument("--bad-every", type=int, default=500, help="steps; 0: none")
    parser.add_argument("--matmul-precision", choices=["default", "high", "highest"],
                        default="highest", help="XLA's, for the float32 model's products")
    parser.add_argument("--tie-tolerance", type=float, default=1e-3,
                        help="the largest logit margin at which a token may differ from its "
                             "solo run's")
    parser.add_argument("--sample-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    set_matmul_precision(args.backend, args.matmul_precision)
    engine, counts, samples, seconds, mismatches = soak(args)
    skip = max(len(samples) // 10, 1)
    result = {"machine": platform.node(), "device": engine_device(args.backend),
              "backend": args.backend, "args": vars(args),
              "seconds": round(seconds, 1), "counts": dict(counts),
              "solo_checked": counts["finished"], "solo_mismatches": mismatches,
              "largest_mismatch_margin": max((m["margin"] for m in mismatches
                                              if m["margin"] is not None), default=None),
              "compiled_buckets": sorted(engine.buckets_used),
              "rss_mib": flatness(samples, "rss_mib", skip),
              "live_buffers": flatness(samples, "live_buffers", skip),
              "samples": samples}
    if samples[0]["device_mib"] is not None:
        result["device_mib"] = flatness(samples, "device_mib", skip)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result.get(k) for k in ("device", "seconds", "counts", "rss_mib",
                                                 "live_buffers", "device_mib")}))
    print(f"wrote {args.out}")
    print(f"{len(mismatches)} of {counts['finished']} finished requests differ from their solo "
          f"runs; the largest logit margin where one first differs: "
          f"{result['largest_mismatch_margin']}")
    wrong = [m for m in mismatches if m["margin"] is None or m["margin"] > args.tie_tolerance]
    if wrong:
        print(f"FAIL: {len(wrong)} differ by more than a near-tie (margin > "
              f"{args.tie_tolerance}); the first: {wrong[0]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
