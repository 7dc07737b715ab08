"""Runs a registered handler directly on torch CPU or CUDA tensors (csrc/eager_runtime.cc).

CUDA handlers run on torch's current stream and take scratch memory from torch's caching
allocator, so they order and share memory with the surrounding torch code.
"""

import ctypes
import functools
import os

import torch

from torch_xla_ext import _kernels, binders, dtypes
from torch_xla_ext.errors import TorchXlaExtError

# Scalar attribute types the runtime passes, by the dtype table's names.
_ATTR_CTYPES = {"float32": ctypes.c_float, "float64": ctypes.c_double, "int32": ctypes.c_int32,
                "int64": ctypes.c_int64, "bool": ctypes.c_bool}
_PLATFORMS = {"cpu": "Host", "cuda": "CUDA"}


class _Buffer(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _Attr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int32), ("value", ctypes.c_void_p),
                ("size", ctypes.c_size_t)]


_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


@functools.lru_cache(maxsize=None)
def _runtime():
    dll = ctypes.CDLL(os.path.join(_kernels.LIB_DIR, "libxla_ext_eager.so"))
    dll.xla_ext_eager_call.restype = ctypes.c_int
    dll.xla_ext_eager_call.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
        ctypes.c_int32, ctypes.POINTER(_Buffer), ctypes.c_int32, ctypes.POINTER(_Buffer),
        ctypes.c_int32, ctypes.POINTER(_Attr), _ALLOC, _FREE, ctypes.c_void_p,
        ctypes.c_char_p, ctypes.c_size_t]
    return dll


def _handler(target, platform):
    for library in binders.libraries():
        for kernel in library.kernels:
            if kernel.target == target and kernel.platform == platform:
                return kernel.handler
    raise TorchXlaExtError(f"no {platform} handler is registered for target {target!r}")


def _buffers(tensors, keep):
    array = (_Buffer * len(tensors))()
    for i, t in enumerate(tensors):
        dims = (ctypes.c_int64 * max(t.dim(), 1))(*t.shape)
        keep.append(dims)
        array[i] = _Buffer(dtypes.lookup(t.dtype).ffi_id, t.data_ptr(), t.dim(), dims)
    return array


def _attrs(attrs, keep):
    array = (_Attr * len(attrs))()
    for i, name in enumerate(sorted(attrs)):  # XLA passes attributes sorted by name
        value = attrs[name]
        if isinstance(value, str):
            data = value.encode()
            keep.append(data)
            array[i] = _Attr(name.encode(), -1, ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p),
                             len(data))
        else:
            dtype = dtypes.name(value.dtype)
            scalar = _ATTR_CTYPES[dtype](value.item())
            keep.append(scalar)
            array[i] = _Attr(name.encode(), dtypes.DTYPES[dtype].ffi_id, ctypes.addressof(scalar), 0)
    return array


def _cuda_allocator(device):
    stream = torch.cuda.current_stream(device).cuda_stream

    def alloc(_, size, alignment):  # the caching allocator's blocks are 512-byte aligned
        return torch.cuda.caching_allocator_alloc(size, device, stream) if size else None

    def free(_, data, size):
        if data:
            torch.cuda.caching_allocator_delete(data)

    return _ALLOC(alloc), _FREE(free)


def run(target, inputs, outputs, attrs=None):
    """Runs `target`'s handler for the tensors' device on `inputs`, writing `outputs` in place.

    attrs: {name: a NumPy scalar (float32, float64, int32, int64, bool) or a str}.
    Every tensor must be contiguous and on the same device.
    """
    device = (inputs + outputs)[0].device
    for what, group in (("inputs", inputs), ("outputs", outputs)):
        for i, t in enumerate(group):
            if t.device != device:
                raise TorchXlaExtError(f"{what}[{i}]: expected a tensor on {device}, got {t.device}")
            if not t.is_contiguous():
                raise TorchXlaExtError(f"{what}[{i}]: expected a contiguous tensor")
            if dtypes.lookup(t.dtype) is None:
                raise TorchXlaExtError(f"{what}[{i}]: dtype {t.dtype} is not supported")
    platform = _PLATFORMS.get(device.type)
    if platform is None:
        raise TorchXlaExtError(f"tensors on {device} cannot run eagerly; expected cpu or cuda")
    keep = []
    args, rets = _buffers(inputs, keep), _buffers(outputs, keep)
    attr_array = _attrs(attrs or {}, keep)
    stream, ordinal = None, 0
    alloc, free = _ALLOC(), _FREE()
    if platform == "CUDA":
        ordinal = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(ordinal).cuda_stream
        alloc, free = _cuda_allocator(ordinal)
    err = ctypes.create_string_buffer(4096)
    status = _runtime().xla_ext_eager_call(
        _handler(target, platform), stream, ordinal, len(inputs), args, len(outputs), rets,
        len(attr_array), attr_array, alloc, free, None, err, len(err))
    if status != 0:
        raise TorchXlaExtError(err.value.decode())
