"""Valid random inputs for each op, and the tolerances results are held to: one place for the
tests, the benchmarks and the demo (and for users who want an example call)."""

import torch

# (atol, rtol) of a result against a float64 reference: outputs are rounded to the dtype once,
# accumulation is float32.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _generator(seed, device):
    return torch.Generator(device=device).manual_seed(seed)


def paged_attention(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                    max_blocks_per_seq=None, seed=0, device="cpu"):
    """{query, key_cache, value_cache, block_tables, seq_lens} for xla_ext.paged_attention.

    Each sequence's blocks are scattered over the cache in random order, two blocks belong to
    nobody, and block-table entries past a sequence's length hold ids that must never be read
    (out of range, or negative)."""
    gen = _generator(seed, device)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    num_seqs = len(seq_lens)
    blocks_needed = [-(-int(n) // block_size) for n in seq_lens]
    if max_blocks_per_seq is None:
        max_blocks_per_seq = max(blocks_needed + [1])
    num_blocks = sum(blocks_needed) + 2
    ids = torch.randperm(num_blocks, generator=gen, device=device).int()
    block_tables = torch.full((num_seqs, max_blocks_per_seq), num_blocks + 7, dtype=torch.int32,
                              device=device)
    block_tables[:, ::2] = -3
    used = 0
    for seq, n in enumerate(blocks_needed):
        block_tables[seq, :n] = ids[used:used + n]
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return dict(query=randn(num_seqs, num_heads, head_size), key_cache=randn(*cache_shape),
                value_cache=randn(*cache_shape), block_tables=block_tables,
                seq_lens=seq_lens.to(device))
