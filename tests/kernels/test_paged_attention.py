"""xla_ext.paged_attention through JAX's XLA against the float64 reference."""

import functools

import jax
import numpy as np
import pytest
import torch

from tests import reference
from tests.kernels.common import (DTYPES, HANDLERS_CHECK_DATA, PLATFORM, assert_close, replace,
                                  to_jax, to_torch)
from torch_xla_ext import jax_ops as xla_ext_jax
from torch_xla_ext import checks, op_catalog, sample_inputs
from torch_xla_ext.errors import TorchXlaExtError


def make_inputs(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                max_blocks_per_seq=None, seed=0):
    return tuple(sample_inputs.paged_attention(seq_lens, num_heads, num_kv_heads, head_size,
                                               block_size, dtype, max_blocks_per_seq,
                                               seed).values())


def run(inputs, scale, softcap=0.0, alibi_slopes=None, jit=True):
    fn = functools.partial(xla_ext_jax.paged_attention, scale=scale, softcap=softcap)
    if jit:
        fn = jax.jit(fn)
    alibi = None if alibi_slopes is None else to_jax(alibi_slopes)
    return fn(*map(to_jax, inputs), alibi_slopes=alibi)


def check(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, softcap=0.0,
          alibi=False, **kwargs):
    inputs = make_inputs(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                         **kwargs)
    scale = head_size ** -0.5
    slopes = reference.alibi_slopes(num_heads) if alibi else None
    out = run(inputs, scale, softcap, slopes)
    assert out.shape == inputs[0].shape and out.dtype == to_jax(inputs[0]).dtype
    assert_close(out, reference.paged_attention_ref(*inputs, scale, softcap, slopes), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size",
                         checks.supported(checks.PAGED_ATTENTION, "head_size", "query"))
def test_head_sizes_and_dtypes(head_size, dtype):
    block_size = [8, 16, 32][head_size % 3]
    check([1, 37, 16, 100], 4, 2, head_size, block_size, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size, dtype):
    # Lengths of one token, one block, not a multiple of the block, and the table's maximum.
    check([1, block_size, 3 * block_size + 5, 8 * block_size], 4, 4, 64, block_size, dtype,
          max_blocks_per_seq=8)


@pytest.mark.parametrize("num_heads,num_kv_heads", [
    (8, 8), (8, 4), (8, 2), (8, 1), (16, 1), (12, 4), (32, 8)], ids=str)
def test_gqa_ratios(num_heads, num_kv_heads):
    check([5, 70], num_heads, num_kv_heads, 128, 16, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_sequences_split_into_partitions(dtype):
    # On CUDA long sequences are split into partitions (512 tokens on the CUDA-core kernel; on
    # the tensor-core kernel 64 here, enough for one CTA per SM): lengths below, at and past
    # partition edges, and the block table's maximum (1312 tokens).
    check([1312, 511, 512, 513, 1025, 3], 8, 2, 128, 16, dtype, max_blocks_per_seq=82)


def test_one_very_long_sequence():
    # About one partition per SM of an H100 on the tensor-core kernel (131 of 528 tokens) and
    # 135 of 512 tokens on the CUDA-core kernel: more partitions than the combine kernel's
    # warps of a row load in one pass.
    check([69000], 8, 8, 128, 16, torch.bfloat16)


# Batches whose lengths differ widely, as a serving system's do: lengths 0, 1, block_size +- 1,
# a block edge, one long beside short ones, all empty but one, a long tail, and more sequences
# than an H100 has SMs. On CUDA they exercise how the kernels split a batch between CTAs.
SKEWED_BATCHES = {
    "edges": [0, 1, 15, 16, 17, 0, 31, 33, 0],
    "one_long_among_short": [9000] + [1, 17, 256, 3, 0, 40, 255] * 3,
    "all_empty_but_one": [0] * 7 + [2000] + [0] * 8,
    "all_empty_but_one_short": [0] * 5 + [3],
    "many_short": [(7 * i) % 50 for i in range(300)],
    "long_tail": [int(4000 * 0.6 ** i) + i % 3 for i in range(24)],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("batch", SKEWED_BATCHES, ids=str)
def test_skewed_batches(batch, dtype):
    check(SKEWED_BATCHES[batch], 8, 2, 128, 16, dtype)


def test_skewed_batch_with_a_large_gqa_group():
    # 16 query heads per kv head: the MMA tiles' upper rows, and pieces split between CTAs.
    check([5000, 1, 0, 300, 17], 32, 2, 64, 16, torch.float16)


@pytest.mark.parametrize("softcap,alibi", [(30.0, False), (0.0, True), (5.0, True)],
                         ids=["softcap", "alibi", "softcap+alibi"])
def test_softcap_and_alibi(softcap, alibi):
    check([1, 40, 700], 8, 2, 64, 16, torch.float32, softcap=softcap, alibi=alibi)


@pytest.mark.parametrize("block_size", [8, 16])
def test_nan_in_other_tokens_does_not_leak(block_size):
    # Sequence 0's K and V are NaN, and so is every cache slot past a sequence's length: the
    # others' outputs must not see them. On the H100's tensor-core kernel sequence 0's three
    # 16-token stages and sequence 1's one token share a CTA with a 3-stage ring, so sequence
    # 1's stage reuses the buffer of sequence 0's first: its 15 skipped tokens' rows hold NaN.
    seq_lens = [48, 1, 17, 33]
    inputs = make_inputs(seq_lens, 8, 2, 128, block_size, torch.bfloat16)
    query, key_cache, value_cache, block_tables, lens = inputs
    used = torch.zeros(key_cache.shape[:2], dtype=torch.bool)
    for seq, n in enumerate(seq_lens):
        for t in range(n):
            used[block_tables[seq, t // block_size], t % block_size] = seq != 0
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    key_cache[~used] = float("nan")
    value_cache[~used] = float("nan")
    inputs = (query, key_cache, value_cache, block_tables, lens)
    out = run(inputs, 128 ** -0.5)
    assert torch.isnan(to_torch(out)[0]).all()
    assert_close(out[1:], reference.paged_attention_ref(*inputs, 128 ** -0.5)[1:],
                 torch.bfloat16)


def test_zero_length_sequences_give_zeros():
    inputs = make_inputs([0, 9, 0], 4, 2, 64, 8, torch.float16)
    out = to_torch(run(inputs, 0.125))
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0)
    assert_close(out[1:2], reference.paged_attention_ref(*inputs, 0.125)[1:2], torch.float16)


def test_empty_batch():
    inputs = make_inputs([], 4, 2, 64, 8, torch.bfloat16)
    out = run(inputs, 0.125)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    num_kv_heads = pick([1, 2, 3, 4])
    num_heads = num_kv_heads * pick([1, 2, 4, 5, 8])
    block_size = pick([8, 16, 32])
    num_seqs = int(torch.randint(1, 6, (1,), generator=gen))
    seq_lens = torch.randint(0, 700, (num_seqs,), generator=gen).tolist()
    check(seq_lens, num_heads, num_kv_heads, pick([64, 80, 96, 112, 128, 256]), block_size,
          pick(DTYPES), softcap=pick([0.0, 20.0]), alibi=pick([False, True]), seed=seed)


BAD_INPUTS = [
    ("query", lambda x: replace(x, 0, x[0].to(torch.int32))),
    ("query", lambda x: replace(x, 0, x[0][0])),
    ("query", lambda x: replace(x, 0, x[0][..., :48])),  # unsupported head_size
    ("key_cache", lambda x: replace(x, 1, x[1].half())),
    ("key_cache", lambda x: replace(x, 1, x[1][0])),
    ("key_cache", lambda x: replace(x, 1, x[1][:, :4])),  # unsupported block_size
    ("key_cache", lambda x: replace(x, 1, x[1][:, :, :, :32])),  # head_size != query's
    ("key_cache", lambda x: replace(x, 1, x[1].repeat(1, 1, 2, 1)[:, :, :3])),  # 4 % 3 != 0
    ("value_cache", lambda x: replace(x, 2, x[2][:1])),
    ("value_cache", lambda x: replace(x, 2, x[2].double())),
    ("block_tables", lambda x: replace(x, 3, x[3].long())),
    ("block_tables", lambda x: replace(x, 3, x[3][:1])),
    ("seq_lens", lambda x: replace(x, 4, x[4].long())),
    ("seq_lens", lambda x: replace(x, 4, x[4][:1])),
]


def _bad_inputs():
    return list(make_inputs([5, 20], 4, 2, 64, 8, torch.float32))


@pytest.mark.parametrize("arg,corrupt", BAD_INPUTS, ids=[a for a, _ in BAD_INPUTS])
def test_rejects_bad_arguments(arg, corrupt):
    with pytest.raises(TorchXlaExtError, match=f"argument '{arg}'"):
        run(corrupt(_bad_inputs()), 0.125, jit=False)


@pytest.mark.parametrize("slopes", [torch.ones(3), torch.ones(4, dtype=torch.float16)], ids=str)
def test_rejects_bad_alibi_slopes(slopes):
    with pytest.raises(TorchXlaExtError, match="argument 'alibi_slopes'"):
        run(_bad_inputs(), 0.125, alibi_slopes=slopes, jit=False)


OP = op_catalog.PAGED_ATTENTION
ATTRIBUTES = dict(scale=np.float32(0.125), softcap=np.float32(0.0))


def _raw_call(inputs, alibi_slopes, workspace=None):
    """The target called directly, past the Python checks, so the handler's checks run; with
    the workspace result the front ends give it, or `workspace` (its type) instead."""
    args = [to_jax(t) for t in inputs] + [to_jax(alibi_slopes)]
    if workspace is None:
        shape, dtype = OP.handler_results(dict(zip(OP.operands, args)), ATTRIBUTES,
                                          xla_ext_jax.workspace_gpu())[-1]
        workspace = jax.ShapeDtypeStruct(shape, dtype)
    out_type = (jax.ShapeDtypeStruct(args[0].shape, args[0].dtype), workspace)
    call = jax.ffi.ffi_call(OP.target, out_type)
    fn = jax.jit(lambda *a: call(*a, **ATTRIBUTES)[0])
    return jax.block_until_ready(fn(*args))


@pytest.mark.parametrize("arg,corrupt", BAD_INPUTS + [
    ("alibi_slopes", lambda x: x + [torch.ones(3)]),
    ("alibi_slopes", lambda x: x + [torch.ones(4, dtype=torch.float16)]),
], ids=[a for a, _ in BAD_INPUTS] + ["alibi_slopes"] * 2)
def test_handler_rejects_bad_arguments(arg, corrupt):
    inputs = corrupt(_bad_inputs())
    slopes = inputs.pop() if len(inputs) == 6 else torch.zeros(0)
    with pytest.raises(Exception, match=f"argument '{arg}'"):
        _raw_call(inputs, slopes)


def test_handler_rejects_workspace_of_other_dtype():
    with pytest.raises(Exception, match="argument 'workspace': expected dtype u8"):
        _raw_call(list(_bad_inputs()), torch.zeros(0),
                  workspace=jax.ShapeDtypeStruct((256,), np.float32))


@pytest.mark.skipif(PLATFORM == "cpu", reason="the Host handler takes no scratch from the "
                    "workspace: any size is enough")
def test_workspace_size_is_what_the_handler_takes():
    # The size the front ends ask the library for is the handler's own planning: one byte
    # less is refused before anything is launched. A long sequence: both kernels split it.
    inputs = make_inputs([1312, 3], 8, 2, 128, 16, torch.bfloat16, max_blocks_per_seq=82)
    args = [to_jax(t) for t in inputs] + [to_jax(torch.zeros(0))]
    needed = OP.handler_results(dict(zip(OP.operands, args)), ATTRIBUTES,
                                xla_ext_jax.workspace_gpu())[-1][0][0]
    assert needed > 0
    with pytest.raises(Exception, match=f"argument 'workspace': expected at least {needed} "
                                        f"bytes, got {needed - 1} bytes"):
        _raw_call(inputs, torch.zeros(0), jax.ShapeDtypeStruct((needed - 1,), np.uint8))
    assert_close(_raw_call(inputs, torch.zeros(0), jax.ShapeDtypeStruct((needed,), np.uint8)),
                 reference.paged_attention_ref(*inputs, 0.125, 0.0, None), torch.bfloat16)


def test_chain_in_one_executable():
    # Several calls in one jitted function, each call's output the next one's query: on the GPU
    # XLA records such a run of command-buffer compatible custom calls into a command buffer
    # (a CUDA graph) and replays it at each execution, here twice with different inputs. Each
    # execution must give what the calls give one at a time.
    calls = 6

    @jax.jit
    def chain(query, *rest):
        for _ in range(calls):
            query = xla_ext_jax.paged_attention(query, *rest, scale=0.125)
        return query

    for seed in (1, 2):
        inputs = make_inputs([1312, 3, 0, 77], 8, 2, 128, 16, torch.bfloat16,
                             max_blocks_per_seq=82, seed=seed)
        expected = to_jax(inputs[0])
        for _ in range(calls):
            expected = run([to_torch(expected), *inputs[1:]], 0.125)
        got = chain(*map(to_jax, inputs))
        assert np.array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize("case", ["negative", "beyond_table"])
def test_bad_seq_lens(case):
    inputs = _bad_inputs()  # block tables of 3 blocks of 8: at most 24 tokens
    inputs[4][1] = -1 if case == "negative" else 25
    with pytest.raises(TorchXlaExtError, match="argument 'seq_lens'"):
        run(inputs, 0.125, jit=False)
    if HANDLERS_CHECK_DATA:
        message = "argument 'seq_lens'" + (".*beyond the block table" if case != "negative" else "")
        with pytest.raises(Exception, match=message):
            jax.block_until_ready(run(inputs, 0.125))
    else:  # CUDA clamps to [0, capacity] (kernels/paged_attention/paged_attention.h)
        out = to_torch(run(inputs, 0.125))
        inputs[4][1] = 0 if case == "negative" else 24
        assert_close(out, reference.paged_attention_ref(*inputs, 0.125), torch.float32)


@pytest.mark.parametrize("block_id", [-1, 1000])
def test_bad_block_ids(block_id):
    inputs = _bad_inputs()
    inputs[3][1, :] = block_id  # every block of sequence 1
    with pytest.raises(TorchXlaExtError, match="argument 'block_tables'"):
        run(inputs, 0.125, jit=False)
    if HANDLERS_CHECK_DATA:
        with pytest.raises(Exception, match="argument 'block_tables'"):
            jax.block_until_ready(run(inputs, 0.125))
    else:  # CUDA skips tokens in invalid blocks: no token left gives zeros
        out = to_torch(run(inputs, 0.125))
        assert torch.all(out[1] == 0)
        first_seq = [inputs[0][:1], inputs[1], inputs[2], inputs[3][:1], inputs[4][:1]]
        assert_close(out[:1], reference.paged_attention_ref(*first_seq, 0.125), torch.float32)


def test_vmap_matches_a_loop_of_calls():
    batches = [make_inputs([9, 40], 8, 2, 64, 16, torch.float32, seed=s) for s in range(3)]
    stacked = [torch.stack([inputs[i] for inputs in batches]) for i in range(5)]
    fn = jax.vmap(functools.partial(xla_ext_jax.paged_attention, scale=0.125))
    got = jax.jit(fn)(*map(to_jax, stacked))
    for i, inputs in enumerate(batches):
        assert_close(got[i], reference.paged_attention_ref(*inputs, 0.125), torch.float32)
