"""Our ops under XLA SPMD through JAX, on 4 virtual CPU devices
(--xla_force_host_platform_device_count=4, set by the Bazel target): jit with sharded
arguments (the ops' custom partitioning), the shard_map helper (jax_ops.sharded) and torchax,
each against the same op run on one device, and the compiled HLO free of collectives when the
sharding is one the kernels split (heads, batch)."""

import functools
import re
import warnings

import jax

jax.config.update("jax_enable_x64", True)  # reshape_and_cache's slot_mapping is int64

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from torch_xla_ext import jax_ops, sample_inputs  # noqa: E402
from torch_xla_ext.errors import TorchXlaExtError  # noqa: E402
from torch_xla_ext.partitioning import ShardingWarning  # noqa: E402

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)(-start)?\(")
CACHE_COPY = re.compile(r"= f32\[\d+,\d+,\d+,\d+\]\S* copy\(")  # a copy of a (local) cache


def _mesh(**axes):
    """A mesh of the first devices, e.g. _mesh(dp=2, tp=2)."""
    shape = tuple(axes.values())
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), tuple(axes))


def _np(t):
    return t.numpy()


def _paged(num_seqs=4, heads=8, kv_heads=4, alibi=False):
    inputs = sample_inputs.paged_attention([20, 33, 5, 17][:num_seqs], heads, kv_heads, 64, 16,
                                           torch.float32, seed=3)
    args = {k: _np(v) for k, v in inputs.items()}
    args["alibi_slopes"] = (np.linspace(-0.5, -0.05, heads).astype(np.float32) if alibi
                            else None)
    return args


def _slot_writes(kv_heads=4, combined=False):
    g = torch.Generator().manual_seed(0)
    key, value = (torch.randn(5, kv_heads, 64, generator=g) for _ in range(2))
    shape = (6, 16, 2 * kv_heads, 64) if combined else (6, 16, kv_heads, 64)
    return key.numpy(), value.numpy(), torch.randn(*shape, generator=g).numpy()


def _ragged(kv_heads=4):
    inputs = sample_inputs.ragged_paged_attention([5, 1, 16, 3], [37, 9, 16, 40], num_q_heads=8,
                                                  num_kv_heads=kv_heads, head_dim=64,
                                                  page_size=16, dtype=torch.float32,
                                                  max_num_seqs=6, padding_rows=3)
    return {k: _np(v) for k, v in inputs.items()}


def _put(mesh, arrays, specs):
    return [None if x is None else jax.device_put(jnp.copy(x), NamedSharding(mesh, spec))
            for x, spec in zip(arrays, specs)]


def _run_sharded(fn, mesh, arrays, specs, donate=()):
    """fn jitted over arrays placed with specs: (results as NumPy, compiled HLO text)."""
    placed = _put(mesh, arrays, specs)
    step = jax.jit(fn, donate_argnums=donate)
    text = step.lower(*placed).compile().as_text()
    out = jax.block_until_ready(step(*placed))
    for index in donate:
        assert placed[index].is_deleted()  # donated: the result took its buffers
    return jax.tree.map(np.asarray, out), text


def _run_one_device(fn, arrays):
    device = jax.devices()[0]
    return jax.tree.map(np.asarray, jax.jit(fn)(*[None if x is None else
                                                  jax.device_put(x, device) for x in arrays]))


def _assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def _attention(scale=0.125, softcap=0.0):
    return lambda q, k, v, bt, sl, al: jax_ops.paged_attention(q, k, v, bt, sl, scale, softcap,
                                                               al)


HEADS = P(None, "x", None)  # [seqs or tokens, heads, head_size]
CACHE_HEADS = P(None, None, "x", None)  # [blocks, block_size, heads, head_size]


@pytest.mark.parametrize("devices, alibi, softcap", [(2, False, 0.0), (4, True, 30.0)])
def test_paged_attention_heads_split_runs_locally(devices, alibi, softcap):
    mesh = _mesh(x=devices)
    a = _paged(alibi=alibi)
    arrays = [a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["seq_lens"],
              a["alibi_slopes"]]
    specs = [HEADS, CACHE_HEADS, CACHE_HEADS, P(), P(), P("x")]
    fn = _attention(softcap=softcap)
    got, text = _run_sharded(fn, mesh, arrays, specs)
    _assert_same(got, _run_one_device(fn, arrays))
    assert "xla_ext.paged_attention" in text and not COLLECTIVES.search(text)


def test_paged_attention_query_split_pulls_replicated_caches_apart_locally():
    """Only the query arrives split: each device takes its heads' slice of the replicated
    caches (no communication) and runs on it."""
    mesh = _mesh(x=2)
    a = _paged()
    arrays = [a[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    fn = functools.partial(jax_ops.paged_attention, scale=0.125)
    got, text = _run_sharded(fn, mesh, arrays, [HEADS, P(), P(), P(), P()])
    _assert_same(got, _run_one_device(fn, arrays))
    assert not COLLECTIVES.search(text)


def test_paged_attention_batch_split_and_2d_mesh():
    """Sequences over one axis (caches replicated over it), heads over the other."""
    a = _paged()
    arrays = [a[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    fn = functools.partial(jax_ops.paged_attention, scale=0.125)
    want = _run_one_device(fn, arrays)
    got, text = _run_sharded(fn, _mesh(x=4), arrays, [P("x"), P(), P(), P("x"), P("x")])
    _assert_same(got, want)
    assert not COLLECTIVES.search(text)
    got, text = _run_sharded(fn, _mesh(dp=2, tp=2), arrays,
                             [P("dp", "tp"), P(None, None, "tp"), P(None, None, "tp"), P("dp"),
                              P("dp")])
    _assert_same(got, want)
    assert not COLLECTIVES.search(text)


def test_reshape_and_cache_heads_split_writes_donated_caches_in_place():
    mesh = _mesh(x=2)
    key, value, cache = _slot_writes()
    value_cache = cache[::-1].copy()
    slots = np.array([0, 3, 40, -1, 95], dtype=np.int64)
    arrays = [key, value, cache, value_cache, slots]
    got, text = _run_sharded(jax_ops.reshape_and_cache, mesh, arrays,
                             [HEADS, HEADS, CACHE_HEADS, CACHE_HEADS, P()], donate=(2, 3))
    _assert_same(got, _run_one_device(jax_ops.reshape_and_cache, arrays))
    assert not COLLECTIVES.search(text)
    assert text.splitlines()[0].count("may-alias") == 2 and not CACHE_COPY.search(text)


def test_kv_cache_update_heads_split_keeps_k_and_v_pairs_together():
    """kv_cache [pages, page_size, 2 * kv_heads, head_size]: 4 kv heads over 2 devices puts
    combined heads 0-3 (K and V of kv heads 0, 1) on the first, as the keys' split does."""
    mesh = _mesh(x=2)
    key, value, cache = _slot_writes(combined=True)
    arrays = [key, value, cache, np.array([0, 3, 40, -1, 95], dtype=np.int32)]
    got, text = _run_sharded(jax_ops.kv_cache_update, mesh, arrays,
                             [HEADS, HEADS, CACHE_HEADS, P()], donate=(2,))
    _assert_same(got, _run_one_device(jax_ops.kv_cache_update, arrays))
    assert not COLLECTIVES.search(text)
    assert "may-alias" in text.splitlines()[0] and not CACHE_COPY.search(text)


def test_kv_cache_update_slices_heads_split():
    mesh = _mesh(x=4)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(9, 8, 64, generator=g).numpy()
    cache = torch.randn(64, 8, 64, generator=g).numpy()
    slices = np.ones((3, 6), dtype=np.int32)
    slices[:, :3] = np.array([[5, 0, 4], [16, 4, 3], [40, 7, 2]], dtype=np.int32).T
    fn = functools.partial(jax_ops.kv_cache_update_slices, page_size=16, num_slices_per_block=8)
    arrays = [kv, slices, cache, np.array([3], dtype=np.int32)]
    got, text = _run_sharded(fn, mesh, arrays, [HEADS, P(), HEADS, P()], donate=(2,))
    _assert_same(got, _run_one_device(fn, arrays))
    assert not COLLECTIVES.search(text)


def test_ragged_paged_attention_heads_split():
    mesh = _mesh(x=4)
    r = _ragged()
    arrays = [r[k] for k in ("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens",
                             "num_seqs")]
    fn = functools.partial(jax_ops.ragged_paged_attention, sm_scale=0.125, soft_cap=20.0)
    got, text = _run_sharded(fn, mesh, arrays, [HEADS, CACHE_HEADS, P(), P(), P(), P()])
    _assert_same(got, _run_one_device(fn, arrays))
    assert not COLLECTIVES.search(text)


def test_ragged_v3_heads_split_writes_then_attends_in_place():
    """The fused step (slots from the metadata, KV write, attention): the metadata math runs
    replicated on every device, the two custom calls on each device's heads."""
    mesh = _mesh(x=2)
    r = _ragged()
    g = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(r["q"].shape[0], 4, 64, generator=g).numpy() for _ in range(2))
    distribution = np.array([0, 0, 4], dtype=np.int32)
    fn = functools.partial(jax_ops.ragged_paged_attention_v3, sm_scale=0.125)
    arrays = [r["q"], keys, values, r["kv_pages"], r["kv_lens"], r["page_indices"],
              r["cu_q_lens"], distribution]
    got, text = _run_sharded(fn, mesh, arrays,
                             [HEADS, HEADS, HEADS, CACHE_HEADS, P(), P(), P(), P()], donate=(3,))
    _assert_same(got, _run_one_device(fn, arrays))
    assert not COLLECTIVES.search(text) and not CACHE_COPY.search(text)


def test_simple_add_any_sharding():
    mesh = _mesh(x=2, y=2)
    a, b = (np.arange(48, dtype=np.float32).reshape(8, 6) * s for s in (1.0, -0.5))
    got, text = _run_sharded(jax_ops.simple_add, mesh, [a, b], [P("x", "y"), P("x", "y")])
    np.testing.assert_array_equal(got, a + b)
    assert not COLLECTIVES.search(text)
    got, _ = _run_sharded(jax_ops.simple_add, mesh, [a, b], [P(None, "x"), P("y")])
    np.testing.assert_array_equal(got, a + b)


@pytest.mark.parametrize("case, devices, specs, message", [
    ("head_size split", 4, [P(None, None, "x"), P(), P(), P(), P()],
     r"'query' dimension 2 \(head_size\) arrives split over mesh axes \['x'\]: the kernel "
     r"needs head_size whole"),
    ("kv heads not divisible", 4, [HEADS, P(), P(), P(), P()],
     r"2 kv_heads do not divide evenly over the 4 devices of axes \['x'\]"),
    ("cache blocks split", 2, [P(), P("x"), P("x"), P(), P()],
     r"'key_cache' dimension 0 \(blocks\) arrives split over mesh axes \['x'\]: the kernel "
     r"needs blocks whole"),
])
def test_unsupported_sharding_is_gathered_with_a_warning(case, devices, specs, message):
    """A split the kernel cannot run is undone by an all-gather XLA inserts before the call
    (documented in the README), with a ShardingWarning saying which dimension and why; the
    result is still right."""
    a = _paged(kv_heads=2)
    arrays = [a[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    fn = functools.partial(jax_ops.paged_attention, scale=0.125)
    with pytest.warns(ShardingWarning, match=message):
        got, text = _run_sharded(fn, _mesh(x=devices), arrays, specs)
    _assert_same(got, _run_one_device(fn, arrays))
    assert "all-gather" in text


def test_gspmd_partitioner_uses_the_same_rules():
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        a = _paged()
        arrays = [a[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
        fn = functools.partial(jax_ops.paged_attention, scale=0.125)
        got, text = _run_sharded(fn, _mesh(x=2), arrays,
                                 [HEADS, CACHE_HEADS, CACHE_HEADS, P(), P()])
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)
    _assert_same(got, _run_one_device(fn, arrays))
    assert not COLLECTIVES.search(text)


def test_shard_map_helper_runs_each_devices_heads():
    mesh = _mesh(x=4)
    a = _paged()
    arrays = [a[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    attention = jax.jit(functools.partial(jax_ops.sharded("paged_attention", mesh, heads="x"),
                                          scale=0.125))
    text = attention.lower(*arrays).compile().as_text()
    _assert_same(np.asarray(attention(*arrays)),
                 _run_one_device(functools.partial(jax_ops.paged_attention, scale=0.125), arrays))
    assert not COLLECTIVES.search(text)

    key, value, cache = _slot_writes(combined=True)
    slots = np.array([0, 3, 40, -1, 95], dtype=np.int32)
    write = jax.jit(jax_ops.sharded("kv_cache_update", mesh, heads="x"))
    _assert_same(np.asarray(write(key, value, cache, slots)),
                 _run_one_device(jax_ops.kv_cache_update, [key, value, cache, slots]))


@pytest.mark.parametrize("name, kwargs, message", [
    ("paged_attention", {"heads": "x", "batch": "x"},
     r"cannot split seqs over mesh axes \['x'\]: mesh axes \['x'\] already split kv_heads"),
    ("kv_cache_update", {"batch": "x"}, r"batch='x': this op has no batch dimension"),
    ("paged_attention", {"heads": "y"}, r"the mesh has no axes \['y'\]"),
    ("attention", {"heads": "x"}, r"name: expected one of \["),
])
def test_shard_map_helper_refuses_what_the_op_cannot_split(name, kwargs, message):
    a = _paged()
    with pytest.raises(TorchXlaExtError, match=message):
        jax_ops.sharded(name, _mesh(x=4), **kwargs)(
            a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["seq_lens"],
            0.125)


def test_heads_that_do_not_divide_are_refused_by_the_helper():
    a = _paged(kv_heads=2)
    with pytest.raises(TorchXlaExtError, match=r"2 kv_heads do not divide evenly over the 4"):
        jax_ops.sharded("paged_attention", _mesh(x=4), heads="x")(
            a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["seq_lens"],
            0.125)


def test_torchax_step_with_sharded_jax_arrays():
    """torchax lowers torch.ops.xla_ext.* to jax_ops, so a torch step over head-split arrays
    is partitioned by the same rules."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import torch_xla_ext.torchax_ops  # noqa: F401  (before the environment exists)
    import torchax
    import torchax.interop

    env = torchax.default_env()
    mesh = _mesh(x=2)
    a = _paged()
    key, value, _ = _slot_writes()
    slots = np.array([5, 40, 70, 100], dtype=np.int64)

    def step(query, key, value, key_cache, value_cache, block_tables, seq_lens, slots):
        torch.ops.xla_ext.reshape_and_cache(key, value, key_cache, value_cache, slots)
        return torch.ops.xla_ext.paged_attention(query, key_cache, value_cache, block_tables,
                                                 seq_lens, 0.125), key_cache

    arrays = [a["query"], key[:4], value[:4], a["key_cache"], a["value_cache"],
              a["block_tables"], a["seq_lens"], slots]
    jitted = torchax.interop.jax_jit(step)

    def run(placed):
        with env:
            out = jitted(*[torchax.tensor.Tensor(x, env) for x in placed])
        return [np.asarray(t.jax()) for t in out], out[0].jax().sharding

    want, _ = run([jax.device_put(x, jax.devices()[0]) for x in arrays])
    got, sharding = run(_put(mesh, arrays, [HEADS, HEADS, HEADS, CACHE_HEADS, CACHE_HEADS, P(),
                                            P(), P()]))
    _assert_same(got, want)
    assert sharding.spec == P(None, "x")
