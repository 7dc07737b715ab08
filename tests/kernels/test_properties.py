"""Property-based tests (hypothesis) of every op in op_catalog.OPS on XLA CPU.

Valid calls: random shapes, dtypes and ragged batches (sequence lengths 0, 1, block_size - 1,
block_size, block_size + 1, one long among short ones) through JAX's XLA (eagerly, under
jax.jit, and donated for the cache writes) and through torch on CPU tensors, held to the
float64 references of tests/reference.py with sample_inputs.TOLERANCES; the cache writes
bit for bit, on random bit patterns (NaN payloads, subnormals, -0 included).

Invalid calls: one argument made wrong at a time (dtype, rank, shape; block ids, lengths,
slots, slices and counts out of range; attributes). Every path that can see the mistake must
raise a TorchXlaExtError, or for the handler under jit an XLA runtime error, whose message
names the argument, and leave every input (the caches above all) as it was:
  - "jax":     torch_xla_ext.jax_ops with concrete values (checked at the call);
  - "jit":     the same under jax.jit (shapes checked while tracing, data by the Host handler);
  - "handler": the FFI target called under jax.jit past every Python check (the handler's own
               checks; mistakes only the Python side checks are left out);
  - "torch":   torch.ops.xla_ext on CPU tensors: the Host handler run in place on the
               tensors (data is checked by the handler only), so "unchanged" means it
               checked everything before writing.

CPU only: the CUDA handlers skip bad data instead of reporting it (kernels/*/*.h) unless
XLA_EXT_DEBUG_CHECKS is set, which tests/gpu/debug_checks_test.py covers on the GPU.
CI keeps it deterministic and short: derandomize=True, few examples, small shapes.
"""

import math

import numpy as np
import pytest
import torch

from tests.kernels.common import PLATFORM

if PLATFORM != "cpu":
    pytest.skip("the properties hold the Host handlers to their contract (CPU only)",
                allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests import reference  # noqa: E402
from tests.kernels.common import (CACHE_DTYPES, DTYPES, TOLERANCES, assert_within_ulps,  # noqa: E402
                                  to_jax, to_torch)
from torch_xla_ext import checks, op_catalog, sample_inputs  # noqa: E402
from torch_xla_ext import jax_ops as xla_ext_jax  # noqa: E402
from torch_xla_ext.errors import TorchXlaExtError  # noqa: E402

OPS = {op.name: op for op in op_catalog.OPS}
INT32_MAX = 2 ** 31 - 1


def properties(max_examples):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


seeds = st.integers(0, 2 ** 31 - 1)


# ------------------------------------------------------------------------------------------
# Tensors, bits, and the four ways of calling an op.

def random_bits(shape, dtype, gen):
    """A tensor whose elements are random bit patterns (NaNs, infinities, subnormals, -0)."""
    width = torch.empty((), dtype=dtype).element_size()
    count = math.prod(shape) * width
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen).view(dtype).reshape(
        shape)


def randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """t's elements as same-width integers: equality of bits, NaNs included."""
    t = t.contiguous()
    return t.view(_INT_OF_WIDTH[t.element_size()]) if t.is_floating_point() else t


def assert_same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(bits(got), bits(want))


def _empty(shape, dtype_name, like):
    return jnp.zeros(shape, getattr(jnp, dtype_name))


def _split(op, args):
    """(tensor argument names present, the others), for jit: tensors traced, others static."""
    tensors = [n for n in op.tensor_args() if isinstance(args[n], torch.Tensor)]
    return tensors, {k: v for k, v in args.items() if k not in tensors}


def _handler_call(op, a):
    """op's FFI target called as jax_ops does, without any of the Python checks."""
    attributes = op.attribute_values(a)
    results = [jax.ShapeDtypeStruct(tuple(s), d)
               for s, d in op.handler_results(a, attributes, xla_ext_jax.workspace_gpu())]
    call = jax.ffi.ffi_call(op.target, results[0] if len(results) == 1 else tuple(results),
                            input_output_aliases={i: o for o, i in op.aliases().items()})
    out = call(*op.operand_values(a, _empty), **attributes)
    return out[:len(op.results(a))] if op.workspace is not None else out


def run_jax(op, args, mode):
    """Runs op on torch tensors `args` through JAX: mode "jax" (eager), "jit", "donate" (jit,
    written operands donated) or "handler" (the target itself under jit). Returns the
    results as a list of torch tensors."""
    tensors, static = _split(op, args)
    arrays = [to_jax(args[n]) for n in tensors]
    fn = getattr(xla_ext_jax, op.name)
    if mode == "jax":
        out = fn(**static, **dict(zip(tensors, arrays)))
    else:
        body = _handler_call if mode == "handler" else lambda o, a: fn(**a)

        def traced(*xs):
            return body(op, dict(static, **dict(zip(tensors, xs))))

        donate = ()
        if mode == "donate":
            donate = tuple(tensors.index(n) for n in op.written_args())
            arrays = [jnp.copy(x) if i in donate else x for i, x in enumerate(arrays)]
        out = jax.block_until_ready(jax.jit(traced, donate_argnums=donate)(*arrays))
    return [to_torch(x) for x in (out if isinstance(out, (tuple, list)) else [out])]


def run_torch(op, args):
    """torch.ops.xla_ext.<op> on CPU tensors; for an in-place op, the written arguments
    (updated in place) are returned."""
    out = getattr(torch.ops.xla_ext, op.name)(**args)
    if op.in_place:
        return [args[n] for n in op.written_args()]
    return list(out) if isinstance(out, (tuple, list)) else [out]


# ------------------------------------------------------------------------------------------
# Ragged batches.

@st.composite
def ragged_lengths(draw, unit, long_max, min_size=1, max_size=5):
    """Lengths of a ragged batch: 0, 1, unit - 1, unit, unit + 1 and small ones, at times one
    long one (>= 4 units) among them."""
    edge = st.sampled_from([0, 1, unit - 1, unit, unit + 1])
    lengths = draw(st.lists(st.one_of(edge, st.integers(0, 2 * unit + 3)), min_size=min_size,
                            max_size=max_size))
    if lengths and draw(st.booleans()):
        lengths[draw(st.integers(0, len(lengths) - 1))] = draw(st.integers(4 * unit, long_max))
    return lengths


@st.composite
def cache_writes(draw, dtypes, block_sizes=(1, 2, 3, 4, 8, 16), head_sizes=(1, 2, 6, 16, 64),
                 at_least_one_token=False):
    """A decode/prefill step's writes: per sequence, tokens already cached (ctx) and new ones
    (new), their blocks scattered over a cache with spare blocks; `positions` lists each new
    token's (sequence, position), `slots` its slot, then padding tokens with negative slots."""
    block_size = draw(st.sampled_from(block_sizes))
    new = draw(ragged_lengths(block_size, 6 * block_size))
    if at_least_one_token and sum(new) == 0:
        new[0] = 1
    ctx = draw(st.lists(st.integers(0, 2 * block_size), min_size=len(new), max_size=len(new)))
    spare_blocks = draw(st.integers(0, 2))
    padding = draw(st.lists(st.one_of(st.just(-1), st.integers(-INT32_MAX - 1, -1)), max_size=3))
    seed = draw(seeds)
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in zip(ctx, new)]
    num_blocks = sum(blocks_needed) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_needed:
        tables.append(ids[used:used + n])
        used += n
    positions = [(s, p) for s, (c, n) in enumerate(zip(ctx, new)) for p in range(c, c + n)]
    slots = [tables[s][p // block_size] * block_size + p % block_size for s, p in positions]
    if draw(st.booleans()):  # tokens in any order: a slot is a slot
        order = torch.randperm(len(slots), generator=gen).tolist()
        positions, slots = [positions[i] for i in order], [slots[i] for i in order]
    return dict(block_size=block_size, num_blocks=num_blocks, ctx=ctx, new=new, tables=tables,
                positions=positions, slots=slots + padding, num_kv_heads=draw(st.integers(1, 3)),
                head_size=draw(st.sampled_from(head_sizes)), dtype=draw(st.sampled_from(dtypes)),
                gen=gen)


def slot_write_inputs(w, combined):
    """key, value [num_tokens, kv_heads, head_size] and the cache(s), random bits."""
    num_tokens, h, d, dtype, gen = (len(w["slots"]), w["num_kv_heads"], w["head_size"],
                                    w["dtype"], w["gen"])
    key = random_bits((num_tokens, h, d), dtype, gen)
    value = random_bits((num_tokens, h, d), dtype, gen)
    if combined:
        return key, value, random_bits((w["num_blocks"], w["block_size"], 2 * h, d), dtype, gen)
    shape = (w["num_blocks"], w["block_size"], h, d)
    return key, value, random_bits(shape, dtype, gen), random_bits(shape, dtype, gen)


def slice_write_inputs(w, extra_columns, junk):
    """vLLM's slices: each sequence's new tokens (consecutive rows of kv) split at page
    boundaries; columns past num_kv_update_slices hold junk that must never be read."""
    ps, gen = w["block_size"], w["gen"]
    columns, row = [], 0
    for s, (c, n) in enumerate(zip(w["ctx"], w["new"])):
        p = c
        while p < c + n:
            length = min(ps - p % ps, c + n - p)
            columns.append((w["tables"][s][p // ps] * ps + p % ps, row, length))
            row, p = row + length, p + length
    pad_rows = len(w["slots"]) - len(w["positions"])
    heads, d, dtype = 2 * w["num_kv_heads"], w["head_size"], w["dtype"]
    kv = random_bits((row + pad_rows, heads, d), dtype, gen)
    kv_cache = random_bits((w["num_blocks"] * ps, heads, d), dtype, gen)
    width = len(columns) + extra_columns
    slices = torch.tensor(junk[:3 * width], dtype=torch.int32).reshape(3, width)
    if columns:
        slices[:, :len(columns)] = torch.tensor(columns, dtype=torch.int32).T
    return dict(kv=kv, slot_mapping=slices, kv_cache=kv_cache,
                num_kv_update_slices=torch.tensor([len(columns)], dtype=torch.int32),
                page_size=ps)


# ------------------------------------------------------------------------------------------
# Valid calls against the references.

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@properties(max_examples=8)
@given(shape=st.lists(st.integers(0, 5), max_size=4), seed=seeds)
def test_simple_add_matches_reference(dtype, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    a, b = randn(shape, dtype, gen) * 100, randn(shape, dtype, gen)
    op = OPS["simple_add"]
    want = reference.simple_add_ref(a, b)
    atol, rtol = TOLERANCES[dtype]
    outs = run_jax(op, dict(a=a, b=b), "jax") + run_jax(op, dict(a=a, b=b), "jit")
    for out in outs + run_torch(op, dict(a=a, b=b)):
        assert out.shape == a.shape and out.dtype == dtype
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)
    assert_same_bits(run_torch(op, dict(a=b, b=a))[0], outs[0])  # a + b == b + a


@st.composite
def attention_inputs(draw, dtypes=DTYPES,
                     head_sizes=checks.supported(checks.PAGED_ATTENTION, "head_size", "query"),
                     long_max=12, at_least_one_token=False):
    """A decode batch: ragged lengths (no empty batch: test_paged_attention.py has it), GQA
    ratios, every head and block size, extra block-table columns, and the sample_inputs
    layout (blocks scattered, spare blocks, junk table entries past each sequence's end).
    softcap in {0} and [1e-3, 1e6]: far beyond, logit / softcap is subnormal (flushed to zero
    on XLA CPU)."""
    block_size = draw(st.sampled_from(
        checks.supported(checks.PAGED_ATTENTION, "block_size", "key_cache")))
    num_kv_heads = draw(st.integers(1, 3))
    num_heads = num_kv_heads * draw(st.sampled_from([1, 2, 3, 4]))
    head_size = draw(st.sampled_from(head_sizes))
    seq_lens = draw(ragged_lengths(block_size, long_max * block_size))
    if at_least_one_token and sum(seq_lens) == 0:
        seq_lens[0] = 1
    blocks_needed = max([-(-n // block_size) for n in seq_lens] + [1])
    max_blocks_per_seq = blocks_needed + draw(st.integers(0, 2))
    dtype = draw(st.sampled_from(dtypes))
    args = sample_inputs.paged_attention(seq_lens, num_heads, num_kv_heads, head_size, block_size,
                                         dtype, max_blocks_per_seq, seed=draw(seeds))
    args["scale"] = draw(st.one_of(st.floats(-1.0, 1.0), st.just(head_size ** -0.5)))
    args["softcap"] = draw(st.one_of(st.just(0.0), st.floats(1e-3, 1e6)))
    args["alibi_slopes"] = reference.alibi_slopes(num_heads) if draw(st.booleans()) else None
    return args


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@properties(max_examples=10)
@given(data=st.data())
def test_paged_attention_matches_reference(dtype, data):
    args = data.draw(attention_inputs(dtypes=[dtype]))
    op = OPS["paged_attention"]
    want = reference.paged_attention_ref(**args)
    atol, rtol = TOLERANCES[dtype]
    outs = run_jax(op, args, "jax") + run_jax(op, args, "jit") + run_torch(op, args)
    for out in outs:
        assert out.shape == args["query"].shape and out.dtype == dtype
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)
        assert torch.all(out[args["seq_lens"] == 0] == 0)  # length 0: zeros, exactly
    # Each sequence on its own: the same bits as within the batch.
    seq = data.draw(st.integers(0, len(args["seq_lens"]) - 1))
    alone = dict(args, **{n: args[n][seq:seq + 1] for n in ("query", "block_tables", "seq_lens")})
    assert_same_bits(run_torch(op, alone)[0], outs[0][seq:seq + 1])


@properties(max_examples=12)
@given(args=attention_inputs(head_sizes=(64, 80)), seed=seeds)
def test_paged_attention_reads_only_its_own_blocks(args, seed):
    """Moving every block elsewhere in the cache (the block tables renamed to match), NaN in
    every block nobody uses and other junk in the unused table entries: the same bits out."""
    op = OPS["paged_attention"]
    before = run_jax(op, args, "jit")[0]
    gen = torch.Generator().manual_seed(seed)
    key_cache, value_cache, tables = args["key_cache"], args["value_cache"], args["block_tables"]
    num_blocks, block_size = key_cache.shape[:2]
    new_num_blocks = num_blocks + 3
    where = torch.randperm(new_num_blocks, generator=gen)[:num_blocks]  # old id -> new id
    moved = dict(args)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        new = torch.full((new_num_blocks,) + tuple(cache.shape[1:]), float("nan"),
                         dtype=cache.dtype)
        new[where] = cache
        moved[name] = new
    used = (torch.arange(tables.shape[1])[None, :] * block_size < args["seq_lens"][:, None])
    junk = torch.randint(-INT32_MAX - 1, INT32_MAX, tables.shape, generator=gen,
                         dtype=torch.int64).int()
    renamed = where[tables.clamp(0, num_blocks - 1).long()].int()
    moved["block_tables"] = torch.where(used, renamed, junk)
    # The cache's blocks nobody uses, and the rows past each sequence's last token in its last
    # block, become NaN too.
    used_ids = set(renamed[used].tolist())
    for name in ("key_cache", "value_cache"):
        for b in range(new_num_blocks):
            if b not in used_ids:
                moved[name][b] = float("nan")
        for seq, n in enumerate(args["seq_lens"].tolist()):
            if n % block_size:
                moved[name][int(renamed[seq, n // block_size]), n % block_size:] = float("nan")
    assert_same_bits(run_jax(op, moved, "jit")[0], before)
    assert_same_bits(run_torch(op, moved)[0], before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@properties(max_examples=8)
@given(data=st.data())
def test_reshape_and_cache_matches_reference(dtype, data):
    w = data.draw(cache_writes([dtype]))
    op = OPS["reshape_and_cache"]
    key, value, key_cache, value_cache = slot_write_inputs(w, combined=False)
    args = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=torch.tensor(w["slots"], dtype=torch.int64))
    want = reference.reshape_and_cache_ref(**args)
    for mode in ("jax", "jit", "donate"):
        for got, expected in zip(run_jax(op, args, mode), want):
            assert_same_bits(got, expected)
    args = dict(args, key_cache=key_cache.clone(), value_cache=value_cache.clone())
    for got, expected in zip(run_torch(op, args), want):  # in place
        assert_same_bits(got, expected)


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@properties(max_examples=8)
@given(data=st.data())
def test_kv_cache_update_matches_reference(dtype, data):
    w = data.draw(cache_writes([dtype]))
    op = OPS["kv_cache_update"]
    key, value, kv_cache = slot_write_inputs(w, combined=True)
    args = dict(key=key, value=value, kv_cache=kv_cache,
                slot_mapping=torch.tensor(w["slots"], dtype=torch.int32))
    want = reference.kv_cache_update_ref(**args)
    for mode in ("jax", "jit", "donate"):
        assert_same_bits(run_jax(op, args, mode)[0], want)
    assert_same_bits(run_torch(op, dict(args, kv_cache=kv_cache.clone()))[0], want)
    # Each new token's K and V rows are where the layout says: K of kv head h at 2h, V at 2h+1.
    for i in range(len(w["positions"])):
        page, offset = divmod(w["slots"][i], w["block_size"])
        assert_same_bits(want[page, offset, 0::2], key[i])
        assert_same_bits(want[page, offset, 1::2], value[i])


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@properties(max_examples=8)
@given(data=st.data(), extra_columns=st.integers(0, 3),
       junk=st.lists(st.integers(-INT32_MAX - 1, INT32_MAX), min_size=400, max_size=400),
       num_slices_per_block=st.integers(1, 8))
def test_kv_cache_update_slices_matches_reference(dtype, data, extra_columns, junk,
                                                 num_slices_per_block):
    w = data.draw(cache_writes([dtype], block_sizes=(1, 3, 4, 8, 16)))
    op = OPS["kv_cache_update_slices"]
    args = slice_write_inputs(w, extra_columns, junk)
    args["num_slices_per_block"] = num_slices_per_block
    kv_cache = args["kv_cache"].clone()
    want = reference.kv_cache_update_slices_ref(args["kv"], args["slot_mapping"],
                                                args["kv_cache"], args["num_kv_update_slices"])
    for mode in ("jax", "jit", "donate"):
        assert_same_bits(run_jax(op, args, mode)[0], want)
    assert_same_bits(run_torch(op, args)[0], want)
    assert_same_bits(args["kv_cache"], kv_cache)  # the functional op leaves its input alone
    # Every new token landed in the row its slot names, as kv_cache_update would put it.
    for row, (s, p) in enumerate(sorted(w["positions"])):
        slot = w["tables"][s][p // w["block_size"]] * w["block_size"] + p % w["block_size"]
        assert_same_bits(want[slot], args["kv"][row])


def rotary_write_inputs(w, num_q_heads):
    """qkv (finite values: the rotation is arithmetic), cos and sin of random angles, the
    combined cache (random bits) and the slots of cache_writes' step."""
    num_tokens, h, d, dtype, gen = (len(w["slots"]), w["num_kv_heads"], w["head_size"],
                                    w["dtype"], w["gen"])
    angles = torch.rand(num_tokens, d, generator=gen) * 100.0
    return dict(qkv=randn((num_tokens, num_q_heads + 2 * h, d), dtype, gen),
                cos=angles.cos().to(dtype), sin=angles.sin().to(dtype),
                kv_cache=random_bits((w["num_blocks"], w["block_size"], 2 * h, d), dtype, gen),
                slot_mapping=torch.tensor(w["slots"], dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@properties(max_examples=8)
@given(data=st.data(), num_q_heads=st.integers(1, 4))
def test_rotary_kv_cache_update_matches_reference(dtype, data, num_q_heads):
    w = data.draw(cache_writes([dtype], head_sizes=(2, 6, 16, 64)))
    op = OPS["rotary_kv_cache_update"]
    args = rotary_write_inputs(w, num_q_heads)
    kv_cache = args["kv_cache"].clone()
    want_q, want_cache = reference.rotary_kv_cache_update_ref(**args)
    for mode in ("jax", "jit", "donate", "handler"):
        q, cache = run_jax(op, args, mode)
        assert_same_bits(q, want_q)
        assert_same_bits(cache, want_cache)
    q, cache = run_torch(op, args)
    assert_same_bits(q, want_q)
    assert_same_bits(cache, want_cache)
    assert_same_bits(args["kv_cache"], kv_cache)  # the functional op leaves its input alone


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@properties(max_examples=8)
@given(num_tokens=st.integers(0, 20), hidden=st.one_of(st.sampled_from([1, 255, 256, 257]),
                                                       st.integers(1, 600)),
       eps=st.sampled_from([0.0, 1e-6, 1e-5, 0.5]), seed=seeds)
def test_add_rms_norm_matches_reference(dtype, num_tokens, hidden, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    args = dict(x=randn((num_tokens, hidden), dtype, gen),
                residual=randn((num_tokens, hidden), dtype, gen) * 4,
                weight=randn((hidden,), dtype, gen), eps=eps)
    op = OPS["add_rms_norm"]
    want_total, want_normed = reference.add_rms_norm_ref(**args)
    # The sum bit for bit; the normed row within a rounding of the dtype (32 units in the last
    # place of float32: the squares summed in another order) at its largest value.
    ulps = 32 if dtype == torch.float32 else 1
    for total, normed in [run_jax(op, args, mode) for mode in ("jax", "jit", "handler")] + \
            [run_torch(op, args)]:
        assert_same_bits(total, want_total)
        assert_within_ulps(normed, want_normed, ulps)


@st.composite
def linear_inputs(draw):
    """small_batch_linear's arguments: token counts around the CUDA kernel's 8-token tiles,
    in_features around its 8-element loads and 32-wide chunks, any form (plain, residual,
    silu_gate)."""
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    num_tokens = draw(st.one_of(st.sampled_from([0, 1, 8, 9, 64, 65]), st.integers(0, 70)))
    in_features = draw(st.one_of(st.sampled_from([0, 1, 8, 31, 32, 33]), st.integers(0, 100)))
    out_features = draw(st.integers(1, 40))
    form = draw(st.sampled_from(["plain", "residual", "silu_gate"]))
    gen = torch.Generator().manual_seed(draw(seeds))
    rows = 2 * out_features if form == "silu_gate" else out_features
    return dict(x=randn((num_tokens, in_features), dtype, gen),
                weight=randn((rows, in_features), dtype, gen),
                residual=(randn((num_tokens, rows), dtype, gen) if form == "residual" else None),
                silu_gate=int(form == "silu_gate"))


@properties(max_examples=12)
@given(args=linear_inputs())
def test_small_batch_linear_matches_reference(args):
    op = OPS["small_batch_linear"]
    want = reference.small_batch_linear_ref(**args)
    # Two roundings of the dtype (one unit in the last place) at the largest output: float32
    # sums in another order.
    for got in [run_jax(op, args, mode)[0] for mode in ("jax", "jit", "handler")] + \
            run_torch(op, args):
        assert_within_ulps(got, want)


FP8 = torch.float8_e4m3fn


def _f32(x):
    """x as the float32 attribute the handler gets (None stays None)."""
    return None if x is None else float(np.float32(x))


@st.composite
def ragged_batches(draw, dtypes=DTYPES,
                   head_dims=checks.supported(checks.RAGGED_PAGED_ATTENTION, "head_dim", "q"),
                   page_sizes=checks.supported(checks.RAGGED_PAGED_ATTENTION, "page_size",
                                               "kv_pages"),
                   at_least_one_row=False, max_work=2e7):
    """A ragged batch as vLLM builds one: per sequence a kv_len around page edges (0, 1,
    page_size - 1, page_size, page_size + 1, at times a long one) and a q_len (none, a decode,
    the whole prompt, a chunk), GQA groups up to 16, q of any float dtype with kv_pages of its
    dtype or fp8, query rows starting 0..2 rows in with padding rows after, max_num_seqs past
    num_seqs with junk there (cu_q_lens, kv_lens, page ids), each sequence's pages scattered
    over a cache with spare pages, and NaN wherever nothing may be read (spare pages, positions
    past a sequence's kv_len). q_len * kv_len * heads * head_dim over the batch stays below
    max_work (prompts become decodes), for the f64 Host handler's time."""
    page_size = draw(st.sampled_from(page_sizes))
    kv_lens = draw(ragged_lengths(page_size, 5 * page_size))
    q_lens = [draw(st.one_of(st.just(min(n, 1)), st.just(n), st.integers(0, n))) for n in kv_lens]
    if at_least_one_row and sum(q_lens) == 0:
        kv_lens[0], q_lens[0] = max(kv_lens[0], 1), 1
    num_kv_heads = draw(st.integers(1, 2))
    num_q_heads = num_kv_heads * draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    head_dim = draw(st.sampled_from(head_dims))
    for i in sorted(range(len(q_lens)), key=lambda i: -q_lens[i] * kv_lens[i]):
        if sum(q * n for q, n in zip(q_lens, kv_lens)) * num_q_heads * head_dim <= max_work:
            break
        q_lens[i] = min(q_lens[i], 1)
    dtype = draw(st.sampled_from(dtypes))
    kv_dtype = dtype if dtype == torch.float32 else draw(st.sampled_from([dtype, FP8]))
    num_seqs = len(kv_lens)
    max_num_seqs = num_seqs + draw(st.integers(0, 2))
    first_row, padding = draw(st.integers(0, 2)), draw(st.integers(0, 3))
    needed = [-(-n // page_size) for n in kv_lens]
    pages_per_seq = max(needed + [1]) + draw(st.integers(0, 1))
    num_pages = sum(needed) + draw(st.integers(0, 2))
    gen = torch.Generator().manual_seed(draw(seeds))

    def junk(*shape):
        return torch.randint(-INT32_MAX - 1, INT32_MAX, shape, generator=gen,
                             dtype=torch.int64).int()

    ids = torch.randperm(num_pages, generator=gen).int()
    page_indices = junk(max_num_seqs, pages_per_seq)
    cu_q_lens = junk(max_num_seqs + 1)
    cu_q_lens[:num_seqs + 1] = first_row + torch.tensor([0] + q_lens).cumsum(0)
    lens = junk(max_num_seqs)
    lens[:num_seqs] = torch.tensor(kv_lens)
    kv_pages = torch.randn(num_pages, page_size, 2 * num_kv_heads, head_dim, generator=gen)
    unused = torch.ones(num_pages, page_size, dtype=torch.bool)
    used = 0
    for seq, (n, kv_len) in enumerate(zip(needed, kv_lens)):
        page_indices[seq, :n] = ids[used:used + n]
        for p in range(n):
            unused[ids[used + p], :min(page_size, kv_len - p * page_size)] = False
        used += n
    kv_pages[unused] = float("nan")
    num_tokens = first_row + sum(q_lens) + padding
    return dict(q=torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype),
                kv_pages=kv_pages.to(kv_dtype), kv_lens=lens, page_indices=page_indices,
                cu_q_lens=cu_q_lens, num_seqs=torch.tensor([num_seqs], dtype=torch.int32),
                sm_scale=_f32(draw(st.one_of(st.floats(-1.0, 1.0), st.just(head_dim ** -0.5)))),
                sliding_window=draw(st.one_of(st.none(), st.integers(1, 2 * page_size))),
                soft_cap=_f32(draw(st.one_of(st.none(), st.floats(1e-2, 1e3)))),
                mask_value=_f32(draw(st.one_of(st.none(), st.sampled_from([0.0, -5.0, -1e4]),
                                               st.floats(-1e30, 0.0)))),
                k_scale=_f32(draw(st.one_of(st.none(), st.floats(0.1, 4.0)))),
                v_scale=_f32(draw(st.one_of(st.none(), st.floats(0.1, 4.0)))),
                # No promise, or one the batch keeps (its longest q_len, or more).
                max_q_len=draw(st.sampled_from([0, max(q_lens, default=0),
                                                max(q_lens, default=0) + 1])))


def _ragged_reference(args):
    """torch_xla's semantics: max_q_len (ours, a promise the batch keeps) changes nothing."""
    mask_value = args["mask_value"]
    return reference.ragged_paged_attention_ref(**dict(
        {k: v for k, v in args.items() if k != "max_q_len"},
        mask_value=reference.DEFAULT_MASK_VALUE if mask_value is None else mask_value))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@properties(max_examples=10)
@given(data=st.data())
def test_ragged_paged_attention_matches_reference(dtype, data):
    args = data.draw(ragged_batches(dtypes=[dtype]))
    op = OPS["ragged_paged_attention"]
    want = _ragged_reference(args)
    atol, rtol = TOLERANCES[dtype]
    first, last = int(args["cu_q_lens"][0]), int(args["cu_q_lens"][int(args["num_seqs"][0])])
    outs = run_jax(op, args, "jax") + run_jax(op, args, "jit") + run_torch(op, args)
    for out in outs:
        assert out.shape == args["q"].shape and out.dtype == dtype
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)
        assert torch.all(out[:first] == 0) and torch.all(out[last:] == 0)  # rows nobody owns
    # A sequence on its own: the same bits as within the batch.
    seq = data.draw(st.integers(0, int(args["num_seqs"][0]) - 1))
    start, end = int(args["cu_q_lens"][seq]), int(args["cu_q_lens"][seq + 1])
    alone = dict(args, q=args["q"][start:end], kv_lens=args["kv_lens"][seq:seq + 1],
                 page_indices=args["page_indices"][seq:seq + 1],
                 cu_q_lens=torch.tensor([0, end - start], dtype=torch.int32),
                 num_seqs=torch.tensor([1], dtype=torch.int32))
    assert_same_bits(run_torch(op, alone)[0], outs[2][start:end])


# ------------------------------------------------------------------------------------------
# Invalid calls: rejected by every path that can see the mistake, naming the argument, with
# every input (every cache) left as it was.

FRONT_END = ("jax", "jit", "torch")  # mistakes only the Python checks see
EVERYWHERE = FRONT_END + ("handler",)


class Bad:
    """One mistake: `change(args, draw)` returns the arguments with it; `arg` is the argument
    the message must name; `paths` are those that must reject it."""

    def __init__(self, name, arg, change, paths=EVERYWHERE):
        self.name, self.arg, self.change, self.paths = name, arg, change, paths

    def __repr__(self):
        return self.name


def _with(args, **changes):
    return dict(args, **{k: v.contiguous() if isinstance(v, torch.Tensor) else v
                         for k, v in changes.items()})


def _other(dtypes, dtype):
    return lambda draw: draw(st.sampled_from([d for d in dtypes if d != dtype]))


def _bad_rank(t, draw):
    """t with one dimension fewer or one more."""
    return t[0] if t.dim() and draw(st.booleans()) and t.shape[0] else t[None]


def _grow_or_shrink(t, dim, draw):
    """t with dimension `dim` one longer or (where it has any) one shorter."""
    if t.shape[dim] and draw(st.booleans()):
        return t.narrow(dim, 0, t.shape[dim] - 1)
    extra = list(t.shape)
    extra[dim] = 1
    b = bits(t)  # torch cannot concatenate float8 tensors: their bytes instead
    return torch.cat([b, torch.zeros(extra, dtype=b.dtype)], dim).view(t.dtype)


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def _fresh(shape, dtype):
    return torch.zeros(shape).to(dtype)


def check_rejected(op, args, bad):
    """Runs every path of `bad.paths` on `args`, expecting each to reject the call naming
    bad.arg and to leave every tensor argument as it was."""
    want = f"{op.target}: argument '{bad.arg}'"
    for path in bad.paths:
        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        errors = {"jax": TorchXlaExtError, "torch": TorchXlaExtError,
                  "jit": (TorchXlaExtError, jax.errors.JaxRuntimeError),
                  "handler": jax.errors.JaxRuntimeError}[path]
        with pytest.raises(errors) as info:
            if path == "torch":
                run_torch(op, inputs)
            else:
                run_jax(op, inputs, path)
        assert want in str(info.value), f"{path}: {info.value}"
        for name, value in args.items():
            if isinstance(value, torch.Tensor):
                assert_same_bits(inputs[name], value)


def _data(draw, lo, hi):
    """An integer in [lo, hi], edges first."""
    return draw(st.one_of(st.sampled_from([lo, hi]), st.integers(lo, hi)))


# simple_add
SIMPLE_ADD_BAD = [
    Bad("a_not_float", "a", lambda a, draw: _with(a, a=a["a"].to(draw(st.sampled_from(
        [torch.int32, torch.float64, torch.float8_e4m3fn]))), b=a["b"].to(torch.int32))),
    Bad("b_dtype", "b", lambda a, draw: _with(a, b=a["b"].to(_other(
        DTYPES + [torch.int32, torch.float64], a["b"].dtype)(draw)))),
    Bad("b_shape", "b", lambda a, draw: _with(a, b=_grow_or_shrink(a["b"], draw(
        st.integers(0, a["b"].dim() - 1)), draw) if a["b"].dim() and draw(st.booleans())
        else _bad_rank(a["b"], draw))),
]


@pytest.mark.parametrize("bad", SIMPLE_ADD_BAD, ids=repr)
@properties(max_examples=4)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), dtype=st.sampled_from(DTYPES),
       data=st.data())
def test_simple_add_rejects(bad, shape, dtype, data):
    gen = torch.Generator().manual_seed(0)
    args = dict(a=randn(shape, dtype, gen), b=randn(shape, dtype, gen))
    check_rejected(OPS["simple_add"], bad.change(args, data.draw), bad)


# paged_attention
def _used_block(args, draw):
    """(seq, b): a block-table entry a sequence reads."""
    seq = draw(st.sampled_from([i for i, n in enumerate(args["seq_lens"].tolist()) if n > 0]))
    block_size = args["key_cache"].shape[1]
    return seq, draw(st.integers(0, (int(args["seq_lens"][seq]) - 1) // block_size))


def _capacity(args):
    return args["block_tables"].shape[1] * args["key_cache"].shape[1]


PAGED_ATTENTION_BAD = [
    Bad("query_dtype", "query", lambda a, draw: _with(a, query=a["query"].to(
        draw(st.sampled_from([torch.int32, torch.float64]))))),
    Bad("query_rank", "query", lambda a, draw: _with(a, query=_bad_rank(a["query"], draw))),
    Bad("query_head_size", "query", lambda a, draw: _with(a, query=_fresh(
        a["query"].shape[:2] + (draw(st.sampled_from([1, 32, 48, 63, 65, 129])),),
        a["query"].dtype))),
    Bad("cache_dtype", "key_cache", lambda a, draw: _with(a, **{n: a[n].to(
        _other(DTYPES, a["query"].dtype)(draw)) for n in ("key_cache", "value_cache")})),
    Bad("key_cache_rank", "key_cache", lambda a, draw: _with(a, key_cache=_bad_rank(
        a["key_cache"], draw))),
    Bad("cache_head_size", "key_cache", lambda a, draw: _with(a, key_cache=a["key_cache"][
        ..., :draw(st.integers(1, a["key_cache"].shape[3] - 1))])),
    Bad("block_size", "key_cache", lambda a, draw: _with(a, **{n: _fresh(
        (a[n].shape[0], draw(st.sampled_from([1, 4, 7, 9, 24, 64]))) + a[n].shape[2:],
        a[n].dtype) for n in ("key_cache", "value_cache")})),
    Bad("num_kv_heads", "key_cache", lambda a, draw: _with(a, **{n: _fresh(
        a[n].shape[:2] + (draw(st.sampled_from([0, a["query"].shape[1] + 1])),) + a[n].shape[3:],
        a[n].dtype) for n in ("key_cache", "value_cache")})),
    Bad("value_cache_shape", "value_cache", lambda a, draw: _with(a, value_cache=_grow_or_shrink(
        a["value_cache"], 0, draw))),
    Bad("value_cache_dtype", "value_cache", lambda a, draw: _with(a, value_cache=a[
        "value_cache"].to(_other(DTYPES + [torch.float64], a["value_cache"].dtype)(draw)))),
    Bad("block_tables_dtype", "block_tables", lambda a, draw: _with(a, block_tables=a[
        "block_tables"].to(draw(st.sampled_from([torch.int64, torch.int16, torch.float32]))))),
    Bad("block_tables_rank", "block_tables", lambda a, draw: _with(a, block_tables=_bad_rank(
        a["block_tables"], draw))),
    Bad("block_tables_rows", "block_tables", lambda a, draw: _with(a, block_tables=_grow_or_shrink(
        a["block_tables"], 0, draw))),
    Bad("seq_lens_dtype", "seq_lens", lambda a, draw: _with(a, seq_lens=a["seq_lens"].long())),
    Bad("seq_lens_shape", "seq_lens", lambda a, draw: _with(a, seq_lens=_grow_or_shrink(
        a["seq_lens"], 0, draw) if draw(st.booleans()) else a["seq_lens"][None])),
    Bad("alibi_slopes", "alibi_slopes", lambda a, draw: _with(a, alibi_slopes=draw(st.sampled_from([
        torch.ones(a["query"].shape[1] + 1), torch.ones(a["query"].shape[1], dtype=torch.float16),
        torch.ones(1, a["query"].shape[1])])))),
    # scale and softcap reach the handlers as float32 attributes: beyond its range they are inf.
    Bad("scale", "scale", lambda a, draw: _with(a, scale=draw(st.sampled_from([-1.0, 1.0])) * draw(
        st.one_of(st.sampled_from([float("nan"), float("inf"), 3.5e38]), st.floats(3.5e38))),
        ), FRONT_END),
    Bad("softcap", "softcap", lambda a, draw: _with(a, softcap=draw(st.one_of(st.sampled_from(
        [float("nan"), float("inf"), -float("inf"), -1.0, -0.5e-45]), st.floats(3.5e38),
        st.floats(max_value=-1e-300)))), FRONT_END),
    # Data: lengths and the block ids they reach.
    Bad("seq_len_negative", "seq_lens", lambda a, draw: _with(a, seq_lens=_set(
        a["seq_lens"], draw(st.integers(0, len(a["seq_lens"]) - 1)),
        _data(draw, -INT32_MAX - 1, -1)))),
    Bad("seq_len_beyond_table", "seq_lens", lambda a, draw: _with(a, seq_lens=_set(
        a["seq_lens"], draw(st.integers(0, len(a["seq_lens"]) - 1)),
        _data(draw, _capacity(a) + 1, INT32_MAX)))),
    Bad("block_id_negative", "block_tables", lambda a, draw: _with(a, block_tables=_set(
        a["block_tables"], _used_block(a, draw), _data(draw, -INT32_MAX - 1, -1)))),
    Bad("block_id_beyond_cache", "block_tables", lambda a, draw: _with(a, block_tables=_set(
        a["block_tables"], _used_block(a, draw),
        _data(draw, a["key_cache"].shape[0], INT32_MAX)))),
]


@pytest.mark.parametrize("bad", PAGED_ATTENTION_BAD, ids=repr)
@properties(max_examples=4)
@given(args=attention_inputs(head_sizes=(64, 80), long_max=5, at_least_one_token=True),
       data=st.data())
def test_paged_attention_rejects(bad, args, data):
    check_rejected(OPS["paged_attention"], bad.change(args, data.draw), bad)


# reshape_and_cache
def _slot_index(a, draw):
    return draw(st.integers(0, len(a["slot_mapping"]) - 1))


def _num_slots(cache):
    return cache.shape[0] * cache.shape[1]


RESHAPE_AND_CACHE_BAD = [
    Bad("key_dtype", "key", lambda a, draw: _with(a, **{n: a[n].to(draw(st.sampled_from(
        [torch.float8_e4m3fn, torch.float64, torch.int16]))) for n in (
        "key", "value", "key_cache", "value_cache")})),
    Bad("key_rank", "key", lambda a, draw: _with(a, key=_bad_rank(a["key"], draw))),
    Bad("value_dtype", "value", lambda a, draw: _with(a, value=a["value"].to(
        _other(DTYPES, a["value"].dtype)(draw)))),
    Bad("value_shape", "value", lambda a, draw: _with(a, value=_grow_or_shrink(
        a["value"], draw(st.integers(0, 2)), draw))),
    Bad("key_cache_dtype", "key_cache", lambda a, draw: _with(a, key_cache=a["key_cache"].to(
        _other(DTYPES, a["key_cache"].dtype)(draw)))),
    Bad("key_cache_rank", "key_cache", lambda a, draw: _with(a, key_cache=_bad_rank(
        a["key_cache"], draw))),
    Bad("key_cache_rows", "key_cache", lambda a, draw: _with(a, key_cache=_grow_or_shrink(
        a["key_cache"], draw(st.integers(2, 3)), draw))),
    Bad("value_cache_shape", "value_cache", lambda a, draw: _with(a, value_cache=_grow_or_shrink(
        a["value_cache"], draw(st.integers(0, 3)), draw))),
    Bad("value_cache_dtype", "value_cache", lambda a, draw: _with(a, value_cache=a[
        "value_cache"].to(_other(DTYPES, a["value_cache"].dtype)(draw)))),
    Bad("slot_mapping_dtype", "slot_mapping", lambda a, draw: _with(a, slot_mapping=a[
        "slot_mapping"].to(draw(st.sampled_from([torch.int32, torch.float32]))))),
    Bad("slot_mapping_shape", "slot_mapping", lambda a, draw: _with(a, slot_mapping=(
        _grow_or_shrink(a["slot_mapping"], 0, draw) if draw(st.booleans())
        else a["slot_mapping"][None]))),
    Bad("slot_beyond_cache", "slot_mapping", lambda a, draw: _with(a, slot_mapping=_set(
        a["slot_mapping"], _slot_index(a, draw),
        _data(draw, _num_slots(a["key_cache"]), 2 ** 63 - 1)))),
]


@pytest.mark.parametrize("bad", RESHAPE_AND_CACHE_BAD, ids=repr)
@properties(max_examples=4)
@given(w=cache_writes(DTYPES, head_sizes=(2, 16), at_least_one_token=True), data=st.data())
def test_reshape_and_cache_rejects(bad, w, data):
    key, value, key_cache, value_cache = slot_write_inputs(w, combined=False)
    args = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=torch.tensor(w["slots"], dtype=torch.int64))
    check_rejected(OPS["reshape_and_cache"], bad.change(args, data.draw), bad)


# The int32 slot_mapping of the ops that write the combined cache "kv_cache" by slot.
SLOT_MAPPING_BAD = [
    Bad("slot_mapping_dtype", "slot_mapping", lambda a, draw: _with(a, slot_mapping=a[
        "slot_mapping"].to(draw(st.sampled_from([torch.int64, torch.int16]))))),
    Bad("slot_mapping_shape", "slot_mapping", lambda a, draw: _with(a, slot_mapping=(
        _grow_or_shrink(a["slot_mapping"], 0, draw) if draw(st.booleans())
        else a["slot_mapping"][None]))),
    Bad("slot_beyond_cache", "slot_mapping", lambda a, draw: _with(a, slot_mapping=_set(
        a["slot_mapping"], _slot_index(a, draw),
        _data(draw, _num_slots(a["kv_cache"]), INT32_MAX)))),
]


# kv_cache_update
KV_CACHE_UPDATE_BAD = [
    Bad("kv_cache_rank", "kv_cache", lambda a, draw: _with(a, kv_cache=_bad_rank(
        a["kv_cache"], draw))),
    # The handler copies bytes of any dtype; only the Python side limits the cache dtypes.
    Bad("kv_cache_dtype", "kv_cache", lambda a, draw: _with(a, **{n: a[n].to(draw(
        st.sampled_from([torch.float64, torch.int8]))) for n in ("key", "value", "kv_cache")}),
        FRONT_END),
    Bad("key_dtype", "key", lambda a, draw: _with(a, **{n: a[n].to(_other(
        CACHE_DTYPES, a["key"].dtype)(draw)) for n in ("key", "value")})),
    Bad("key_rank", "key", lambda a, draw: _with(a, key=_bad_rank(a["key"], draw))),
    Bad("value_dtype", "value", lambda a, draw: _with(a, value=a["value"].to(
        _other(CACHE_DTYPES, a["value"].dtype)(draw)))),
    Bad("value_shape", "value", lambda a, draw: _with(a, value=_grow_or_shrink(
        a["value"], draw(st.integers(0, 2)), draw))),
    Bad("kv_cache_heads", "kv_cache", lambda a, draw: _with(a, kv_cache=_grow_or_shrink(
        a["kv_cache"], draw(st.integers(2, 3)), draw))),
] + SLOT_MAPPING_BAD


@pytest.mark.parametrize("bad", KV_CACHE_UPDATE_BAD, ids=repr)
@properties(max_examples=4)
@given(w=cache_writes(CACHE_DTYPES, head_sizes=(2, 16), at_least_one_token=True),
       data=st.data())
def test_kv_cache_update_rejects(bad, w, data):
    key, value, kv_cache = slot_write_inputs(w, combined=True)
    args = dict(key=key, value=value, kv_cache=kv_cache,
                slot_mapping=torch.tensor(w["slots"], dtype=torch.int32))
    check_rejected(OPS["kv_cache_update"], bad.change(args, data.draw), bad)


# rotary_kv_cache_update
ROTARY_BAD = [
    Bad("qkv_rank", "qkv", lambda a, draw: _with(a, qkv=_bad_rank(a["qkv"], draw))),
    # JAX without x64 would give the handler float32: only the Python side sees float64.
    Bad("qkv_dtype", "qkv", lambda a, draw: _with(a, **{n: a[n].to(torch.float64) for n in (
        "qkv", "cos", "sin", "kv_cache")}), FRONT_END),
    Bad("kv_cache_dtype", "kv_cache", lambda a, draw: _with(a, kv_cache=a["kv_cache"].to(
        _other(DTYPES, a["kv_cache"].dtype)(draw)))),
    Bad("kv_cache_heads", "kv_cache", lambda a, draw: _with(a, kv_cache=_grow_or_shrink(
        a["kv_cache"], 2, draw))),
    Bad("head_size", "kv_cache", lambda a, draw: _with(a, **{n: _grow_or_shrink(
        a[n], a[n].dim() - 1, draw) for n in ("qkv", "cos", "sin")})),
    Bad("cos_dtype", "cos", lambda a, draw: _with(a, cos=a["cos"].to(
        _other(DTYPES, a["cos"].dtype)(draw)))),
    Bad("sin_shape", "sin", lambda a, draw: _with(a, sin=_grow_or_shrink(
        a["sin"], draw(st.integers(0, 1)), draw))),
] + SLOT_MAPPING_BAD


@pytest.mark.parametrize("bad", ROTARY_BAD, ids=repr)
@properties(max_examples=4)
@given(w=cache_writes(DTYPES, head_sizes=(2, 16), at_least_one_token=True),
       num_q_heads=st.integers(1, 3), data=st.data())
def test_rotary_kv_cache_update_rejects(bad, w, num_q_heads, data):
    args = rotary_write_inputs(w, num_q_heads)
    check_rejected(OPS["rotary_kv_cache_update"], bad.change(args, data.draw), bad)


# add_rms_norm
ADD_RMS_NORM_BAD = [
    Bad("x_rank", "x", lambda a, draw: _with(a, x=_bad_rank(a["x"], draw))),
    # JAX without x64 would give the handler float32: only the Python side sees float64.
    Bad("x_dtype", "x", lambda a, draw: _with(a, **{n: a[n].to(torch.float64) for n in (
        "x", "residual", "weight")}), FRONT_END),
    Bad("residual_shape", "residual", lambda a, draw: _with(a, residual=_grow_or_shrink(
        a["residual"], draw(st.integers(0, 1)), draw))),
    Bad("residual_dtype", "residual", lambda a, draw: _with(a, residual=a["residual"].to(
        _other(DTYPES, a["residual"].dtype)(draw)))),
    Bad("weight_shape", "weight", lambda a, draw: _with(a, weight=_grow_or_shrink(
        a["weight"], 0, draw))),
    Bad("weight_dtype", "weight", lambda a, draw: _with(a, weight=a["weight"].to(
        _other(DTYPES, a["weight"].dtype)(draw)))),
    Bad("eps_negative", "eps", lambda a, draw: _with(a, eps=-draw(st.sampled_from(
        [1e-6, 1.0, float("inf")])))),
]


@pytest.mark.parametrize("bad", ADD_RMS_NORM_BAD, ids=repr)
@properties(max_examples=4)
@given(num_tokens=st.integers(1, 9), hidden=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
       seed=seeds, data=st.data())
def test_add_rms_norm_rejects(bad, num_tokens, hidden, dtype, seed, data):
    gen = torch.Generator().manual_seed(seed)
    args = dict(x=randn((num_tokens, hidden), dtype, gen),
                residual=randn((num_tokens, hidden), dtype, gen),
                weight=randn((hidden,), dtype, gen), eps=1e-5)
    check_rejected(OPS["add_rms_norm"], bad.change(args, data.draw), bad)


# small_batch_linear
LINEAR_BAD = [
    Bad("x_rank", "x", lambda a, draw: _with(a, x=_bad_rank(a["x"], draw))),
    # JAX without x64 would give the handler float32: only the Python side sees float64.
    Bad("x_dtype", "x", lambda a, draw: _with(a, **{n: a[n].to(draw(st.sampled_from(
        [torch.float32, torch.int32]))) for n in ("x", "weight", "residual")})),
    Bad("weight_dtype", "weight", lambda a, draw: _with(a, weight=a["weight"].to(_other(
        [torch.float16, torch.bfloat16, torch.float32], a["weight"].dtype)(draw)))),
    Bad("in_features", "weight", lambda a, draw: _with(a, weight=_grow_or_shrink(
        a["weight"], 1, draw))),
    Bad("residual_shape", "residual", lambda a, draw: _with(a, residual=_grow_or_shrink(
        a["residual"], draw(st.integers(0, 1)), draw))),
    Bad("residual_dtype", "residual", lambda a, draw: _with(a, residual=a["residual"].to(_other(
        [torch.float16, torch.bfloat16, torch.float32], a["residual"].dtype)(draw)))),
    Bad("silu_gate_value", "silu_gate", lambda a, draw: _with(
        a, silu_gate=draw(st.sampled_from([-1, 2, 7])))),
    Bad("silu_gate_with_residual", "residual", lambda a, draw: _with(a, silu_gate=1)),
]


@pytest.mark.parametrize("bad", LINEAR_BAD, ids=repr)
@properties(max_examples=4)
@given(num_tokens=st.integers(1, 9), in_features=st.integers(1, 40),
       out_features=st.integers(1, 20), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       seed=seeds, data=st.data())
def test_small_batch_linear_rejects(bad, num_tokens, in_features, out_features, dtype, seed,
                                    data):
    gen = torch.Generator().manual_seed(seed)
    args = dict(x=randn((num_tokens, in_features), dtype, gen),
                weight=randn((2 * out_features, in_features), dtype, gen),
                residual=randn((num_tokens, 2 * out_features), dtype, gen), silu_gate=0)
    check_rejected(OPS["small_batch_linear"], bad.change(args, data.draw), bad)


# kv_cache_update_slices
def _slice_column(a, draw):
    return draw(st.integers(0, int(a["num_kv_update_slices"][0]) - 1))


def _bad_slice(a, draw):
    """One used column (cache_start, new_kv_start, length) reaching out of kv or the cache."""
    slices = a["slot_mapping"].clone()
    i = _slice_column(a, draw)
    rows, new_rows = a["kv_cache"].shape[0], a["kv"].shape[0]
    start, new_start, length = (int(x) for x in slices[:, i])
    how = draw(st.sampled_from(["start<0", "new<0", "length<0", "past cache", "past kv",
                                "int32 overflow"]))
    if how == "start<0":
        start = _data(draw, -INT32_MAX - 1, -1)
    elif how == "new<0":
        new_start = _data(draw, -INT32_MAX - 1, -1)
    elif how == "length<0":
        length = _data(draw, -INT32_MAX - 1, -1)
    elif how == "past cache":
        start = _data(draw, rows - length + 1, INT32_MAX)
    elif how == "past kv":
        new_start = _data(draw, new_rows - length + 1, INT32_MAX)
    else:  # start + length wraps around in 32 bits
        start, length = INT32_MAX - draw(st.integers(0, 3)), _data(draw, 4, INT32_MAX)
    slices[:, i] = torch.tensor([start, new_start, length], dtype=torch.int32)
    return _with(a, slot_mapping=slices)


KV_CACHE_UPDATE_SLICES_BAD = [
    Bad("kv_cache_rank", "kv_cache", lambda a, draw: _with(a, kv_cache=_bad_rank(
        a["kv_cache"], draw))),
    Bad("kv_cache_dtype", "kv_cache", lambda a, draw: _with(a, **{n: a[n].to(draw(
        st.sampled_from([torch.float64, torch.int8]))) for n in ("kv", "kv_cache")}), FRONT_END),
    Bad("kv_dtype", "kv", lambda a, draw: _with(a, kv=a["kv"].to(
        _other(CACHE_DTYPES, a["kv"].dtype)(draw)))),
    Bad("kv_rank", "kv", lambda a, draw: _with(a, kv=_bad_rank(a["kv"], draw))),
    Bad("kv_cache_row_shape", "kv_cache", lambda a, draw: _with(a, kv_cache=_grow_or_shrink(
        a["kv_cache"], draw(st.integers(1, 2)), draw))),
    Bad("slot_mapping_dtype", "slot_mapping", lambda a, draw: _with(a, slot_mapping=a[
        "slot_mapping"].to(draw(st.sampled_from([torch.int64, torch.int16]))))),
    Bad("slot_mapping_shape", "slot_mapping", lambda a, draw: _with(a, slot_mapping=draw(
        st.sampled_from([a["slot_mapping"][:2], a["slot_mapping"][0],
                         torch.cat([a["slot_mapping"], a["slot_mapping"][:1]])])))),
    Bad("num_slices_dtype", "num_kv_update_slices", lambda a, draw: _with(
        a, num_kv_update_slices=a["num_kv_update_slices"].long())),
    Bad("num_slices_size", "num_kv_update_slices", lambda a, draw: _with(
        a, num_kv_update_slices=draw(st.sampled_from([
            a["num_kv_update_slices"][:0], a["num_kv_update_slices"].repeat(2)])))),
    # [1, 1]: one element, which the handler reads; only the Python side wants shape [1].
    Bad("num_slices_rank", "num_kv_update_slices", lambda a, draw: _with(
        a, num_kv_update_slices=a["num_kv_update_slices"][None]), FRONT_END),
    Bad("page_size", "page_size", lambda a, draw: _with(a, page_size=draw(st.one_of(
        st.integers(-2 ** 40, 0),
        st.integers(1, 1000).filter(lambda p: a["kv_cache"].shape[0] % p))))),
    Bad("num_slices_per_block", "num_slices_per_block", lambda a, draw: _with(
        a, num_slices_per_block=draw(st.integers(-2 ** 40, 0)))),
    # Data: the count of used columns, and the columns themselves.
    Bad("num_slices_out_of_range", "num_kv_update_slices", lambda a, draw: _with(
        a, num_kv_update_slices=torch.tensor([draw(st.one_of(
            st.integers(-INT32_MAX - 1, -1),
            st.integers(a["slot_mapping"].shape[1] + 1, INT32_MAX)))], dtype=torch.int32))),
    Bad("slice_out_of_range", "slot_mapping", _bad_slice),
]


@pytest.mark.parametrize("bad", KV_CACHE_UPDATE_SLICES_BAD, ids=repr)
@properties(max_examples=4)
@given(w=cache_writes(CACHE_DTYPES, block_sizes=(1, 3, 4, 8), head_sizes=(2, 16),
                      at_least_one_token=True),
       extra_columns=st.integers(0, 2), data=st.data())
def test_kv_cache_update_slices_rejects(bad, w, extra_columns, data):
    args = slice_write_inputs(w, extra_columns, junk=list(range(-3, 3 * 64)))
    args["num_slices_per_block"] = 4
    check_rejected(OPS["kv_cache_update_slices"], bad.change(args, data.draw), bad)


# ragged_paged_attention
def _ragged_seq(a, draw, with_rows=False):
    """A sequence in use (one with query rows, if with_rows)."""
    n = int(a["num_seqs"][0])
    q_lens = (a["cu_q_lens"][1:n + 1] - a["cu_q_lens"][:n]).tolist()
    return draw(st.sampled_from([i for i in range(n) if q_lens[i] > 0 or not with_rows]))


def _used_page(a, draw):
    """(seq, p): a page-table entry a sequence in use reads."""
    n, page_size = int(a["num_seqs"][0]), a["kv_pages"].shape[1]
    seq = draw(st.sampled_from([i for i in range(n) if a["kv_lens"][i] > 0]))
    return seq, draw(st.integers(0, (int(a["kv_lens"][seq]) - 1) // page_size))


def _q_len(a, seq):
    return int(a["cu_q_lens"][seq + 1] - a["cu_q_lens"][seq])


def _fresh_kv_pages(a, draw, dim, values):
    shape = list(a["kv_pages"].shape)
    shape[dim] = draw(st.sampled_from(values))
    return _fresh(tuple(shape), a["kv_pages"].dtype)


RAGGED_BAD = [
    Bad("q_dtype", "q", lambda a, draw: _with(a, q=a["q"].to(
        draw(st.sampled_from([torch.int32, torch.float64, FP8]))))),
    Bad("q_rank", "q", lambda a, draw: _with(a, q=_bad_rank(a["q"], draw))),
    Bad("q_head_dim", "q", lambda a, draw: _with(a, q=_fresh(
        a["q"].shape[:2] + (draw(st.sampled_from([1, 32, 48, 65, 160, 512])),), a["q"].dtype))),
    Bad("kv_pages_dtype", "kv_pages", lambda a, draw: _with(a, kv_pages=a["kv_pages"].to(_other(
        DTYPES + [torch.float64], a["q"].dtype)(draw)) if a["kv_pages"].dtype != FP8 else
        a["kv_pages"].to(torch.float64))),
    Bad("kv_pages_fp8_with_f32_q", "kv_pages", lambda a, draw: _with(
        a, q=a["q"].float(), kv_pages=a["kv_pages"].to(FP8))),
    Bad("kv_pages_rank", "kv_pages", lambda a, draw: _with(a, kv_pages=_bad_rank(
        a["kv_pages"], draw))),
    Bad("kv_pages_head_dim", "kv_pages", lambda a, draw: _with(a, kv_pages=_fresh_kv_pages(
        a, draw, 3, [d for d in (32, 80, 128, 65) if d != a["q"].shape[2]]))),
    Bad("page_size", "kv_pages", lambda a, draw: _with(a, kv_pages=_fresh_kv_pages(
        a, draw, 1, [1, 4, 12, 24, 256]))),
    Bad("combined_heads", "kv_pages", lambda a, draw: _with(a, kv_pages=_fresh_kv_pages(
        a, draw, 2, [0, 1, a["kv_pages"].shape[2] + 1] + (
            [2 * (a["q"].shape[1] + 1)] if a["q"].shape[1] > 1 else [])))),
    Bad("gqa_group_beyond_16", "kv_pages", lambda a, draw: _with(a, q=_fresh(
        (a["q"].shape[0], 17 * a["kv_pages"].shape[2] // 2, a["q"].shape[2]), a["q"].dtype))),
    Bad("kv_lens_dtype", "kv_lens", lambda a, draw: _with(a, kv_lens=a["kv_lens"].long())),
    Bad("kv_lens_shape", "kv_lens", lambda a, draw: _with(a, kv_lens=_grow_or_shrink(
        a["kv_lens"], 0, draw) if draw(st.booleans()) else a["kv_lens"][None])),
    Bad("page_indices_dtype", "page_indices", lambda a, draw: _with(a, page_indices=a[
        "page_indices"].to(draw(st.sampled_from([torch.int64, torch.int16]))))),
    Bad("page_indices_rank", "page_indices", lambda a, draw: _with(a, page_indices=a[
        "page_indices"][None] if draw(st.booleans()) else a["page_indices"][0])),
    Bad("cu_q_lens_dtype", "cu_q_lens", lambda a, draw: _with(a, cu_q_lens=a[
        "cu_q_lens"].to(draw(st.sampled_from([torch.int64, torch.float32]))))),
    Bad("cu_q_lens_shape", "cu_q_lens", lambda a, draw: _with(a, cu_q_lens=_grow_or_shrink(
        a["cu_q_lens"], 0, draw))),
    Bad("num_seqs_dtype", "num_seqs", lambda a, draw: _with(a, num_seqs=a["num_seqs"].long())),
    Bad("num_seqs_shape", "num_seqs", lambda a, draw: _with(a, num_seqs=draw(st.sampled_from(
        [a["num_seqs"].repeat(2), a["num_seqs"][:0]])))),
    # Attributes: the handler takes 0 as "none" for sliding_window and soft_cap, and any
    # mask_value but NaN; only the Python side wants None, a cap > 0 and a finite mask.
    Bad("sm_scale", "sm_scale", lambda a, draw: _with(a, sm_scale=draw(st.sampled_from(
        [float("nan"), float("inf"), -float("inf"), 3.5e38])))),
    Bad("k_scale", "k_scale", lambda a, draw: _with(a, k_scale=draw(st.sampled_from(
        [float("nan"), float("inf"), -4e38])))),
    Bad("v_scale", "v_scale", lambda a, draw: _with(a, v_scale=draw(st.sampled_from(
        [float("nan"), float("inf")])))),
    Bad("sliding_window_negative", "sliding_window", lambda a, draw: _with(
        a, sliding_window=draw(st.integers(-INT32_MAX - 1, -1)))),
    Bad("sliding_window_zero_or_beyond_int32", "sliding_window", lambda a, draw: _with(
        a, sliding_window=draw(st.sampled_from([0, INT32_MAX + 1, 2 ** 40]))), FRONT_END),
    Bad("soft_cap", "soft_cap", lambda a, draw: _with(a, soft_cap=draw(st.one_of(
        st.sampled_from([float("nan"), float("inf"), -1.0, 3.5e38]),
        st.floats(max_value=-1e-30))))),
    Bad("soft_cap_zero", "soft_cap", lambda a, draw: _with(a, soft_cap=0.0), FRONT_END),
    Bad("mask_value_nan", "mask_value", lambda a, draw: _with(a, mask_value=float("nan"))),
    Bad("max_q_len_negative", "max_q_len", lambda a, draw: _with(
        a, max_q_len=draw(st.integers(-INT32_MAX - 1, -1)))),
    Bad("mask_value_infinite", "mask_value", lambda a, draw: _with(a, mask_value=draw(
        st.sampled_from([float("inf"), -float("inf"), -3.5e38]))), FRONT_END),
    # Data: the count, the row ranges, the lengths and the page ids they reach.
    Bad("num_seqs_out_of_range", "num_seqs", lambda a, draw: _with(a, num_seqs=torch.tensor(
        [draw(st.one_of(st.integers(-INT32_MAX - 1, -1),
                        st.integers(a["kv_lens"].shape[0] + 1, INT32_MAX)))], dtype=torch.int32))),
    Bad("first_row_negative", "cu_q_lens", lambda a, draw: _with(a, cu_q_lens=_set(
        a["cu_q_lens"], 0, _data(draw, -INT32_MAX - 1, -1)))),
    Bad("rows_decreasing", "cu_q_lens", lambda a, draw: (lambda seq: _with(a, cu_q_lens=_set(
        a["cu_q_lens"], seq + 1, int(a["cu_q_lens"][seq]) - _data(draw, 1, 2 ** 20))))(
        _ragged_seq(a, draw))),
    Bad("rows_beyond_batch", "cu_q_lens", lambda a, draw: _with(a, cu_q_lens=_set(
        a["cu_q_lens"], int(a["num_seqs"][0]), _data(draw, a["q"].shape[0] + 1, INT32_MAX)))),
    Bad("kv_len_below_q_len", "kv_lens", lambda a, draw: (lambda seq: _with(a, kv_lens=_set(
        a["kv_lens"], seq, _data(draw, -INT32_MAX - 1, _q_len(a, seq) - 1))))(
        _ragged_seq(a, draw, with_rows=True))),
    Bad("kv_len_beyond_pages", "kv_lens", lambda a, draw: _with(a, kv_lens=_set(
        a["kv_lens"], _ragged_seq(a, draw),
        _data(draw, a["page_indices"].shape[1] * a["kv_pages"].shape[1] + 1, INT32_MAX)))),
    Bad("page_id_negative", "page_indices", lambda a, draw: _with(a, page_indices=_set(
        a["page_indices"], _used_page(a, draw), _data(draw, -INT32_MAX - 1, -1)))),
    Bad("page_id_beyond_cache", "page_indices", lambda a, draw: _with(a, page_indices=_set(
        a["page_indices"], _used_page(a, draw),
        _data(draw, a["kv_pages"].shape[0], INT32_MAX)))),
]


@pytest.mark.parametrize("bad", RAGGED_BAD, ids=repr)
# The handler path passes attributes as float32, as XLA would: 3.5e38 becomes inf on purpose.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@properties(max_examples=3)
@given(args=ragged_batches(head_dims=(64, 128), page_sizes=(8, 16), at_least_one_row=True),
       data=st.data())
def test_ragged_paged_attention_rejects(bad, args, data):
    check_rejected(OPS["ragged_paged_attention"], bad.change(args, data.draw), bad)
