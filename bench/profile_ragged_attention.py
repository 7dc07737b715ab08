"""Launches the CUDA ragged-paged-attention handler on one mix of bench/ragged_bench.py through
torch (CUDA tensors), for a profiler:

    ncu --kernel-name "regex:AttendKernel|CombineKernel" --launch-skip 4 --launch-count 2 \\
        python3 bench/profile_ragged_attention.py --mix "decode 64 x 2048"

Four calls; each launches the attention kernel and its combine kernel
(`tools/device/run.sh ncu_ragged` profiles the third call's, into
bench/results/<gpu>-ncu-ragged.txt; `run.sh clocks_ragged` keeps --clocks in
<gpu>-ragged-clocks.txt). With --trace, three more calls
are captured in a CUDA graph and replayed under torch.profiler's CUPTI trace
(bench/gpu_trace.py): each kernel's, memset's and copy's start and end on the GPU, with no host
gaps between the calls. With --clocks S, calls replayed back to back in a CUDA graph for S
seconds while nvidia-smi samples the SM clock, the power draw and the active clock-throttle
reasons every 100 ms: the medians of the samples taken while the calls ran."""

import argparse
import os
import sys

import torch

from torch_xla_ext import sample_inputs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ragged_bench import D, H, KVH, MIXES, PAGE, SCALE  # noqa: E402

mixes = {name: (q_lens, kv_lens) for name, q_lens, kv_lens in MIXES}
parser = argparse.ArgumentParser()
parser.add_argument("--mix", required=True, help="a mix name of ragged_bench.MIXES")
parser.add_argument("--trace", action="store_true",
                    help="print the GPU timeline of three calls replayed in a CUDA graph (CUPTI)")
parser.add_argument("--clocks", type=float, metavar="SECONDS",
                    help="replay calls for SECONDS and print the SM clock and power nvidia-smi "
                    "samples meanwhile")
args = parser.parse_args()
if args.mix not in mixes:
    parser.error(f"--mix: expected one of {sorted(mixes)}, got {args.mix!r}")
if args.clocks is not None and args.clocks <= 0:
    parser.error(f"--clocks: expected a positive number of seconds, got {args.clocks}")
q_lens, kv_lens = mixes[args.mix]
inputs = sample_inputs.ragged_paged_attention(q_lens, kv_lens, H, KVH, D, PAGE, torch.bfloat16,
                                              device="cuda")


def call():
    torch.ops.xla_ext.ragged_paged_attention(**inputs, sm_scale=SCALE)


for _ in range(4):
    call()
torch.cuda.synchronize()
if args.trace:
    from gpu_trace import print_graph_timeline

    print_graph_timeline(call, 3, args.mix)
if args.clocks is not None:
    import statistics
    import subprocess
    import time

    from gpu_trace import captured_graph

    graph = captured_graph(call, 20)
    sampler = subprocess.Popen(
        ["nvidia-smi", f"--id={torch.cuda.current_device()}",
         "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
         "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # nvidia-smi's first samples, before the calls start, are dropped below
    start = time.monotonic()
    replays = 0
    while time.monotonic() - start < args.clocks:
        graph.replay()
        replays += 1
        if replays % 50 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    sampler.terminate()
    samples = [line.split(", ") for line in sampler.communicate()[0].splitlines()]
    during = samples[10:-2]  # the ~1 s before the calls, and the last samples at the stop
    if not during:
        raise RuntimeError(f"nvidia-smi gave {len(samples)} samples; too few for --clocks "
                           f"{args.clocks}")
    clocks_mhz = [float(s[0]) for s in during]
    power_w = [float(s[1]) for s in during]
    reasons = sorted({s[2] for s in during})
    print(f"{args.mix}: {20 * replays / elapsed:.0f} calls/s ({1e6 * elapsed / (20 * replays):.1f} "
          f"us each) over {elapsed:.1f} s; {len(during)} samples: SM clock median "
          f"{statistics.median(clocks_mhz):.0f} MHz (min {min(clocks_mhz):.0f}), power median "
          f"{statistics.median(power_w):.0f} W, throttle reasons {reasons}")
