"""Launches the CUDA ragged-paged-attention handler on one mix of bench/ragged_bench.py through
torch (CUDA tensors), for a profiler:

    ncu --kernel-name "regex:AttendKernel|CombineKernel" --launch-skip 4 --launch-count 2 \\
        python3 bench/profile_ragged_attention.py --mix "decode 64 x 2048"
    python3 bench/profile_ragged_attention.py --decode 1,2048 --heads 32,8,64 --max-num-seqs 64 \\
        --padding-rows 15 --max-q-len 1 --trace   # the 1B model's attention in a B=1 decode step

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
from ragged_bench import D, H, KVH, MIXES, PAGE  # noqa: E402

mixes = {name: (q_lens, kv_lens) for name, q_lens, kv_lens in MIXES}
parser = argparse.ArgumentParser()
parser.add_argument("--mix", help="a mix name of ragged_bench.MIXES")
parser.add_argument("--decode", metavar="B,L",
                    help="instead of --mix: B decode steps (one query row each) at L tokens")
parser.add_argument("--heads", metavar="H,KVH,D", default=f"{H},{KVH},{D}",
                    help="query heads, kv heads and head size (default: ragged_bench's)")
parser.add_argument("--max-num-seqs", type=int,
                    help="the batch's sequence slots (default: its sequences), as a serving "
                         "engine pads them")
parser.add_argument("--padding-rows", type=int, default=0,
                    help="query rows past the last sequence's, as a bucketed step has")
parser.add_argument("--max-q-len", type=int, default=0,
                    help="the op's max_q_len (1 with --decode: the decode kernel alone, as the "
                    "serving engine runs its decode steps)")
parser.add_argument("--trace", action="store_true",
                    help="print the GPU timeline of three calls replayed in a CUDA graph (CUPTI)")
parser.add_argument("--clocks", type=float, metavar="SECONDS",
                    help="replay calls for SECONDS and print the SM clock and power nvidia-smi "
                    "samples meanwhile")
args = parser.parse_args()
if (args.mix is None) == (args.decode is None):
    parser.error("expected one of --mix and --decode")
if args.mix is not None and args.mix not in mixes:
    parser.error(f"--mix: expected one of {sorted(mixes)}, got {args.mix!r}")
if args.clocks is not None and args.clocks <= 0:
    parser.error(f"--clocks: expected a positive number of seconds, got {args.clocks}")
if args.mix is not None:
    q_lens, kv_lens = mixes[args.mix]
else:
    batch, length = (int(v) for v in args.decode.split(","))
    q_lens, kv_lens = [1] * batch, [length] * batch
    args.mix = f"decode {batch} x {length}"
num_heads, num_kv_heads, head_dim = (int(v) for v in args.heads.split(","))
inputs = sample_inputs.ragged_paged_attention(q_lens, kv_lens, num_heads, num_kv_heads, head_dim,
                                              PAGE, torch.bfloat16,
                                              max_num_seqs=args.max_num_seqs,
                                              padding_rows=args.padding_rows, device="cuda")


# Passed only when set: a baseline tree (tools/device/ab_kernels.sh) may predate it.
promise = {"max_q_len": args.max_q_len} if args.max_q_len else {}


def call():
    torch.ops.xla_ext.ragged_paged_attention(**inputs, sm_scale=head_dim ** -0.5, **promise)


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
