"""Launches the CUDA paged-attention handler on one batch through torch, for a profiler (bf16,
block 16): B=32, L=4096, H=32, KVH=8, D=128 by default, or a mix of bench/decode_mixes_bench.py.

    ncu --kernel-name regex:AttendTensorCore --launch-skip 2 --launch-count 1 \\
        python3 bench/profile_paged_attention.py [--mix "TP=8 shard (H=4, KVH=1): long tail 64"]

Four calls; with --mix, the attention and combine kernels of a call are launch pairs
(`tools/device/run.sh ncu_mixes` profiles the third call's, into
bench/results/<gpu>-ncu-mixes.txt; `run.sh bench` the default batch, into <gpu>-ncu.txt).
--trace: then the GPU timeline of three calls replayed in a CUDA graph (bench/gpu_trace.py)."""

import argparse
import os
import sys

import torch

from torch_xla_ext import sample_inputs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

D, BLOCK = 128, 16
parser = argparse.ArgumentParser()
parser.add_argument("--mix", help="a key of decode_mixes_bench.MIXES")
parser.add_argument("--trace", action="store_true",
                    help="print the GPU timeline of three calls replayed in a CUDA graph (CUPTI)")
args = parser.parse_args()
head_size = D
if args.mix is None:
    lengths, heads, kv_heads = [4096] * 32, 32, 8
else:
    from decode_mixes_bench import MIXES

    if args.mix not in MIXES:
        parser.error(f"--mix: expected one of {sorted(MIXES)}, got {args.mix!r}")
    lengths, heads, kv_heads, *rest = MIXES[args.mix]
    head_size = rest[0] if rest else D
inputs = sample_inputs.paged_attention(lengths, heads, kv_heads, head_size, BLOCK,
                                       torch.bfloat16, device="cuda")
for _ in range(4):
    torch.ops.xla_ext.paged_attention(**inputs, scale=head_size ** -0.5)
torch.cuda.synchronize()
if args.trace:
    from gpu_trace import print_graph_timeline

    print_graph_timeline(
        lambda: torch.ops.xla_ext.paged_attention(**inputs, scale=head_size ** -0.5), 3,
        args.mix or "B=32 x 4096")
