"""What the kernel tests share: the platform under test, conversions between torch tensors
(where the references live) and JAX arrays, and tolerances."""

import os

import jax

# reshape_and_cache's slot_mapping is int64, which JAX keeps only with x64 on.
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_xla_ext.jax_ops as xla_ext_jax  # noqa: E402,F401  (registers the kernels into JAX)
from torch_xla_ext import checks, sample_inputs  # noqa: E402

PLATFORM = os.environ.get("XLA_EXT_TEST_PLATFORM", "cpu")
DEVICE = jax.devices(PLATFORM)[0]
# Whether the handlers under test reject bad block ids, lengths and slots: the Host handlers
# always; the CUDA handlers with XLA_EXT_DEBUG_CHECKS set (kernels/common/debug_checks.cuh),
# else they skip or clamp such entries as each op's header says.
HANDLERS_CHECK_DATA = PLATFORM == "cpu" or os.environ.get("XLA_EXT_DEBUG_CHECKS", "") not in (
    "", "0")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# What a KV cache may hold, as the cache-writing ops' C++ contract declares it.
CACHE_DTYPES = [getattr(torch, name)
                for name in checks.supported("xla_ext.kv_cache_update", "dtype", "kv_cache")]
TOLERANCES = sample_inputs.TOLERANCES


# dtypes NumPy has no type of its own for: (torch dtype, JAX dtype, same-width integer type).
_BIT_CAST = [(torch.bfloat16, jnp.bfloat16, torch.int16, np.int16),
             (torch.float8_e4m3fn, jnp.float8_e4m3fn, torch.uint8, np.uint8)]


def to_jax(t):
    """A torch CPU tensor as a JAX array on the device under test."""
    for torch_dtype, jax_dtype, torch_int, _ in _BIT_CAST:
        if t.dtype == torch_dtype:
            return jax.device_put(t.contiguous().view(torch_int).numpy().view(jax_dtype), DEVICE)
    return jax.device_put(t.contiguous().numpy(), DEVICE)


def to_torch(x):
    array = np.asarray(x)
    for torch_dtype, jax_dtype, _, numpy_int in _BIT_CAST:
        if array.dtype == jax_dtype:
            return torch.from_numpy(array.view(numpy_int).copy()).view(torch_dtype)
    return torch.from_numpy(array.copy())


# A dtype's unit in the last place relative to a value's magnitude: a rounding moves a value by
# half of it at most.
RELATIVE_ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def assert_within_ulps(got, want, ulps=1):
    """got has want's dtype and shape and is within `ulps` units in the last place of want,
    taken at want's largest magnitude (at least 1): for kernels that sum in float32 in another
    order than the reference."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = max(float(want.double().abs().max()) if want.numel() else 0.0, 1.0)
    torch.testing.assert_close(got.double(), want.double(),
                               atol=ulps * RELATIVE_ULP[want.dtype] * scale, rtol=0)


def assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(to_torch(actual).double(), expected.double(), atol=atol, rtol=rtol)


def replace(inputs, index, tensor):
    """A copy of the list of op inputs with inputs[index] swapped, for the bad-input tests."""
    inputs = list(inputs)
    inputs[index] = tensor
    return inputs
