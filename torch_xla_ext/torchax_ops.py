"""torchax front end: under torchax (PyTorch on JAX), torch.ops.xla_ext.* lower to the JAX
functions of torch_xla_ext.jax_ops (made from op_catalog.OPS), so PyTorch code runs our
kernels inside an XLA graph (on the GPU, the CUDA handlers through XLA GPU).

Import this module before torchax's environment is first created (torchax.default_env()).
"""

import torch

from torch_xla_ext.errors import import_dependency

jaten = import_dependency(
    "torchax.ops.jaten", "torch_xla_ext.torchax_ops",
    "torchax ships inside the torch_xla 2.9 wheel and imports only with flax installed: "
    "pip install torch_xla==2.9.0 flax==0.12.0 (or a torchax wheel that matches your torch)")

import torch_xla_ext  # noqa: E402,F401  (defines torch.ops.xla_ext)
from torch_xla_ext import jax_ops  # noqa: E402
from torch_xla_ext.op_catalog import OPS  # noqa: E402


def _in_place(op, functional_op):
    """The in-place op on torchax tensors: its functional variant lowers to JAX (aliasing the
    written inputs), and copy_ rebinds each written argument to its new value."""

    def write(*args, **kwargs):
        a = op.bind(args, kwargs)
        new = functional_op(**a)
        for name, value in zip(op.written_args(), new if isinstance(new, tuple) else (new,)):
            a[name].copy_(value)

    return write


for _op in OPS:
    _jax_fn = getattr(jax_ops, _op.name)
    if _op.in_place:
        _functional = getattr(torch.ops.xla_ext, _op.name + "_functional")
        jaten.op(_functional.default)(_jax_fn)
        jaten.op(getattr(torch.ops.xla_ext, _op.name).default,
                 is_jax_function=False)(_in_place(_op, _functional))
    else:
        jaten.op(getattr(torch.ops.xla_ext, _op.name).default)(_jax_fn)
    if _op.also_as:
        namespace, name = _op.also_as
        jaten.op(getattr(getattr(torch.ops, namespace), name).default)(_jax_fn)
