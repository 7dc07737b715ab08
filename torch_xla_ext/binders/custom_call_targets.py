"""Users' own custom-call targets: one function under one name, as torch_xla's
`_xla_register_custom_call_target(name, capsule, platform)` takes it (torch_xla 2.9 only raises
"RegisterCustomCall not implemented"), pushed into the XLA that runs the graphs.

A function is either a legacy custom-call function (the ABIs of api_version 1, 2 and 3: on
CUDA `(stream, buffers, opaque, opaque_len[, status])`, on the CPU `(out, ins[, opaque,
opaque_len], status)`) or a typed FFI handler (`XLA_FFI_Handler*`, api_version 4). XLA keeps
the two in separate registries and cannot tell them apart by their address, and torch_xla's
registration call does not say which it is; the call does (its api_version). So a target
registered without `api_version` takes its kind from the first call of it, which is when it
goes into XLA's registry; a later call with the other kind is refused with the reason.

Where each goes: the CPU (platform "Host") is torch_xla's own XLA inside `_XLAC`: legacy
functions into its CustomCallTargetRegistry, typed handlers through its XLA_FFI_Api
(binders/torch_xla_runtime.py); CUDA is the PJRT plugin of PJRT_DEVICE=GPU: legacy functions
through its GPU custom-call extension, typed handlers through its FFI extension
(binders/pjrt_plugin.py). A target registered for CUDA before that plugin's client exists is
kept and registered when it starts.
"""

import ctypes
import dataclasses
import os
import threading

from torch_xla_ext import binders
from torch_xla_ext.binders import LEGACY, TYPED_FFI
from torch_xla_ext.errors import TorchXlaExtError

LEGACY_API_VERSIONS = (1, 2, 3)
TYPED_FFI_API_VERSION = 4
# The platform names users write, by the XLA platform they mean.
PLATFORM_NAMES = {"Host": "Host", "host": "Host", "CPU": "Host", "cpu": "Host",
                  "CUDA": "CUDA", "cuda": "CUDA", "GPU": "CUDA", "gpu": "CUDA"}
# PJRT_DEVICE -> the XLA platform its graphs run on.
PJRT_DEVICE_PLATFORMS = {"CPU": "Host", "GPU": "CUDA"}


@dataclasses.dataclass
class Target:
    name: str
    platform: str  # "Host" or "CUDA"
    address: int
    kind: str | None  # LEGACY, TYPED_FFI, or None until its first call


_lock = threading.RLock()
_targets = {}  # (name, platform) -> Target


def kind_of_api_version(api_version):
    return TYPED_FFI if api_version == TYPED_FFI_API_VERSION else LEGACY


def platform_of(platform):
    """The XLA platform ("Host" or "CUDA") a user's platform name means."""
    if not isinstance(platform, str) or platform not in PLATFORM_NAMES:
        raise TorchXlaExtError(
            f"platform: expected one of {sorted(set(PLATFORM_NAMES.values()))} (also written "
            f"{', '.join(repr(n) for n in PLATFORM_NAMES if n not in ('Host', 'CUDA'))}): "
            f"torch_xla runs graphs on the CPU (platform 'Host', PJRT_DEVICE=CPU) or on NVIDIA "
            f"GPUs (platform 'CUDA', PJRT_DEVICE=GPU); got {platform!r}")
    return PLATFORM_NAMES[platform]


def running_platform():
    """The XLA platform this process's torch_xla runs graphs on, by PJRT_DEVICE."""
    device = os.environ.get("PJRT_DEVICE", "CPU").split("_")[0]
    if device not in PJRT_DEVICE_PLATFORMS:
        raise TorchXlaExtError(
            f"PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}: torch_xla_ext registers custom-call "
            f"targets for PJRT_DEVICE {' or '.join(PJRT_DEVICE_PLATFORMS)} only")
    return PJRT_DEVICE_PLATFORMS[device]


def _executable_ranges():
    """(start, end) of every executable mapping of this process."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            if "x" in perms:
                start, end = (int(x, 16) for x in span.split("-"))
                ranges.append((start, end))
    return ranges


def function_address(function):
    """The code address a PyCapsule (as torch_xla and jax.ffi take it), a ctypes function or
    an int holds; refuses anything that does not point into executable code."""
    if isinstance(function, int) and not isinstance(function, bool):
        address = function
    elif isinstance(function, ctypes._CFuncPtr):
        address = ctypes.cast(function, ctypes.c_void_p).value or 0
    elif type(function).__name__ == "PyCapsule":
        get_name = ctypes.pythonapi.PyCapsule_GetName
        get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                                      ctypes.c_char_p]
        address = get_pointer(function, get_name(function)) or 0
    else:
        raise TorchXlaExtError(
            f"function: expected a PyCapsule holding the function's address (e.g. "
            f"ctypes.pythonapi.PyCapsule_New(ctypes.cast(lib.fn, ctypes.c_void_p), None, None), "
            f"or jax.ffi.pycapsule(lib.fn)), got {type(function).__name__}")
    if not any(start <= address < end for start, end in _executable_ranges()):
        raise TorchXlaExtError(
            f"function: the capsule holds {address:#x}, which is not the address of a function "
            "(no loaded code is there): wrap the function's own address, e.g. of "
            "ctypes.CDLL(path).XlaGpuSimpleAdd, not a data pointer or a DLPack capsule")
    return address


def register(name, function, platform, api_version=None):
    """Registers `function` (see function_address) as custom-call target `name` for
    `platform`. api_version: 1, 2 or 3 (a legacy function) or 4 (a typed FFI handler); None
    lets the first call of the target decide."""
    if not isinstance(name, str) or not name:
        raise TorchXlaExtError(f"name: expected a non-empty string, got {name!r}")
    platform = platform_of(platform)
    if api_version is not None and api_version not in LEGACY_API_VERSIONS + (TYPED_FFI_API_VERSION,):
        raise TorchXlaExtError(f"api_version: expected 1, 2, 3 or 4 (or None: decided by the "
                               f"first call), got {api_version!r}")
    address = function_address(function)
    kind = None if api_version is None else kind_of_api_version(api_version)
    with _lock:
        known = _targets.get((name, platform))
        if known is not None:
            if known.address != address:
                raise TorchXlaExtError(
                    f"{name} is already registered for {platform} with another function "
                    f"({known.address:#x}; this one is {address:#x}): a target has one "
                    "function per platform; register this one under another name")
            if kind is not None and known.kind is not None and kind != known.kind:
                raise TorchXlaExtError(_kind_mismatch(known, kind, "is registered"))
            if kind is not None and known.kind is None:
                known.kind = kind
                binders.add_target(known)
            return known
        if kind == TYPED_FFI:
            _refuse_a_library_target(name, platform)
        target = Target(name, platform, address, kind)
        if kind is not None:
            binders.add_target(target)  # refused by a runtime: nothing is recorded
        _targets[(name, platform)] = target
        return target


def _refuse_a_library_target(name, platform):
    for row in binders.registrations():
        if row["target"] == name and row["platform"] == platform:
            raise TorchXlaExtError(
                f"{name} is already a typed FFI handler of a loaded kernel library for "
                f"{platform} (torch_xla_ext's own, or one given to load_kernels): register "
                "yours under another name")


def _kind_mismatch(target, kind, how):
    return (f"{target.name} {how} as a {kind}, but its function was registered for "
            f"{target.platform} as a {target.kind}. XLA calls the two with different "
            "arguments and cannot tell them apart, so calling a function with the other ABI "
            "would crash: call it with api_version "
            f"{'4' if target.kind == TYPED_FFI else '1, 2 or 3 (the one its signature has)'}, "
            "or register the other function under its own name")


def prepare_call(name, api_version):
    """Before a call of `name` with `api_version` is recorded: the target must have a
    function of that kind on the platform that runs the graph. A user's target of unknown
    kind takes it now and goes into XLA's registry. Raises with how to register otherwise."""
    platform = running_platform()
    kind = kind_of_api_version(api_version)
    with _lock:
        target = _targets.get((name, platform))
        if target is not None:
            if target.kind is None:
                target.kind = kind
                try:
                    binders.add_target(target)
                except TorchXlaExtError:
                    target.kind = None
                    raise
            elif target.kind != kind:
                raise TorchXlaExtError(_kind_mismatch(target, kind,
                                                      f"is called with api_version={api_version}"))
            return
    if binders.has_target(name, platform, kind):
        return
    elsewhere = [t.platform for (n, _), t in _targets.items() if n == name]
    where = (f"; it is registered for {elsewhere[0]} only, and this process runs graphs on "
             f"{platform} (PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'CPU')})"
             if elsewhere else "")
    other = (" (torch_xla_ext's typed FFI handler of that name needs api_version=4)"
             if kind == LEGACY and binders.has_target(name, platform, TYPED_FFI) else "")
    raise TorchXlaExtError(
        f"custom call {name}: no {kind} is registered under that name for {platform}{where}"
        f"{other}. Register it before the call: torch_xla._XLAC._xla_register_custom_call_"
        f"target({name!r}, capsule, {platform!r}) with capsule = ctypes.pythonapi."
        f"PyCapsule_New(ctypes.cast(lib.{name if name.isidentifier() else 'fn'}, "
        "ctypes.c_void_p).value, None, None) (set PyCapsule_New.restype = ctypes.py_object and "
        "argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]); or, for a typed FFI "
        "handler, build it into a kernel library and torch_xla_ext.load_kernels(path)")


def default_api_version(name):
    """The api_version a call of `name` defaults to in `_xla_gpu_custom_call`: 4 for a typed
    FFI handler (ours, a loaded library's, or a user's declared as one), else 2 (torch_xla
    2.8's status-returning default)."""
    platform = running_platform()
    with _lock:
        target = _targets.get((name, platform))
    if target is not None:
        return TYPED_FFI_API_VERSION if target.kind == TYPED_FFI else 2
    return TYPED_FFI_API_VERSION if binders.has_target(name, platform, TYPED_FFI) else 2
