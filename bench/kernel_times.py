"""Where a paged-attention call's time goes on the GPU: a CUPTI trace (torch.profiler, which also
records the kernels JAX launches in this process) of the same jitted chain bench/decode_bench.py
times, per shape:
  period    the chain's span on the GPU (first kernel start to last kernel end) per call,
  kernels   each kernel's time per call,
  idle      period minus the kernels: the GPU waiting between kernels (launch latency);
            negative when kernels overlap (a programmatic launch starts before its
            predecessor ends and waits on the GPU),
  attention_end_to_next_start   ours only: the combine kernel and launch latencies.
Medians of 3 traced runs.

    python bench/kernel_times.py [--impl xla_ext|xla_gather|sdpa_cudnn] [--out FILE]

`tools/device/run.sh bench` runs it for xla_ext and sdpa_cudnn and keeps both in
bench/results/h100-kernel-times.json.
"""

import argparse
import json
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import decode_bench  # noqa: E402

CALLS = 20


def chain_kernels(fn):
    """The kernels of one run of fn, in start order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return sorted(kernels, key=lambda e: e.time_range.start)


def summarize(fn, reps=3):
    """Per call, median over reps: the span from the chain's first kernel start to its last
    kernel end, and each kernel's summed duration, both over CALLS."""
    fn()  # compile, warm up
    torch.cuda.synchronize()
    periods, per_name, gaps = [], {}, []
    for _ in range(reps):
        kernels = chain_kernels(fn)
        attend = [e for e in kernels if "Attend" in e.name]
        gaps += [b.time_range.start - a.time_range.end for a, b in zip(attend, attend[1:])]
        periods.append((kernels[-1].time_range.end - kernels[0].time_range.start) / CALLS)
        totals = {}
        for e in kernels:
            name = e.name[:70]
            totals[name] = totals.get(name, 0.0) + e.time_range.elapsed_us() / CALLS
        for name, total in totals.items():
            per_name.setdefault(name, []).append(total)
    period = statistics.median(periods)
    durations = {n: statistics.median(d) for n, d in per_name.items()}
    result = {"period_us": round(period, 2),
              "kernels_us": {n: round(d, 2) for n, d in durations.items()},
              "idle_us": round(period - sum(durations.values()), 2)}
    if gaps:  # our calls: from an attention kernel's end to the next one's start
        result["attention_end_to_next_start_us"] = round(statistics.median(gaps), 2)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", default="xla_ext", choices=["xla_ext", "xla_gather", "sdpa_cudnn"])
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    for batch, seq_len, block_size in decode_bench.SHAPES:
        fn = decode_bench.paged_attention_callable(batch, seq_len, block_size, args.impl, CALLS)
        result = {"shape": f"B={batch},L={seq_len},block={block_size}", "impl": args.impl,
                  **summarize(fn)}
        print(json.dumps(result), flush=True)
        results.append(result)
        del fn
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "jax": jax.__version__,
                       "calls_per_chain": CALLS, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
