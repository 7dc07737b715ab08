"""Binds kernel tables into a PJRT plugin's XLA through the plugin's FFI extension
(`register_handler`), without jax.ffi: the route a torch_xla GPU plugin needs.

The plugin must be the instance the framework loaded: dlopen of the same path returns the
loaded library, so its GetPjrtApi() returns the framework's API.
"""

import ctypes
import os

from torch_xla_ext import _kernels


class PjrtPluginRuntime:
    def __init__(self, name, library_path, platform="CUDA"):
        self.name = name
        self.path = os.path.abspath(library_path)
        self.platform = platform
        plugin = ctypes.CDLL(self.path)
        plugin.GetPjrtApi.restype = ctypes.c_void_p
        self.api = plugin.GetPjrtApi()
        # PJRT_Api: size_t struct_size; void* extension_start;
        #           PJRT_Api_Version {size_t; void*; int major; int minor}; ...
        self.pjrt_version = (ctypes.c_int32.from_address(self.api + 32).value,
                             ctypes.c_int32.from_address(self.api + 36).value)
        self._binder = _kernels.binder_dll()

    def bind(self, library):
        _kernels.call_binder(self._binder.xla_ext_bind_pjrt_plugin, self.api, library,
                             self.platform)
        return [(k.target, k.platform) for k in library.kernels if k.platform == self.platform]

    def describe(self):
        return {
            "name": self.name,
            "kind": f"PJRT plugin {self.path}",
            "version": "PJRT C API %d.%d" % self.pjrt_version,
            "platforms": [self.platform],
        }
