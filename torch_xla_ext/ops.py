"""torch.library ops in namespace `xla_ext`, made from op_catalog.OPS: one schema each,
implemented for XLA tensors (our custom call inside the lazy graph), CPU and CUDA tensors (the
same handlers, run eagerly), and fake tensors (shapes only, for torch.compile and opcheck).

An op that writes into arguments (`Tensor(a!)`) also gets `<name>_functional`, returning the
new values instead: what it becomes under functionalization (torch_xla's lazy tensors), its
custom call writing each new value into the old one's buffer (input/output aliasing).
"""

import threading

import torch

from torch_xla_ext import eager
from torch_xla_ext.custom_call import custom_call
from torch_xla_ext.errors import TorchXlaExtError
from torch_xla_ext.op_catalog import OPS

_lib = torch.library.Library("xla_ext", "DEF")
_other_libs = {}  # namespace -> Library, for the ops also registered under another name


def _empty(shape, dtype_name, like):
    return like.new_empty(shape, dtype=getattr(torch, dtype_name))


def _results_like(op, args):
    return [torch.empty(shape, dtype=dtype, device=args[op.operands[0]].device)
            for shape, dtype in op.results(args)]


# Eager calls repeat with the same shapes (every layer of every step), so what depends only on
# the tensors' shapes, dtypes and device and on the other arguments (the checks, the result
# shapes, the packed handler call) is kept, per thread, under those; a call that fails its
# checks is not kept. Data is checked by the handlers at every call.
_MAX_PREPARED_CALLS = 512
_prepared = threading.local()


def _signature(values):
    """What the checks and the packed call depend on, hashable: a tensor by shape, dtype and
    device (type and index: eager tensors are on the CPU or a GPU), anything else by type and
    value (a float by its exact bits: -0.0 is not 0.0)."""
    key = []
    for v in values:
        if isinstance(v, torch.Tensor):
            key.append((v.shape, v.dtype, v.is_cuda, v.get_device()))
        elif isinstance(v, float):
            key.append((float, v.hex()))
        else:
            key.append((type(v), v))
    return tuple(key)


def _prepared_call(op, args, write_into_arguments):
    """(the kept eager.PreparedCall or None, the result shapes and dtypes or None, its key)."""
    calls = getattr(_prepared, "calls", None)
    if calls is None:
        calls = _prepared.calls = {}
    key = (op.name, write_into_arguments, _signature(args[name] for name, *_ in op.arguments))
    try:
        return (*calls.get(key, (None, None)), key)
    except TypeError:  # an unhashable argument: nothing kept for it
        return None, None, None


def _keep_prepared_call(key, prepared, results):
    if key is None:
        return
    calls = _prepared.calls
    if len(calls) >= _MAX_PREPARED_CALLS:
        calls.clear()
    calls[key] = (prepared, results)


def _run_eagerly(op, args, write_into_arguments):
    """Checks the arguments and runs the handler on CPU/CUDA tensors. Written operands are
    updated in place when `write_into_arguments`, else copied first (the op is functional)."""
    prepared, results, key = _prepared_call(op, args, write_into_arguments)
    if prepared is None:
        op.check(**args)
        results = op.results(args)
    operands = [t.contiguous() for t in op.operand_values(args, _empty)]
    outputs = []
    for index, (shape, dtype) in enumerate(results):
        if index in op.writes:
            position = op.operands.index(op.writes[index])
            if write_into_arguments:
                target = args[op.writes[index]]
                if not target.is_contiguous():
                    raise TorchXlaExtError(f"{op.target}: argument '{op.writes[index]}': "
                                           "expected a contiguous tensor (it is written in place)")
            else:
                target = operands[position].clone()
            # The handler reads and writes the same buffer: XLA's aliasing, done by hand.
            operands[position] = target
            outputs.append(target)
        else:
            outputs.append(torch.empty(shape, dtype=dtype, device=operands[0].device))
    if prepared is None:
        prepared = eager.PreparedCall(op.target, operands, outputs, op.attribute_values(args))
        _keep_prepared_call(key, prepared, results)
    prepared(operands, outputs)
    return outputs


def check_known_values(op, args):
    """Checks the data arguments (block ids, lengths, slots) on the host when their values
    already sit in device buffers: a bad request then fails here, before anything is built or
    run. Arguments still to be computed are checked by the handlers when the step runs."""
    if op.check_values is None:
        return
    import torch_xla

    tensors = [args[name] for name in op.value_args]
    if any(torch_xla._XLAC._check_tensor_need_materialization(tensors)):
        return
    op.check_values(args, {name: t.cpu().numpy() for name, t in zip(op.value_args, tensors)})


def _on_xla(op, args):
    check_known_values(op, args)
    return custom_call(op.operand_values(args, _empty), op.target,
                       [s for s, _ in op.results(args)], [d for _, d in op.results(args)],
                       attrs=op.attribute_values(args), aliases=op.aliases())


def _single(results):
    return results[0] if len(results) == 1 else tuple(results)


def _functional_impls(op):
    """eager, XLA and fake implementations of a functional op (results returned)."""

    def run_eagerly(*args, **kwargs):
        return _single(_run_eagerly(op, op.bind(args, kwargs), write_into_arguments=False))

    def run_on_xla(*args, **kwargs):
        a = op.bind(args, kwargs)
        op.check(**a)
        return _single(_on_xla(op, a))

    def fake(*args, **kwargs):
        a = op.bind(args, kwargs)
        op.check(**a)
        return _single(_results_like(op, a))

    return run_eagerly, run_on_xla, fake


def _register(lib, qualified, name, schema, eager_fn, xla_fn, fake_fn):
    lib.define(name + schema)
    for key in ("CPU", "CUDA"):
        lib.impl(name, eager_fn, key)
    lib.impl(name, xla_fn, "XLA")
    torch.library.register_fake(qualified, fake_fn, lib=lib)


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
    _register(_lib, f"xla_ext::{functional_name}", functional_name, op.functional_schema,
              *_functional_impls(op))
    functional_op = getattr(torch.ops.xla_ext, functional_name)
    written = op.written_args()

    def run_eagerly(*args, **kwargs):
        _run_eagerly(op, op.bind(args, kwargs), write_into_arguments=True)

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

    _register(_lib, f"xla_ext::{op.name}", op.name, op.schema, run_eagerly, run_on_xla, fake)
    _lib.impl(op.name, functionalize, "Functionalize")


def _register_also_as(op):
    """The op under another name too (e.g. vLLM's torch.ops.xla.kv_cache_update_op), unless
    torch_xla or the user's code defines that op already."""
    namespace, name = op.also_as
    if hasattr(getattr(torch.ops, namespace), name):
        return
    lib = _other_libs.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    _register(lib, f"{namespace}::{name}", name, op.schema, *_functional_impls(op))


for _op in OPS:
    if _op.in_place:
        _register_in_place(_op)
    else:
        _register(_lib, f"xla_ext::{_op.name}", _op.name, _op.schema, *_functional_impls(_op))
    if _op.also_as:
        _register_also_as(_op)
