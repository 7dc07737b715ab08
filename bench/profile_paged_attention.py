"""Launches the CUDA paged-attention handler at B=32, L=4096 (bf16, H=32, KVH=8, D=128,
block 16) through torch, for a profiler: `ncu --kernel-name regex:AttendTensorCore
--launch-skip 2 --launch-count 1 python3 bench/profile_paged_attention.py`."""

import torch

import torch_xla_ext  # noqa: F401

B, L, H, KVH, D, BLOCK = 32, 4096, 32, 8, 128, 16
blocks = B * L // BLOCK
key_cache = torch.randn(blocks, BLOCK, KVH, D, device="cuda", dtype=torch.bfloat16)
value_cache = torch.randn_like(key_cache)
query = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
block_tables = torch.randperm(blocks, device="cuda").int().reshape(B, L // BLOCK)
seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
for _ in range(4):
    torch.ops.xla_ext.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                      D ** -0.5)
torch.cuda.synchronize()
