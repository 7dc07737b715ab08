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


def kv_cache_update(num_tokens, num_kv_heads, head_size, num_pages, page_size, dtype,
                    skipped=slice(None, None, 3), seed=0):
    """{key, value, kv_cache, slot_mapping} for kv_cache_update: each token to a distinct
    random slot of the combined cache, except the tokens `skipped` selects (slot -1; default
    every third)."""
    gen = _generator(seed, "cpu")
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    kv_cache = torch.randn(num_pages, page_size, 2 * num_kv_heads, head_size,
                           generator=gen).to(dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens].int()
    slots[skipped] = -1
    return dict(key=key, value=value, kv_cache=kv_cache, slot_mapping=slots)


def rotary_kv_cache_update(num_tokens, num_q_heads, num_kv_heads, head_size, num_pages,
                           page_size, dtype, skipped=slice(None, None, 3), seed=0):
    """{qkv, cos, sin, kv_cache, slot_mapping} for rotary_kv_cache_update: cos and sin of
    random angles (a rotary table's rows), slots as kv_cache_update's."""
    gen = _generator(seed, "cpu")
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_size,
                      generator=gen).to(dtype)
    angles = torch.rand(num_tokens, head_size, generator=gen) * 100.0
    writes = kv_cache_update(num_tokens, num_kv_heads, head_size, num_pages, page_size, dtype,
                             skipped, seed)
    return dict(qkv=qkv, cos=angles.cos().to(dtype), sin=angles.sin().to(dtype),
                kv_cache=writes["kv_cache"], slot_mapping=writes["slot_mapping"])


# A ragged batch as serving makes them: chunked prefills beside decodes, a prefill with
# q_len == kv_len, and an empty sequence.
MIXED_BATCH = dict(q_lens=[5, 1, 1, 16, 0, 3], kv_lens=[37, 9, 100, 16, 4, 3])


def ragged_paged_attention(q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, page_size,
                           dtype, kv_dtype=None, max_num_seqs=None, padding_rows=0, seed=0,
                           device="cpu"):
    """{q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs} for ragged_paged_attention:
    sequence i brings q_lens[i] new tokens and has kv_lens[i] in the cache, new ones included.

    Pages are scattered over the cache in random order; the batch has `padding_rows` rows past
    the last sequence's; entries past num_seqs are junk as vLLM leaves them (cu_q_lens 1, stale
    kv_lens), and page-table entries past a sequence's pages are other sequences' pages (valid
    ids, as torch_xla's reference gathers whole rows of the table)."""
    gen = _generator(seed, device)
    num_seqs = len(q_lens)
    max_num_seqs = max_num_seqs or num_seqs
    pages_needed = [-(-int(n) // page_size) for n in kv_lens]
    pages_per_seq = max(pages_needed + [1])
    num_pages = sum(pages_needed) + 2
    ids = torch.randperm(num_pages, generator=gen, device=device).int()
    page_indices = torch.randint(num_pages, (max_num_seqs, pages_per_seq), generator=gen,
                                 device=device, dtype=torch.int32)
    used = 0
    for seq, n in enumerate(pages_needed):
        page_indices[seq, :n] = ids[used:used + n]
        used += n
    cu_q_lens = torch.ones(max_num_seqs + 1, dtype=torch.int32)
    cu_q_lens[:num_seqs + 1] = torch.tensor([0] + list(q_lens)).cumsum(0)
    lens = torch.full((max_num_seqs,), page_size * pages_per_seq, dtype=torch.int32)
    lens[:num_seqs] = torch.tensor(kv_lens, dtype=torch.int32)
    num_tokens = int(sum(q_lens)) + padding_rows

    def randn(*shape, to=dtype):
        return torch.randn(*shape, generator=gen, device=device).to(to)

    return dict(q=randn(num_tokens, num_q_heads, head_dim),
                kv_pages=randn(num_pages, page_size, 2 * num_kv_heads, head_dim,
                               to=kv_dtype or dtype),
                kv_lens=lens.to(device), page_indices=page_indices,
                cu_q_lens=cu_q_lens.to(device),
                num_seqs=torch.tensor([num_seqs], dtype=torch.int32, device=device))
