"""The CPU and CUDA kernels of the torch ops: csrc/torch_ops.cc runs an op's registered
handler on torch tensors.

CUDA handlers run on torch's current stream and take scratch memory (and workspace results,
which are not returned) from torch's caching allocator, so they order and share memory with
the surrounding torch code. What depends only
on the arguments' shapes, dtypes, devices and scalar values is worked out here once (`describe`:
the checks, the result shapes, the handler's attributes) and kept by the C++ kernel, which
runs later calls of the same signature without Python.
"""

import functools
import importlib.machinery
import importlib.util
import os

import torch

from torch_xla_ext import _kernels, binders, dtypes
from torch_xla_ext.errors import TorchXlaExtError

_PLATFORMS = {"cpu": "Host", "cuda": "CUDA"}
_MODULE = "libxla_ext_torch"


@functools.lru_cache(maxsize=None)
def _extension():
    path = os.path.join(_kernels.LIB_DIR, _MODULE + ".so")
    if not os.path.exists(path):
        raise _kernels.not_built_error(path)
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, path)
    spec = importlib.util.spec_from_file_location(_MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def empty(shape, dtype_name, like):
    """An empty array for an optional operand given as None (OpDef.operand_values)."""
    return like.new_empty(shape, dtype=getattr(torch, dtype_name))


def _handler(target, platform):
    for library in binders.libraries():
        for kernel in library.kernels:
            if kernel.target == target and kernel.platform == platform:
                return kernel.handler
    raise TorchXlaExtError(f"no {platform} handler is registered for target {target!r}")


def _ffi_id(what, t):
    entry = dtypes.lookup(t.dtype)
    if entry is None:
        raise TorchXlaExtError(f"{what}: dtype {t.dtype} is not supported")
    return entry.ffi_id


def _attribute(name, value):
    """(name, FFI DataType or -1 for a string, value bytes) of an attribute."""
    if isinstance(value, str):
        return name, -1, value.encode()
    return name, dtypes.lookup(value.dtype).ffi_id, value.tobytes()


def _describe(op, write_into_arguments, *values):
    """Checks a call's arguments (in schema order) and says what the handler call is, as
    csrc/torch_ops.cc's Parse reads it."""
    args = dict(zip([name for name, *_ in op.arguments], values))
    op.check(**args)
    operand_values = op.operand_values(args, empty)
    device = operand_values[0].device
    platform = _PLATFORMS.get(device.type)
    if platform is None:
        raise TorchXlaExtError(f"tensors on {device} cannot run eagerly; expected cpu or cuda")
    attribute_values = op.attribute_values(args)
    returned = len(op.results(args))  # the workspace result after them is not
    results = op.handler_results(args, attribute_values,
                                 device.index if platform == "CUDA" else None)
    operands = []
    for name, value in zip(op.operands, operand_values):
        if value.device != device:
            raise TorchXlaExtError(f"{op.target}: argument '{name}': expected a tensor on "
                                   f"{device}, got {value.device}")
        given = args[name] is not None  # else an empty array the handler takes for None
        operands.append((list(args).index(name) if given else -1,
                         _ffi_id(f"argument '{name}'", value), None if given else value))
    written = {}
    for index, name in op.writes.items():
        if write_into_arguments and not args[name].is_contiguous():
            raise TorchXlaExtError(f"{op.target}: argument '{name}': expected a contiguous "
                                   "tensor (it is written in place)")
        written[index] = op.operands.index(name)
    result_specs = []
    for index, (shape, dtype) in enumerate(results):
        entry = dtypes.lookup(dtype)
        if entry is None:
            raise TorchXlaExtError(f"{op.target}: result {index}: dtype {dtype} is not supported")
        result_specs.append((list(shape), entry.ffi_id, written.get(index, -1),
                             index < returned))
    attributes = [_attribute(name, value) for name, value in attribute_values.items()]
    return _handler(op.target, platform), operands, result_specs, attributes


def register(namespace, name, op, write_into_arguments):
    """Makes `op`'s handlers the CPU and CUDA kernels of torch.ops.<namespace>.<name>: written
    operands are updated in place when `write_into_arguments`, else copied first (the op is
    functional)."""
    _extension().register(namespace, name,
                          functools.partial(_describe, op, write_into_arguments),
                          TorchXlaExtError, write_into_arguments)
