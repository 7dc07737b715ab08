"""An op written down once (`OpDef`): its schema, checks, and how its arguments become the
handler's operands, attributes and results. The torch.library ops (ops.py), the JAX functions
(jax_ops.py) and the torchax lowerings (torchax_ops.py) are all made from these descriptions;
the descriptions themselves are in op_catalog.py.

Arguments reach every function as a dict by name (`bind`), with the schema's defaults applied,
so the descriptions never depend on how a caller spelled a call.
"""

import dataclasses
import functools
import re
from typing import Callable, Optional

import numpy as np

from torch_xla_ext import dtypes
from torch_xla_ext.errors import TorchXlaExtError
from torch_xla_ext.partitioning import Layout


@dataclasses.dataclass(frozen=True)
class OpDef:
    name: str  # torch.library xla_ext::<name>, torch_xla_ext.jax_ops.<name>
    target: str  # the XLA FFI target of its handlers
    schema: str  # "(Tensor a, ...) -> ..." in torch.library's syntax
    doc: str
    operands: tuple  # argument names, in the order the handler binds its operands
    # args -> [(shape, dtype)] of the handler's results, in the arguments' own framework
    # (args: the operands and the attributes by name).
    results: Callable
    check: Callable  # check(**args): shapes and dtypes; raises TorchXlaExtError
    attributes: dict = dataclasses.field(default_factory=dict)  # argument -> attribute dtype
    # Optional attributes: argument -> the value the handler takes for None.
    attribute_none: dict = dataclasses.field(default_factory=dict)
    # Optional tensor arguments passed to the handler as an empty array when None:
    # argument -> (shape, dtype name).
    absent: dict = dataclasses.field(default_factory=dict)
    writes: dict = dataclasses.field(default_factory=dict)  # result index -> operand it aliases
    value_args: tuple = ()  # arguments check_values reads, where their values are known
    check_values: Optional[Callable] = None  # check_values(args, values)
    # Also registered under this (namespace, name) when that op does not exist yet.
    also_as: Optional[tuple] = None
    # How its tensors split over devices (partitioning.Layout: which dimensions are heads or
    # batch); jax_ops' custom partitioning and the shard_map and torch_xla SPMD helpers read it.
    layout: Optional[Layout] = None
    # Bytes of scratch the CUDA handler takes as its last result (workspace.py):
    # workspace(op, args, attribute values, CUDA device ordinal or workspace.ANY_GPU). The
    # front ends add that result to the custom call and drop it from what they return.
    workspace: Optional[Callable] = None

    @functools.cached_property
    def arguments(self):
        """[(name, default or _REQUIRED, is_tensor, is_written)] from the schema."""
        import torch

        parsed = torch._C.parse_schema(f"xla_ext::{self.name}{self.schema}")
        return [(a.name, a.default_value if a.has_default_value() else _REQUIRED,
                 "Tensor" in str(a.type), bool(a.alias_info and a.alias_info.is_write))
                for a in parsed.arguments]

    @property
    def in_place(self):
        """Whether the schema writes into arguments (Tensor(a!)) and returns nothing."""
        return any(written for *_, written in self.arguments)

    @property
    def functional_schema(self):
        """The in-place schema with the written arguments returned as results instead."""
        arguments = re.sub(r"Tensor\([a-z]!\)", "Tensor", self.schema.rsplit(" -> ", 1)[0])
        results = ", ".join(["Tensor"] * len(self.writes))
        return f"{arguments} -> {'Tensor' if len(self.writes) == 1 else f'({results})'}"

    @functools.cached_property
    def _argument_names(self):
        return [name for name, *_ in self.arguments]

    @functools.cached_property
    def _attribute_types(self):
        return {name: np.dtype(dtype).type for name, dtype in self.attributes.items()}

    def bind(self, args, kwargs):
        """The call's arguments as {name: value}, defaults applied."""
        names = self._argument_names
        if len(args) > len(names):
            raise TorchXlaExtError(f"{self.target}: expected at most {len(names)} arguments "
                                   f"({', '.join(names)}), got {len(args)}")
        bound = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise TorchXlaExtError(f"{self.target}: unexpected argument {key!r}; expected "
                                       f"{', '.join(names)}")
            if key in bound:
                raise TorchXlaExtError(f"{self.target}: argument {key!r} given twice")
            bound[key] = value
        for name, default, *_ in self.arguments:
            if name not in bound:
                if default is _REQUIRED:
                    raise TorchXlaExtError(f"{self.target}: argument {name!r} is missing")
                bound[name] = default
        return bound

    def tensor_args(self):
        return [name for name, _, is_tensor, _ in self.arguments if is_tensor]

    def written_args(self):
        """Operands written in place, in result order."""
        return [self.writes[i] for i in sorted(self.writes)]

    def attribute_values(self, args):
        """{attribute: NumPy scalar of the attribute's dtype}."""
        return {name: type_(self.attribute_none[name] if args[name] is None else args[name])
                for name, type_ in self._attribute_types.items()}

    def operand_values(self, args, empty):
        """The handler's operands; `empty(shape, dtype name, like)` makes an absent one."""
        like = args[self.operands[0]]
        return [empty(*self.absent[name], like) if args[name] is None else args[name]
                for name in self.operands]

    def handler_results(self, args, attributes, gpu):
        """[(shape, dtype)] of the handler's results: results(args), then, where the op has
        one, the workspace (workspace.py) for CUDA device `gpu` (an ordinal or
        workspace.ANY_GPU; None off the GPU: empty)."""
        results = list(self.results(args))
        if self.workspace is not None:
            size = 0 if gpu is None else self.workspace(self, args, attributes, gpu)
            results.append(((size,), "uint8"))
        return results

    def check_call(self, inputs, attributes, outputs, gpu):
        """Checks a direct custom call of this op's target (custom_call, _xla_gpu_custom_call)
        against this description, as the op's own front ends are checked: `inputs` the
        handler's operands (an absent optional operand as its empty array), `attributes`
        {name: (dtype name, value)}, `outputs` [(shape, dtype name)] the handler's results
        (for CUDA device `gpu`, as handler_results). Returns the call's arguments by name."""
        if len(inputs) != len(self.operands):
            raise TorchXlaExtError(
                f"{self.target}: inputs: expected {len(self.operands)} operands "
                f"({', '.join(self.operands)}), got {len(inputs)}")
        args = {}
        for name, tensor in zip(self.operands, inputs):
            absent = self.absent.get(name)
            given = (tuple(tensor.shape), dtypes.name(tensor.dtype))
            args[name] = None if absent and given == (tuple(absent[0]), absent[1]) else tensor
        if set(attributes) != set(self.attributes):
            expected = ", ".join(f"{n}: {t}" for n, t in sorted(self.attributes.items()))
            got = ", ".join(f"{n}: {t}" for n, (t, _) in sorted(attributes.items()))
            raise TorchXlaExtError(f"{self.target}: attrs: expected {{{expected}}}, got {{{got}}}")
        for name, (dtype, value) in attributes.items():
            if dtype != self.attributes[name]:
                raise TorchXlaExtError(f"{self.target}: attrs[{name!r}]: expected "
                                       f"{self.attributes[name]}, got {dtype}")
            args[name] = value
        self.check(**{name: args.get(name) for name in self._argument_names})
        expected = [(tuple(int(d) for d in shape), dtypes.name(dtype)) for shape, dtype in
                    self.handler_results(args, self.attribute_values(args), gpu)]
        if len(outputs) != len(expected):
            described = ", ".join(f"{list(shape)} {dtype}" for shape, dtype in expected)
            raise TorchXlaExtError(f"{self.target}: output_shapes: expected {len(expected)} "
                                   f"results ({described}), got {len(outputs)}")
        for i, ((shape, dtype), (want_shape, want_dtype)) in enumerate(zip(outputs, expected)):
            if tuple(int(d) for d in shape) != want_shape:
                raise TorchXlaExtError(
                    f"{self.target}: output_shapes[{i}]: expected {list(want_shape)} for these "
                    f"inputs, got {[int(d) for d in shape]}")
            if dtype != want_dtype:
                raise TorchXlaExtError(f"{self.target}: output_dtypes[{i}]: expected "
                                       f"{want_dtype}, got {dtype}")
        return args

    def aliases(self):
        """{result index: operand index} for the results written into an operand's buffer."""
        return {out: self.operands.index(name) for out, name in self.writes.items()}


class _Required:
    def __repr__(self):
        return "<required>"


_REQUIRED = _Required()
