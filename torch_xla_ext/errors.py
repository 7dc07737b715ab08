"""The one exception type torch_xla_ext raises for setup and usage errors."""

import importlib


class TorchXlaExtError(RuntimeError):
    """Raised with a message that says what was found, what was expected and what to do."""


# What to install for the JAX-based pieces: the versions the kernels and wheel are built against.
JAX_INSTALL = "pip install jax==0.7.1 jaxlib==0.7.1 (the versions torch_xla_ext is built against)"


def import_dependency(module, needed_by, install):
    """Imports `module` for the front end `needed_by`, or says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TorchXlaExtError(
            f"{needed_by} needs {module}, which cannot be imported ({e}). Install it: "
            f"{install}") from e
