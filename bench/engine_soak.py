"""A long run of the serving engine on the CPU: requests arrive at random steps with random
prompt lengths, token budgets and EOS ids, some are aborted mid-way, and the engine runs for
--steps steps (async scheduling, runs of decode steps when they apply). Every step checks that no
token is reported for a request after it finished or was aborted and that the pages in use are
exactly those the running sequences hold; at the end every page is free and every request got
its tokens. Host memory (RSS) and the device buffers alive are sampled along the way: both must
stay flat once the engine has compiled its steps.

    python bench/engine_soak.py --backend torchax --steps 10000 --out bench/results/cpu-engine-soak-torchax.json
    PJRT_DEVICE=CPU python bench/engine_soak.py --backend torch_xla --steps 10000 \\
        --out bench/results/cpu-engine-soak-torch-xla.json

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
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_DEVICE", "CPU")

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


def _check_ended(seq_id, request, aborted):
    """A request's tokens once it ended: no more than max_new_tokens, nothing after its EOS
    token, and all of them unless it was aborted."""
    max_new_tokens, eos, got = request
    assert len(got) <= max_new_tokens and eos not in got[:-1], (seq_id, got)
    assert aborted or len(got) == max_new_tokens or got[-1:] == [eos], (seq_id, got)


def soak(args):
    rng = random.Random(args.seed)
    model = hf.random_model(hf.TINY, seed=0)
    engine = Engine(model, backend=args.backend, max_num_seqs=8, max_num_batched_tokens=64,
                    page_size=16, max_model_len=256, num_pages=96,
                    max_decode_steps=args.max_decode_steps)
    vocab = model.config.vocab_size
    # The requests not ended yet: seq_id -> (max_new_tokens, eos, tokens so far). An ended one
    # is checked and dropped, so the run's own bookkeeping does not grow.
    live, abort_at = {}, {}
    counts = collections.Counter()
    samples = []

    def abort(seq_id):
        if engine.abort_request(seq_id):
            _check_ended(seq_id, live.pop(seq_id), aborted=True)
            counts["aborted"] += 1

    def take(out):
        for seq_id, token in out.new_tokens.items():
            assert seq_id in live, f"a token for request {seq_id} after its end"
            live[seq_id][2].append(token)
        for seq_id, generated in out.finished.items():
            request = live.pop(seq_id)
            assert generated == request[2], seq_id
            _check_ended(seq_id, request, aborted=False)
            counts["finished"] += 1
        counts["tokens"] += len(out.new_tokens)

    start = time.perf_counter()
    for step in range(args.steps):
        if rng.random() < args.arrival_rate:
            max_new_tokens = rng.randint(1, 100)
            eos = rng.randrange(vocab) if rng.random() < 0.3 else None
            seq_id = engine.add_request(
                [rng.randrange(vocab) for _ in range(rng.randint(1, 120))], max_new_tokens, eos)
            live[seq_id] = (max_new_tokens, eos, [])
            counts["requests"] += 1
            if rng.random() < args.abort_rate:
                abort_at[seq_id] = step + rng.randint(0, 60)
        for seq_id in [s for s, when in abort_at.items() if when <= step]:
            del abort_at[seq_id]
            if seq_id in live:
                abort(seq_id)
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
    return engine, counts, samples, time.perf_counter() - start


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
    parser.add_argument("--sample-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    engine, counts, samples, seconds = soak(args)
    skip = max(len(samples) // 10, 1)
    result = {"machine": platform.node(), "backend": args.backend, "args": vars(args),
              "seconds": round(seconds, 1), "counts": dict(counts),
              "compiled_buckets": sorted(engine.buckets_used),
              "rss_mib": flatness(samples, "rss_mib", skip),
              "live_buffers": flatness(samples, "live_buffers", skip),
              "samples": samples}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("seconds", "counts", "rss_mib", "live_buffers")}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
