"""Runs a registered handler directly on torch CPU or CUDA tensors (csrc/eager_runtime.cc).

CUDA handlers run on torch's current stream and take scratch memory from torch's caching
allocator, so they order and share memory with the surrounding torch code.
"""

import ctypes
import functools
import os

import torch

from torch_xla_ext import _kernels, binders
from torch_xla_ext.errors import TorchXlaExtError

_FFI_DTYPES = {
    torch.bool: 1, torch.int8: 2, torch.int16: 3, torch.int32: 4, torch.int64: 5,
    torch.uint8: 6, torch.float16: 10, torch.float32: 11, torch.float64: 12, torch.bfloat16: 16,
    torch.float8_e4m3fn: 20,
}
_ATTR_DTYPES = {"f32": (11, ctypes.c_float), "f64": (12, ctypes.c_double),
                "i32": (4, ctypes.c_int32), "i64": (5, ctypes.c_int64), "pred": (1, ctypes.c_bool)}
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
        array[i] = _Buffer(_FFI_DTYPES[t.dtype], t.data_ptr(), t.dim(), dims)
    return array


def _attrs(attrs, keep):
    array = (_Attr * len(attrs))()
    for i, name in enumerate(sorted(attrs)):  # XLA passes attributes sorted by name
        mlir_type, value = attrs[name]
        if mlir_type == "str":
            data = value.encode()
            keep.append(data)
            array[i] = _Attr(name.encode(), -1, ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p),
                             len(data))
        else:
            dtype, ctype = _ATTR_DTYPES[mlir_type]
            scalar = ctype(value)
            keep.append(scalar)
            array[i] = _Attr(name.encode(), dtype, ctypes.addressof(scalar), 0)
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

    attrs: {name: (type, value)} with type one of "f32", "f64", "i32", "i64", "pred", "str".
    Every tensor must be contiguous and on the same device.
    """
    device = (inputs + outputs)[0].device
    for what, group in (("inputs", inputs), ("outputs", outputs)):
        for i, t in enumerate(group):
            if t.device != device:
                raise TorchXlaExtError(f"{what}[{i}]: expected a tensor on {device}, got {t.device}")
            if not t.is_contiguous():
                raise TorchXlaExtError(f"{what}[{i}]: expected a contiguous tensor")
            if t.dtype not in _FFI_DTYPES:
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
