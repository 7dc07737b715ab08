"""Our ops under torch_xla SPMD on 4 CPU devices (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4, set by
the Bazel target): torch_xla_ext.spmd.sharded runs each op on each device's heads (or
sequences) inside manual sharding, as torch_xla's Pallas kernels do. Results against the same
op on CPU tensors (the same Host handlers, one device), and XLA's optimised HLO of each step
(dumped by this process) free of collectives and of cache copies, the caches donated."""

import glob
import os
import re
import tempfile

_DUMP = tempfile.mkdtemp(prefix="spmd_hlo_")
# Read when torch_xla starts its client, i.e. at the first device use below.
os.environ["XLA_FLAGS"] = f"--xla_dump_to={_DUMP} --xla_dump_hlo_as_text"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()

import torch_xla_ext  # noqa: E402,F401
from torch_xla_ext import sample_inputs, spmd  # noqa: E402
from torch_xla_ext.errors import TorchXlaExtError  # noqa: E402

DEVICES = 4
COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)(-start)?\(")


@pytest.fixture(scope="module")
def mesh():
    assert xr.global_runtime_device_count() == DEVICES, "run with CPU_NUM_DEVICES=4"
    return xs.Mesh(np.arange(DEVICES), (DEVICES,), ("x",))


def _step_module(target):
    """The optimised HLO of the latest step that called `target`."""
    paths = sorted(glob.glob(os.path.join(_DUMP, "*SyncTensorsGraph*after_optimizations.txt")))
    modules = [open(p).read() for p in paths]
    modules = [m for m in modules if f'custom_call_target="{target}"' in m]
    assert modules, f"no step called {target}"
    return modules[-1]


def _assert_local(module, donated=0):
    """No collective; `donated` caches aliased to their new values, none copied."""
    assert not COLLECTIVES.search(module)
    assert module.splitlines()[0].count("may-alias") == donated
    assert not re.search(r"= f32\[\d+,\d+,\d+(,\d+)?\]\S* copy\(", module)


def _to(device, tensors):
    return [None if t is None else t.to(device) for t in tensors]


@pytest.mark.parametrize("split", [{"heads": "x"}, {"batch": "x"}])
def test_paged_attention(mesh, split):
    inputs = sample_inputs.paged_attention([20, 33, 5, 17], 8, 4, 64, 16, torch.float32, seed=3)
    args = [*inputs.values(), 0.125, 30.0, torch.linspace(-0.5, -0.05, 8)]
    want = torch.ops.xla_ext.paged_attention(*args)
    on_xla = _to(torch_xla.device(), args[:5]) + args[5:7] + _to(torch_xla.device(), args[7:])
    out = spmd.sharded("paged_attention", mesh, **split)(*on_xla)
    torch_xla.sync()
    assert torch.equal(out.cpu(), want)
    tiles = "[1,4,1]" if "heads" in split else "[4,1,1]"
    assert torch_xla._XLAC._get_xla_sharding_spec(out) == f"{{devices={tiles}0,1,2,3}}"
    _assert_local(_step_module("xla_ext.paged_attention"))


def _cache_on(mesh, cache, spec):
    on_xla = cache.to(torch_xla.device())
    xs.mark_sharding(on_xla, mesh, spec)
    return on_xla


def test_reshape_and_cache_writes_the_sharded_caches_in_place(mesh):
    g = torch.Generator().manual_seed(0)
    key, value = (torch.randn(5, 4, 64, generator=g) for _ in range(2))
    caches = [torch.randn(6, 16, 4, 64, generator=g) for _ in range(2)]
    slots = torch.tensor([0, 3, 40, -1, 95])
    want = [c.clone() for c in caches]
    torch.ops.xla_ext.reshape_and_cache(key, value, *want, slots)
    on_xla = [_cache_on(mesh, c, (None, None, "x", None)) for c in caches]
    torch_xla.sync()
    spmd.sharded("reshape_and_cache", mesh, heads="x")(
        *_to(torch_xla.device(), [key, value]), *on_xla, slots.to(torch_xla.device()))
    torch_xla.sync()
    for got, expected in zip(on_xla, want):
        assert torch.equal(got.cpu(), expected)
        assert torch_xla._XLAC._get_xla_sharding_spec(got) == "{devices=[1,1,4,1]0,1,2,3}"
    _assert_local(_step_module("xla_ext.reshape_and_cache"), donated=2)


def test_kv_cache_update_then_ragged_attention_in_one_step(mesh):
    """vLLM's TPU layer order: write this step's K/V into the combined cache, then attend."""
    inputs = sample_inputs.ragged_paged_attention([5, 1, 16, 3], [37, 9, 16, 40], num_q_heads=8,
                                                  num_kv_heads=4, head_dim=64, page_size=16,
                                                  dtype=torch.float32, max_num_seqs=6)
    g = torch.Generator().manual_seed(1)
    key, value = (torch.randn(3, 4, 64, generator=g) for _ in range(2))
    slots = torch.tensor([36, 8, 100], dtype=torch.int32)
    metadata = [inputs[k] for k in ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")]
    cache = inputs["kv_pages"].clone()
    torch.ops.xla_ext.kv_cache_update(key, value, cache, slots)
    want = torch.ops.xla_ext.ragged_paged_attention(inputs["q"], cache, *metadata, 0.125)

    dev = torch_xla.device()
    on_xla = _cache_on(mesh, inputs["kv_pages"], (None, None, "x", None))
    torch_xla.sync()
    spmd.sharded("kv_cache_update", mesh, heads="x")(key.to(dev), value.to(dev), on_xla,
                                                      slots.to(dev))
    out = spmd.sharded("ragged_paged_attention", mesh, heads="x")(
        inputs["q"].to(dev), on_xla, *_to(dev, metadata), 0.125)
    torch_xla.sync()
    assert torch.equal(on_xla.cpu(), cache)
    assert torch.equal(out.cpu(), want)
    module = _step_module("xla_ext.ragged_paged_attention")
    assert 'custom_call_target="xla_ext.kv_cache_update"' in module
    _assert_local(module, donated=1)


def test_kv_cache_update_slices_heads_copied_back_as_vllm_does(mesh):
    g = torch.Generator().manual_seed(0)
    kv, cache = torch.randn(9, 8, 64, generator=g), torch.randn(64, 8, 64, generator=g)
    slices = torch.ones(3, 6, dtype=torch.int32)
    slices[:, :3] = torch.tensor([[5, 0, 4], [16, 4, 3], [40, 7, 2]], dtype=torch.int32).T
    num = torch.tensor([3], dtype=torch.int32)
    want = torch.ops.xla_ext.kv_cache_update_slices(kv, slices, cache, num, 16, 8)
    dev = torch_xla.device()
    on_xla = _cache_on(mesh, cache, (None, "x", None))
    torch_xla.sync()
    new = spmd.sharded("kv_cache_update_slices", mesh, heads="x")(
        kv.to(dev), slices.to(dev), on_xla, num.to(dev), 16, 8)
    on_xla.copy_(new)
    del new  # only the cache outlives the step: its buffer is donated to the new value
    torch_xla.sync()
    assert torch.equal(on_xla.cpu(), want)
    _assert_local(_step_module("xla_ext.kv_cache_update_slices"), donated=1)


def test_simple_add_batch(mesh):
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    out = spmd.sharded("simple_add", mesh, batch="x")(a.to(torch_xla.device()),
                                                       b.to(torch_xla.device()))
    torch_xla.sync()
    assert torch.equal(out.cpu(), a + b)


@pytest.mark.parametrize("name, kwargs, kv_heads, message", [
    ("paged_attention", {"heads": "x"}, 2,
     r"cannot split kv_heads over mesh axes \['x'\]: 2 kv_heads do not divide evenly over the "
     r"4 devices"),
    ("paged_attention", {"heads": "tp"}, 4, r"the mesh has no axes \['tp'\]"),
    ("reshape_and_cache", {"batch": "x"}, 4, r"batch='x': this op has no batch dimension"),
])
def test_splits_the_op_cannot_run_are_refused(mesh, name, kwargs, kv_heads, message):
    inputs = sample_inputs.paged_attention([20, 33], 8, kv_heads, 64, 16, torch.float32)
    args = _to(torch_xla.device(), inputs.values())
    if name == "reshape_and_cache":
        args = [args[0][:, :4], args[0][:, 4:], args[1], args[2],
                torch.tensor([1, 2], device=torch_xla.device())]
    else:
        args.append(0.125)
    with pytest.raises(TorchXlaExtError, match=message):
        spmd.sharded(name, mesh, **kwargs)(*args)


def test_the_plain_op_on_sharded_tensors_is_gathered(mesh):
    """Without the helper, XLA's partitioner sees an opaque custom call and gathers its
    operands onto every device (README: Several devices): correct, replicated, not split."""
    inputs = sample_inputs.paged_attention([20, 33, 5, 17], 8, 4, 64, 16, torch.float32, seed=4)
    want = torch.ops.xla_ext.paged_attention(*inputs.values(), 0.125)
    args = _to(torch_xla.device(), inputs.values())
    for tensor, spec in zip(args[:3], [(None, "x", None)] + [(None, None, "x", None)] * 2):
        xs.mark_sharding(tensor, mesh, spec)
    out = torch.ops.xla_ext.paged_attention(*args, 0.125)
    torch_xla.sync()
    assert torch.equal(out.cpu(), want)
    assert torch_xla._XLAC._get_xla_sharding_spec(out) == "{replicated}"
    assert "all-gather" in _step_module("xla_ext.paged_attention")
