"""The `jax_plugins` entry point: JAX calls initialize() when its backends start, so a JAX
program gets our kernels registered without importing torch_xla_ext itself."""


def initialize():
    import torch_xla_ext.jax_ops  # noqa: F401  (registers the kernels into JAX on import)
