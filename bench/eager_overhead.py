"""Host time per call of the torch ops on CPU or CUDA tensors (the eager path: torch.library
dispatch into csrc/torch_ops.cc's C++ kernel, which runs a kept call per signature of shapes,
dtypes and scalar arguments through csrc/eager_runtime.cc), on inputs so small that the kernels
cost next to nothing.

    python bench/eager_overhead.py --device cpu --out bench/results/cpu-eager-overhead.json
    python bench/eager_overhead.py --device cuda --out bench/results/h100-eager-overhead.json

CPU time of this process per call (time.process_time, the best of 7 rounds of 2000 calls), so
other processes on a shared machine do not inflate it. On CUDA the kernels run behind the host,
and this is the host's submission time (bench/decode_mixes_bench.py reports it beside the
GPU time, eager and in a CUDA graph).
"""

import argparse
import json
import platform
import time

import torch

import torch_xla_ext  # noqa: F401  (registers torch.ops.xla_ext.*)
from torch_xla_ext import sample_inputs


def host_us(fn, calls=2000, rounds=7):
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = args.device
    a = torch.ones(4, device=device)
    b = torch.ones(4, device=device)
    data = sample_inputs.paged_attention([1, 3], 2, 1, 64, 8, torch.float32, device=device)
    attention = tuple(data.values()) + (0.125,)
    ragged = sample_inputs.ragged_paged_attention([3, 1], [5, 9], 2, 1, 64, 8, torch.float32,
                                                  device=device)
    rows = {
        "simple_add": host_us(lambda: torch.ops.xla_ext.simple_add(a, b)),
        "paged_attention": host_us(lambda: torch.ops.xla_ext.paged_attention(*attention)),
        "ragged_paged_attention": host_us(
            lambda: torch.ops.xla_ext.ragged_paged_attention(**ragged, sm_scale=0.125)),
        "torch add (for scale)": host_us(lambda: torch.add(a, b)),
    }
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    result = {"device": device, "host": platform.processor() or platform.machine(),
              "host_us_per_call": {k: round(v, 1) for k, v in rows.items()}}
    print(json.dumps(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
