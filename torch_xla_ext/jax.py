"""JAX front end: torch_xla_ext's kernels as JAX functions, each one `jax.ffi.ffi_call` of
its XLA FFI target (an opaque custom call in the HLO), usable eagerly and under jax.jit.

Importing this module registers the built-in kernels into JAX's XLA (CPU, and CUDA where a
CUDA PJRT plugin is installed). Arguments are checked here, with errors naming the argument;
the handlers check again (and, on the CPU, check data such as block ids that a jitted
function cannot see).
"""

import jax
import jax.numpy as jnp
import numpy as np

from torch_xla_ext import _kernels, binders
from torch_xla_ext.binders.jax import JaxRuntime
from torch_xla_ext.errors import TorchXlaExtError

__all__ = ["paged_attention", "reshape_and_cache", "simple_add"]

SIMPLE_ADD_TARGET = "XlaGpuSimpleAdd"
PAGED_ATTENTION_TARGET = "xla_ext.paged_attention"
RESHAPE_AND_CACHE_TARGET = "xla_ext.reshape_and_cache"

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)
HEAD_SIZES = (64, 80, 96, 112, 128, 256)
BLOCK_SIZES = (8, 16, 32)

binders.add_library(_kernels.builtin_library())
binders.add_runtime(JaxRuntime())


def _fail(op, arg, expected, got):
    raise TorchXlaExtError(f"{op}: argument '{arg}': expected {expected}, got {got}")


def _check_float(op, arg, x):
    if x.dtype not in FLOAT_DTYPES:
        _fail(op, arg, "dtype float32, float16 or bfloat16", f"dtype {x.dtype}")


def _check_dtype(op, arg, x, dtype, why=""):
    if x.dtype != dtype:
        _fail(op, arg, f"dtype {jnp.dtype(dtype)}{why}", f"dtype {x.dtype}")


def _check_rank(op, arg, x, rank, layout):
    if x.ndim != rank:
        _fail(op, arg, f"rank {rank} {layout}", f"shape {tuple(x.shape)}")


def _check_shape(op, arg, x, shape, why=""):
    if tuple(x.shape) != tuple(shape):
        _fail(op, arg, f"shape {tuple(shape)}{why}", f"shape {tuple(x.shape)}")


def _concrete(x):
    """x as a NumPy array when its values are known here (not inside jit), else None."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def simple_add(a, b):
    """a + b elementwise (float32, float16 or bfloat16; same shape and dtype)."""
    op = SIMPLE_ADD_TARGET
    a, b = jnp.asarray(a), jnp.asarray(b)
    _check_float(op, "a", a)
    _check_dtype(op, "b", b, a.dtype, " (the dtype of 'a')")
    _check_shape(op, "b", b, a.shape, " (the shape of 'a')")
    return jax.ffi.ffi_call(op, jax.ShapeDtypeStruct(a.shape, a.dtype))(a, b)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, softcap=0.0,
                    alibi_slopes=None):
    """Decode attention over a paged KV cache (vLLM semantics).

    query [num_seqs, num_heads, head_size]; key_cache, value_cache
    [num_blocks, block_size, num_kv_heads, head_size] (same dtype as query); block_tables
    [num_seqs, max_blocks_per_seq] int32; seq_lens [num_seqs] int32; alibi_slopes float32
    [num_heads] or None. Returns [num_seqs, num_heads, head_size] in the query's dtype.
    """
    op = PAGED_ATTENTION_TARGET
    query, key_cache, value_cache = map(jnp.asarray, (query, key_cache, value_cache))
    block_tables, seq_lens = jnp.asarray(block_tables), jnp.asarray(seq_lens)
    _check_float(op, "query", query)
    _check_rank(op, "query", query, 3, "[num_seqs, num_heads, head_size]")
    num_seqs, num_heads, head_size = query.shape
    if head_size not in HEAD_SIZES:
        _fail(op, "query", f"head_size (dim 2) in {HEAD_SIZES}", f"shape {tuple(query.shape)}")
    _check_dtype(op, "key_cache", key_cache, query.dtype, " (the query's)")
    _check_rank(op, "key_cache", key_cache, 4,
                "[num_blocks, block_size, num_kv_heads, head_size]")
    num_blocks, block_size, num_kv_heads, cache_head_size = key_cache.shape
    if cache_head_size != head_size:
        _fail(op, "key_cache", f"head_size (dim 3) {head_size} (the query's)",
              f"shape {tuple(key_cache.shape)}")
    if block_size not in BLOCK_SIZES:
        _fail(op, "key_cache", f"block_size (dim 1) in {BLOCK_SIZES}",
              f"shape {tuple(key_cache.shape)}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        _fail(op, "key_cache", f"num_kv_heads (dim 2) dividing num_heads = {num_heads}",
              f"shape {tuple(key_cache.shape)}")
    _check_dtype(op, "value_cache", value_cache, query.dtype, " (the query's)")
    _check_shape(op, "value_cache", value_cache, key_cache.shape, " (the key_cache's)")
    _check_dtype(op, "block_tables", block_tables, jnp.int32)
    _check_rank(op, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    if block_tables.shape[0] != num_seqs:
        _fail(op, "block_tables", f"{num_seqs} rows (num_seqs)",
              f"shape {tuple(block_tables.shape)}")
    _check_dtype(op, "seq_lens", seq_lens, jnp.int32)
    _check_shape(op, "seq_lens", seq_lens, (num_seqs,))
    if alibi_slopes is None:
        alibi_slopes = jnp.zeros((0,), jnp.float32)
    else:
        alibi_slopes = jnp.asarray(alibi_slopes)
        _check_dtype(op, "alibi_slopes", alibi_slopes, jnp.float32)
        _check_shape(op, "alibi_slopes", alibi_slopes, (num_heads,))

    lens, tables = _concrete(seq_lens), _concrete(block_tables)
    if lens is not None:
        capacity = block_tables.shape[1] * block_size
        bad = np.flatnonzero((lens < 0) | (lens > capacity))
        if bad.size:
            i = int(bad[0])
            _fail(op, "seq_lens", f"0 <= seq_len <= max_blocks_per_seq * block_size = {capacity}",
                  f"seq_lens[{i}] = {lens[i]}" + (" (seq_len beyond the block table)"
                                                  if lens[i] > capacity else ""))
        if tables is not None:
            used = np.arange(tables.shape[1])[None, :] * block_size < lens[:, None]
            bad = np.argwhere(used & ((tables < 0) | (tables >= num_blocks)))
            if bad.size:
                s, b = map(int, bad[0])
                _fail(op, "block_tables", f"block ids in [0, num_blocks = {num_blocks})",
                      f"block_tables[{s}][{b}] = {tables[s, b]}")

    call = jax.ffi.ffi_call(op, jax.ShapeDtypeStruct(query.shape, query.dtype))
    return call(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                scale=np.float32(scale), softcap=np.float32(softcap))


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Writes token i's key/value rows [num_kv_heads, head_size] into slot slot_mapping[i]
    (block * block_size + offset; negative = skip) of the NHD caches. Returns the updated
    (key_cache, value_cache); the results alias the cache arguments, so a jitted caller
    that donates the caches updates them in place."""
    op = RESHAPE_AND_CACHE_TARGET
    key, value, key_cache, value_cache, slot_mapping = map(
        jnp.asarray, (key, value, key_cache, value_cache, slot_mapping))
    _check_float(op, "key", key)
    _check_rank(op, "key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    _check_dtype(op, "value", value, key.dtype, " (the key's)")
    _check_shape(op, "value", value, key.shape, " (the key's)")
    _check_dtype(op, "key_cache", key_cache, key.dtype, " (the key's)")
    _check_rank(op, "key_cache", key_cache, 4,
                "[num_blocks, block_size, num_kv_heads, head_size]")
    if tuple(key_cache.shape[2:]) != tuple(key.shape[1:]):
        _fail(op, "key_cache", f"num_kv_heads, head_size {tuple(key.shape[1:])} (the key's)",
              f"shape {tuple(key_cache.shape)}")
    _check_dtype(op, "value_cache", value_cache, key.dtype, " (the key's)")
    _check_shape(op, "value_cache", value_cache, key_cache.shape, " (the key_cache's)")
    if slot_mapping.dtype != np.int64:
        # Without jax_enable_x64, JAX turns int64 arrays into int32 ones.
        _fail(op, "slot_mapping", "dtype int64 (needs jax.config.update('jax_enable_x64', True))",
              f"dtype {slot_mapping.dtype}")
    _check_shape(op, "slot_mapping", slot_mapping, key.shape[:1])
    slots = _concrete(slot_mapping)
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slots is not None and slots.size and slots.max() >= num_slots:
        i = int(np.argmax(slots >= num_slots))
        _fail(op, "slot_mapping", f"slots < num_blocks * block_size = {num_slots}",
              f"slot_mapping[{i}] = {slots[i]}")

    cache_type = jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype)
    call = jax.ffi.ffi_call(op, (cache_type, cache_type), input_output_aliases={2: 0, 3: 1})
    return tuple(call(key, value, key_cache, value_cache, slot_mapping))
