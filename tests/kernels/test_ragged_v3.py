"""jax_ops.ragged_paged_attention_v3 (tpu-inference's "v3" signature): this step's keys and
values written into the donated cache at their rows' positions, then attention, in one jitted
call, against the references."""

import functools

import jax
import jax.numpy as jnp
import torch

from tests import reference
from tests.kernels.common import assert_close, to_jax, to_torch
from torch_xla_ext import jax_ops, sample_inputs


def test_writes_the_steps_rows_then_attends():
    q_lens, kv_lens = [5, 1, 1, 16, 0, 3], [37, 9, 100, 16, 4, 3]
    inputs = sample_inputs.ragged_paged_attention(q_lens, kv_lens, num_q_heads=8, num_kv_heads=2,
                                                  head_dim=64, page_size=16,
                                                  dtype=torch.float32, max_num_seqs=8,
                                                  padding_rows=4)
    num_tokens = inputs["q"].shape[0]
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(num_tokens, 2, 64, generator=gen)
    values = torch.randn(num_tokens, 2, 64, generator=gen)
    slots = torch.full((num_tokens,), -1, dtype=torch.int32)  # padding rows write nothing
    row = 0
    for seq, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        for j in range(q_len):
            position = kv_len - q_len + j
            page = int(inputs["page_indices"][seq, position // 16])
            slots[row] = page * 16 + position % 16
            row += 1
    want_cache = reference.kv_cache_update_ref(keys, values, inputs["kv_pages"], slots)
    want = reference.ragged_paged_attention_ref(
        inputs["q"], want_cache, inputs["kv_lens"], inputs["page_indices"], inputs["cu_q_lens"],
        inputs["num_seqs"], sm_scale=0.125, sliding_window=20)

    step = jax.jit(functools.partial(jax_ops.ragged_paged_attention_v3, sm_scale=0.125,
                                     sliding_window=20), donate_argnums=(3,))
    cache = jnp.copy(to_jax(inputs["kv_pages"]))  # a buffer XLA owns, donated below
    distribution = jnp.array([0, 0, len(q_lens)], dtype=jnp.int32)
    out, new_cache = step(to_jax(inputs["q"]), to_jax(keys), to_jax(values), cache,
                          to_jax(inputs["kv_lens"]), to_jax(inputs["page_indices"]),
                          to_jax(inputs["cu_q_lens"]), distribution)
    assert torch.equal(to_torch(new_cache), want_cache)
    assert_close(out, want, torch.float32)
