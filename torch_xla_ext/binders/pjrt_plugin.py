"""Binds kernel tables into a PJRT plugin's XLA through the plugin's FFI extension
(`register_handler`), without jax.ffi: the route a torch_xla GPU plugin needs. Users' legacy
custom-call functions go through the plugin's GPU custom-call extension.

The plugin must be the instance the framework loaded: dlopen of the same path returns the
loaded library, so its GetPjrtApi() returns the framework's API.
"""

import ctypes
import functools
import os

from torch_xla_ext import _kernels
from torch_xla_ext.errors import TorchXlaExtError


class PjrtPluginRuntime:
    """`wraps`: for a plugin that wraps another (torch_xla_ext's PJRT shim), the wrapped
    plugin's path, shown by describe()."""

    def __init__(self, name, library_path, platform="CUDA", wraps=None):
        self.name = name
        self.path = os.path.abspath(library_path)
        self.platform = platform
        self.wraps = wraps
        try:
            plugin = ctypes.CDLL(self.path)
            get_api = plugin.GetPjrtApi
        except (OSError, AttributeError) as e:
            raise TorchXlaExtError(f"{self.path} is not a loadable PJRT plugin "
                                   f"(a shared object exporting GetPjrtApi): {e}") from e
        get_api.restype = ctypes.c_void_p
        self.api = get_api()
        if not self.api:
            raise TorchXlaExtError(f"{self.path}: GetPjrtApi() returned null (the plugin "
                                   "printed why to stderr)")
        self._binder = _kernels.binder_dll()
        major, minor = ctypes.c_int32(), ctypes.c_int32()
        self._binder.xla_ext_pjrt_api_version(self.api, ctypes.byref(major), ctypes.byref(minor))
        self.pjrt_version = (major.value, minor.value)

    def bind(self, library):
        _kernels.call_binder(self._binder.xla_ext_bind_pjrt_plugin, self.api, library,
                             self.platform)
        return [(k.target, k.platform) for k in library.kernels if k.platform == self.platform]

    def register_target(self, target):
        """A user's target (custom_call_targets.Target): a typed FFI handler through the FFI
        extension, a legacy function through the GPU custom-call extension."""
        name = target.name.encode()
        _kernels.register_target(
            target,
            functools.partial(self._binder.xla_ext_pjrt_register_ffi_handler, self.api, name,
                              self.platform.encode(), target.address, 0),
            functools.partial(self._binder.xla_ext_pjrt_register_legacy_target, self.api, name,
                              target.address),
            self.path)

    def has_legacy_target(self, name):
        return False  # the plugin's registry cannot be read; users' targets are known above

    def describe(self):
        kind = f"PJRT plugin {self.path}"
        if self.wraps:
            kind += f" wrapping {self.wraps}"
        return {
            "name": self.name,
            "kind": kind,
            "version": "PJRT C API %d.%d" % self.pjrt_version,
            "platforms": [self.platform],
        }
