"""Binds kernel tables into JAX's XLA through its public `jax.ffi.register_ffi_target`."""

import ctypes


# XLA platform names in the table -> JAX's names for them.
_JAX_PLATFORMS = {"Host": "cpu", "CUDA": "CUDA"}
_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


class JaxRuntime:
    """JAX's XLA: CPU and, where a CUDA PJRT plugin is installed, CUDA. Registration for a
    platform whose backend has not started yet is kept by JAX until it does."""

    name = "jax"

    def __init__(self):
        import jax
        import jaxlib

        self._jax = jax
        self.versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}

    def bind(self, library):
        from jax._src.lib import xla_client

        done = []
        for kernel in library.kernels:
            platform = _JAX_PLATFORMS.get(kernel.platform)
            if platform is None:
                continue
            capsule = self._jax.ffi.pycapsule(_HANDLER(kernel.handler))
            self._jax.ffi.register_ffi_target(
                kernel.target, capsule, platform=platform, api_version=1,
                traits=xla_client.CustomCallTargetTraits(kernel.traits))
            done.append((kernel.target, kernel.platform))
        return done

    def describe(self):
        return {
            "name": self.name,
            "kind": "jax.ffi.register_ffi_target",
            "version": self.versions["jax"],
            "platforms": sorted(_JAX_PLATFORMS),
        }
