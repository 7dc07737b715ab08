"""Float64 PyTorch references for the kernels, written for clarity rather than speed."""

import math

import torch


def simple_add_ref(a, b):
    return a.double() + b.double()


def paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale,
                        softcap=0.0, alibi_slopes=None):
    """vLLM decode attention over a paged NHD cache; returns float64
    [num_seqs, num_heads, head_size]. Sequences of length 0 give zeros."""
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float64)
    for seq in range(num_seqs):
        seq_len = int(seq_lens[seq])
        if seq_len == 0:
            continue
        tokens = torch.arange(seq_len)
        blocks = block_tables[seq].long()[tokens // block_size]
        offsets = tokens % block_size
        # [seq_len, num_kv_heads, head_size] -> one kv head per query head
        k = key_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
        v = value_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
        q = query[seq].double()
        logits = scale * torch.einsum("hd,thd->ht", q, k)
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        if alibi_slopes is not None:
            logits = logits + alibi_slopes.double()[:, None] * (tokens - (seq_len - 1)).double()
        weights = torch.softmax(logits, dim=-1)
        out[seq] = torch.einsum("ht,thd->hd", weights, v)
    return out


def reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping):
    """Returns new (key_cache, value_cache) with token i's rows at slot slot_mapping[i]
    (slot = block * block_size + offset); negative slots are skipped."""
    num_blocks, block_size = key_cache.shape[:2]
    kc = key_cache.clone().reshape(num_blocks * block_size, *key_cache.shape[2:])
    vc = value_cache.clone().reshape(num_blocks * block_size, *value_cache.shape[2:])
    keep = slot_mapping >= 0
    kc[slot_mapping[keep]] = key[keep]
    vc[slot_mapping[keep]] = value[keep]
    return kc.reshape(key_cache.shape), vc.reshape(value_cache.shape)


def alibi_slopes(num_heads):
    """The ALiBi paper's slopes (as in vLLM), float32 [num_heads]."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def kv_cache_update_ref(key, value, kv_cache, slot_mapping):
    """A new combined cache [num_pages, page_size, 2 * num_kv_heads, head_size] with token i's
    key rows at combined heads 2h and value rows at 2h + 1 of slot slot_mapping[i]
    (page * page_size + offset); negative slots are skipped."""
    if kv_cache.dtype == torch.float8_e4m3fn:  # torch cannot index fp8 tensors: move bytes
        return kv_cache_update_ref(key.view(torch.uint8), value.view(torch.uint8),
                                   kv_cache.view(torch.uint8), slot_mapping).view(kv_cache.dtype)
    num_pages, page_size = kv_cache.shape[:2]
    cache = kv_cache.clone().reshape(num_pages * page_size, *kv_cache.shape[2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    cache[slots, 0::2] = key[keep]
    cache[slots, 1::2] = value[keep]
    return cache.reshape(kv_cache.shape)


def rotary_kv_cache_update_ref(qkv, cos, sin, kv_cache, slot_mapping):
    """(q, new cache) of rotary_kv_cache_update: the q and k heads of qkv rotated by torch's
    eager ops in qkv's dtype (transformers' Llama: x * cos + rotate_half(x) * sin), the k
    heads and the v heads then written as kv_cache_update writes them."""
    num_kv_heads = kv_cache.shape[2] // 2
    num_q_heads = qkv.shape[1] - 2 * num_kv_heads
    half = qkv.shape[2] // 2

    def rotate(x):
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    q = rotate(qkv[:, :num_q_heads])
    k = rotate(qkv[:, num_q_heads:num_q_heads + num_kv_heads])
    v = qkv[:, num_q_heads + num_kv_heads:]
    return q, kv_cache_update_ref(k, v, kv_cache, slot_mapping)


def add_rms_norm_ref(x, residual, weight, eps):
    """(residual + x, its RMSNorm) as torch's eager ops and transformers' LlamaRMSNorm compute
    them in x's dtype."""
    total = residual + x
    x32 = total.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return total, weight * x32.to(x.dtype)


def small_batch_linear_ref(x, weight, residual=None, silu_gate=0):
    """small_batch_linear as torch's eager ops compute it in x's dtype: x @ weight.T (+
    residual), or silu(x @ gate.T) * (x @ up.T) with weight = [gate; up]; the products from a
    float64 matmul, rounded once."""
    def product(w):
        return (x.double() @ w.double().T).to(x.dtype)

    if silu_gate:
        gate, up = weight.chunk(2)
        return torch.nn.functional.silu(product(gate)) * product(up)
    out = product(weight)
    return out if residual is None else out + residual


def kv_cache_update_slices_ref(kv, slices, kv_cache, num_slices):
    """vLLM's slice form: for i < num_slices[0], kv rows [new_start, +length) go to cache rows
    [cache_start, +length), slices = [cache_start, new_start, length] x max_slices."""
    if kv_cache.dtype == torch.float8_e4m3fn:
        return kv_cache_update_slices_ref(kv.view(torch.uint8), slices,
                                          kv_cache.view(torch.uint8), num_slices).view(kv.dtype)
    cache = kv_cache.clone()
    for i in range(int(num_slices[0])):
        start, new_start, length = (int(slices[r, i]) for r in range(3))
        cache[start:start + length] = kv[new_start:new_start + length]
    return cache


# torch_xla's DEFAULT_MASK_VALUE (torch_xla/experimental/custom_kernel.py).
DEFAULT_MASK_VALUE = -0.7 * float(torch.finfo(torch.float32).max)


def ragged_paged_attention_ref(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                               sm_scale=1.0, sliding_window=None, soft_cap=None,
                               mask_value=DEFAULT_MASK_VALUE, k_scale=None, v_scale=None):
    """torch_xla's ragged_paged_attention in float64, [max_num_batched_tokens, num_q_heads,
    head_dim]: sequence i < num_seqs[0] owns query rows cu_q_lens[i]..cu_q_lens[i + 1], whose
    row j attends cache positions k <= kv_len - q_len + j (and, with a sliding window,
    k > kv_len - q_len + j - sliding_window); masked scores are mask_value, soft-capping comes
    before the mask. kv_pages [pages, page_size, 2 * num_kv_heads, head_dim] holds K of kv
    head h at combined head 2h and V at 2h + 1 (any float dtype, fp8 too: K and V are
    dequantised as float64 values times k_scale / v_scale). Rows no sequence owns are zeros."""
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = kv_pages.shape[1]
    num_kv_heads = kv_pages.shape[2] // 2
    group = num_q_heads // num_kv_heads
    pages = kv_pages.double()  # torch cannot index fp8 tensors
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    for i in range(int(num_seqs[0])):
        q_start, q_end, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        q_len = q_end - q_start
        positions = torch.arange(kv_len)
        rows = pages[page_indices[i].long()[positions // page_size], positions % page_size]
        k = rows[:, 0::2].repeat_interleave(group, dim=1)  # [kv_len, num_q_heads, head_dim]
        v = rows[:, 1::2].repeat_interleave(group, dim=1)
        if k_scale is not None:
            k = k * k_scale
        if v_scale is not None:
            v = v * v_scale
        scores = sm_scale * torch.einsum("qhd,khd->hqk", q[q_start:q_end].double(), k)
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = (kv_len - q_len + torch.arange(q_len))[:, None]
        masked = positions[None, :] > q_pos
        if sliding_window is not None:
            masked |= positions[None, :] <= q_pos - sliding_window
        scores = scores.masked_fill(masked, mask_value)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out
