"""KV-cache writes through torch_xla (PJRT_DEVICE=CPU): torch.ops.xla_ext.kv_cache_update and
vLLM's torch.ops.xla.kv_cache_update_op, on XLA and CPU tensors, against the references."""

import pytest
import torch

from tests import reference


def _slot_inputs(dtype=torch.float32, num_tokens=5, kv_heads=2, head=64, pages=6, page=16,
                 seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, kv_heads, head, generator=g).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head, generator=g).to(dtype)
    kv_cache = torch.randn(pages, page, 2 * kv_heads, head, generator=g).to(dtype)
    slots = torch.randperm(pages * page, generator=g)[:num_tokens].int()
    slots[1] = -1
    return key, value, kv_cache, slots


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
