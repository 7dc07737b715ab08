"""torchax front end: under torchax (PyTorch on JAX), torch.ops.xla_ext.* lower to the JAX
functions of torch_xla_ext.jax_ops, so PyTorch code runs our kernels inside an XLA graph (on the
GPU, the CUDA handlers through XLA GPU).

Import this module before torchax's environment is first created (torchax.default_env()).
"""

import torch

from torch_xla_ext.errors import import_dependency

jaten = import_dependency(
    "torchax.ops.jaten", "torch_xla_ext.torchax_ops",
    "torchax ships inside the torch_xla 2.9 wheel and imports only with flax installed: "
    "pip install torch_xla==2.9.0 flax==0.12.0 (or a torchax wheel that matches your torch)")

import torch_xla_ext  # noqa: E402,F401  (defines torch.ops.xla_ext)
from torch_xla_ext import jax_ops as xla_ext_jax  # noqa: E402


def _paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, softcap=0.0,
                     alibi_slopes=None):
    return xla_ext_jax.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                       scale, softcap, alibi_slopes)


def _reshape_and_cache_functional(key, value, key_cache, value_cache, slot_mapping):
    return tuple(xla_ext_jax.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping))


def _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    # Called with torchax tensors: the functional op lowers to JAX (input/output aliasing),
    # and copy_ rebinds the caches to its results.
    new_key_cache, new_value_cache = torch.ops.xla_ext.reshape_and_cache_functional(
        key, value, key_cache, value_cache, slot_mapping)
    key_cache.copy_(new_key_cache)
    value_cache.copy_(new_value_cache)


def _kv_cache_update(key, value, kv_cache, slot_mapping):
    kv_cache.copy_(torch.ops.xla_ext.kv_cache_update_functional(key, value, kv_cache,
                                                                slot_mapping))


jaten.op(torch.ops.xla_ext.simple_add.default)(xla_ext_jax.simple_add)
jaten.op(torch.ops.xla_ext.paged_attention.default)(_paged_attention)
jaten.op(torch.ops.xla_ext.reshape_and_cache_functional.default)(_reshape_and_cache_functional)
jaten.op(torch.ops.xla_ext.reshape_and_cache.default, is_jax_function=False)(_reshape_and_cache)
jaten.op(torch.ops.xla_ext.kv_cache_update_functional.default)(xla_ext_jax.kv_cache_update)
jaten.op(torch.ops.xla_ext.kv_cache_update.default, is_jax_function=False)(_kv_cache_update)
jaten.op(torch.ops.xla.kv_cache_update_op.default)(xla_ext_jax.kv_cache_update_slices)
