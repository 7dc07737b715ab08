"""torch_xla 2.9 on NVIDIA GPUs: the `torch_xla.plugins` entry point `gpu`, selected with
PJRT_DEVICE=GPU (install with `pip install 'torch_xla_ext[gpu]'` for CUDA 12, or
`'torch_xla_ext[gpu-cuda13]'` for CUDA 13).

torch_xla loads our PJRT shim (lib/libxla_ext_pjrt_shim.so), which wraps a CUDA PJRT plugin
and presents its platform as "gpu": under its own name, "cuda", torch_xla 2.9 aborts ("XLA:CUDA
is not supported anymore"). The plugin is jax-cuda12-pjrt 0.7.1's (PJRT C API 0.75, the
version torch_xla 2.9 speaks) or jax-cuda13-pjrt 0.7.2's (0.76, which the shim adapts).
Devices are then GPU:0, GPU:1, ... When torch_xla starts the client, our CUDA handlers (and
those of every library given to load_kernels) are registered into the plugin through its FFI
extension.

PJRT_DEVICE has no underscore on purpose: torch_xla.runtime.device_type() keeps only the part
before the first "_", and the plugin registry is looked up with that.
"""

import collections
import ctypes
import importlib.metadata
import importlib.util
import os

from torch_xla.experimental import plugins

from torch_xla_ext import _kernels, binders
from torch_xla_ext.binders.pjrt_plugin import PjrtPluginRuntime
from torch_xla_ext.errors import TorchXlaExtError

PJRT_DEVICE = "GPU"  # = the entry point's name, upper-cased by torch_xla
RUNTIME_NAME = "torch_xla_gpu"
SHIM_LIBRARY = os.path.join(_kernels.LIB_DIR, "libxla_ext_pjrt_shim.so")
# Read by the shim: the plugin it wraps. Set here unless the user set it.
PLUGIN_PATH_VARIABLE = "TORCH_XLA_EXT_PJRT_PLUGIN"
CudaPluginDist = collections.namedtuple("CudaPluginDist", "dist version module pjrt_api extra")
# The CUDA PJRT plugins the shim can wrap, in the order they are looked for: only these
# versions speak a PJRT C API torch_xla 2.9 can drive (jax-cuda12-pjrt 0.7.0 is 0.73; 0.7.2 of
# either is 0.76, of which only jax-cuda13-pjrt's is pinned and tested).
CUDA_PLUGINS = (
    CudaPluginDist("jax-cuda12-pjrt", "0.7.1", "jax_plugins.xla_cuda12", "0.75", "gpu"),
    CudaPluginDist("jax-cuda13-pjrt", "0.7.2", "jax_plugins.xla_cuda13", "0.76", "gpu-cuda13"),
)
CUDA_PLUGIN_LIBRARY = "xla_cuda_plugin.so"
INSTALL_HINT = " or ".join(f"pip install 'torch_xla_ext[{p.extra}]' ({p.dist}=={p.version})"
                           for p in CUDA_PLUGINS)


def cuda_plugin_path():
    """The PJRT plugin the shim wraps: $TORCH_XLA_EXT_PJRT_PLUGIN if set, else that of the
    first of CUDA_PLUGINS installed."""
    if os.environ.get(PLUGIN_PATH_VARIABLE):
        return os.environ[PLUGIN_PATH_VARIABLE]
    found = []
    for candidate in CUDA_PLUGINS:
        try:
            version = importlib.metadata.version(candidate.dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if version != candidate.version:
            found.append(f"{candidate.dist} {version} (PJRT C API {candidate.pjrt_api} is "
                         f"{candidate.dist}=={candidate.version}'s)")
            continue
        spec = importlib.util.find_spec(candidate.module)
        path = (os.path.join(spec.submodule_search_locations[0], CUDA_PLUGIN_LIBRARY)
                if spec else None)
        if path is None or not os.path.exists(path):
            raise TorchXlaExtError(
                f"{candidate.dist} {version} is installed but {candidate.module}/"
                f"{CUDA_PLUGIN_LIBRARY} is missing; reinstall it: "
                f"pip install --force-reinstall {candidate.dist}=={candidate.version}")
        return path
    wanted = " or ".join(f"{p.dist}=={p.version}" for p in CUDA_PLUGINS)
    raise TorchXlaExtError(
        f"PJRT_DEVICE={PJRT_DEVICE} needs {wanted}; "
        + (f"found {', '.join(found)}" if found else "neither is installed")
        + f": {INSTALL_HINT}")


def load_shim():
    """Points the shim at the CUDA plugin and checks it there (loadable, PJRT C API 0.75/0.76)
    before torch_xla loads the shim, whose GetPjrtApi() could only return null. Returns the
    wrapped plugin's path."""
    path = cuda_plugin_path()
    os.environ[PLUGIN_PATH_VARIABLE] = path
    shim = ctypes.CDLL(SHIM_LIBRARY)
    shim.xla_ext_pjrt_shim_load.restype = ctypes.c_void_p
    shim.xla_ext_pjrt_shim_load.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    err = ctypes.create_string_buffer(2048)
    if not shim.xla_ext_pjrt_shim_load(err, len(err)):
        raise TorchXlaExtError(f"PJRT_DEVICE={PJRT_DEVICE}: {err.value.decode()}")
    return path


def register_handlers():
    """Registers every kernel library's CUDA handlers into the plugin torch_xla loaded."""
    return binders.add_runtime(PjrtPluginRuntime(RUNTIME_NAME, SHIM_LIBRARY, platform="CUDA",
                                                 wraps=load_shim()))


class CudaPlugin(plugins.DevicePlugin):
    """One process driving the GPUs the CUDA plugin sees (no xmp.spawn / torchrun topology)."""

    def library_path(self):
        load_shim()
        os.environ["XLA_FLAGS"] = xla_flags(os.environ)
        return SHIM_LIBRARY

    def client_create_options(self):
        # torch_xla calls this after loading and initializing the plugin, before it creates
        # the client: the first point where handlers can go into the plugin's registry.
        register_handlers()
        return allocator_options(os.environ)

    def configure_single_process(self):
        pass


def xla_flags(environ):
    """XLA_FLAGS for the plugin's XLA. With XLA_EXT_DEBUG_CHECKS on, every CUDA call must run
    outside CUDA graphs, where it can synchronise and fail its own step: XLA records a step's
    custom calls into command buffers (CUDA graphs) even when their handlers say they may not
    be (seen on the H200 for a torch.compile'd serving step), and a captured call reports a
    violation only at the next call that is not captured. So command buffers go off, unless
    XLA_FLAGS sets them itself."""
    flags = environ.get("XLA_FLAGS", "")
    debug = environ.get("XLA_EXT_DEBUG_CHECKS", "") not in ("", "0")
    if debug and "--xla_gpu_enable_command_buffer" not in flags:
        flags = f"{flags} --xla_gpu_enable_command_buffer=".strip()
    return flags


def allocator_options(environ):
    """The CUDA PJRT client's allocator options that `environ` sets, from the variables
    torch_xla's own CUDA plugin reads: PJRT_ALLOCATOR_FRACTION (memory_fraction, the share of
    each GPU's memory the client takes, a number in (0, 1]; XLA's default 0.75) and
    PJRT_ALLOCATOR_PREALLOCATE (preallocate, whether it takes it all at start: true/false or
    1/0; default true)."""
    options = {}
    fraction = environ.get("PJRT_ALLOCATOR_FRACTION")
    if fraction:
        try:
            value = float(fraction)
        except ValueError:
            value = None
        if value is None or not 0 < value <= 1:
            raise TorchXlaExtError(f"PJRT_ALLOCATOR_FRACTION: expected a number in (0, 1], "
                                   f"got {fraction!r}")
        options["memory_fraction"] = value
    preallocate = environ.get("PJRT_ALLOCATOR_PREALLOCATE")
    if preallocate:
        words = {"1": True, "true": True, "0": False, "false": False}
        if preallocate.lower() not in words:
            raise TorchXlaExtError(f"PJRT_ALLOCATOR_PREALLOCATE: expected true, false, 1 or 0, "
                                   f"got {preallocate!r}")
        options["preallocate"] = words[preallocate.lower()]
    return options


def status():
    """For doctor: how PJRT_DEVICE=GPU would run, and whether it does in this process."""
    try:
        wraps, problem = cuda_plugin_path(), None
    except TorchXlaExtError as e:
        wraps, problem = None, str(e)
    return {
        "pjrt_device": PJRT_DEVICE,
        "selected": os.environ.get("PJRT_DEVICE") == PJRT_DEVICE,
        "shim": SHIM_LIBRARY,
        "wraps": wraps,
        "problem": problem,
        "active": any(runtime.name == RUNTIME_NAME for runtime in binders.runtimes()),
    }
