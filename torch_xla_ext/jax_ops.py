"""JAX front end: torch_xla_ext's kernels as JAX functions, made from op_catalog.OPS, each one
`jax.ffi.ffi_call` of its XLA FFI target (an opaque custom call in the HLO), usable eagerly,
under jax.jit and under jax.vmap (each call of a batch runs in turn).

Importing this module registers the built-in kernels into JAX's XLA (CPU, and CUDA where a
CUDA PJRT plugin is installed). Arguments are checked here, with errors naming the argument;
data such as block ids is checked here too where its values are known (outside jit), and by
the Host handlers. An op that writes into an argument (a KV cache) returns the new value,
aliased to that argument: donate it to jax.jit to write in place.
"""

import numpy as np

from torch_xla_ext.errors import JAX_INSTALL, TorchXlaExtError, import_dependency

jax = import_dependency("jax", "torch_xla_ext.jax_ops", JAX_INSTALL)
import jax.numpy as jnp  # noqa: E402

from torch_xla_ext import _kernels, binders  # noqa: E402
from torch_xla_ext.binders.jax_runtime import JaxRuntime  # noqa: E402
from torch_xla_ext.op_catalog import OPS  # noqa: E402

binders.add_library(_kernels.builtin_library())
binders.add_runtime(JaxRuntime())


def _concrete(x):
    """x as a NumPy array when its values are known here (not inside jit), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _empty(shape, dtype_name, like):
    return jnp.zeros(shape, getattr(jnp, dtype_name))


def _check(op, args):
    try:
        op.check(**args)
    except TorchXlaExtError as e:
        if "expected dtype int64, got dtype int32" in str(e) and not jax.config.jax_enable_x64:
            raise TorchXlaExtError(f"{e} (JAX keeps int64 arrays only with "
                                   "jax.config.update('jax_enable_x64', True))") from None
        raise


def _function(op):
    tensors = set(op.tensor_args())

    def call(*args, **kwargs):
        a = op.bind(args, kwargs)
        a = {k: jnp.asarray(v) if k in tensors and v is not None else v for k, v in a.items()}
        _check(op, a)
        if op.check_values is not None:
            values = {name: _concrete(a[name]) for name in op.value_args}
            if all(v is not None for v in values.values()):
                op.check_values(a, values)
        results = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in op.results(a)]
        ffi = jax.ffi.ffi_call(op.target, results[0] if len(results) == 1 else tuple(results),
                               input_output_aliases={i: out for out, i in op.aliases().items()},
                               vmap_method="sequential")
        out = ffi(*op.operand_values(a, _empty), **op.attribute_values(a))
        return tuple(out) if len(results) > 1 else out

    call.__name__ = call.__qualname__ = op.name
    call.__doc__ = op.doc
    return call


_FUNCTIONS = {op.name: _function(op) for op in OPS}
globals().update(_FUNCTIONS)


def ragged_paged_attention_v3(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                              distribution, sm_scale=1.0, sliding_window=None, soft_cap=None,
                              mask_value=None, k_scale=None, v_scale=None):
    """vllm-project/tpu-inference's "v3" ragged attention signature: writes this step's keys
    and values ([max_num_batched_tokens, num_kv_heads, head_dim], one row per query token) into
    kv_cache at their positions, then attends as ragged_paged_attention does. Returns
    (out, kv_cache), the cache aliased to the argument: donate it to jit to write in place.
    distribution: int32 [3], (decode-only sequences, + prefill-only, + mixed); its last entry
    is num_seqs. Rows no sequence owns write nothing."""
    queries, kv_lens, page_indices, cu_q_lens, distribution = map(
        jnp.asarray, (queries, kv_lens, page_indices, cu_q_lens, distribution))
    num_seqs = distribution[2:3]
    num_tokens, page_size = queries.shape[0], kv_cache.shape[1]
    # Entries past num_seqs are junk (cu_q_lens holds 1 there): keep the bounds monotone.
    index = jnp.arange(cu_q_lens.shape[0])
    bounds = jnp.where(index <= num_seqs[0], cu_q_lens, num_tokens + 1)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(bounds, rows, side="right") - 1, 0, kv_lens.shape[0] - 1)
    position = kv_lens[seq] - (bounds[seq + 1] - bounds[seq]) + (rows - bounds[seq])
    page = jnp.clip(position // page_size, 0, page_indices.shape[1] - 1)
    owned = (rows >= bounds[0]) & (rows < bounds[num_seqs[0]]) & (position >= 0)
    slots = jnp.where(owned, page_indices[seq, page] * page_size + position % page_size, -1)
    kv_cache = _FUNCTIONS["kv_cache_update"](keys, values, kv_cache, slots.astype(jnp.int32))
    out = _FUNCTIONS["ragged_paged_attention"](
        queries, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, sliding_window,
        soft_cap, mask_value, k_scale, v_scale)
    return out, kv_cache


__all__ = [*_FUNCTIONS, "ragged_paged_attention_v3"]
