"""xla_ext.add_rms_norm through JAX's XLA (the platform under test) and torch's eager op
against torch's own ops (transformers' LlamaRMSNorm): the sum bit for bit, the normed row
within a rounding of the dtype (the kernels sum the squares in another order, and CUDA's
rsqrt is not the CPU's; for float32, within 32 units in its last place)."""

import jax
import pytest
import torch

from tests import reference
from tests.kernels.common import DTYPES, PLATFORM, assert_within_ulps, to_jax, to_torch
from torch_xla_ext import jax_ops as xla_ext_jax
from torch_xla_ext.errors import TorchXlaExtError

# Units in the last place the normed row may be off by: one rounding; for float32, 32 (a row's
# squares summed in another order than torch's, over thousands of them).
NORM_ULPS = {torch.float32: 32, torch.float16: 1, torch.bfloat16: 1}
EPS = 1e-5


def make_inputs(num_tokens, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    residual = (torch.randn(num_tokens, hidden, generator=gen) * 4).to(dtype)
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype)
    return x, residual, weight


def assert_matches(got, want):
    total, normed = got
    want_total, want_normed = want
    assert total.dtype == want_total.dtype and torch.equal(total, want_total)
    assert_within_ulps(normed, want_normed, NORM_ULPS[want_normed.dtype])


def run_jax(x, residual, weight, eps=EPS):
    fn = jax.jit(lambda x, r, w: xla_ext_jax.add_rms_norm(x, r, w, eps))
    return tuple(to_torch(a) for a in fn(to_jax(x), to_jax(residual), to_jax(weight)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (16, 2048), (5, 100), (3, 4096),
                                               (2, 1), (33, 257)])
def test_matches_torch(num_tokens, hidden, dtype):
    x, residual, weight = make_inputs(num_tokens, hidden, dtype)
    want = reference.add_rms_norm_ref(x, residual, weight, EPS)
    assert_matches(run_jax(x, residual, weight), want)
    device = "cpu" if PLATFORM == "cpu" else "cuda"
    if device == "cpu" or torch.cuda.is_available():  # torch's eager op, on the same platform
        got = torch.ops.xla_ext.add_rms_norm(x.to(device), residual.to(device),
                                             weight.to(device), EPS)
        assert_matches(tuple(t.cpu() for t in got), want)


def test_zero_tokens():
    x, residual, weight = make_inputs(0, 64, torch.bfloat16)
    total, normed = run_jax(x, residual, weight)
    assert total.shape == normed.shape == (0, 64)


@pytest.mark.parametrize("change, message", [
    (lambda x, r, w, e: (x.double(), r.double(), w.double(), e),
     r"argument 'x': expected dtype float32, float16 or bfloat16, got dtype float64"),
    (lambda x, r, w, e: (x[0], r, w, e), r"argument 'x': expected rank 2"),
    (lambda x, r, w, e: (x, r[:, :8], w, e),
     r"argument 'residual': expected shape \[4, 64\] \(the shape of 'x'\), got shape \[4, 8\]"),
    (lambda x, r, w, e: (x, r.half(), w, e), r"argument 'residual': expected dtype bfloat16"),
    (lambda x, r, w, e: (x, r, w[:8], e),
     r"argument 'weight': expected shape \[64\] \(hidden of 'x'\), got shape \[8\]"),
    (lambda x, r, w, e: (x, r, w.float(), e), r"argument 'weight': expected dtype bfloat16"),
    (lambda x, r, w, e: (x, r, w, -1.0), r"argument 'eps': expected >= 0, got -1.0"),
])
def test_bad_arguments(change, message):
    x, r, w, e = change(*make_inputs(4, 64, torch.bfloat16), EPS)
    with pytest.raises(TorchXlaExtError, match=message):
        xla_ext_jax.add_rms_norm(to_jax(x), to_jax(r), to_jax(w), e)
    with pytest.raises(TorchXlaExtError, match=message):
        torch.ops.xla_ext.add_rms_norm(x, r, w, e)
