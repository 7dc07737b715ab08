"""The one exception type torch_xla_ext raises for setup and usage errors."""


class TorchXlaExtError(RuntimeError):
    """Raised with a message that says what was found, what was expected and what to do."""
