"""xla_ext.kv_cache_update and xla_ext.kv_cache_update_slices through JAX's XLA against the
references: bit-exact copies into the combined cache, in place when the cache is donated."""

import functools

import jax
import pytest
import torch

from tests import reference
from tests.kernels.common import CACHE_DTYPES, HANDLERS_CHECK_DATA, to_jax, to_torch
from torch_xla_ext import jax_ops as xla_ext_jax
from torch_xla_ext import op_catalog, sample_inputs
from torch_xla_ext.errors import TorchXlaExtError


def make_slot_inputs(num_tokens, num_kv_heads, head_size, num_pages, page_size, dtype, seed=0):
    return tuple(sample_inputs.kv_cache_update(num_tokens, num_kv_heads, head_size, num_pages,
                                               page_size, dtype, seed=seed).values())


def run_slots(inputs, jit=True):
    fn = jax.jit(xla_ext_jax.kv_cache_update) if jit else xla_ext_jax.kv_cache_update
    return to_torch(fn(*map(to_jax, inputs)))


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same(got, want):
    assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_size,num_pages,page_size", [
    (1, 1, 64, 1, 8),
    (10, 2, 128, 4, 16),
    (33, 8, 80, 9, 32),
    (5, 3, 6, 2, 4),  # rows not a multiple of 16 bytes (narrower copies on CUDA)
])
def test_slots_match_reference(num_tokens, num_kv_heads, head_size, num_pages, page_size, dtype):
    inputs = make_slot_inputs(num_tokens, num_kv_heads, head_size, num_pages, page_size, dtype)
    assert_same(run_slots(inputs), reference.kv_cache_update_ref(*inputs))


def test_slots_all_skipped_or_none():
    key, value, kv_cache, slots = make_slot_inputs(6, 2, 64, 3, 8, torch.bfloat16)
    assert_same(run_slots((key, value, kv_cache, torch.full((6,), -1, dtype=torch.int32))),
                kv_cache)
    empty = make_slot_inputs(0, 2, 64, 3, 8, torch.float32)
    assert_same(run_slots(empty, jit=False), empty[2])


def test_slots_in_place_when_donated():
    key, value, kv_cache, slots = make_slot_inputs(7, 2, 64, 3, 8, torch.float16)
    cache = jax.numpy.copy(to_jax(kv_cache))  # a buffer XLA owns (device_put may share NumPy's)
    pointer = cache.unsafe_buffer_pointer()
    step = jax.jit(xla_ext_jax.kv_cache_update, donate_argnums=(2,))
    new_cache = step(to_jax(key), to_jax(value), cache, to_jax(slots))
    assert new_cache.unsafe_buffer_pointer() == pointer and cache.is_deleted()
    assert_same(to_torch(new_cache), reference.kv_cache_update_ref(key, value, kv_cache, slots))


def test_slots_without_aliasing_copy_the_cache():
    inputs = make_slot_inputs(7, 2, 64, 3, 8, torch.float16)
    call = jax.ffi.ffi_call(op_catalog.KV_CACHE_UPDATE.target,
                            jax.ShapeDtypeStruct(tuple(inputs[2].shape), to_jax(inputs[2]).dtype))
    got = to_torch(jax.jit(call)(*map(to_jax, inputs)))
    assert_same(got, reference.kv_cache_update_ref(*inputs))


def test_slot_out_of_range():
    key, value, kv_cache, _ = make_slot_inputs(4, 2, 64, 2, 8, torch.float32)
    slots = torch.tensor([0, 16, 3, -1], dtype=torch.int32)  # 16 == num_pages * page_size
    with pytest.raises(TorchXlaExtError, match=r"argument 'slot_mapping'.*slot_mapping\[1\] = 16"):
        run_slots((key, value, kv_cache, slots), jit=False)
    if HANDLERS_CHECK_DATA:
        with pytest.raises(Exception,
                           match=r"argument 'slot_mapping'.*slot_mapping\[1\] = 16"):
            run_slots((key, value, kv_cache, slots))
    else:  # CUDA skips the token (kernels/kv_cache_update/kv_cache_update.h)
        want = reference.kv_cache_update_ref(key, value, kv_cache,
                                             torch.tensor([0, -1, 3, -1], dtype=torch.int32))
        assert_same(run_slots((key, value, kv_cache, slots)), want)


@pytest.mark.parametrize("change, message", [
    (lambda k, v, c, s: (k, v, c, s.long()), "argument 'slot_mapping': expected dtype int32"),
    (lambda k, v, c, s: (k.half(), v.half(), c, s),
     r"argument 'key': expected dtype float32 \(the dtype of 'kv_cache'\)"),
    (lambda k, v, c, s: (k, v, c[:, :, :3], s),
     r"argument 'kv_cache': expected \[2 \* num_kv_heads, head_size\] = \[4, 64\]"),
    (lambda k, v, c, s: (k, v[:2], c, s), r"argument 'value': expected shape \[4, 2, 64\]"),
    (lambda k, v, c, s: (k, v, c, s[:3]), r"argument 'slot_mapping': expected shape \[4\]"),
])
def test_slot_bad_arguments(change, message):
    inputs = change(*make_slot_inputs(4, 2, 64, 2, 8, torch.float32))
    with pytest.raises(TorchXlaExtError, match=message):
        xla_ext_jax.kv_cache_update(*map(to_jax, inputs))


def make_rotary_inputs(num_tokens, num_q_heads, num_kv_heads, head_size, num_pages, page_size,
                       dtype, seed=0):
    return tuple(sample_inputs.rotary_kv_cache_update(
        num_tokens, num_q_heads, num_kv_heads, head_size, num_pages, page_size, dtype,
        seed=seed).values())


def run_rotary(inputs, jit=True):
    fn = jax.jit(xla_ext_jax.rotary_kv_cache_update) if jit else \
        xla_ext_jax.rotary_kv_cache_update
    return [to_torch(x) for x in fn(*map(to_jax, inputs))]


ROTARY_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", ROTARY_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,num_q_heads,num_kv_heads,head_size,num_pages,page_size", [
    (16, 32, 8, 64, 40, 16),  # the 1B model's decode bucket
    (1, 32, 8, 128, 3, 16),
    (37, 4, 2, 128, 9, 8),
    (5, 3, 1, 10, 2, 4),  # half rows of 5 elements: one element a thread on CUDA
    (0, 2, 1, 64, 2, 8),
])
def test_rotary_matches_reference(num_tokens, num_q_heads, num_kv_heads, head_size, num_pages,
                                  page_size, dtype):
    # Bit for bit: the same roundings as torch's eager ops, on any platform.
    inputs = make_rotary_inputs(num_tokens, num_q_heads, num_kv_heads, head_size, num_pages,
                                page_size, dtype)
    q, cache = run_rotary(inputs)
    want_q, want_cache = reference.rotary_kv_cache_update_ref(*inputs)
    assert_same(q, want_q)
    assert_same(cache, want_cache)


def test_rotary_in_place_when_donated():
    qkv, cos, sin, kv_cache, slots = make_rotary_inputs(7, 4, 2, 64, 3, 8, torch.bfloat16)
    cache = jax.numpy.copy(to_jax(kv_cache))
    pointer = cache.unsafe_buffer_pointer()
    step = jax.jit(xla_ext_jax.rotary_kv_cache_update, donate_argnums=(3,))
    q, new_cache = step(to_jax(qkv), to_jax(cos), to_jax(sin), cache, to_jax(slots))
    assert new_cache.unsafe_buffer_pointer() == pointer and cache.is_deleted()
    want_q, want_cache = reference.rotary_kv_cache_update_ref(qkv, cos, sin, kv_cache, slots)
    assert_same(to_torch(q), want_q)
    assert_same(to_torch(new_cache), want_cache)


def test_rotary_slot_out_of_range():
    qkv, cos, sin, kv_cache, _ = make_rotary_inputs(4, 4, 2, 64, 2, 8, torch.float32)
    slots = torch.tensor([0, 16, 3, -1], dtype=torch.int32)  # 16 == num_pages * page_size
    inputs = (qkv, cos, sin, kv_cache, slots)
    message = r"rotary_kv_cache_update: argument 'slot_mapping'.*slot_mapping\[1\] = 16"
    with pytest.raises(TorchXlaExtError, match=message):
        run_rotary(inputs, jit=False)
    if HANDLERS_CHECK_DATA:
        with pytest.raises(Exception, match=message):
            run_rotary(inputs)
    else:  # CUDA skips the token's cache rows; its q rows are still rotated
        q, cache = run_rotary(inputs)
        want_q, want_cache = reference.rotary_kv_cache_update_ref(
            qkv, cos, sin, kv_cache, torch.tensor([0, -1, 3, -1], dtype=torch.int32))
        assert_same(q, want_q)
        assert_same(cache, want_cache)


@pytest.mark.parametrize("change, message", [
    (lambda x, c, s, k, m: (x, c, s, k, m.long()),
     "argument 'slot_mapping': expected dtype int32"),
    (lambda x, c, s, k, m: (x, c.half(), s, k, m),
     r"argument 'cos': expected dtype float32 \(the dtype of 'qkv'\)"),
    (lambda x, c, s, k, m: (x, c, s[:, :32], k, m),
     r"argument 'sin': expected shape \[4, 64\] \(num_tokens, head_size of 'qkv'\)"),
    (lambda x, c, s, k, m: (x[:, :4], c, s, k, m),
     r"argument 'qkv': expected num_q_heads \+ 2 \* num_kv_heads heads in dimension 1 with "
     r"num_q_heads >= 1 \(num_kv_heads = 2, kv_cache's\), got shape \[4, 4, 64\]"),
    (lambda x, c, s, k, m: (x, c, s, k[:, :, :3], m),
     r"argument 'kv_cache': expected \[2 \* num_kv_heads, 64\] in dimensions 2-3"),
    (lambda x, c, s, k, m: (x.double(), c.double(), s.double(), k.double(), m),
     r"argument 'qkv': expected dtype float32, float16 or bfloat16"),
])
def test_rotary_bad_arguments(change, message):
    inputs = change(*make_rotary_inputs(4, 4, 2, 64, 2, 8, torch.float32))
    with pytest.raises(TorchXlaExtError, match=message):
        xla_ext_jax.rotary_kv_cache_update(*map(to_jax, inputs))


def make_slice_inputs(dtype, num_combined_heads=4, head_size=64, num_pages=6, page_size=8,
                      seed=0):
    """Three sequences' new tokens (5, 1 and 11 of them), each split at page boundaries into
    slices as vLLM does, plus padding columns that num_slices leaves unused."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(17, num_combined_heads, head_size, generator=gen).to(dtype)
    kv_cache = torch.randn(num_pages * page_size, num_combined_heads, head_size,
                           generator=gen).to(dtype)
    columns = [(3, 0, 5), (13, 5, 1), (22, 6, 2), (24, 8, 8), (32, 16, 1)]
    slices = torch.full((3, 8), 123, dtype=torch.int32)  # junk past num_slices
    slices[:, :len(columns)] = torch.tensor(columns, dtype=torch.int32).T
    return kv, slices, kv_cache, torch.tensor([len(columns)], dtype=torch.int32)


def run_slices(inputs, page_size=8, jit=True):
    fn = lambda *a: xla_ext_jax.kv_cache_update_slices(*a, page_size, 4)  # noqa: E731
    return to_torch((jax.jit(fn) if jit else fn)(*map(to_jax, inputs)))


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_slices_match_reference(dtype):
    inputs = make_slice_inputs(dtype)
    assert_same(run_slices(inputs), reference.kv_cache_update_slices_ref(*inputs))


def test_slices_bad_values():
    kv, slices, kv_cache, num_slices = make_slice_inputs(torch.float32)
    reaching_out = slices.clone()
    reaching_out[:, 1] = torch.tensor([47, 5, 2])  # rows 47..48 of a 48-row cache
    with pytest.raises(TorchXlaExtError, match=r"argument 'slot_mapping'.*cache_start\[1\] = 47"):
        run_slices((kv, reaching_out, kv_cache, num_slices), jit=False)
    with pytest.raises(TorchXlaExtError,
                       match=r"argument 'num_kv_update_slices'.*num_kv_update_slices\[0\] = 9"):
        run_slices((kv, slices, kv_cache, torch.tensor([9], dtype=torch.int32)), jit=False)
    if HANDLERS_CHECK_DATA:
        with pytest.raises(Exception,
                           match=r"argument 'slot_mapping'.*cache_start\[1\] = 47"):
            run_slices((kv, reaching_out, kv_cache, num_slices))
    else:  # CUDA skips that slice
        want_slices = slices.clone()
        want_slices[2, 1] = 0
        assert_same(run_slices((kv, reaching_out, kv_cache, num_slices)),
                    reference.kv_cache_update_slices_ref(kv, want_slices, kv_cache, num_slices))
    with pytest.raises(TorchXlaExtError, match="argument 'page_size': expected a positive divisor"):
        run_slices((kv, slices, kv_cache, num_slices), page_size=7)


def test_vmap_over_layers_writes_each_layers_cache():
    """One step's K/V of every layer into that layer's cache: vmap over a stack of caches."""
    layers = [make_slot_inputs(6, 2, 64, 3, 8, torch.float32, seed=s) for s in range(3)]
    stacked = [torch.stack([layer[i] for layer in layers]) for i in range(4)]
    got = to_torch(jax.jit(jax.vmap(xla_ext_jax.kv_cache_update))(*map(to_jax, stacked)))
    for i, layer in enumerate(layers):
        assert_same(got[i], reference.kv_cache_update_ref(*layer))


STEPS = 6


@pytest.mark.parametrize("donate", [False, True], ids=["copied", "donated"])
def test_chain_in_one_executable(donate):
    # Several writes in one jitted function, each into the cache the previous one wrote: on
    # the GPU XLA records such a run of command-buffer compatible custom calls into a command
    # buffer (a CUDA graph) and replays it at each execution, here twice with new inputs, the
    # cache copied first (not donated) or written in place. Each execution must give what the
    # writes give one at a time.
    @functools.partial(jax.jit, donate_argnums=(2, 6) if donate else ())
    def chain(keys, values, cache, slots, kvs, slices, slice_cache, num_slices):
        for i in range(STEPS):
            cache = xla_ext_jax.kv_cache_update(keys[i], values[i], cache, slots[i])
            slice_cache = xla_ext_jax.kv_cache_update_slices(kvs[i], slices, slice_cache,
                                                             num_slices, 8, 4)
        return cache, slice_cache

    for seed in (1, 2):
        writes = [make_slot_inputs(10, 2, 128, 4, 16, torch.bfloat16, seed=10 * seed + i)
                  for i in range(STEPS)]
        slice_writes = [make_slice_inputs(torch.bfloat16, seed=10 * seed + i)
                        for i in range(STEPS)]
        cache = want = writes[0][2]
        slices, slice_cache, num_slices = slice_writes[0][1:]
        want_slices = slice_cache
        for (key, value, _, slots), (kv, *_) in zip(writes, slice_writes):
            want = reference.kv_cache_update_ref(key, value, want, slots)
            want_slices = reference.kv_cache_update_slices_ref(kv, slices, want_slices,
                                                               num_slices)
        got, got_slices = chain(*[to_jax(torch.stack([w[j] for w in writes])) for j in (0, 1)],
                                jax.numpy.copy(to_jax(cache)),
                                to_jax(torch.stack([w[3] for w in writes])),
                                to_jax(torch.stack([w[0] for w in slice_writes])),
                                to_jax(slices), jax.numpy.copy(to_jax(slice_cache)),
                                to_jax(num_slices))
        assert_same(to_torch(got), want)
        assert_same(to_torch(got_slices), want_slices)
