"""torch_xla_ext: custom GPU kernels as opaque XLA custom calls in PyTorch/XLA, JAX and torchax.

Importing the package is the whole setup: the built-in kernels (and any later
`load_kernels(path)`) are registered into torch_xla's XLA, and into JAX's when JAX is used,
`torch_xla._XLAC._xla_gpu_custom_call(..., target=...)` is available again, and
`torch_xla._XLAC._xla_register_custom_call_target` registers a user's own function (legacy ABI
or typed FFI). Once the wheel is installed, `import torch_xla` imports it (through torch_xla's
plugin entry points).
"""

import importlib.util
import os

from torch_xla_ext import _kernels, binders
from torch_xla_ext.custom_call import custom_call, gpu_custom_call, mlir_dictionary
from torch_xla_ext.errors import TorchXlaExtError
from torch_xla_ext.step import sync

__version__ = "0.1.0"
__all__ = ["TorchXlaExtError", "custom_call", "get_include", "gpu_custom_call", "load_kernels",
           "mlir_dictionary", "sync"]


def get_include():
    """Include directories for building a kernel library: xla_ext/registry.h and the XLA FFI
    headers of the pinned jaxlib (xla/ffi/api/ffi.h)."""
    import jaxlib

    return [os.path.join(os.path.dirname(__file__), "include"),
            os.path.join(os.path.dirname(jaxlib.__file__), "include")]


def load_kernels(path):
    """Loads a kernel library built with xla_ext/registry.h and registers its handlers into
    every XLA runtime of this process, now and as runtimes appear. Returns the library."""
    return binders.add_library(_kernels.KernelLibrary(path))


def _bind_on_import():
    binders.add_library(_kernels.builtin_library())
    # Where torch_xla is not installed (JAX-only machines) there is nothing to bind it to;
    # where it is, a failure to bind is an error.
    if importlib.util.find_spec("torch_xla") is not None:
        from torch_xla_ext.binders.torch_xla_runtime import TorchXlaRuntime
        from torch_xla_ext.custom_call import install_torch_xla_entry_points
        from torch_xla_ext.step import install_failure_hooks

        binders.add_runtime(TorchXlaRuntime())
        install_torch_xla_entry_points()
        install_failure_hooks()  # a failed graph's error is raised once (see step.py)


_bind_on_import()

from torch_xla_ext import ops  # noqa: E402,F401  (registers torch.ops.xla_ext.*)

if importlib.util.find_spec("torch_xla") is not None:
    from torch_xla_ext import torch_xla_ops  # noqa: F401  (ragged_paged_attention off TPU)
