"""Launches the CUDA paged-attention handler at B=32, L=4096 (bf16, H=32, KVH=8, D=128,
block 16) through torch, for a profiler: `ncu --kernel-name regex:AttendTensorCore
--launch-skip 2 --launch-count 1 python3 bench/profile_paged_attention.py`."""

import torch

from torch_xla_ext import sample_inputs

B, L, H, KVH, D, BLOCK = 32, 4096, 32, 8, 128, 16
inputs = sample_inputs.paged_attention([L] * B, H, KVH, D, BLOCK, torch.bfloat16, device="cuda")
for _ in range(4):
    torch.ops.xla_ext.paged_attention(**inputs, scale=D ** -0.5)
torch.cuda.synchronize()
