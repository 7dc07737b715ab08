"""torch.library ops in namespace `xla_ext`, made from op_catalog.OPS: one schema each,
implemented for XLA tensors (our custom call inside the lazy graph), CPU and CUDA tensors (the
same handlers, run eagerly), and fake tensors (shapes only, for torch.compile and opcheck).

An op that writes into arguments (`Tensor(a!)`) also gets `<name>_functional`, returning the
new values instead: what it becomes under functionalization (torch_xla's lazy tensors), its
custom call writing each new value into the old one's buffer (input/output aliasing).
"""

import torch

from torch_xla_ext import checks, eager, workspace
from torch_xla_ext.custom_call import op_custom_call
from torch_xla_ext.op_catalog import OPS

_lib = torch.library.Library("xla_ext", "DEF")
_other_libs = {}  # namespace -> Library, for the ops also registered under another name


def _results_like(op, args):
    return [torch.empty(shape, dtype=dtype, device=args[op.operands[0]].device)
            for shape, dtype in op.results(args)]


def _on_xla(op, args):
    checks.check_known_values(op, args)
    attributes = op.attribute_values(args)
    results = op.handler_results(args, attributes, workspace.xla_device_gpu())
    outputs = op_custom_call(op.operand_values(args, eager.empty), op.target,
                             [s for s, _ in results], [d for _, d in results], attributes,
                             op.aliases())
    return outputs[:len(op.results(args))]  # not the workspace


def _single(results):
    return results[0] if len(results) == 1 else tuple(results)


def _functional_impls(op):
    """XLA and fake implementations of a functional op (results returned)."""

    def run_on_xla(*args, **kwargs):
        a = op.bind(args, kwargs)
        op.check(**a)
        return _single(_on_xla(op, a))

    def fake(*args, **kwargs):
        a = op.bind(args, kwargs)
        op.check(**a)
        return _single(_results_like(op, a))

    return run_on_xla, fake


def _register(lib, namespace, name, schema, op, write_into_arguments, xla_fn, fake_fn):
    """Defines namespace::name; its CPU and CUDA kernels are csrc/torch_ops.cc's (eager.py)."""
    lib.define(name + schema)
    eager.register(namespace, name, op, write_into_arguments)
    lib.impl(name, xla_fn, "XLA")
    torch.library.register_fake(f"{namespace}::{name}", fake_fn, lib=lib)


def _functionalize_in_place(functional_op, args, written):
    """Runs `functional_op` (an in-place op's functional variant) below functionalization and
    makes its results the new values of the `written` arguments, as functionalization does
    for ATen's in-place ops."""
    for value in args.values():
        if isinstance(value, torch.Tensor):
            torch._sync(value)
    unwrapped = {k: torch._from_functional_tensor(v) if isinstance(v, torch.Tensor) else v
                 for k, v in args.items()}
    with torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
        results = functional_op(**unwrapped)
    results = results if isinstance(results, tuple) else (results,)
    for name, new in zip(written, results):
        target, old = args[name], unwrapped[name]
        # As for ATen's in-place ops: lets torch_xla donate the old buffer to the new value
        # (input/output aliasing of the step), so the call writes into it in place.
        if old.device.type == "xla":
            torch._propagate_xla_data(old, new)
        torch._functionalize_replace(target, new)
        torch._functionalize_commit_update(target)
        torch._functionalize_sync(target)


def _register_in_place(op):
    functional_name = op.name + "_functional"
    _register(_lib, "xla_ext", functional_name, op.functional_schema, op, False,
              *_functional_impls(op))
    functional_op = getattr(torch.ops.xla_ext, functional_name)
    written = op.written_args()

    def run_on_xla(*args, **kwargs):
        # Reached only with torch_xla's functionalization off (XLA_DISABLE_FUNCTIONALIZATION=1).
        a = op.bind(args, kwargs)
        op.check(**a)
        for name, new in zip(written, _on_xla(op, a)):
            a[name].copy_(new)

    def fake(*args, **kwargs):
        op.check(**op.bind(args, kwargs))

    def functionalize(*args, **kwargs):
        _functionalize_in_place(functional_op, op.bind(args, kwargs), written)

    _register(_lib, "xla_ext", op.name, op.schema, op, True, run_on_xla, fake)
    _lib.impl(op.name, functionalize, "Functionalize")


def _register_also_as(op):
    """The op under another name too (e.g. vLLM's torch.ops.xla.kv_cache_update_op), unless
    torch_xla or the user's code defines that op already."""
    namespace, name = op.also_as
    if hasattr(getattr(torch.ops, namespace), name):
        return
    lib = _other_libs.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    _register(lib, namespace, name, op.schema, op, False, *_functional_impls(op))


for _op in OPS:
    if _op.in_place:
        _register_in_place(_op)
    else:
        _register(_lib, "xla_ext", _op.name, _op.schema, _op, False, *_functional_impls(_op))
    if _op.also_as:
        _register_also_as(_op)
