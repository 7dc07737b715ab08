"""xla_ext.small_batch_linear through JAX's XLA (the platform under test) and torch's eager op
against the float64 reference rounded as torch rounds: plain, with a residual, and SwiGLU's
gate; token counts across the CUDA kernel's tiles (8, 16, 32, 64 and past 64), in_features
that are not multiples of its 32-wide chunks or of its 16-byte loads, out_features that are
not multiples of its 16-row tiles."""

import jax
import pytest
import torch

from tests import reference
from tests.kernels.common import PLATFORM, assert_within_ulps, to_jax, to_torch
from torch_xla_ext import jax_ops as xla_ext_jax
from torch_xla_ext.errors import TorchXlaExtError

DTYPES = [torch.float16, torch.bfloat16]
# Results are held to two roundings of the dtype (the product's, then the residual's sum or the
# gate's): one unit in the last place (assert_within_ulps).


def make_inputs(num_tokens, in_features, weight_rows, dtype, residual=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    weight = (torch.randn(weight_rows, in_features, generator=gen) / 8).to(dtype)
    res = torch.randn(num_tokens, weight_rows, generator=gen).to(dtype) if residual else None
    return x, weight, res


def run_jax(x, weight, residual=None, silu_gate=0, jit=True):
    fn = lambda x, w, r: xla_ext_jax.small_batch_linear(x, w, r, silu_gate)  # noqa: E731
    fn = jax.jit(fn) if jit else fn
    return to_torch(fn(to_jax(x), to_jax(weight), None if residual is None else to_jax(residual)))


SHAPES = [  # (num_tokens, in_features, weight_rows)
    (1, 64, 16),
    (3, 72, 40),      # in_features not a multiple of 32, rows not of 16
    (8, 2048, 48),
    (13, 100, 24),    # in_features not a multiple of 8: element loads on CUDA
    (16, 256, 272),
    (33, 512, 64),
    (64, 160, 96),
    (70, 96, 80),     # more tokens than one CUDA tile holds
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,in_features,weight_rows", SHAPES)
@pytest.mark.parametrize("form", ["plain", "residual", "silu_gate"])
def test_matches_reference(num_tokens, in_features, weight_rows, dtype, form):
    x, weight, residual = make_inputs(num_tokens, in_features, weight_rows, dtype,
                                      residual=form == "residual")
    gate = int(form == "silu_gate")
    want = reference.small_batch_linear_ref(x, weight, residual, gate)
    assert_within_ulps(run_jax(x, weight, residual, gate), want)
    device = "cpu" if PLATFORM == "cpu" else "cuda"
    if device == "cpu" or torch.cuda.is_available():  # torch's eager op, on the same platform
        got = torch.ops.xla_ext.small_batch_linear(
            x.to(device), weight.to(device), None if residual is None else residual.to(device),
            gate)
        assert_within_ulps(got.cpu(), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["plain", "silu_gate"])
def test_views_not_16_byte_aligned_on_cuda(form):
    # Torch views one element into their storage: the CUDA kernel's element loads.
    gate = int(form == "silu_gate")
    x, weight, _ = make_inputs(9, 64, 48, torch.bfloat16)
    x_storage = torch.cat([torch.zeros(1, dtype=x.dtype), x.flatten()]).cuda()
    w_storage = torch.cat([torch.zeros(1, dtype=x.dtype), weight.flatten()]).cuda()
    got = torch.ops.xla_ext.small_batch_linear(x_storage[1:].view(9, 64),
                                               w_storage[1:].view(48, 64), None, gate)
    assert_within_ulps(got.cpu(), reference.small_batch_linear_ref(x, weight, None, gate))


def test_zero_tokens_and_zero_in_features():
    x, weight, _ = make_inputs(0, 64, 32, torch.bfloat16)
    assert run_jax(x, weight).shape == (0, 32)
    x, weight, residual = make_inputs(5, 0, 32, torch.bfloat16, residual=True)
    assert torch.equal(run_jax(x, weight, residual), residual)


def test_silu_gate_pairs_each_gate_row_with_its_up_row():
    # Rows j and j + out_features: a gate of all-ones rows against an up of distinct rows.
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    gate = torch.full((24, 32), 1 / 16, dtype=torch.bfloat16)  # x @ gate.T = 2
    up = (torch.arange(24, dtype=torch.float32)[:, None] / 32).expand(24, 32).to(torch.bfloat16)
    got = run_jax(x, torch.cat([gate, up]), silu_gate=1)
    want = torch.nn.functional.silu(torch.tensor(2.0)).to(torch.bfloat16) * torch.arange(
        24, dtype=torch.bfloat16)
    torch.testing.assert_close(got[0], want.to(torch.bfloat16))
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("change, message", [
    (lambda x, w, r, g: (x.float(), w.float(), r, g), r"argument 'x': expected dtype float16 or "
     r"bfloat16, got dtype float32"),
    (lambda x, w, r, g: (x, w.half(), r, g), r"argument 'weight': expected dtype bfloat16 \(the "
     r"dtype of 'x'\)"),
    (lambda x, w, r, g: (x[0], w, r, g), r"argument 'x': expected rank 2"),
    (lambda x, w, r, g: (x, w[:, :16], r, g), r"argument 'weight': expected shape "
     r"\[weight_rows, 64\] \(in_features of 'x'\), got shape \[32, 16\]"),
    (lambda x, w, r, g: (x, w, r[:, :8], g), r"argument 'residual': expected shape \[4, 32\]"),
    (lambda x, w, r, g: (x, w, r.half(), g), r"argument 'residual': expected dtype bfloat16"),
    (lambda x, w, r, g: (x, w, r, 1), r"argument 'residual': expected none with silu_gate"),
    (lambda x, w, r, g: (x, w[:31], None, 1), r"argument 'weight': expected an even number of "
     r"rows with silu_gate"),
    (lambda x, w, r, g: (x, w, r, 2), r"argument 'silu_gate': expected 0 or 1, got 2"),
])
def test_bad_arguments(change, message):
    x, w, r, g = change(*make_inputs(4, 64, 32, torch.bfloat16, residual=True), 0)
    with pytest.raises(TorchXlaExtError, match=message):
        xla_ext_jax.small_batch_linear(to_jax(x), to_jax(w), None if r is None else to_jax(r), g)
    with pytest.raises(TorchXlaExtError, match=message):
        torch.ops.xla_ext.small_batch_linear(x, w, r, g)
