"""KV-cache writes through torch_xla (PJRT_DEVICE=CPU): torch.ops.xla_ext.kv_cache_update and
vLLM's torch.ops.xla.kv_cache_update_op, on XLA and CPU tensors, against the references."""

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import reference
from torch_xla_ext import sample_inputs


def _slot_inputs(dtype=torch.float32):
    """key, value, kv_cache [6 pages, 16, 4, 64], slots (token 1 skipped)."""
    return tuple(sample_inputs.kv_cache_update(5, 2, 64, 6, 16, dtype, skipped=1).values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_kv_cache_update_in_place_on_xla_and_cpu(xla_device, dtype):
    import torch_xla

    key, value, kv_cache, slots = _slot_inputs(dtype)
    want = reference.kv_cache_update_ref(key, value, kv_cache, slots)
    on_xla = kv_cache.to(xla_device)
    torch.ops.xla_ext.kv_cache_update(key.to(xla_device), value.to(xla_device), on_xla,
                                      slots.to(xla_device))
    torch_xla.sync()
    on_cpu = kv_cache.clone()
    torch.ops.xla_ext.kv_cache_update(key, value, on_cpu, slots)
    for got in (on_xla.cpu(), on_cpu):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _slice_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(9, 4, 64, generator=g)
    kv_cache = torch.randn(4 * 16, 4, 64, generator=g)
    slices = torch.full((3, 6), 1, dtype=torch.int32)  # columns past num_slices are junk
    slices[:, :3] = torch.tensor([[5, 0, 4], [16, 4, 3], [40, 7, 2]], dtype=torch.int32).T
    return kv, slices, kv_cache, torch.tensor([3], dtype=torch.int32)


def test_vllm_kv_cache_update_op_on_xla_and_cpu(xla_device):
    """vLLM's write_to_kv_cache, unchanged: the op returns the new cache, copied back."""
    import torch_xla

    kv, slices, kv_cache, num_slices = _slice_inputs()
    want = reference.kv_cache_update_slices_ref(kv, slices, kv_cache, num_slices)
    on_xla = kv_cache.to(xla_device)
    new_cache = torch.ops.xla.kv_cache_update_op(kv.to(xla_device), slices.to(xla_device), on_xla,
                                                 num_slices.to(xla_device), 16, 8)
    on_xla.copy_(new_cache)
    torch_xla.sync()
    assert torch.equal(on_xla.cpu(), want)
    got_cpu = torch.ops.xla.kv_cache_update_op(kv, slices, kv_cache, num_slices, 16, 8)
    assert torch.equal(got_cpu, want) and not torch.equal(kv_cache, want)


@pytest.mark.parametrize("op, args", [
    ("kv_cache_update", lambda: _slot_inputs()),
    ("kv_cache_update_functional", lambda: _slot_inputs()),
])
def test_opcheck(xla_device, op, args):
    torch.library.opcheck(getattr(torch.ops.xla_ext, op).default, args())


def test_opcheck_vllm_op(xla_device):
    torch.library.opcheck(torch.ops.xla.kv_cache_update_op.default, (*_slice_inputs(), 16, 8))


def test_bad_arguments_name_the_argument(xla_device):
    from torch_xla_ext import TorchXlaExtError

    key, value, kv_cache, slots = (t.to(xla_device) for t in _slot_inputs())
    with pytest.raises(TorchXlaExtError, match="argument 'slot_mapping': expected dtype int32"):
        torch.ops.xla_ext.kv_cache_update(key, value, kv_cache, slots.long())
    with pytest.raises(TorchXlaExtError, match=r"argument 'kv_cache': expected \[2 \* num_kv_heads"):
        torch.ops.xla_ext.kv_cache_update(key, value, kv_cache[:, :, :2], slots)
    kv, slices, cache, num_slices = (t.to(xla_device) for t in _slice_inputs())
    with pytest.raises(TorchXlaExtError, match="argument 'page_size': expected a positive divisor"):
        torch.ops.xla.kv_cache_update_op(kv, slices, cache, num_slices, 5, 8)


# A serving step's cache writes, run in a child process that dumps XLA's optimised HLO.
_STEP = textwrap.dedent("""
    import sys, torch, torch_xla, torch_xla_ext
    dev = torch_xla.device()
    layers, mode = 3, sys.argv[1]
    shape = {"reshape_and_cache": (64, 16, 2, 64), "kv_cache_update": (64, 16, 4, 64),
             "kv_cache_update_op": (64 * 16, 4, 64)}[mode]
    caches = [[torch.zeros(shape, device=dev) for _ in range(2 if mode == "reshape_and_cache" else 1)]
              for _ in range(layers)]
    torch_xla.sync()
    rows = torch.arange(3 * 128, dtype=torch.float32).reshape(3, 2, 64)
    for layer, cache in enumerate(caches):
        key, value = (rows + 1000 * layer).to(dev), (2 * rows - 1000 * layer).to(dev)
        if mode == "reshape_and_cache":
            torch.ops.xla_ext.reshape_and_cache(key, value, cache[0], cache[1],
                                                torch.tensor([3, 40, 700], device=dev))
        elif mode == "kv_cache_update":
            torch.ops.xla_ext.kv_cache_update(key, value, cache[0],
                                              torch.tensor([3, 40, 700], dtype=torch.int32, device=dev))
        else:  # vLLM's write_to_kv_cache: the op returns the new cache, copied back
            kv = torch.stack([key, value], dim=2).reshape(3, 4, 64)
            # (cache_start, new_kv_start, length): token 0 to row 3, tokens 1-2 to rows 40-41
            slices = torch.tensor([[3, 0, 1], [40, 1, 2]], dtype=torch.int32).T.contiguous()
            new = torch.ops.xla.kv_cache_update_op(kv, slices.to(dev), cache[0],
                                                   torch.tensor([2], dtype=torch.int32, device=dev),
                                                   16, 8)
            cache[0].copy_(new)
            del new  # as in vLLM: only the cache outlives the step
    torch_xla.sync()
    for layer, cache in enumerate(caches):
        if len(cache) == 2:  # separate K and V caches
            print(layer, float(cache[0].sum()), float(cache[1].sum()), flush=True)
        else:  # combined: K at even combined heads, V at odd ones
            print(layer, float(cache[0][..., 0::2, :].sum()), float(cache[0][..., 1::2, :].sum()),
                  flush=True)
""")


def _run_step(tmp_path, mode):
    """The printed per-layer sums, and the optimised HLO module of the step."""
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"),
               XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text")
    result = subprocess.run([sys.executable, "-c", _STEP, mode], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    modules = [open(p).read() for p in glob.glob(str(tmp_path / "*after_optimizations.txt"))]
    step = [m for m in modules if "custom_call_target=" in m]
    assert len(step) == 1
    return [line.split()[1:] for line in result.stdout.splitlines()], step[0]


def _cache_copies(module, shape):
    """Instructions of the optimised module that copy a whole cache."""
    type_ = "f32[" + ",".join(map(str, shape)) + "]"
    return [line for line in module.splitlines() if f"= {type_}" in line and " copy(" in line]


@pytest.mark.parametrize("mode, shape, num_caches", [
    ("reshape_and_cache", (64, 16, 2, 64), 6),  # K and V caches of the same shape, 3 layers
    ("kv_cache_update", (64, 16, 4, 64), 3),
    ("kv_cache_update_op", (64 * 16, 4, 64), 3),
])
def test_a_step_writes_every_cache_in_place(tmp_path, mode, shape, num_caches):
    """The step's optimised HLO donates every cache to its new value and copies none, and each
    cache (several of the same shape) holds its own rows afterwards."""
    sums, module = _run_step(tmp_path, mode)
    header = module.splitlines()[0]
    assert header.count("may-alias") == num_caches, header
    assert _cache_copies(module, shape) == []
    rows = torch.arange(3 * 128, dtype=torch.float32).reshape(3, 2, 64)
    for layer, got in enumerate(sums):
        key, value = rows + 1000 * layer, 2 * rows - 1000 * layer
        assert [float(x) for x in got] == [float(key.sum()), float(value.sum())]
