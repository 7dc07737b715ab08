"""xla_ext.ragged_paged_attention through JAX's XLA (the target called directly with
jax.ffi.ffi_call) against the float64 reference and torch_xla's own
`_ragged_paged_attention_nonkernel` (where torch_xla is installed: not on the GPU machine)."""

import functools

import jax
import numpy as np
import pytest
import torch

from tests import reference
from tests.kernels.common import (DTYPES, HANDLERS_CHECK_DATA, PLATFORM, TOLERANCES, to_jax,
                                  to_torch)
from torch_xla_ext import jax_ops as xla_ext_jax
from torch_xla_ext import checks, op_catalog

OP = op_catalog.RAGGED_PAGED_ATTENTION
TARGET = OP.target
FP8 = torch.float8_e4m3fn


@functools.lru_cache(maxsize=None)
def torch_xla_nonkernel():
    """torch_xla 2.9.0's pure-torch reference, or None where torch_xla is not installed."""
    try:
        from torch_xla.experimental.custom_kernel import _ragged_paged_attention_nonkernel
    except ImportError:
        return None
    return _ragged_paged_attention_nonkernel


def make_inputs(seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype=None,
                max_num_seqs=None, num_tokens=None, pages_per_seq=None, unused_pages="valid",
                seed=0):
    """(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) for sequences of
    (q_len, kv_len). Each sequence's pages are scattered over the cache in random order; rows
    past sum(q_len) up to num_tokens are padding (random q). Entries past num_seqs are junk as
    vLLM leaves them: cu_q_lens 1 (not monotone), stale kv_lens within the table, page ids out
    of range. Page-table entries past a sequence's kv_len hold ids never to be read: in range
    (unused_pages="valid", which torch_xla's reference needs: it gathers every entry) or out
    of range ("invalid")."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    num_seqs = len(seqs)
    max_num_seqs = max_num_seqs or max(num_seqs, 1)
    needed = [-(-kv_len // page_size) for _, kv_len in seqs]
    pages_per_seq = pages_per_seq or max(needed + [1])
    num_pages = sum(needed) + 3  # three pages nobody uses
    total_q = sum(q_len for q_len, _ in seqs)
    num_tokens = total_q if num_tokens is None else num_tokens

    ids = torch.randperm(num_pages, generator=gen).int()
    if unused_pages == "valid":
        page_indices = torch.randint(0, num_pages, (max_num_seqs, pages_per_seq), generator=gen)
    else:
        page_indices = torch.full((max_num_seqs, pages_per_seq), num_pages + 7)
        page_indices[:, ::2] = -3
    page_indices = page_indices.int()
    page_indices[num_seqs:] = torch.where(torch.arange(pages_per_seq) % 2 == 0, -1,
                                          2 ** 31 - 1).int()
    used = 0
    for i, n in enumerate(needed):
        page_indices[i, :n] = ids[used:used + n]
        used += n

    capacity = pages_per_seq * page_size
    kv_lens = torch.randint(0, capacity + 1, (max_num_seqs,), generator=gen).int()  # stale
    kv_lens[:num_seqs] = torch.tensor([kv_len for _, kv_len in seqs], dtype=torch.int32)
    cu_q_lens = torch.ones(max_num_seqs + 1, dtype=torch.int32)  # vLLM's filler
    cu_q_lens[0] = 0
    cu_q_lens[1:num_seqs + 1] = torch.tensor([q_len for q_len, _ in seqs],
                                             dtype=torch.int32).cumsum(0)

    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    kv_pages = torch.randn(num_pages, page_size, 2 * num_kv_heads, head_dim,
                           generator=gen).to(kv_dtype)
    return [q, kv_pages, kv_lens, page_indices, cu_q_lens,
            torch.tensor([num_seqs], dtype=torch.int32)]


def attributes(head_dim, sm_scale=None, sliding_window=None, soft_cap=None,
               mask_value=reference.DEFAULT_MASK_VALUE, k_scale=None, v_scale=None):
    """torch_xla's keyword arguments (None = off) for a head_dim."""
    return dict(sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale,
                sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value,
                k_scale=k_scale, v_scale=v_scale)


def ffi_attributes(a, max_q_len=0):
    """The handler's attributes: 0 turns sliding_window and soft_cap off, 1 the scales;
    max_q_len (0: no promise) is ours, not torch_xla's."""
    return dict(
        max_q_len=np.int32(max_q_len),
        sm_scale=np.float32(a["sm_scale"]),
        sliding_window=np.int32(a["sliding_window"] or 0),
        soft_cap=np.float32(a["soft_cap"] or 0.0),
        mask_value=np.float32(a["mask_value"]),
        k_scale=np.float32(1.0 if a["k_scale"] is None else a["k_scale"]),
        v_scale=np.float32(1.0 if a["v_scale"] is None else a["v_scale"]),
    )


def workspace_type(args, attributes):
    """The handler's workspace result, sized as the front ends size it."""
    named = dict(zip(OP.operands, args))
    shape, dtype = OP.handler_results(named, attributes, xla_ext_jax.workspace_gpu())[-1]
    return jax.ShapeDtypeStruct(shape, dtype)


def target_call(args, ffi_attrs):
    """The target as a function of JAX arrays shaped as `args`, its attributes bound."""
    out_type = (jax.ShapeDtypeStruct(args[0].shape, args[0].dtype),
                workspace_type(args, ffi_attrs))
    return functools.partial(jax.ffi.ffi_call(TARGET, out_type), **ffi_attrs)


def run(inputs, attrs, out_dtype=None, jit=True, workspace=None, max_q_len=0):
    """The target on `inputs`; `workspace` replaces the workspace result's type."""
    args = [to_jax(t) for t in inputs]
    attributes = ffi_attributes(attrs, max_q_len)
    out_type = (jax.ShapeDtypeStruct(args[0].shape, out_dtype or args[0].dtype),
                workspace or workspace_type(args, attributes))
    call = functools.partial(jax.ffi.ffi_call(TARGET, out_type), **attributes)
    if jit:
        call = jax.jit(call)
    return to_torch(jax.block_until_ready(call(*args))[0])


def assert_close(out, expected, dtype):
    """out (a torch tensor of the run) against a reference, with common.py's tolerances."""
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected.double(), atol=atol, rtol=rtol)


def owned_rows(inputs):
    """Rows owned by a sequence: cu_q_lens[0]..cu_q_lens[num_seqs]."""
    cu_q_lens, num_seqs = inputs[4], int(inputs[5][0])
    return int(cu_q_lens[0]), int(cu_q_lens[num_seqs])


def check(seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype=None,
          attrs=None, torch_xla=True, max_q_len=0, **kwargs):
    inputs = make_inputs(seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype,
                         kv_dtype=kv_dtype, **kwargs)
    attrs = attrs or attributes(head_dim)
    out = run(inputs, attrs, max_q_len=max_q_len)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    assert_close(out, reference.ragged_paged_attention_ref(*inputs, **attrs), dtype)
    first, last = owned_rows(inputs)
    assert torch.all(out[:first] == 0) and torch.all(out[last:] == 0), "padding rows not zero"
    nonkernel = torch_xla_nonkernel()
    if torch_xla and nonkernel is not None and first == 0:
        # In float64 (its bf16 path rounds the scores and weights to bf16); fp8 values are
        # exact in float64, and it dequantises them with k_scale/v_scale itself.
        q, kv_pages, *rest = inputs
        expected = nonkernel(q.double(), kv_pages.double(), *rest, attrs["k_scale"],
                             attrs["v_scale"], sm_scale=attrs["sm_scale"],
                             sliding_window=attrs["sliding_window"], soft_cap=attrs["soft_cap"],
                             mask_value=attrs["mask_value"])
        assert_close(out[:last], expected, dtype)
    return inputs, out


MIXED = [(1, 37), (5, 20), (16, 16), (1, 1), (9, 70)]  # decodes, a chunk, a whole prefill


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim",
                         checks.supported(checks.RAGGED_PAGED_ATTENTION, "head_dim", "q"))
def test_head_dims_and_dtypes(head_dim, dtype):
    check(MIXED, 8, 2, head_dim, [16, 32][head_dim % 3 % 2], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [8, 16, 32, 64, 128])
def test_page_sizes(page_size, dtype):
    # Lengths of one token, one page, not a multiple of the page, and the table's maximum.
    check([(1, 1), (1, page_size), (7, 3 * page_size + 5), (3, 6 * page_size)], 4, 4, 64,
          page_size, dtype, pages_per_seq=6)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [
    (4, 4), (8, 2), (16, 2), (32, 2), (12, 4), (6, 1), (16, 1), (10, 5)], ids=str)
def test_gqa_groups(num_q_heads, num_kv_heads):
    check(MIXED, num_q_heads, num_kv_heads, 128, 16, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pure_decode(dtype):
    check([(1, n) for n in (1, 2, 15, 16, 17, 100, 700, 33)], 8, 1, 128, 16, dtype)


# Decode steps only, as the caller promises with max_q_len = 1 (the CUDA handler's decode kernel
# alone, merging split sequences itself): the 1B serving step's shape at B=1 (idle sequence
# slots and padding rows, as the engine pads them), skewed lengths, and one sequence long enough
# to split into more pieces than one merge round trip reads.
DECODE_ONLY = {
    "b1_of_64_slots": dict(seqs=[(1, 2048)], max_num_seqs=64, num_tokens=16),
    "skewed": dict(seqs=[(1, n) for n in (2048, 1, 17, 300, 4096, 5, 700, 16, 33)],
                   max_num_seqs=16, num_tokens=16),
    "b64": dict(seqs=[(1, 1000 + 37 * i) for i in range(64)], max_num_seqs=64),
    "one_long": dict(seqs=[(1, 40000), (1, 3)], max_num_seqs=4, num_tokens=8),
}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", DECODE_ONLY)
def test_decode_only(mix, dtype, head_dim):
    kwargs = DECODE_ONLY[mix]
    seqs = kwargs["seqs"]
    inputs, out = check(seqs, 32, 8, head_dim, 16, dtype, max_q_len=1, torch_xla=False,
                        **{k: v for k, v in kwargs.items() if k != "seqs"})
    # The same rows as without the promise (the handler's other kernels), to rounding.
    assert_close(out, run(inputs, attributes(head_dim)), dtype)


@pytest.mark.parametrize("attrs", [dict(sliding_window=100), dict(soft_cap=20.0),
                                   dict(sliding_window=7, soft_cap=5.0)], ids=str)
def test_decode_only_window_and_soft_cap(attrs):
    check([(1, 90), (1, 1), (1, 3000), (1, 64)], 16, 4, 128, 16, torch.bfloat16, max_q_len=1,
          attrs=attributes(128, **attrs), max_num_seqs=8, num_tokens=8)


def test_decode_only_calls_in_a_row():
    # The fused merge's counters are set back at every call: calls one after another in one
    # executable (on the GPU, one command buffer) each give the right rows.
    attrs = attributes(64)
    inputs = make_inputs([(1, 3000), (1, 50), (1, 2048)], 32, 8, 64, 16, torch.bfloat16,
                         max_num_seqs=8, num_tokens=8)
    args = [to_jax(t) for t in inputs]
    call = target_call(args, ffi_attributes(attrs, max_q_len=1))

    @jax.jit
    def chain(q, *rest):
        outs = []
        for _ in range(4):
            q = call(q, *rest)[0]
            outs.append(q)
        return outs

    expected = inputs
    for out in jax.block_until_ready(chain(*args)):
        expected = [run(expected, attrs, max_q_len=1), *expected[1:]]
        assert torch.equal(to_torch(out), expected[0])


def test_max_q_len_broken_promise():
    # Sequence 1 has 3 rows under max_q_len = 1: the Host handler (and the CUDA one with the
    # debug checks) refuse it; the CUDA handler's decode kernel alone gives NaN in its rows and
    # the right values in the others.
    inputs = make_inputs([(1, 40), (3, 30), (1, 500)], 8, 2, 64, 16, torch.bfloat16,
                         max_num_seqs=4, num_tokens=8)
    attrs = attributes(64)
    if HANDLERS_CHECK_DATA:
        with pytest.raises(Exception, match="argument 'max_q_len'.*1 with sequence 1's "
                                            "q_len = 3"):
            run(inputs, attrs, max_q_len=1)
        return
    out = run(inputs, attrs, max_q_len=1)
    assert torch.all(torch.isnan(out[1:4]))
    expected = reference.ragged_paged_attention_ref(*inputs, **attrs)
    assert_close(out[[0, 4]], expected[[0, 4]], torch.bfloat16)
    assert torch.all(out[5:] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pure_prefill(dtype):
    # q_len = kv_len: a whole prompt at once.
    check([(37, 37), (64, 64), (1, 1), (5, 5)], 4, 2, 64, 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_beside_decodes(dtype):
    check([(1, 50), (30, 130), (1, 7), (17, 17), (1, 300), (64, 200)], 8, 2, 128, 16, dtype)


@pytest.mark.parametrize("window", [1, 4, 33, 100, 5000])  # shorter than, about and > kv_len
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sliding_window(window, dtype):
    check([(1, 90), (20, 150), (3, 3), (40, 40), (1, 1)], 8, 4, 64, 16, dtype,
          attrs=attributes(64, sliding_window=window))


@pytest.mark.parametrize("soft_cap,window", [(5.0, None), (30.0, None), (2.0, 24)], ids=str)
def test_soft_cap(soft_cap, window):
    check(MIXED, 8, 2, 128, 16, torch.float32,
          attrs=attributes(128, sm_scale=0.5, soft_cap=soft_cap, sliding_window=window))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("k_scale,v_scale", [(None, None), (0.5, 2.0), (0.03, 0.7)], ids=str)
def test_fp8_kv_pages(k_scale, v_scale, head_dim, dtype):
    check(MIXED, 8, 2, head_dim, 16, dtype, kv_dtype=FP8,
          attrs=attributes(head_dim, k_scale=k_scale, v_scale=v_scale))


def test_scales_with_kv_of_the_query_dtype():
    check(MIXED, 4, 4, 64, 16, torch.float32, attrs=attributes(64, k_scale=0.25, v_scale=3.0))


@pytest.mark.parametrize("mask_value", [0.0, -5.0, -1e4, -float("inf")], ids=str)
def test_mask_value(mask_value):
    # A mask_value above -1e30 gives masked positions weight (the CUDA kernel then visits
    # every position below kv_len); -inf none.
    check([(20, 50), (1, 9), (6, 6)], 4, 2, 64, 16, torch.float32,
          attrs=attributes(64, mask_value=mask_value, sliding_window=8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padding_rows_and_junk_past_num_seqs(dtype):
    # 4 of 9 sequences in use; 40 rows of padding after them; cu_q_lens past num_seqs is 1,
    # kv_lens stale, page rows out of range.
    inputs, out = check([(3, 40), (1, 17), (12, 12), (1, 64)], 8, 2, 64, 16, dtype,
                        max_num_seqs=9, num_tokens=57)
    assert torch.all(out[17:] == 0)
    assert inputs[4][5:].eq(1).all() and not inputs[3][5:].ge(0).all()


def test_unused_page_entries_out_of_range():
    # Entries of a sequence's page row past its kv_len are never read (torch_xla's reference
    # gathers them, so it is left out here).
    check(MIXED, 8, 2, 64, 16, torch.float32, unused_pages="invalid", pages_per_seq=12,
          torch_xla=False)


def test_no_sequences_gives_zeros():
    inputs = make_inputs([], 4, 2, 64, 16, torch.bfloat16, max_num_seqs=4, num_tokens=8)
    out = run(inputs, attributes(64))
    assert out.shape == (8, 4, 64) and torch.all(out == 0)


def test_no_tokens():
    inputs = make_inputs([], 4, 2, 64, 16, torch.float16, max_num_seqs=2, num_tokens=0)
    assert run(inputs, attributes(64)).shape == (0, 4, 64)


# Few query rows over a large page table: on CUDA their kv ranges are split into partitions
# and combined. Lengths below, at and past partition edges, a prefill chunk too.
LONG_ROWS = [(1, 3000), (1, 1), (1, 2049), (30, 1500), (1, 512)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_rows(dtype):
    check(LONG_ROWS, 4, 2, 128, 16, dtype, pages_per_seq=200)


def test_long_rows_with_window_and_soft_cap():
    check([(1, 3000), (20, 2500)], 8, 2, 64, 32, torch.bfloat16, pages_per_seq=100,
          attrs=attributes(64, sliding_window=700, soft_cap=20.0))


# Batches whose work is far from even: on CUDA the tensor-core kernel splits a long decode and
# a long prefill chunk's tiles over many CTAs, and a CTA holds many short sequences' tiles.
SKEWED = {
    "one long decode among short": [(1, 5000)] + [(1, 40)] * 30,
    "long prefill chunk beside decodes": [(300, 1200), (1, 1), (1, 17), (1, 300)],
    "empty sequences": [(0, 0), (1, 65), (0, 30), (129, 129), (0, 0)],
    "all empty but one": [(0, 0)] * 5 + [(40, 900)],
    "lengths about a stage": [(1, 63), (1, 64), (1, 65), (64, 64), (65, 65), (63, 129)],
}


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(16, 1), (8, 8), (8, 2)], ids=str)
@pytest.mark.parametrize("mix", SKEWED, ids=str)
def test_skewed_batches(mix, num_q_heads, num_kv_heads):
    check(SKEWED[mix], num_q_heads, num_kv_heads, 128, 16, torch.bfloat16)


@pytest.mark.parametrize("window", [50, 700])
def test_skewed_batches_with_window(window):
    check(SKEWED["long prefill chunk beside decodes"], 8, 2, 64, 32, torch.float16,
          attrs=attributes(64, sliding_window=window, soft_cap=30.0))


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed):
    gen = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    num_kv_heads = pick([1, 2, 3, 4])
    num_q_heads = num_kv_heads * pick([1, 2, 3, 4, 8, 16])
    head_dim = pick([64, 80, 96, 112, 128, 192, 256])
    page_size = pick([8, 16, 32, 64, 128])
    dtype = pick(DTYPES)
    kv_dtype = pick([dtype, FP8]) if dtype != torch.float32 else dtype
    seqs = []
    for _ in range(int(torch.randint(1, 7, (1,), generator=gen))):
        kv_len = int(torch.randint(1, 400, (1,), generator=gen))
        q_len = pick([1, 1, kv_len, max(1, kv_len // 3)])
        seqs.append((q_len, kv_len))
    attrs = attributes(head_dim, sliding_window=pick([None, None, 1, 17, 300]),
                       soft_cap=pick([None, 10.0]),
                       k_scale=pick([None, 0.5]) if kv_dtype == FP8 else None,
                       v_scale=pick([None, 1.5]) if kv_dtype == FP8 else None)
    check(seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, kv_dtype=kv_dtype,
          attrs=attrs, max_num_seqs=len(seqs) + pick([0, 3]),
          num_tokens=sum(q for q, _ in seqs) + pick([0, 5]), seed=seed)


def test_torch_xla_reference_runs_on_cpu():
    # The comparisons above use torch_xla's reference wherever it can be imported.
    if PLATFORM != "cpu":
        pytest.skip("torch_xla is not installed on the GPU machine")
    assert torch_xla_nonkernel() is not None


# --- bad inputs ---------------------------------------------------------------------------

def _inputs(dtype=torch.float32):
    return make_inputs([(3, 10), (1, 20)], 4, 2, 64, 8, dtype, max_num_seqs=3, num_tokens=6)


def _with(inputs, index, tensor):
    inputs = list(inputs)
    inputs[index] = tensor
    return inputs


BAD_SHAPES = [
    ("q", lambda x: _with(x, 0, x[0].to(torch.int32))),
    ("q", lambda x: _with(x, 0, x[0][0])),
    ("q", lambda x: _with(x, 0, x[0][..., :48])),  # unsupported head_dim
    ("kv_pages", lambda x: _with(x, 1, x[1].half())),  # not q's dtype
    ("kv_pages", lambda x: _with(x, 1, x[1].to(FP8))),  # fp8 with an f32 q
    ("kv_pages", lambda x: _with(x, 1, x[1][0])),
    ("kv_pages", lambda x: _with(x, 1, x[1][..., :32])),  # head_dim != q's
    ("kv_pages", lambda x: _with(x, 1, x[1][:, :4])),  # page_size 4
    ("kv_pages", lambda x: _with(x, 1, torch.cat([x[1], x[1][:, :4]], 1))),  # page_size 12
    ("kv_pages", lambda x: _with(x, 1, x[1][:, :, :3])),  # odd combined heads
    ("kv_pages", lambda x: _with(_with(x, 0, x[0].repeat(1, 9, 1)), 1, x[1][:, :, :2])),  # 36/1
    ("kv_lens", lambda x: _with(x, 2, x[2].long())),
    ("kv_lens", lambda x: _with(x, 2, x[2][:2])),
    ("page_indices", lambda x: _with(x, 3, x[3].long())),
    ("page_indices", lambda x: _with(x, 3, x[3][0])),
    ("cu_q_lens", lambda x: _with(x, 4, x[4][:3])),
    ("cu_q_lens", lambda x: _with(x, 4, x[4].float())),
    ("num_seqs", lambda x: _with(x, 5, torch.tensor([2, 0], dtype=torch.int32))),
    ("num_seqs", lambda x: _with(x, 5, x[5].long())),
]


@pytest.mark.parametrize("arg,corrupt", BAD_SHAPES, ids=[a for a, _ in BAD_SHAPES])
def test_rejects_bad_arguments(arg, corrupt):
    with pytest.raises(Exception, match=f"argument '{arg}'"):
        run(corrupt(_inputs()), attributes(64), jit=False)


def test_group_of_four_with_one_kv_head_is_accepted():
    inputs = _inputs()
    inputs[1] = inputs[1][:, :, :2].contiguous()
    assert_close(run(inputs, attributes(64)),
                 reference.ragged_paged_attention_ref(*inputs, **attributes(64)),
                 torch.float32)


def test_rejects_other_out_dtype():
    with pytest.raises(Exception, match="argument 'out'"):
        run(_inputs(), attributes(64), out_dtype=np.float16, jit=False)


def test_rejects_workspace_of_other_dtype():
    with pytest.raises(Exception, match="argument 'workspace': expected dtype u8"):
        run(_inputs(), attributes(64), jit=False,
            workspace=jax.ShapeDtypeStruct((256,), np.float32))


@pytest.mark.skipif(PLATFORM == "cpu", reason="the Host handler takes no scratch from the "
                    "workspace: any size is enough")
def test_workspace_size_is_what_the_handler_takes():
    # The size the front ends ask the library for is the handler's own planning: one byte
    # less is refused before anything is launched. Few rows over long sequences: every
    # kernel takes scratch for them (the CUDA-core one splits their kv ranges).
    inputs = make_inputs(LONG_ROWS, 4, 2, 128, 16, torch.bfloat16, pages_per_seq=200)
    attrs = attributes(128)
    needed = workspace_type([to_jax(t) for t in inputs], ffi_attributes(attrs)).shape[0]
    assert needed > 0
    with pytest.raises(Exception, match=f"argument 'workspace': expected at least {needed} "
                                        f"bytes, got {needed - 1} bytes"):
        run(inputs, attrs, jit=False, workspace=jax.ShapeDtypeStruct((needed - 1,), np.uint8))
    assert_close(run(inputs, attrs, workspace=jax.ShapeDtypeStruct((needed,), np.uint8)),
                 reference.ragged_paged_attention_ref(*inputs, **attrs), torch.bfloat16)


def test_chain_in_one_executable():
    # Several calls in one jitted function, each call's output the next one's q: on the GPU
    # XLA records such a run of command-buffer compatible custom calls into a command buffer
    # (a CUDA graph) and replays it at each execution, here twice with different inputs.
    # Each execution must give what the calls give one at a time. (The optimised HLO does not
    # show the command buffers, which XLA forms from the thunks; that the calls are recorded
    # shows in their time: docs/performance.md, "Workspace instead of XLA's scratch allocator".)
    calls = 6
    attrs = attributes(128)
    first = make_inputs(MIXED, 8, 2, 128, 16, torch.bfloat16, seed=1)
    second = make_inputs(MIXED, 8, 2, 128, 16, torch.bfloat16, seed=2)
    call = target_call([to_jax(t) for t in first], ffi_attributes(attrs))

    @jax.jit
    def chain(q, *rest):
        for _ in range(calls):
            q = call(q, *rest)[0]
        return q

    for inputs in (first, second):
        expected = inputs
        for _ in range(calls):
            expected = [run(expected, attrs), *expected[1:]]
        out = to_torch(jax.block_until_ready(chain(*[to_jax(t) for t in inputs])))
        assert torch.equal(out, expected[0])


@pytest.mark.parametrize("name,value", [
    ("sliding_window", -1), ("soft_cap", -1.0), ("soft_cap", float("inf")),
    ("sm_scale", float("nan")), ("k_scale", float("inf")), ("v_scale", float("nan")),
    ("mask_value", float("nan"))], ids=str)
def test_rejects_bad_attributes(name, value):
    with pytest.raises(Exception, match=f"argument '{name}'"):
        run(_inputs(), {**attributes(64), name: value}, jit=False)


def test_rejects_negative_max_q_len():
    with pytest.raises(Exception, match="argument 'max_q_len': expected a bound >= 1 on every "
                                        "q_len, or 0 for none, got -1"):
        run(_inputs(), attributes(64), jit=False, max_q_len=-1)


def _set(index, position, value):
    def corrupt(inputs):
        inputs = [t.clone() for t in inputs]
        inputs[index][position] = value
        return inputs
    return corrupt


BAD_DATA = [  # sequences 0 and 1: q_len 3 and 1, kv_len 10 and 20; pages of 8, 3 per row
    ("num_seqs", "num_seqs\\[0\\] = 4", _set(5, 0, 4)),
    ("num_seqs", "num_seqs\\[0\\] = -1", _set(5, 0, -1)),
    ("cu_q_lens", "cu_q_lens\\[0\\] = -1", _set(4, 0, -1)),
    ("cu_q_lens", "cu_q_lens\\[2\\] = 2 < cu_q_lens\\[1\\] = 3", _set(4, 2, 2)),
    ("cu_q_lens", "cu_q_lens\\[2\\] = 7", _set(4, 2, 7)),  # beyond the 6 rows
    ("kv_lens", "kv_lens\\[1\\] = 0 with q_len = 1", _set(2, 1, 0)),
    ("kv_lens", "kv_lens\\[0\\] = 25", _set(2, 0, 25)),  # beyond 3 pages of 8
    ("page_indices", "page_indices\\[1\\]\\[2\\] = -1", _set(3, (1, 2), -1)),
    ("page_indices", "page_indices\\[0\\]\\[1\\] = 8", _set(3, (0, 1), 8)),  # 8 pages
]


@pytest.mark.parametrize("arg,detail,corrupt", BAD_DATA, ids=[a for a, _, _ in BAD_DATA])
def test_host_rejects_bad_data(arg, detail, corrupt):
    if not HANDLERS_CHECK_DATA:
        pytest.skip("the CUDA handler reports data errors only with XLA_EXT_DEBUG_CHECKS set "
                    "(see test_cuda_bad_data)")
    with pytest.raises(Exception, match=f"argument '{arg}'.*{detail}"):
        run(corrupt(_inputs()), attributes(64))


def test_host_ignores_entries_past_num_seqs():
    inputs = _inputs()  # sequence 2 is junk: kv_len stale, cu_q_lens[3] = 1, pages out of range
    inputs[2][2] = 10 ** 6
    out = run(inputs, attributes(64))
    assert_close(out, reference.ragged_paged_attention_ref(*inputs, **attributes(64)),
                 torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # both CUDA kernels
def test_cuda_bad_data(dtype):
    """What ragged_paged_attention.h says the CUDA handler does with bad data."""
    if HANDLERS_CHECK_DATA:
        pytest.skip("the handler rejects bad data (test_host_rejects_bad_data)")
    attrs = attributes(64)
    ref = functools.partial(reference.ragged_paged_attention_ref, **attrs)
    inputs = _inputs(dtype)

    # num_seqs beyond max_num_seqs: clamped (sequence 2 owns rows 4..5 once cu_q_lens says so).
    bad = [t.clone() for t in inputs]
    bad[5][0], bad[4][3], bad[2][2] = 7, 6, 2
    good = [t.clone() for t in bad]
    good[5][0] = 3
    good[3][2] = good[3][0]
    bad[3][2] = good[3][2]
    assert_close(run(bad, attrs), ref(*good), dtype)

    # kv_len beyond the page table: clamped to its 24 tokens.
    bad = [t.clone() for t in inputs]
    bad[2][1] = 1000
    good = [t.clone() for t in bad]
    good[2][1] = 24
    assert_close(run(bad, attrs), ref(*good), dtype)

    # q_len > kv_len: the sequence's rows are zeros; the others are right.
    bad = [t.clone() for t in inputs]
    bad[2][0] = 2
    out = run(bad, attrs)
    assert torch.all(out[:3] == 0)
    assert_close(out[3:], ref(*inputs)[3:], dtype)

    # Every page of sequence 1 out of range: no position left, zeros.
    bad = [t.clone() for t in inputs]
    bad[3][1, :] = 10 ** 6
    out = run(bad, attrs)
    assert torch.all(out[3] == 0)
    assert_close(out[:3], ref(*inputs)[:3], dtype)

    # Non-monotone cu_q_lens: no fault, finite values, rows past the last entry zero.
    bad = [t.clone() for t in inputs]
    bad[4][1] = 5
    out = run(bad, attrs)
    assert torch.all(torch.isfinite(out)) and torch.all(out[4:] == 0)
