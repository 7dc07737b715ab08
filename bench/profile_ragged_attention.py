"""Launches the CUDA ragged-paged-attention handler on one mix of bench/ragged_bench.py through
torch (CUDA tensors), for a profiler:

    ncu --kernel-name "regex:AttendKernel|CombineKernel" --launch-skip 4 --launch-count 2 \\
        python3 bench/profile_ragged_attention.py --mix "decode 64 x 2048"

Four calls; each launches the attention kernel and its combine kernel
(`tools/device/run.sh ncu_ragged` profiles the third call's). With --trace, a fifth call runs
under torch.profiler's CUPTI trace (bench/gpu_trace.py) and its GPU work is printed in order:
what each kernel, memset and copy of one call takes on the GPU. (The gaps between them are the
eager torch op's host time, which a compiled XLA graph does not have.)"""

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
                    help="print the GPU work of one more call (CUPTI, through torch.profiler)")
args = parser.parse_args()
if args.mix not in mixes:
    parser.error(f"--mix: expected one of {sorted(mixes)}, got {args.mix!r}")
q_lens, kv_lens = mixes[args.mix]
inputs = sample_inputs.ragged_paged_attention(q_lens, kv_lens, H, KVH, D, PAGE, torch.bfloat16,
                                              device="cuda")
for _ in range(4):
    torch.ops.xla_ext.ragged_paged_attention(**inputs, sm_scale=SCALE)
torch.cuda.synchronize()
if args.trace:
    from gpu_trace import gpu_events

    def call():
        torch.ops.xla_ext.ragged_paged_attention(**inputs, sm_scale=SCALE)
        torch.cuda.synchronize()

    events = sorted(gpu_events(call), key=lambda e: e.time_range.start)
    print(f"{args.mix}: {len(events)} GPU events, first start to last end "
          f"{events[-1].time_range.end - events[0].time_range.start:.1f} us")
    for e in events:
        print(f"  {e.time_range.elapsed_us():9.1f} us  {e.name[:100]}")
