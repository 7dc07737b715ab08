"""The workspace result of an op whose CUDA handler takes its scratch from one (OpDef.workspace).

It is a uint8 vector that the front ends add to the custom call's results and drop from what
they return. XLA allocates it with the call's other buffers, so XLA may record the call into a
command buffer (a CUDA graph) and replay it; scratch allocated at every call could not be
replayed. Its size is the handler's own planning for the call's shapes on the GPU, asked of the
kernel library; off the GPU it is empty (the Host handlers need none).
"""

import ctypes
import functools

from torch_xla_ext import _kernels, dtypes

ANY_GPU = -1  # size for whichever visible GPU needs the most


def xla_device_gpu():
    """The `gpu` of workspace functions for torch_xla's device: ANY_GPU on a GPU, else None."""
    import torch_xla.runtime

    return ANY_GPU if torch_xla.runtime.device_type() in ("GPU", "CUDA") else None


def _shape(x):
    return tuple(int(d) for d in x.shape)


def _dims(*shapes):
    return [(ctypes.c_int64 * len(shape))(*shape) for shape in shapes]


@functools.lru_cache(maxsize=None)
def _function(name, *argtypes):
    """The kernel library's exported size query `name`, which returns int64 bytes."""
    fn = _kernels.builtin_library().function(name)
    fn.restype = ctypes.c_int64
    fn.argtypes = list(argtypes)
    return fn


_DIMS = ctypes.POINTER(ctypes.c_int64)


@functools.lru_cache(maxsize=1024)
def _paged_attention_bytes(gpu, dtype, query_shape, cache_shape, block_tables_shape):
    fn = _function("xla_ext_paged_attention_workspace_bytes", ctypes.c_int, ctypes.c_int,
                   _DIMS, _DIMS, _DIMS)
    return fn(gpu, dtype, *_dims(query_shape, cache_shape, block_tables_shape))


def paged_attention(args, attributes, gpu):
    """Bytes of workspace xla_ext.paged_attention's CUDA handler needs for the call (0 for a
    call its checks reject, which takes none)."""
    query, cache, tables = (args[n] for n in ("query", "key_cache", "block_tables"))
    dtype = dtypes.lookup(query.dtype)
    if dtype is None or (query.ndim, cache.ndim, tables.ndim) != (3, 4, 2):
        return 0
    return _paged_attention_bytes(gpu, dtype.ffi_id, _shape(query), _shape(cache), _shape(tables))


@functools.lru_cache(maxsize=1024)
def _ragged_paged_attention_bytes(gpu, q_dtype, kv_dtype, q_shape, kv_pages_shape,
                                  page_indices_shape, attributes):
    fn = _function("xla_ext_ragged_paged_attention_workspace_bytes", ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, _DIMS, _DIMS, _DIMS, ctypes.c_float, ctypes.c_int32,
                   ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float)
    a = dict(attributes)
    return fn(gpu, q_dtype, kv_dtype, *_dims(q_shape, kv_pages_shape, page_indices_shape),
              a["sm_scale"], a["sliding_window"], a["soft_cap"], a["mask_value"], a["k_scale"],
              a["v_scale"])


def ragged_paged_attention(args, attributes, gpu):
    """Bytes of workspace xla_ext.ragged_paged_attention's CUDA handler needs for the call (0
    for a call its checks reject, which takes none)."""
    q, kv_pages, page_indices = (args[n] for n in ("q", "kv_pages", "page_indices"))
    types = [dtypes.lookup(x.dtype) for x in (q, kv_pages)]
    if None in types or (q.ndim, kv_pages.ndim, page_indices.ndim) != (3, 4, 2):
        return 0
    return _ragged_paged_attention_bytes(
        gpu, types[0].ffi_id, types[1].ffi_id, _shape(q), _shape(kv_pages), _shape(page_indices),
        tuple(sorted((name, value.item()) for name, value in attributes.items())))
