"""torch.ops.xla_ext.* on XLA (CPU), CPU and fake tensors, against the float64 references."""

import pytest
import torch

from tests import reference
from torch_xla_ext import sample_inputs

def _paged_inputs(dtype):
    return sample_inputs.paged_attention([1, 17, 40], num_heads=8, num_kv_heads=2, head_size=64,
                                         block_size=16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_simple_add_on_xla_and_cpu(xla_device, dtype):
    a = torch.randn(5, 7).to(dtype)
    b = torch.randn(5, 7).to(dtype)
    want = (a.float() + b.float()).to(dtype)
    assert torch.equal(torch.ops.xla_ext.simple_add(a.to(xla_device), b.to(xla_device)).cpu(), want)
    assert torch.equal(torch.ops.xla_ext.simple_add(a, b), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap, alibi", [(0.0, False), (30.0, True)])
def test_paged_attention_on_xla_and_cpu(xla_device, dtype, softcap, alibi):
    inputs = _paged_inputs(dtype)
    slopes = torch.linspace(-0.5, -0.01, 8) if alibi else None
    scale = 64 ** -0.5
    want = reference.paged_attention_ref(**inputs, scale=scale, softcap=softcap,
                                         alibi_slopes=slopes)
    on_xla = {k: v.to(xla_device) for k, v in inputs.items()}
    got_xla = torch.ops.xla_ext.paged_attention(
        **on_xla, scale=scale, softcap=softcap,
        alibi_slopes=None if slopes is None else slopes.to(xla_device)).cpu()
    got_cpu = torch.ops.xla_ext.paged_attention(**inputs, scale=scale, softcap=softcap,
                                                alibi_slopes=slopes)
    for got in (got_xla, got_cpu):
        assert got.dtype == dtype
        atol, rtol = sample_inputs.TOLERANCES[dtype]
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def test_reshape_and_cache_in_place_on_xla(xla_device):
    import torch_xla

    g = torch.Generator().manual_seed(1)
    key_cache = torch.randn(6, 16, 2, 64, generator=g)
    value_cache = torch.randn(6, 16, 2, 64, generator=g)
    key = torch.randn(4, 2, 64, generator=g)
    value = torch.randn(4, 2, 64, generator=g)
    slots = torch.tensor([0, 17, -1, 95])  # -1: skipped
    want_k, want_v = reference.reshape_and_cache_ref(key, value, key_cache, value_cache, slots)

    kc, vc = key_cache.to(xla_device), value_cache.to(xla_device)
    torch.ops.xla_ext.reshape_and_cache(key.to(xla_device), value.to(xla_device), kc, vc,
                                        slots.to(xla_device))
    torch_xla.sync()
    assert torch.equal(kc.cpu(), want_k.to(kc.dtype)) and torch.equal(vc.cpu(), want_v.to(vc.dtype))

    cpu_k, cpu_v = key_cache.clone(), value_cache.clone()
    torch.ops.xla_ext.reshape_and_cache(key, value, cpu_k, cpu_v, slots)
    assert torch.equal(cpu_k, want_k.to(cpu_k.dtype)) and torch.equal(cpu_v, want_v.to(cpu_v.dtype))


@pytest.mark.parametrize("op, args", [
    ("simple_add", lambda: (torch.randn(3, 4), torch.randn(3, 4))),
    ("paged_attention", lambda: tuple(_paged_inputs(torch.float32).values()) + (0.125,)),
    ("reshape_and_cache", lambda: (torch.randn(2, 2, 64), torch.randn(2, 2, 64),
                                   torch.randn(4, 16, 2, 64), torch.randn(4, 16, 2, 64),
                                   torch.tensor([5, -1]))),
])
def test_opcheck(xla_device, op, args):
    torch.library.opcheck(getattr(torch.ops.xla_ext, op).default, args())


def test_bad_inputs_raise_clear_errors_and_later_calls_work(xla_device):
    from torch_xla_ext import TorchXlaExtError

    inputs = {k: v.to(xla_device) for k, v in _paged_inputs(torch.float32).items()}
    bad = [
        (dict(query=inputs["query"].half()),  # an f16 query with f32 caches
         r"argument 'key_cache': expected dtype float16 \(the dtype of 'query'\)"),
        (dict(block_tables=inputs["block_tables"].long()),
         "argument 'block_tables': expected dtype int32, got dtype int64"),
        (dict(seq_lens=inputs["seq_lens"][:2]), r"argument 'seq_lens': expected shape \[3\]"),
        (dict(key_cache=inputs["key_cache"][:, :, [0, 1, 0]].contiguous(),
              value_cache=inputs["value_cache"][:, :, [0, 1, 0]].contiguous()),
         "argument 'key_cache': expected num_kv_heads dividing num_heads=8, got 3"),
        (dict(query=inputs["query"][:, :, :32].contiguous()),
         r"argument 'query': expected head_size in \[64, 80, 96, 112, 128, 256\], got 32"),
    ]
    for change, message in bad:
        with pytest.raises(TorchXlaExtError, match=message):
            torch.ops.xla_ext.paged_attention(**{**inputs, **change}, scale=0.1)
    with pytest.raises(TorchXlaExtError, match="argument 'b': expected shape"):
        torch.ops.xla_ext.simple_add(torch.ones(3, device=xla_device),
                                     torch.ones(4, device=xla_device))
    out = torch.ops.xla_ext.paged_attention(**inputs, scale=0.1)
    assert torch.isfinite(out.cpu()).all()


def test_eager_calls_of_one_signature_read_their_own_tensors_and_scalars():
    """The eager path keeps a checked, packed handler call per signature (shapes, dtypes,
    device, scalar arguments): calls that share one must still read their own data and
    scalars, write into their own caches, and a data error must not stick to the signature."""
    from torch_xla_ext import TorchXlaExtError

    for seed, scale, softcap in ((0, 0.125, 0.0), (1, 0.125, 0.0), (2, 0.5, 0.0), (3, 0.5, 30.0),
                                 (4, 0.125, 0.0)):
        inputs = sample_inputs.paged_attention([1, 17, 40], num_heads=8, num_kv_heads=2,
                                               head_size=64, block_size=16, dtype=torch.float32,
                                               seed=seed)
        want = reference.paged_attention_ref(**inputs, scale=scale, softcap=softcap)
        got = torch.ops.xla_ext.paged_attention(**inputs, scale=scale, softcap=softcap)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

        bad_tables = inputs["block_tables"].clone()
        bad_tables[2, 0] = 10_000
        with pytest.raises(TorchXlaExtError, match="argument 'block_tables'"):
            torch.ops.xla_ext.paged_attention(**{**inputs, "block_tables": bad_tables},
                                              scale=scale, softcap=softcap)

    key, value = torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    for slots in ([3, 17], [40, 5]):
        caches = [torch.zeros(8, 16, 4, 64), torch.zeros(8, 16, 4, 64)]
        want = reference.reshape_and_cache_ref(key, value, *[c.clone() for c in caches],
                                               torch.tensor(slots))
        torch.ops.xla_ext.reshape_and_cache(key, value, *caches, torch.tensor(slots))
        assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


def test_eager_calls_take_strided_operands_and_refuse_strided_in_place_targets():
    """A kept call is found by contiguity too: a strided operand is read through a contiguous
    copy, while a strided cache, which the op would have to write in place, is refused (and
    left as it was) even after a contiguous cache of the same shape has been written."""
    from torch_xla_ext import TorchXlaExtError

    inputs = _paged_inputs(torch.float32)
    want = reference.paged_attention_ref(**inputs, scale=0.125)
    strided_query = inputs["query"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided_query.is_contiguous()
    for query in (inputs["query"], strided_query, inputs["query"]):
        got = torch.ops.xla_ext.paged_attention(**{**inputs, "query": query}, scale=0.125)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    key, value, slots = torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.tensor([3, 17])
    torch.ops.xla_ext.reshape_and_cache(key, value, torch.zeros(8, 16, 4, 64),
                                        torch.zeros(8, 16, 4, 64), slots)
    strided_cache = torch.zeros(8, 4, 16, 64).transpose(1, 2)
    with pytest.raises(TorchXlaExtError, match="argument 'key_cache': expected a contiguous"):
        torch.ops.xla_ext.reshape_and_cache(key, value, strided_cache,
                                            torch.zeros(8, 16, 4, 64), slots)
    assert not strided_cache.any()

    caches = [torch.zeros(8, 16, 4, 64), torch.zeros(8, 16, 4, 64)]
    new_caches = torch.ops.xla_ext.reshape_and_cache_functional(key, value, *caches, slots)
    want = reference.reshape_and_cache_ref(key, value, *[c.clone() for c in caches], slots)
    assert not caches[0].any() and not caches[1].any()  # the functional op copies first
    assert torch.equal(new_caches[0], want[0]) and torch.equal(new_caches[1], want[1])


def test_eager_calls_from_several_threads_each_get_their_own_results():
    """The C++ kernel keeps calls in one table for all threads: threads calling with different
    signatures and data at once must each get their own result."""
    import concurrent.futures

    cases = []
    for seed, lengths in enumerate(([1, 17, 40], [5, 33], [64, 2, 9, 16], [1, 17, 40])):
        inputs = sample_inputs.paged_attention(lengths, num_heads=8, num_kv_heads=2,
                                               head_size=64, block_size=16,
                                               dtype=torch.float32, seed=seed)
        cases.append((inputs, reference.paged_attention_ref(**inputs, scale=0.125)))

    def run(case):
        inputs, want = case
        for _ in range(20):
            got = torch.ops.xla_ext.paged_attention(**inputs, scale=0.125)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        for future in [pool.submit(run, case) for case in cases]:
            future.result()
