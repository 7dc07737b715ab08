"""JAX front end: torch_xla_ext's kernels as JAX functions, each one `jax.ffi.ffi_call` of
its XLA FFI target (an opaque custom call in the HLO), usable eagerly and under jax.jit.

Importing this module registers the built-in kernels into JAX's XLA (CPU, and CUDA where a
CUDA PJRT plugin is installed). Arguments are checked here, with errors naming the argument;
the handlers check again (and, on the CPU, check data such as block ids that a jitted
function cannot see).
"""

import numpy as np

from torch_xla_ext.errors import JAX_INSTALL, TorchXlaExtError, import_dependency

jax = import_dependency("jax", "torch_xla_ext.jax_ops", JAX_INSTALL)
import jax.numpy as jnp  # noqa: E402

from torch_xla_ext import _kernels, binders, checks  # noqa: E402
from torch_xla_ext.binders.jax_runtime import JaxRuntime  # noqa: E402

__all__ = ["kv_cache_update", "kv_cache_update_slices", "paged_attention", "reshape_and_cache",
           "simple_add"]

SIMPLE_ADD_TARGET = "XlaGpuSimpleAdd"
PAGED_ATTENTION_TARGET = "xla_ext.paged_attention"
RESHAPE_AND_CACHE_TARGET = "xla_ext.reshape_and_cache"
KV_CACHE_UPDATE_TARGET = "xla_ext.kv_cache_update"
KV_CACHE_UPDATE_SLICES_TARGET = "xla_ext.kv_cache_update_slices"

binders.add_library(_kernels.builtin_library())
binders.add_runtime(JaxRuntime())


def _concrete(x):
    """x as a NumPy array when its values are known here (not inside jit), else None."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def simple_add(a, b):
    """a + b elementwise (float32, float16 or bfloat16; same shape and dtype)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    checks.simple_add(a, b)
    return jax.ffi.ffi_call(SIMPLE_ADD_TARGET, jax.ShapeDtypeStruct(a.shape, a.dtype))(a, b)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, softcap=0.0,
                    alibi_slopes=None):
    """Decode attention over a paged KV cache (vLLM semantics).

    query [num_seqs, num_heads, head_size]; key_cache, value_cache
    [num_blocks, block_size, num_kv_heads, head_size] (same dtype as query); block_tables
    [num_seqs, max_blocks_per_seq] int32; seq_lens [num_seqs] int32; alibi_slopes float32
    [num_heads] or None. Returns [num_seqs, num_heads, head_size] in the query's dtype.
    """
    query, key_cache, value_cache = map(jnp.asarray, (query, key_cache, value_cache))
    block_tables, seq_lens = jnp.asarray(block_tables), jnp.asarray(seq_lens)
    alibi_slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes)
    checks.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, softcap,
                           alibi_slopes)
    lens, tables = _concrete(seq_lens), _concrete(block_tables)
    if lens is not None and tables is not None:
        checks.paged_attention_values(lens, tables, key_cache.shape[1], key_cache.shape[0])
    if alibi_slopes is None:
        alibi_slopes = jnp.zeros((0,), jnp.float32)  # [0] elements: no ALiBi
    call = jax.ffi.ffi_call(PAGED_ATTENTION_TARGET,
                            jax.ShapeDtypeStruct(query.shape, query.dtype))
    return call(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                scale=np.float32(scale), softcap=np.float32(softcap))


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Writes token i's key/value rows [num_kv_heads, head_size] into slot slot_mapping[i]
    (block * block_size + offset; negative = skip) of the NHD caches. Returns the updated
    (key_cache, value_cache); the results alias the cache arguments, so a jitted caller
    that donates the caches updates them in place."""
    key, value, key_cache, value_cache, slot_mapping = map(
        jnp.asarray, (key, value, key_cache, value_cache, slot_mapping))
    if slot_mapping.dtype == np.int32 and not jax.config.jax_enable_x64:
        raise TorchXlaExtError(
            "xla_ext.reshape_and_cache: argument 'slot_mapping': expected dtype int64, got "
            "dtype int32 (JAX keeps int64 arrays only with jax.config.update('jax_enable_x64', "
            "True))")
    checks.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    slots = _concrete(slot_mapping)
    if slots is not None:
        checks.slot_values(slots, key_cache.shape[0] * key_cache.shape[1])
    cache_type = jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype)
    call = jax.ffi.ffi_call(RESHAPE_AND_CACHE_TARGET, (cache_type, cache_type),
                            input_output_aliases={2: 0, 3: 1})
    return tuple(call(key, value, key_cache, value_cache, slot_mapping))


def kv_cache_update(key, value, kv_cache, slot_mapping):
    """Writes token i's key and value rows [num_kv_heads, head_size] into slot slot_mapping[i]
    (int32; page * page_size + offset; negative = skip) of the combined cache `kv_cache`
    [num_pages, page_size, 2 * num_kv_heads, head_size] (K of kv head h at 2h, V at 2h + 1).
    Returns the updated cache, aliased to `kv_cache`: donate it to jit to write in place."""
    key, value, kv_cache, slot_mapping = map(jnp.asarray, (key, value, kv_cache, slot_mapping))
    checks.kv_cache_update(key, value, kv_cache, slot_mapping)
    slots = _concrete(slot_mapping)
    if slots is not None:
        checks.kv_slot_values(slots, kv_cache.shape[0] * kv_cache.shape[1])
    call = jax.ffi.ffi_call(KV_CACHE_UPDATE_TARGET,
                            jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
                            input_output_aliases={2: 0})
    return call(key, value, kv_cache, slot_mapping)


def kv_cache_update_slices(kv, slices, kv_cache, num_slices, page_size, num_slices_per_block):
    """vLLM's `kv_cache_update`: for each of the first num_slices[0] columns
    (cache_start, new_kv_start, length) of `slices` (int32 [3, max_slices]), copies rows
    kv[new_kv_start:+length] into kv_cache[cache_start:+length]. kv [num_tokens,
    num_combined_heads, head_size]; kv_cache [num_pages * page_size, num_combined_heads,
    head_size]. Returns the updated cache, aliased to `kv_cache` (donate it)."""
    kv, slices, kv_cache, num_slices = map(jnp.asarray, (kv, slices, kv_cache, num_slices))
    checks.kv_cache_update_slices(kv, slices, kv_cache, num_slices, page_size,
                                  num_slices_per_block)
    table, count = _concrete(slices), _concrete(num_slices)
    if table is not None and count is not None:
        checks.slice_values(table, count, kv.shape[0], kv_cache.shape[0])
    call = jax.ffi.ffi_call(KV_CACHE_UPDATE_SLICES_TARGET,
                            jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
                            input_output_aliases={2: 0})
    return call(kv, slices, kv_cache, num_slices, page_size=np.int64(page_size),
                num_slices_per_block=np.int64(num_slices_per_block))
