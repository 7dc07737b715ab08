"""xla_ext.reshape_and_cache through JAX's XLA against the reference."""

import jax
import pytest
import torch

from tests import reference
from tests.kernels.common import DTYPES, HANDLERS_CHECK_DATA, replace, to_jax, to_torch
from torch_xla_ext import jax_ops as xla_ext_jax
from torch_xla_ext import op_catalog
from torch_xla_ext.errors import TorchXlaExtError


def make_inputs(num_tokens, num_kv_heads, head_size, num_blocks, block_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    # Distinct slots, every third one skipped.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    return key, value, key_cache, value_cache, slots


def run(inputs, jit=True):
    fn = jax.jit(xla_ext_jax.reshape_and_cache) if jit else xla_ext_jax.reshape_and_cache
    return [to_torch(x) for x in fn(*map(to_jax, inputs))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_size,num_blocks,block_size", [
    (1, 1, 64, 1, 8),
    (10, 2, 128, 4, 16),
    (33, 8, 80, 9, 32),
    (5, 3, 6, 2, 4),  # row bytes not a multiple of 16 (a 2- or 4-byte copy on CUDA)
])
def test_matches_reference(num_tokens, num_kv_heads, head_size, num_blocks, block_size, dtype):
    inputs = make_inputs(num_tokens, num_kv_heads, head_size, num_blocks, block_size, dtype)
    key_cache, value_cache = run(inputs)
    expected_key_cache, expected_value_cache = reference.reshape_and_cache_ref(*inputs)
    assert torch.equal(key_cache, expected_key_cache)
    assert torch.equal(value_cache, expected_value_cache)


def test_no_tokens():
    inputs = make_inputs(0, 2, 64, 3, 8, torch.float32)
    key_cache, value_cache = run(inputs, jit=False)
    assert torch.equal(key_cache, inputs[2]) and torch.equal(value_cache, inputs[3])


def test_all_slots_skipped():
    inputs = list(make_inputs(6, 2, 64, 3, 8, torch.bfloat16))
    inputs[4] = torch.full((6,), -1, dtype=torch.int64)
    key_cache, value_cache = run(inputs)
    assert torch.equal(key_cache, inputs[2]) and torch.equal(value_cache, inputs[3])


def test_without_aliasing_copies_the_caches():
    """Results in buffers of their own: the handler copies the caches before writing."""
    inputs = make_inputs(7, 2, 64, 3, 8, torch.float16)
    cache_type = jax.ShapeDtypeStruct(tuple(inputs[2].shape), to_jax(inputs[2]).dtype)
    call = jax.ffi.ffi_call(op_catalog.RESHAPE_AND_CACHE.target, (cache_type, cache_type))
    key_cache, value_cache = [to_torch(x) for x in jax.jit(call)(*map(to_jax, inputs))]
    expected_key_cache, expected_value_cache = reference.reshape_and_cache_ref(*inputs)
    assert torch.equal(key_cache, expected_key_cache)
    assert torch.equal(value_cache, expected_value_cache)


def test_slot_out_of_range():
    inputs = list(make_inputs(4, 2, 64, 2, 8, torch.float32))
    inputs[4] = torch.tensor([0, 16, 3, -1])  # 16 == num_blocks * block_size
    with pytest.raises(TorchXlaExtError, match="argument 'slot_mapping'.*slot_mapping\\[1\\] = 16"):
        run(inputs, jit=False)
    if HANDLERS_CHECK_DATA:
        with pytest.raises(Exception,
                           match="argument 'slot_mapping'.*slot_mapping\\[1\\] = 16"):
            run(inputs)
    else:  # CUDA skips the token (see kernels/reshape_and_cache/reshape_and_cache.h)
        key_cache, _ = run(inputs)
        skipped = list(inputs)
        skipped[4] = torch.tensor([0, -1, 3, -1])
        assert torch.equal(key_cache, reference.reshape_and_cache_ref(*skipped)[0])


BAD_INPUTS = [
    ("key", lambda x: replace(x, 0, x[0].to(torch.int32))),
    ("key", lambda x: replace(x, 0, x[0][0])),
    ("value", lambda x: replace(x, 1, x[1].half())),
    ("value", lambda x: replace(x, 1, x[1][:2])),
    ("key_cache", lambda x: replace(x, 2, x[2][..., :32])),
    ("key_cache", lambda x: replace(x, 2, x[2].half())),
    ("value_cache", lambda x: replace(x, 3, x[3][:1])),
    ("slot_mapping", lambda x: replace(x, 4, x[4].int())),
    ("slot_mapping", lambda x: replace(x, 4, x[4][:2])),
]


@pytest.mark.parametrize("arg,corrupt", BAD_INPUTS, ids=[a for a, _ in BAD_INPUTS])
def test_rejects_bad_arguments(arg, corrupt):
    inputs = corrupt(make_inputs(4, 2, 64, 2, 8, torch.float32))
    with pytest.raises(TorchXlaExtError, match=f"argument '{arg}'"):
        run(inputs, jit=False)


@pytest.mark.parametrize("arg,corrupt", BAD_INPUTS, ids=[a for a, _ in BAD_INPUTS])
def test_handler_rejects_bad_arguments(arg, corrupt):
    """The handler's own checks, reached by calling the target directly."""
    inputs = [to_jax(t) for t in corrupt(make_inputs(4, 2, 64, 2, 8, torch.float32))]
    cache_type = jax.ShapeDtypeStruct(inputs[2].shape, inputs[2].dtype)
    call = jax.ffi.ffi_call(op_catalog.RESHAPE_AND_CACHE.target, (cache_type, cache_type))
    with pytest.raises(Exception, match=f"argument '{arg}'"):
        jax.block_until_ready(jax.jit(call)(*inputs))
