"""Runs a registered handler directly on torch CPU or CUDA tensors (csrc/eager_runtime.cc).

CUDA handlers run on torch's current stream and take scratch memory from torch's caching
allocator, so they order and share memory with the surrounding torch code.
"""

import ctypes
import functools
import os
import threading

import numpy as np
import torch

from torch_xla_ext import _kernels, binders, dtypes
from torch_xla_ext.errors import TorchXlaExtError

# Scalar attribute types the runtime passes, by the dtype table's names.
_ATTR_CTYPES = {"float32": ctypes.c_float, "float64": ctypes.c_double, "int32": ctypes.c_int32,
                "int64": ctypes.c_int64, "bool": ctypes.c_bool}
_PLATFORMS = {"cpu": "Host", "cuda": "CUDA"}


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
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
        ctypes.POINTER(ctypes.c_int64), ctypes.c_int32, ctypes.POINTER(_Attr), _ALLOC, _FREE, ctypes.c_void_p,
        ctypes.c_char_p, ctypes.c_size_t]
    return dll


# What a call costs on the host is paid at every layer of every step, so the per-call work is
# table lookups: handlers, dtype ids, attribute types and the allocator callbacks are found
# once and kept.
_HANDLERS = {}


def _handler(target, platform):
    handler = _HANDLERS.get((target, platform))
    if handler is not None:
        return handler
    for library in binders.libraries():
        for kernel in library.kernels:
            if kernel.target == target and kernel.platform == platform:
                _HANDLERS[(target, platform)] = kernel.handler
                return kernel.handler
    raise TorchXlaExtError(f"no {platform} handler is registered for target {target!r}")


@functools.lru_cache(maxsize=None)
def _ffi_id(dtype):
    """The FFI DataType number of a torch dtype, or None if the table has none."""
    entry = dtypes.lookup(dtype)
    return None if entry is None else entry.ffi_id


@functools.lru_cache(maxsize=None)
def _scalar_type(numpy_type):
    """(ctypes type, FFI DataType number) of a NumPy scalar type."""
    name = dtypes.name(np.dtype(numpy_type))
    return _ATTR_CTYPES[name], dtypes.DTYPES[name].ffi_id


def _buffers(tensors, ids):
    """The tensors as csrc/eager_runtime.cc takes them: one int64 array of (dtype, address,
    rank, dims...) per tensor; and the index of each tensor's address in it."""
    packed, address_slots = [], []
    for t, ffi_id in zip(tensors, ids):
        shape = t.shape
        address_slots.append(len(packed) + 1)
        packed += (ffi_id, t.data_ptr(), len(shape), *shape)
    return (ctypes.c_int64 * len(packed))(*packed), address_slots


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
            ctype, ffi_id = _scalar_type(type(value))
            scalar = ctype(value.item())
            keep.append(scalar)
            array[i] = _Attr(name.encode(), ffi_id, ctypes.addressof(scalar), 0)
    return array


@functools.lru_cache(maxsize=None)
def _cuda_allocator(device):
    """Scratch from torch's caching allocator, on the stream current when the handler asks."""

    def alloc(_, size, alignment):  # the caching allocator's blocks are 512-byte aligned
        if not size:
            return None
        return torch.cuda.caching_allocator_alloc(
            size, device, torch.cuda.current_stream(device).cuda_stream)

    def free(_, data, size):
        if data:
            torch.cuda.caching_allocator_delete(data)

    return _ALLOC(alloc), _FREE(free)


_NO_ALLOCATOR = (_ALLOC(), _FREE())
_errors = threading.local()


def _error_buffer():
    buffer = getattr(_errors, "buffer", None)
    if buffer is None:
        buffer = _errors.buffer = ctypes.create_string_buffer(4096)
    return buffer


class PreparedCall:
    """A handler call on tensors of given shapes, dtypes and device, checked and packed once:
    each call then writes only the tensors' addresses (and, on CUDA, the current stream) into
    the packed buffers. Not for use by two threads at once."""

    def __init__(self, target, inputs, outputs, attrs=None):
        """For `target`'s handler on the tensors' device. Every tensor must be contiguous and
        on one device; attrs: {name: a NumPy scalar (float32, float64, int32, int64, bool) or
        a str}."""
        device = (inputs[0] if inputs else outputs[0]).device
        ids = []
        for what, group in (("inputs", inputs), ("outputs", outputs)):
            for i, t in enumerate(group):
                if t.device != device:
                    raise TorchXlaExtError(
                        f"{what}[{i}]: expected a tensor on {device}, got {t.device}")
                if not t.is_contiguous():
                    raise TorchXlaExtError(f"{what}[{i}]: expected a contiguous tensor")
                ffi_id = _ffi_id(t.dtype)
                if ffi_id is None:
                    raise TorchXlaExtError(f"{what}[{i}]: dtype {t.dtype} is not supported")
                ids.append(ffi_id)
        platform = _PLATFORMS.get(device.type)
        if platform is None:
            raise TorchXlaExtError(f"tensors on {device} cannot run eagerly; expected cpu or cuda")
        self._handler = _handler(target, platform)
        self._num_inputs, self._num_outputs = len(inputs), len(outputs)
        self._buffers, self._address_slots = _buffers(list(inputs) + list(outputs), ids)
        self._keep = []
        self._attrs = _attrs(attrs or {}, self._keep)
        self._ordinal = None
        self._alloc, self._free = _NO_ALLOCATOR
        if platform == "CUDA":
            self._ordinal = device.index if device.index is not None else torch.cuda.current_device()
            self._alloc, self._free = _cuda_allocator(self._ordinal)

    def __call__(self, inputs, outputs):
        """Runs the handler on `inputs`, writing `outputs` in place: contiguous tensors of the
        shapes, dtypes and device this call was prepared for."""
        buffers = self._buffers
        for slot, t in zip(self._address_slots, (*inputs, *outputs)):
            buffers[slot] = t.data_ptr()
        ordinal, stream = self._ordinal, None
        if ordinal is not None:
            stream = torch.cuda.current_stream(ordinal).cuda_stream
        err = _error_buffer()
        status = _runtime().xla_ext_eager_call(
            self._handler, stream, ordinal or 0, self._num_inputs, self._num_outputs, buffers,
            len(self._attrs), self._attrs, self._alloc, self._free, None, err, len(err))
        if status != 0:
            raise TorchXlaExtError(err.value.decode())

