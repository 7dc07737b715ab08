"""torch_xla SPMD (torch_xla.distributed.spmd): our ops on tensors split over a mesh.

XLA's SPMD partitioner cannot see into a custom call, so it would gather every operand onto
every device. `sharded(name, mesh, heads=..., batch=...)` runs the op as torch_xla's own Pallas
kernels do under SPMD: each tensor is split by the op's layout (op_catalog; heads over the
`heads` axis, sequences over `batch`) and marked manually sharded, the custom call runs on each
device's pieces with the op's attributes unchanged, and the results are put back together as
sharded global tensors. No collective runs. In-place ops write the new pieces into their
arguments, which stay sharded (and are donated by torch_xla's step as usual).

    import torch_xla.distributed.spmd as xs, torch_xla.runtime as xr
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(n), (n,), ("tp",))
    attention = torch_xla_ext.spmd.sharded("paged_attention", mesh, heads="tp")
    out = attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
"""

import torch

import torch_xla_ext  # noqa: F401  (defines torch.ops.xla_ext)
from torch_xla_ext import partitioning
from torch_xla_ext.errors import TorchXlaExtError
from torch_xla_ext.op_catalog import OPS
from torch_xla_ext.ops import check_known_values

_OPS = {op.name: op for op in OPS}


def _partition_spec(spec):
    """A layout spec as torch_xla's partition spec: None, an axis name, or a tuple of them."""
    return tuple(None if not axes else axes[0] if len(axes) == 1 else axes for axes in spec)


def sharded(name, mesh, heads=None, batch=None):
    """torch.ops.xla_ext.<name> on tensors split over `mesh` (a torch_xla spmd Mesh): heads
    over mesh axis (or axes) `heads`, batch (sequences) over `batch`, the rest replicated.
    Same signature as the op. Raises a TorchXlaExtError when the op cannot split that way."""
    import torch_xla.distributed.spmd as xs

    if name not in _OPS:
        raise TorchXlaExtError(f"name: expected one of {sorted(_OPS)}, got {name!r}")
    op = _OPS[name]
    request = op.layout.roles(op.target, heads, batch)
    run = getattr(torch.ops.xla_ext, name + "_functional" if op.in_place else name)
    axis_sizes = dict(mesh.shape())

    def call(*args, **kwargs):
        a = op.bind(args, kwargs)
        op.check(**a)
        check_known_values(op, a)  # on the whole tensors, before they are split
        absent = tuple(n for n in op.operands if a[n] is None)
        shapes = {n: tuple(a[n].shape) for n in op.operands if a[n] is not None}
        shapes.update({n: (0,) for n in absent})
        results = op.results(a)
        shapes.update({partitioning.result_name(i): tuple(shape)
                       for i, (shape, _) in enumerate(results)})
        specs = op.layout.request(op.layout.dims(shapes, absent), shapes, request, axis_sizes,
                                  op.target)
        pieces = {n: xs.enable_manual_sharding(a[n], _partition_spec(specs[n]),
                                               mesh=mesh).global_tensor
                  for n in op.tensor_args() if a[n] is not None}
        out = run(**{**a, **pieces})
        out = out if isinstance(out, tuple) else (out,)
        whole = [xs.disable_manual_sharding(
            piece, _partition_spec(specs[partitioning.result_name(i)]), results[i][0],
            mesh=mesh).global_tensor for i, piece in enumerate(out)]
        if op.in_place:
            for arg, new in zip(op.written_args(), whole):
                a[arg].copy_(new)
            return None
        return whole[0] if len(whole) == 1 else tuple(whole)

    call.__name__ = call.__qualname__ = f"sharded_{name}"
    return call
