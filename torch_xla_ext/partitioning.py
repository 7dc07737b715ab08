"""How an op's tensors split over the devices of a mesh (`Layout`, one per OpDef).

A layout names every dimension of every operand and result, e.g. paged attention's query is
"seqs (kv_heads group) head_size": a dimension named twice in different tensors is the same
quantity. "(kv_heads group)" is one dimension holding kv_heads * group entries, kv_heads
major: q head i belongs to kv head i // group, so splitting it into n contiguous pieces gives
each device whole groups of the kv heads it holds when n divides kv_heads. "..." stands for
any number of dimensions split freely (elementwise ops).

Only the names given as `heads` and `batch` (and those "..." stands for) may be split over mesh
axes; each device then runs the kernel on its own pieces, with the op's attributes unchanged,
and no data moves. The JAX custom partitioning (jax_ops), the shard_map helper (jax_ops.sharded)
and the torch_xla SPMD helper (torch_xla_ext.spmd.sharded) all read these rules from here.

Partition specs here are tuples with one entry per dimension, each a tuple of mesh axis names
(empty: not split).
"""

import dataclasses
import math
import re
from typing import Optional

from torch_xla_ext.errors import TorchXlaExtError

ELLIPSIS = "..."


class ShardingWarning(UserWarning):
    """A sharded dimension the kernel cannot split: XLA gathers it before the call."""


def result_name(index):
    """How results are named among a layout's tensors."""
    return f"result {index}"


def normalize_spec(spec, rank):
    """A PartitionSpec-like sequence (None, "x", ("x", "y"), ...) as `rank` tuples of axes."""
    entries = list(spec) + [None] * (rank - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _label(dim):
    return dim[0] if len(dim) == 1 else "(" + " ".join(dim) + ")"


@dataclasses.dataclass(frozen=True)
class Layout:
    operands: dict  # tensor argument -> its dimension names, e.g. "seqs (kv_heads group) head_size"
    results: tuple  # the same, per result
    heads: Optional[str] = None  # the name split for tensor parallelism (heads)
    batch: Optional[str] = None  # the name split for data parallelism, where that is natural
    sizes: dict = dataclasses.field(default_factory=dict)  # fixed sizes, e.g. {"kv": 2}

    def tensor_names(self):
        return [*self.operands, *(result_name(i) for i in range(len(self.results)))]

    def dims(self, shapes, absent=()):
        """{tensor: [dimension as a tuple of names]} for these shapes ({tensor: shape}, results
        under `result_name(i)`). An absent operand (an empty stand-in) gets names of its own."""
        texts = {**self.operands, **{result_name(i): t for i, t in enumerate(self.results)}}
        dims = {}
        for tensor, text in texts.items():
            rank = len(shapes[tensor])
            if tensor in absent:
                dims[tensor] = [(f"{tensor}_{i}",) for i in range(rank)]
                continue
            parsed = [tuple(group.strip("()").split())
                      for group in re.findall(r"\([^)]*\)|\S+", text)]
            if parsed and parsed[0] == (ELLIPSIS,):
                # Ellipsis dimensions are shared positionally by every tensor of the op.
                parsed = [(f"dim{i}",) for i in range(rank - len(parsed) + 1)] + parsed[1:]
            if len(parsed) != rank:
                raise TorchXlaExtError(f"layout {text!r} of '{tensor}' has {len(parsed)} "
                                       f"dimensions, the tensor {rank}")
            dims[tensor] = parsed
        return dims

    def splittable(self, dims):
        """Names that may be split over mesh axes, in the order they claim axes."""
        names = [n for n in (self.heads, self.batch) if n]
        elementwise = {d[0] for ds in dims.values() for d in ds if re.fullmatch(r"dim\d+", d[0])}
        return names + sorted(elementwise - set(names))

    def factor_sizes(self, dims, shapes):
        """{name: size}: whole dimensions give their size; a compound dimension gives the size
        of its one remaining unknown name."""
        sizes = dict(self.sizes)
        pending = []
        for tensor, ds in dims.items():
            for dim, size in zip(ds, shapes[tensor]):
                if len(dim) == 1:
                    sizes.setdefault(dim[0], int(size))
                else:
                    pending.append((dim, int(size)))
        while pending:
            progress = False
            for dim, size in list(pending):
                unknown = [n for n in dim if n not in sizes]
                if len(unknown) <= 1:
                    if unknown:
                        known = math.prod(sizes[n] for n in dim if n in sizes)
                        sizes[unknown[0]] = size // known if known else 0
                    pending.remove((dim, size))
                    progress = True
            if not progress:
                raise TorchXlaExtError(f"layout: cannot size {pending} from the shapes")
        return sizes

    def specs(self, dims, assignment):
        """{tensor: partition spec} when each name in `assignment` ({name: axes}) is split over
        its axes: a dimension is split where its major (first) name is."""
        return {tensor: tuple(assignment.get(dim[0], ()) for dim in ds)
                for tensor, ds in dims.items()}

    def _problem(self, name, axes, sizes, axis_sizes, taken):
        """Why `name` cannot be split over `axes`, or None."""
        clash = [a for a in axes if a in taken]
        if clash:
            return f"mesh axes {clash} already split {taken[clash[0]]}"
        unknown = [a for a in axes if a not in axis_sizes]
        if unknown:
            return f"the mesh has no axes {unknown} (it has {sorted(axis_sizes)})"
        count = math.prod(axis_sizes[a] for a in axes)
        if sizes.get(name, 0) % count:
            return (f"{sizes.get(name, 0)} {name} do not divide evenly over the {count} devices "
                    f"of axes {list(axes)}")
        return None

    def roles(self, op, heads=None, batch=None):
        """{name: axes} for the helpers' heads= and batch= (a mesh axis name or a tuple of
        them); raises a TorchXlaExtError for a role the op does not have."""
        assignment = {}
        for role, axes in (("heads", heads), ("batch", batch)):
            if axes is None:
                continue
            if getattr(self, role) is None:
                raise TorchXlaExtError(f"{op}: {role}={axes!r}: this op has no {role} dimension "
                                       "to split")
            assignment[getattr(self, role)] = (axes,) if isinstance(axes, str) else tuple(axes)
        return assignment

    def request(self, dims, shapes, assignment, axis_sizes, op):
        """The partition specs for an explicit request ({name: axes}; the helpers' heads= and
        batch=); raises a TorchXlaExtError naming what cannot be split that way."""
        sizes = self.factor_sizes(dims, shapes)
        allowed = self.splittable(dims)
        taken = {}
        for name, axes in assignment.items():
            if name not in allowed:
                raise TorchXlaExtError(f"{op}: cannot split {name!r} over mesh axes; it can split "
                                       f"{allowed or 'nothing'}")
            problem = self._problem(name, axes, sizes, axis_sizes, taken)
            if problem:
                raise TorchXlaExtError(f"{op}: cannot split {name} over mesh axes {list(axes)}: "
                                       f"{problem}")
            taken.update({a: name for a in axes})
        return self.specs(dims, assignment)

    def choose(self, dims, shapes, incoming, axis_sizes):
        """What the op runs with, given the shardings its operands arrive with ({tensor:
        partition spec}): ({name: axes}, specs, notes). Each splittable name keeps the axes of
        the first operand that splits it (the partitioner moves the others to match); anything
        else is run whole, and each note says which sharded dimension XLA all-gathers for it."""
        sizes = self.factor_sizes(dims, shapes)
        assignment, taken, refused = {}, {}, {}
        for name in self.splittable(dims):
            for tensor in incoming:
                for dim, axes in zip(dims[tensor], incoming[tensor]):
                    if dim[0] != name or not axes or name in assignment or name in refused:
                        continue
                    problem = self._problem(name, axes, sizes, axis_sizes, taken)
                    if problem:
                        refused[name] = problem
                    else:
                        assignment[name] = tuple(axes)
                        taken.update({a: name for a in axes})
        specs = self.specs(dims, assignment)
        notes = []
        for tensor, spec in incoming.items():
            for index, (dim, axes, wanted) in enumerate(zip(dims[tensor], spec, specs[tensor])):
                if not axes or tuple(axes) == wanted:
                    continue
                if dim[0] in refused:
                    why = refused[dim[0]]
                elif dim[0] in assignment:
                    why = f"the op runs {dim[0]} split over {list(assignment[dim[0]])}"
                else:
                    why = (f"the kernel needs {_label(dim)} whole; it can split "
                           f"{self.splittable(dims) or 'nothing'}")
                notes.append(f"'{tensor}' dimension {index} ({_label(dim)}) arrives split over "
                             f"mesh axes {list(axes)}: {why}; XLA regathers it")
        return assignment, specs, notes
