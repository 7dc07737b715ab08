"""vLLM's KV-cache write (torch.ops.xla.kv_cache_update_op) on our op.

vLLM's Pallas backend defines that op when it is imported (pallas.py, unless tpu_inference is
installed), with a Pallas kernel, which runs on TPUs only; torch_xla_ext defines the same op at
its own import if nobody has yet (op_catalog: KV_CACHE_UPDATE_SLICES). Defining it twice fails,
whichever comes first, so `serve()` imports the backend with its definition and kernel
registrations of that one op skipped when the op exists already, then makes the op's XLA kernel
ours (torch.ops.xla_ext.kv_cache_update_slices: the same schema and semantics). The platform's
config check and the worker call it, in whichever process comes first."""

import contextlib
import sys
import warnings

import torch

_KV_OP = "kv_cache_update_op"
_kernels = None  # the torch.library.Library holding our kernel for vLLM's op


@contextlib.contextmanager
def _without_redefining_kv_op():
    """While vLLM's Pallas backend is imported: its XLA_LIB.define and kernel registrations
    of kv_cache_update_op do nothing if the op exists already."""
    from torch_xla.experimental.custom_kernel import XLA_LIB

    if not hasattr(torch.ops.xla, _KV_OP):
        yield
        return
    define, impl = XLA_LIB.define, torch.library.impl

    def define_others(schema, *args, **kwargs):
        return None if schema.startswith(_KV_OP + "(") else define(schema, *args, **kwargs)

    def impl_others(lib, name, *args, **kwargs):
        if lib is XLA_LIB and name == _KV_OP:
            return lambda fn: fn
        return impl(lib, name, *args, **kwargs)

    XLA_LIB.define, torch.library.impl = define_others, impl_others
    try:
        yield
    finally:
        XLA_LIB.define, torch.library.impl = define, impl


def serve():
    """Imports vLLM's Pallas backend and makes vLLM's kv_cache_update_op run ours on XLA
    devices."""
    global _kernels
    if _kernels is not None:
        return
    if "vllm.v1.attention.backends.pallas" not in sys.modules:
        with _without_redefining_kv_op():
            import vllm.v1.attention.backends.pallas  # noqa: F401
    import torch_xla_ext  # noqa: F401  (our ops; ragged_paged_attention's kernel off TPUs)

    def on_xla(kv, slot_mapping, kv_cache, num_kv_update_slices, page_size,
               num_slices_per_block):
        return torch.ops.xla_ext.kv_cache_update_slices(
            kv, slot_mapping, kv_cache, num_kv_update_slices, page_size, num_slices_per_block)

    kernels = torch.library.Library("xla", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
        warnings.simplefilter("ignore", UserWarning)
        kernels.impl(_KV_OP, on_xla, "XLA", allow_override=True)
    _kernels = kernels
