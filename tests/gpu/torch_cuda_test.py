"""torch.ops.xla_ext.* on CUDA tensors: the CUDA handlers, run on torch's current stream."""

import pytest
import torch

from tests import reference
from torch_xla_ext import sample_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", autouse=True)
def ops():
    import torch_xla_ext  # noqa: F401


def _inputs(dtype):
    return sample_inputs.paged_attention([1, 100, 200, 256], num_heads=32, num_kv_heads=8,
                                         head_size=128, block_size=16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_on_cuda_on_a_side_stream(dtype):
    inputs = _inputs(dtype)
    want = reference.paged_attention_ref(**inputs, scale=0.088)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = torch.ops.xla_ext.paged_attention(**{k: v.cuda() for k, v in inputs.items()},
                                                scale=0.088)
    stream.synchronize()
    atol, rtol = sample_inputs.TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu().double(), want, atol=atol, rtol=rtol)


def test_simple_add_and_reshape_and_cache_on_cuda():
    a, b = torch.randn(1000, 3), torch.randn(1000, 3)
    assert torch.equal(torch.ops.xla_ext.simple_add(a.cuda(), b.cuda()).cpu(), a + b)
    kc, vc = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.tensor([0, -1, 63])
    want_k, want_v = reference.reshape_and_cache_ref(key, value, kc, vc, slots)
    kc_cuda, vc_cuda = kc.cuda(), vc.cuda()
    torch.ops.xla_ext.reshape_and_cache(key.cuda(), value.cuda(), kc_cuda, vc_cuda, slots.cuda())
    assert torch.equal(kc_cuda.cpu(), want_k.float()) and torch.equal(vc_cuda.cpu(), want_v.float())


@pytest.mark.parametrize("op", ["simple_add", "paged_attention", "reshape_and_cache"])
def test_opcheck_on_cuda(op):
    args = {
        "simple_add": lambda: (torch.randn(3, 4).cuda(), torch.randn(3, 4).cuda()),
        "paged_attention": lambda: tuple(v.cuda() for v in _inputs(torch.float32).values())
        + (0.1,),
        "reshape_and_cache": lambda: (torch.randn(2, 2, 64).cuda(), torch.randn(2, 2, 64).cuda(),
                                      torch.randn(4, 16, 2, 64).cuda(),
                                      torch.randn(4, 16, 2, 64).cuda(),
                                      torch.tensor([5, -1]).cuda()),
    }[op]()
    torch.library.opcheck(getattr(torch.ops.xla_ext, op).default, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_kv_cache_update_on_cuda(dtype):
    g = torch.Generator().manual_seed(1)
    key = torch.randn(9, 2, 64, generator=g).to(dtype)
    value = torch.randn(9, 2, 64, generator=g).to(dtype)
    kv_cache = torch.randn(4, 16, 4, 64, generator=g).to(dtype)
    slots = torch.tensor([0, -1, 63, 17, 5, 6, 7, 40, 41], dtype=torch.int32)
    want = reference.kv_cache_update_ref(key, value, kv_cache, slots)
    on_cuda = kv_cache.cuda()
    torch.ops.xla_ext.kv_cache_update(key.cuda(), value.cuda(), on_cuda, slots.cuda())
    assert torch.equal(on_cuda.cpu().view(torch.uint8), want.view(torch.uint8))

    kv = torch.randn(9, 4, 64, generator=g).to(dtype)
    flat = kv_cache.reshape(64, 4, 64)
    slices = torch.tensor([[3, 0, 5], [16, 5, 1], [40, 6, 3], [1, 1, 1]], dtype=torch.int32).T
    num_slices = torch.tensor([3], dtype=torch.int32)
    want = reference.kv_cache_update_slices_ref(kv, slices.contiguous(), flat, num_slices)
    got = torch.ops.xla.kv_cache_update_op(kv.cuda(), slices.contiguous().cuda(), flat.cuda(),
                                           num_slices.cuda(), 16, 8)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_paged_attention_on_cuda(dtype):
    inputs = sample_inputs.ragged_paged_attention([5, 1, 1, 40, 0, 3], [37, 9, 100, 40, 4, 3],
                                                  num_q_heads=8, num_kv_heads=2, head_dim=128,
                                                  page_size=16, dtype=dtype, max_num_seqs=8,
                                                  padding_rows=3)
    want = reference.ragged_paged_attention_ref(**inputs, sm_scale=0.09, sliding_window=24)
    got = torch.ops.xla_ext.ragged_paged_attention(**{k: v.cuda() for k, v in inputs.items()},
                                                   sm_scale=0.09, sliding_window=24)
    atol, rtol = sample_inputs.TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu().double(), want, atol=atol, rtol=rtol)


def test_calls_replayed_from_a_cuda_graph_read_their_new_inputs():
    """A captured call keeps its scratch memory (split-KV partials, the ragged handler's work
    lists) in the graph's private pool: each replay computes from the inputs' current values,
    as an eager call of the same signature does."""
    lengths = [1, 4000, 37, 2048]  # long sequences: the decode kernel splits them (scratch)
    inputs = {k: v.cuda() for k, v in sample_inputs.paged_attention(
        lengths, num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
        dtype=torch.bfloat16).items()}
    ragged = {k: v.cuda() for k, v in sample_inputs.ragged_paged_attention(
        [5, 1, 40, 3], [37, 900, 40, 3], num_q_heads=8, num_kv_heads=2, head_dim=128,
        page_size=16, dtype=torch.bfloat16, max_num_seqs=6, padding_rows=2).items()}

    def step():
        return (torch.ops.xla_ext.paged_attention(**inputs, scale=0.088),
                torch.ops.xla_ext.ragged_paged_attention(**ragged, sm_scale=0.09))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in range(3):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        inputs["query"].copy_(torch.randn(inputs["query"].shape, generator=generator,
                                          device="cuda"))
        ragged["q"].copy_(torch.randn(ragged["q"].shape, generator=generator, device="cuda"))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want)
        want_decode = reference.paged_attention_ref(**{k: v.cpu() for k, v in inputs.items()},
                                                    scale=0.088)
        atol, rtol = sample_inputs.TOLERANCES[torch.bfloat16]
        torch.testing.assert_close(captured[0].cpu().double(), want_decode, atol=atol, rtol=rtol)


def test_a_bad_argument_on_cuda_tensors_raises_and_leaves_the_cache_alone():
    """A call whose arguments fail their checks raises the op's error (through the C++
    kernel, which keeps nothing for it) and writes nothing."""
    from torch_xla_ext import TorchXlaExtError

    kc, vc = torch.zeros(4, 16, 2, 64, device="cuda"), torch.zeros(4, 16, 2, 64, device="cuda")
    key, value = torch.randn(3, 2, 64, device="cuda"), torch.randn(3, 2, 64, device="cuda")
    with pytest.raises(TorchXlaExtError, match="argument 'slot_mapping'"):
        torch.ops.xla_ext.reshape_and_cache(key, value, kc, vc,
                                            torch.tensor([0, 1], device="cuda"))
    assert not kc.any() and not vc.any()
