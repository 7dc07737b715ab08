"""Launches the CUDA ragged-paged-attention handler on one mix of bench/ragged_bench.py through
torch (CUDA tensors), for a profiler:

    ncu --kernel-name "regex:AttendKernel|CombineKernel" --launch-skip 4 --launch-count 2 \\
        python3 bench/profile_ragged_attention.py --mix "decode 64 x 2048"

Four calls; each launches the attention kernel and its combine kernel
(`tools/device/run.sh ncu_ragged` profiles the third call's). With --trace, three more calls
are captured in a CUDA graph and replayed under torch.profiler's CUPTI trace
(bench/gpu_trace.py): each kernel's, memset's and copy's start and end on the GPU, with no host
gaps between the calls."""

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
    from gpu_trace import print_graph_timeline

    print_graph_timeline(
        lambda: torch.ops.xla_ext.ragged_paged_attention(**inputs, sm_scale=SCALE), 3, args.mix)
