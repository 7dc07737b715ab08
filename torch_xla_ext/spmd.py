"""torch_xla SPMD (torch_xla.distributed.spmd): our ops on tensors split over a mesh.

XLA's SPMD partitioner cannot see into a custom call, so it would gather every operand onto
every device. `sharded(name, mesh, heads=..., batch=...)` runs the op as torch_xla's own Pallas
kernels do under SPMD: each tensor is split by the op's layout (op_catalog; heads over the
`heads` axis, sequences over `batch`) and marked manually sharded, the custom call runs on each
device's pieces with the op's attributes unchanged, and the results are put back together as
sharded global tensors. No collective runs. In-place ops write the new pieces into their
arguments, which stay sharded (and are donated by torch_xla's step as usual).

The split runs inside a torch op of its own, torch.ops.xla_ext_spmd.<name> (the op's
functional form, with the mesh as a string and the axes as keyword arguments), so that
torch.compile (dynamo, backend "openxla") traces it as one opaque call with the op's fake
implementation, and the manual sharding happens when torch_xla builds the graph: the same
helper serves lazy tensors and compiled steps.

    import torch_xla.distributed.spmd as xs, torch_xla.runtime as xr
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(n), (n,), ("tp",))
    attention = torch_xla_ext.spmd.sharded("paged_attention", mesh, heads="tp")
    out = attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
"""

import functools

import torch

import torch_xla_ext  # noqa: F401  (defines torch.ops.xla_ext)
from torch_xla_ext import partitioning
from torch_xla_ext.checks import check_known_values
from torch_xla_ext.errors import TorchXlaExtError
from torch_xla_ext.op_catalog import OPS

_OPS = {op.name: op for op in OPS if op.layout is not None}
_lib = torch.library.Library("xla_ext_spmd", "DEF")


def _partition_spec(spec):
    """A layout spec as torch_xla's partition spec: None, an axis name, or a tuple of them."""
    return tuple(None if not axes else axes[0] if len(axes) == 1 else axes for axes in spec)


@functools.lru_cache(maxsize=None)
def _mesh(text):
    """The torch_xla Mesh written as `text` (str(mesh)): a torch op's arguments are strings."""
    import torch_xla.distributed.spmd as xs

    return xs.Mesh.from_str(text)


def _functional(op):
    """torch.ops.xla_ext's op that returns its results (the written arguments' new values)."""
    return getattr(torch.ops.xla_ext, op.name + "_functional" if op.in_place else op.name)


def _split_call(op, args, mesh, heads, batch):
    """The op's functional form on each device's pieces of args ({name: value}); the results as
    sharded global tensors."""
    import torch_xla.distributed.spmd as xs

    op.check(**args)
    check_known_values(op, args)  # on the whole tensors, before they are split
    absent = tuple(n for n in op.operands if args[n] is None)
    shapes = {n: tuple(args[n].shape) for n in op.operands if args[n] is not None}
    shapes.update({n: (0,) for n in absent})
    results = op.results(args)
    shapes.update({partitioning.result_name(i): tuple(shape)
                   for i, (shape, _) in enumerate(results)})
    specs = op.layout.request(op.layout.dims(shapes, absent), shapes,
                              op.layout.roles(op.target, heads, batch), dict(mesh.shape()),
                              op.target)
    pieces = {n: xs.enable_manual_sharding(args[n], _partition_spec(specs[n]),
                                           mesh=mesh).global_tensor
              for n in op.tensor_args() if args[n] is not None}
    out = _functional(op)(**{**args, **pieces})
    out = out if isinstance(out, tuple) else (out,)
    whole = [xs.disable_manual_sharding(
        piece, _partition_spec(specs[partitioning.result_name(i)]), results[i][0],
        mesh=mesh).global_tensor for i, piece in enumerate(out)]
    return whole[0] if len(whole) == 1 else tuple(whole)


def _register(op):
    """xla_ext_spmd::<op.name>: the op's functional schema plus the mesh and axes."""
    schema = op.functional_schema if op.in_place else op.schema
    arguments, returns = schema.rsplit(" -> ", 1)
    _lib.define(f"{op.name}{arguments[:-1]}, *, str mesh, str? heads=None, str? batch=None) "
                f"-> {returns}")

    def on_xla(*args, mesh, heads=None, batch=None, **kwargs):
        return _split_call(op, op.bind(args, kwargs), _mesh(mesh), heads, batch)

    def fake(*args, mesh, heads=None, batch=None, **kwargs):
        return _functional(op)(*args, **kwargs)  # fake tensors: the op's own fake

    _lib.impl(op.name, on_xla, "XLA")
    torch.library.register_fake(f"xla_ext_spmd::{op.name}", fake, lib=_lib)


for _op in _OPS.values():
    _register(_op)


def sharded(name, mesh, heads=None, batch=None, functional=False):
    """torch.ops.xla_ext.<name> on tensors split over `mesh` (a torch_xla spmd Mesh): heads
    over mesh axis (or axes) `heads`, batch (sequences) over `batch`, the rest replicated.
    Same signature as the op; on lazy tensors and inside torch.compile alike. An in-place op
    writes its arguments, or with `functional` returns their new values instead (as its
    <name>_functional does): what a compiled step wants, since torch_xla 2.9's dynamo bridge
    fails to run a graph that copies into a sharded argument ("Trying to access XLA data ...
    while an async operation is in flight"). Raises a TorchXlaExtError when the op cannot
    split that way."""
    if name not in _OPS:
        raise TorchXlaExtError(f"name: expected one of {sorted(_OPS)}, got {name!r}")
    op = _OPS[name]
    op.layout.roles(op.target, heads, batch)  # a split the op has no dimension for: now
    split_op = getattr(torch.ops.xla_ext_spmd, name)
    axes = dict(mesh=str(mesh), heads=heads, batch=batch)
    # Read here, not in `call`: dynamo cannot trace OpDef's cached properties (their lock).
    names = [argument for argument, *_ in op.arguments]
    written = op.written_args()

    def call(*args, **kwargs):
        new = split_op(*args, **kwargs, **axes)
        if functional or not op.in_place:
            return new
        given = {**dict(zip(names, args)), **kwargs}
        for arg, value in zip(written, new if isinstance(new, tuple) else (new,)):
            given[arg].copy_(value)
        return None

    call.__name__ = call.__qualname__ = f"sharded_{name}"
    return call
