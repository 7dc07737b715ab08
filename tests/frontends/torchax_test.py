"""torchax: PyTorch code calling torch.ops.xla_ext.* runs our handlers inside a JAX-compiled
XLA graph (here on the CPU; on the GPU machine the same test runs with the CUDA handlers)."""

import os

import pytest
import torch

from tests import reference
from torch_xla_ext import sample_inputs

PLATFORM = os.environ.get("XLA_EXT_TEST_PLATFORM", "cpu")


@pytest.fixture(scope="module")
def env():
    import jax

    # slot_mapping is int64 (vLLM's); JAX keeps 64-bit integers only with x64 on.
    jax.config.update("jax_enable_x64", True)
    import torch_xla_ext.torchax_ops  # noqa: F401  (before the environment exists)
    import torchax

    return torchax.default_env()


def _jitted(fn):
    import torchax.interop

    return torchax.interop.jax_jit(fn)


def test_ops_run_inside_a_jitted_xla_graph(env):
    import jax

    g = torch.Generator().manual_seed(3)
    block_size, kv_heads, head = 16, 2, 64
    inputs = sample_inputs.paged_attention([20, 33], 8, kv_heads, head, block_size, torch.float32,
                                           seed=3)
    query, key_cache, value_cache = inputs["query"], inputs["key_cache"], inputs["value_cache"]
    block_tables, seq_lens = inputs["block_tables"], inputs["seq_lens"]
    new_key = torch.randn(2, kv_heads, head, generator=g)
    new_value = torch.randn(2, kv_heads, head, generator=g)
    last = (seq_lens - 1).long()  # this step's token: the last position of each sequence
    slots = block_tables.long()[torch.arange(2), last // block_size] * block_size + last % block_size
    want_k, want_v = reference.reshape_and_cache_ref(new_key, new_value, key_cache, value_cache,
                                                     slots)
    want = reference.paged_attention_ref(query, want_k.float(), want_v.float(), block_tables,
                                         seq_lens, 0.125)

    def step(query, new_key, new_value, key_cache, value_cache, block_tables, seq_lens, slots):
        torch.ops.xla_ext.reshape_and_cache(new_key, new_value, key_cache, value_cache, slots)
        out = torch.ops.xla_ext.paged_attention(query, key_cache, value_cache, block_tables,
                                                seq_lens, 0.125)
        return torch.ops.xla_ext.simple_add(out, out), key_cache

    device = "jax"
    with env:
        args = [t.to(device) for t in (query, new_key, new_value, key_cache, value_cache,
                                       block_tables, seq_lens, slots)]
        doubled, new_cache = _jitted(step)(*args)
        assert jax.devices()[0] == jax.devices(PLATFORM)[0]
        got = torch.from_numpy(__import__("numpy").asarray(doubled.jax()))
        got_cache = torch.from_numpy(__import__("numpy").asarray(new_cache.jax()))
    torch.testing.assert_close(got.double(), 2 * want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got_cache, want_k.float())
