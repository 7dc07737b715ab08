"""XlaGpuSimpleAdd through JAX's XLA against the float64 reference."""

import jax
import pytest
import torch

from tests import reference
from tests.kernels.common import DTYPES, assert_close, to_jax, to_torch
from torch_xla_ext import jax_ops as xla_ext_jax
from torch_xla_ext import op_catalog
from torch_xla_ext.errors import TorchXlaExtError

SHAPES = [(), (0,), (7,), (0, 3), (3, 5), (2, 3, 33), (2, 1, 3, 5)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(len(shape))
    a = torch.randn(shape, generator=gen).to(dtype)
    b = torch.randn(shape, generator=gen).to(dtype)
    out = jax.jit(xla_ext_jax.simple_add)(to_jax(a), to_jax(b))
    assert out.shape == shape
    assert_close(out, reference.simple_add_ref(a, b), dtype)


def test_rejects_dtype_mismatch():
    a, b = torch.ones(3), torch.ones(3, dtype=torch.float16)
    with pytest.raises(TorchXlaExtError, match="argument 'b'.*float32"):
        xla_ext_jax.simple_add(to_jax(a), to_jax(b))


def test_rejects_shape_mismatch():
    with pytest.raises(TorchXlaExtError, match=r"argument 'b'.*shape \[3\]"):
        xla_ext_jax.simple_add(to_jax(torch.ones(3)), to_jax(torch.ones(4)))


def test_rejects_integer_inputs():
    with pytest.raises(TorchXlaExtError, match="argument 'a'.*float32, float16 or bfloat16"):
        xla_ext_jax.simple_add(to_jax(torch.ones(3, dtype=torch.int32)),
                               to_jax(torch.ones(3, dtype=torch.int32)))


def test_handler_rejects_shape_mismatch():
    """The handler's own check, reached by calling the target directly."""
    a, b = to_jax(torch.ones(3)), to_jax(torch.ones(4))
    call = jax.ffi.ffi_call(op_catalog.SIMPLE_ADD.target, jax.ShapeDtypeStruct((3,), a.dtype))
    with pytest.raises(Exception, match="argument 'b'"):
        jax.block_until_ready(jax.jit(call)(a, b))


def test_vmap_runs_each_call_of_the_batch():
    a, b = torch.randn(4, 5, 3), torch.randn(4, 5, 3)
    got = to_torch(jax.vmap(xla_ext_jax.simple_add)(to_jax(a), to_jax(b)))
    assert torch.equal(got, a + b)
