"""Custom calls on torch_xla lazy tensors: typed FFI and the legacy ABIs.

torch_xla's own `_xla_custom_call` builds an IR node whose hash covers only the target name,
so calls that differ in attributes, output shapes, dtypes or api_version silently reuse the
first compiled executable, and it never emits output/operand aliasing. Here each call is a
one-instruction HLO module run through `_xla_user_computation`, whose node hash covers the
whole module (target, attributes, shapes, dtypes, aliasing, api_version): the stale
executable cannot happen, and in-place kernels alias their outputs to their inputs.

`import torch_xla_ext` puts three entry points on `torch_xla._XLAC` (install_torch_xla_entry_
points): `_xla_gpu_custom_call` (torch_xla 2.8's, gone in 2.9, now with a target),
`_xla_register_custom_call_target` (2.9's raises "RegisterCustomCall not implemented"; ours
registers into the XLA that runs the graphs, binders/custom_call_targets.py) and
`_xla_custom_call` (same arguments as 2.9's; each call its own executable, and a target with no
function is refused at the call instead of failing the graph's compilation).
"""

import collections
import math
import numbers
import threading

import numpy as np
import torch

from torch_xla_ext import checks, dtypes, step
from torch_xla_ext.binders import custom_call_targets
from torch_xla_ext.dtypes import DTYPES
from torch_xla_ext.errors import JAX_INSTALL, TorchXlaExtError, import_dependency

API_VERSION_STATUS_RETURNING = 2
API_VERSION_TYPED_FFI = 4
# xla::CustomCallApiVersion, as torch_xla's `_xla_custom_call` numbers it.
API_VERSIONS = (1, 2, 3, 4)
# torch_xla 2.8's `_xla_gpu_custom_call` always called this target, with the legacy ABI.
LEGACY_GPU_TARGET = "triton_kernel_call"
# The attribute that asks a handler registered by XLA_EXT_REGISTER_KERNEL to defer a failure:
# per result, the operand it updates in place or -1 (kernels/registry/registry.h).
DEFER_FAILURE = "xla_ext_defer_failure"

# NumPy's float types by their MLIR names: the attribute floats MLIR text is written in.
_FLOAT_TYPES = {"f16": np.float16, "f32": np.float32, "f64": np.float64}
# Attribute types: NumPy scalar and array types by the dtype table (no i1 arrays).
_MLIR_NUMPY_TYPES = {np.dtype(n): d.mlir for n, d in DTYPES.items()
                     if n in np.sctypeDict and not n.startswith(("float8", "bfloat16"))}


def _mlir_string(text):
    """An MLIR string literal of `text` (str, or bytes for a legacy call's binary opaque):
    printable ASCII as itself, quotes, backslashes and newlines escaped, every other byte as
    MLIR's hex escape."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    special = {ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n"}
    escaped = "".join(special.get(b) or (chr(b) if 0x20 <= b < 0x7F else f"\\{b:02X}")
                      for b in data)
    return f'"{escaped}"'


def _mlir_float(value, mlir_type):
    np_type = _FLOAT_TYPES[mlir_type]
    if math.isfinite(value):
        # The shortest decimal that reads back as the same value of that width.
        text = np.format_float_positional(np_type(value), unique=True, trim="0")
        return f"{text} : {mlir_type}"
    # MLIR spells non-finite floats by their bits.
    bits = np.array(value, dtype=np_type).view(f"u{np.dtype(np_type).itemsize}").item()
    return f"0x{bits:X} : {mlir_type}"


def _mlir_attribute(name, value):
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, np.generic):
        mlir_type = _MLIR_NUMPY_TYPES.get(value.dtype)
        if mlir_type is None:
            raise TorchXlaExtError(f"attrs[{name!r}]: numpy type {value.dtype} has no XLA FFI "
                                   "attribute type")
        if mlir_type.startswith("f"):
            return _mlir_float(value.item(), mlir_type)
        return f"{value.item()} : {mlir_type}"
    if isinstance(value, numbers.Integral):
        return f"{int(value)} : i64"
    if isinstance(value, numbers.Real):
        return _mlir_float(float(value), "f32")
    if isinstance(value, str):
        return _mlir_string(value)
    if isinstance(value, dict):
        return mlir_dictionary(value, prefix=f"{name}.")
    if isinstance(value, (np.ndarray, list, tuple)):
        array = np.asarray(value)
        if array.dtype == np.float64 and not isinstance(value, np.ndarray):
            array = array.astype(np.float32)  # Python floats are f32, as scalars are
        if array.dtype == np.int64 and not isinstance(value, np.ndarray):
            array = array.astype(np.int64)
        if array.ndim != 1:
            raise TorchXlaExtError(f"attrs[{name!r}]: expected a 1-D array, got shape "
                                   f"{list(array.shape)}")
        mlir_type = _MLIR_NUMPY_TYPES.get(array.dtype)
        if mlir_type is None or mlir_type == "i1":
            raise TorchXlaExtError(f"attrs[{name!r}]: arrays of {array.dtype} have no XLA FFI "
                                   "attribute type")
        if array.size == 0:
            return f"array<{mlir_type}>"
        if mlir_type.startswith("f"):
            items = ", ".join(_mlir_float(v, mlir_type).split(" : ")[0] for v in array.tolist())
        else:
            items = ", ".join(str(v) for v in array.tolist())
        return f"array<{mlir_type}: {items}>"
    raise TorchXlaExtError(
        f"attrs[{name!r}]: expected int, float, bool, str, a numpy scalar, a 1-D array or a "
        f"dict, got {type(value).__name__}")


def mlir_dictionary(attrs, prefix=""):
    """Typed attributes as the MLIR dictionary text XLA's typed FFI reads from backend_config.

    Python int -> i64, float -> f32, bool -> i1, str -> string, numpy scalars keep their exact
    type (np.float64 -> f64, np.int32 -> i32, ...), 1-D arrays -> dense arrays, dicts nest.
    """
    items = []
    for name in sorted(attrs):
        if not isinstance(name, str) or not name.isidentifier():
            raise TorchXlaExtError(f"attrs: attribute names must be identifiers, got {name!r}")
        items.append(f"{name} = {_mlir_attribute(prefix + name, attrs[name])}")
    return "{" + ", ".join(items) + "}"


def _tensor_type(shape, dtype, what):
    entry = dtypes.lookup(dtype)
    if entry is None:
        raise TorchXlaExtError(f"{what}: dtype {dtype} is not supported; expected one of "
                               f"{', '.join(DTYPES)}")
    element = entry.mlir
    dims = [int(d) for d in shape]
    if any(d < 0 for d in dims):
        raise TorchXlaExtError(f"{what}: expected non-negative dimensions, got {dims}")
    return "tensor<" + "".join(f"{d}x" for d in dims) + element + ">"


_Spec = collections.namedtuple(
    "_Spec", "target inputs outputs backend_config api_version has_side_effect aliases "
             "frontend_attributes")


def _stablehlo_text(spec):
    """The call as a StableHLO module: `stablehlo.custom_call`, as jax.ffi.ffi_call emits it.

    The module's parameters are the call's operands in reverse order (see `custom_call`)."""
    args = ", ".join(f"%arg{i}: {t}" for i, t in reversed(list(enumerate(spec.inputs))))
    operands = ", ".join(f"%arg{i}" for i in range(len(spec.inputs)))
    single = len(spec.outputs) == 1
    results = spec.outputs[0] if single else "(" + ", ".join(spec.outputs) + ")"
    config = (spec.backend_config or "{}") if spec.api_version == API_VERSION_TYPED_FFI \
        else _mlir_string(spec.backend_config)
    options = [
        f"api_version = {spec.api_version} : i32",
        f"backend_config = {config}",
        f"has_side_effect = {'true' if spec.has_side_effect else 'false'}",
    ]
    if spec.aliases:
        aliases = ", ".join(
            "#stablehlo.output_operand_alias<output_tuple_indices = "
            f"[{'' if single else out}], operand_index = {operand}, operand_tuple_indices = []>"
            for out, operand in spec.aliases)
        options.append(f"output_operand_aliases = [{aliases}]")
    if spec.frontend_attributes:
        pairs = ", ".join(f"{k} = {_mlir_string(v)}" for k, v in spec.frontend_attributes)
        options.append(f"mhlo.frontend_attributes = {{{pairs}}}")
    values = "%0" if single else ", ".join(f"%0#{i}" for i in range(len(spec.outputs)))
    result_name = "%0" if single else f"%0:{len(spec.outputs)}"
    return "\n".join([
        "module @xla_ext_custom_call {",
        f"  func.func public @main({args}) -> {results} {{",
        f"    {result_name} = stablehlo.custom_call @{spec.target}({operands}) "
        f"{{{', '.join(options)}}} : ({', '.join(spec.inputs)}) -> {results}",
        f"    return {values} : {', '.join(spec.outputs)}",
        "  }",
        "}",
    ])


_computations = {}
_computations_lock = threading.Lock()


def _computation(spec):
    with _computations_lock:
        computation = _computations.get(spec)
        if computation is None:
            import torch_xla

            # The pinned jaxlib lowers StableHLO to HLO.
            xla_client = import_dependency("jaxlib.xla_client", "torch_xla_ext.custom_call",
                                           JAX_INSTALL)

            try:
                hlo = xla_client._xla.mlir.mlir_module_to_xla_computation(
                    _stablehlo_text(spec), use_tuple_args=False, return_tuple=False)
            except Exception as e:  # the MLIR parser's message names the bad attribute
                raise TorchXlaExtError(f"custom call {spec.target}: {e}") from e
            computation = torch_xla._XLAC._xla_op_computation_from_module_proto(
                f"xla_ext.{spec.target}", hlo.as_serialized_hlo_module_proto())
            _computations[spec] = computation
        return computation


def _check_inputs(inputs):
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, (list, tuple)):
        raise TorchXlaExtError(f"inputs: expected a list of XLA tensors, got {type(inputs).__name__}")
    if not inputs:
        raise TorchXlaExtError("inputs: expected at least one XLA tensor, got an empty list")
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise TorchXlaExtError(f"inputs[{i}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "xla":
            raise TorchXlaExtError(f"inputs[{i}]: expected a tensor on an XLA device, got one on "
                                   f"{t.device}; move it with .to(torch_xla.device())")


def custom_call(inputs, target, output_shapes, output_dtypes, attrs=None, has_side_effect=False,
                aliases=None, api_version=API_VERSION_TYPED_FFI, backend_config=None,
                frontend_attributes=None):
    """Calls the XLA custom-call `target` on XLA tensors and returns its outputs (a list).

    attrs: typed FFI attributes (see `mlir_dictionary`); or, for the legacy ABIs, a raw
    `backend_config` string (the "opaque" payload). aliases: {output_index: input_index} for
    outputs written in place into an input's buffer (XLA copies the input first only where
    the input is still needed elsewhere).

    A call of one of our ops' targets is checked at the call against the op's description
    (op_catalog.py), as the op itself is: its operands, attribute names and types, output
    shapes and dtypes, and the data the host can see. A target of a user's library that
    registered a check (XLA_EXT_REGISTER_CHECK) is checked at the call by that check: the
    inputs' and outputs' dtypes and shapes, and the scalar attributes. A bad call raises
    TorchXlaExtError and records nothing. Other targets are checked by their handlers when the
    step runs.
    """
    spec = _spec(inputs, target, output_shapes, output_dtypes, attrs, has_side_effect, aliases,
                 api_version, backend_config, frontend_attributes)
    _check_against_description(spec, inputs, output_shapes, output_dtypes)
    custom_call_targets.prepare_call(spec.target, spec.api_version)
    return _record(spec, inputs)


def op_custom_call(inputs, target, output_shapes, output_dtypes, attrs, aliases):
    """custom_call for the op front ends (ops.py), whose own checks have run. The call asks
    its handler to defer a failure (kernels/registry/registry.h), which step.py raises at the
    next call that waits for the device: so a failure leaves the caches the call updates in
    place (`aliases`, {result index: operand index}) as they were, not lost with its graph."""
    in_place = np.array([aliases.get(i, -1) for i in range(len(output_shapes))], dtype=np.int64)
    results = _record(_spec(inputs, target, output_shapes, output_dtypes,
                            {**attrs, DEFER_FAILURE: in_place}, False, aliases,
                            API_VERSION_TYPED_FFI, None, None), inputs)
    step.note_deferring_call(results, aliases)
    return results


def _spec(inputs, target, output_shapes, output_dtypes, attrs, has_side_effect, aliases,
          api_version, backend_config, frontend_attributes):
    _check_inputs(inputs)
    if not isinstance(target, str) or not target:
        raise TorchXlaExtError(f"target: expected a non-empty string, got {target!r}")
    if api_version not in API_VERSIONS:
        raise TorchXlaExtError(f"api_version: expected one of {list(API_VERSIONS)}, got "
                               f"{api_version!r}")
    if len(output_shapes) != len(output_dtypes) or not output_shapes:
        raise TorchXlaExtError(
            f"output_shapes, output_dtypes: expected two non-empty lists of equal length, got "
            f"{len(output_shapes)} shapes and {len(output_dtypes)} dtypes")
    if attrs and backend_config is not None:
        raise TorchXlaExtError("attrs, backend_config: give one of them, not both")
    if attrs and api_version != API_VERSION_TYPED_FFI:
        raise TorchXlaExtError(f"attrs: typed attributes need api_version=4 (typed FFI), got "
                               f"api_version={api_version}")
    if backend_config is not None and not isinstance(backend_config, (str, bytes)):
        raise TorchXlaExtError(f"backend_config: expected a str (or bytes, a legacy call's "
                               f"opaque), got {type(backend_config).__name__}")
    if isinstance(backend_config, bytes) and api_version == API_VERSION_TYPED_FFI:
        raise TorchXlaExtError("backend_config: a typed FFI call (api_version=4) takes an MLIR "
                               "attribute dictionary as a str, got bytes")
    config = mlir_dictionary(attrs) if attrs else (backend_config or "")
    outputs = tuple(_tensor_type(s, d, f"output_shapes[{i}]/output_dtypes[{i}]")
                    for i, (s, d) in enumerate(zip(output_shapes, output_dtypes)))
    input_shapes = tuple(_tensor_type(t.shape, t.dtype, f"inputs[{i}]")
                         for i, t in enumerate(inputs))
    alias_pairs = tuple(sorted((aliases or {}).items()))
    for out, operand in alias_pairs:
        if not 0 <= out < len(outputs) or not 0 <= operand < len(inputs):
            raise TorchXlaExtError(f"aliases: {{{out}: {operand}}} is out of range for "
                                   f"{len(outputs)} outputs and {len(inputs)} inputs")
        if outputs[out] != input_shapes[operand]:
            raise TorchXlaExtError(f"aliases: output {out} ({outputs[out]}) and input {operand} "
                                   f"({input_shapes[operand]}) must have the same shape and dtype")
    return _Spec(target, input_shapes, outputs, config, api_version, bool(has_side_effect),
                 alias_pairs, tuple(sorted((frontend_attributes or {}).items())))


def _check_against_description(spec, inputs, output_shapes, output_dtypes):
    if spec.api_version != API_VERSION_TYPED_FFI:
        return
    from torch_xla_ext.op_catalog import OPS

    op = next((o for o in OPS if o.target == spec.target), None)
    if op is None:
        _run_library_check(spec, inputs, output_shapes, output_dtypes)
        return
    from torch_xla_ext import workspace

    outputs = [(shape, dtypes.name(dtype)) for shape, dtype in zip(output_shapes, output_dtypes)]
    args = op.check_call(inputs, _dictionary_entries(spec.backend_config), outputs,
                         workspace.xla_device_gpu())
    checks.check_known_values(op, args)


def _run_library_check(spec, inputs, output_shapes, output_dtypes):
    """Runs the shape check that a loaded kernel library declares for spec.target, if any."""
    from torch_xla_ext import binders

    library = next((lib for lib in binders.libraries()
                    if getattr(lib.contracts.get(spec.target), "check", None) is not None), None)
    if library is None:
        return
    # _spec accepted every dtype, so each has an entry.
    operands = [(dtypes.lookup(t.dtype).ffi_id, tuple(int(d) for d in t.shape)) for t in inputs]
    operands += [(dtypes.lookup(dtype).ffi_id, tuple(int(d) for d in shape))
                 for shape, dtype in zip(output_shapes, output_dtypes)]
    attributes = sorted((name, DTYPES[dtype].ffi_id, float(value))
                        for name, (dtype, value) in _dictionary_entries(spec.backend_config).items()
                        if isinstance(value, (bool, int, float)) and dtype in DTYPES)
    message = library.check(spec.target, operands, attributes)
    if message is not None:
        raise TorchXlaExtError(f"{spec.target}: {message}")


_DTYPE_OF_MLIR = {d.mlir: name for name, d in DTYPES.items()}


def _dictionary_entries(text):
    """{name: (dtype name, value)} of an MLIR attribute dictionary's scalar entries, as
    mlir_dictionary writes them; other entries as (their kind, None)."""
    body = text.strip()
    if not body:
        return {}
    if not (body.startswith("{") and body.endswith("}")):
        raise TorchXlaExtError(f"backend_config: expected an MLIR attribute dictionary "
                               f"{{name = value : type, ...}}, got {text!r}")
    items, depth, start, quoted = [], 0, 1, False
    for i in range(1, len(body) - 1):
        c = body[i]
        if quoted:
            quoted = not (c == '"' and body[i - 1] != "\\")
        elif c == '"':
            quoted = True
        elif c in "<{[(":
            depth += 1
        elif c in ">}])":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:-1])
    entries = {}
    for item in filter(str.strip, items):
        name, _, value = (part.strip() for part in item.partition("="))
        if value in ("true", "false"):
            entries[name] = ("bool", value == "true")
        elif value.startswith('"'):
            entries[name] = ("string", None)
        elif " : " in value and not value.startswith(("array", "{")):
            literal, _, mlir_type = (part.strip() for part in value.rpartition(" : "))
            entries[name] = (_DTYPE_OF_MLIR.get(mlir_type, mlir_type), _scalar(literal, mlir_type))
        else:
            entries[name] = ("array or dictionary", None)
    return entries


def _scalar(literal, mlir_type):
    if literal.startswith("0x"):  # a float by its bits (non-finite), as _mlir_float writes it
        np_type = _FLOAT_TYPES.get(mlir_type)
        if np_type is None:
            return None  # a type no op's attribute has; check_call refuses it by type
        return np.array(int(literal, 16), dtype=f"u{np.dtype(np_type).itemsize}").view(
            np_type).item()
    try:
        return int(literal)
    except ValueError:
        return float(literal)


def _record(spec, inputs):
    import torch_xla

    # torch_xla numbers a node's device-data parameters in reverse operand order, and XLA pairs
    # the step's donated parameters with its outputs by size in parameter order. Reversing the
    # module's parameters here makes parameter order follow operand order, so a call writing
    # two same-shaped caches (K and V) has each result paired with its own cache's buffer, not
    # with the other's (which costs four cache-sized copies per call).
    return torch_xla._XLAC._xla_user_computation("xla::xla_ext_custom_call", list(inputs)[::-1],
                                                 _computation(spec))


def gpu_custom_call(inputs, payload, output_shapes, output_dtypes, target=LEGACY_GPU_TARGET,
                    api_version=None):
    """torch_xla 2.8's `_xla_gpu_custom_call`, restored, with the target it lacked.

    The default target and ABI stay 2.8's ("triton_kernel_call", status-returning, payload as
    opaque). A typed FFI target (torch_xla_ext's, a loaded library's, or a user's registered
    as one) defaults to the typed FFI, with `payload` as its MLIR attribute dictionary ("" for
    none).
    """
    if api_version is None:
        api_version = custom_call_targets.default_api_version(target)
    if not isinstance(payload, (str, bytes)):
        raise TorchXlaExtError(f"payload: expected a str, got {type(payload).__name__}")
    return custom_call(inputs, target, output_shapes, output_dtypes, backend_config=payload,
                       api_version=api_version)


# torch_xla's own `_xla_custom_call`, kept by install_torch_xla_entry_points.
_torch_xla_own_custom_call = None


def torch_xla_custom_call(inputs, target, output_shapes, output_dtypes, has_side_effect=False,
                          backend_config="", api_version=API_VERSION_TYPED_FFI,
                          frontend_attributes=None):
    """torch_xla's `_xla_custom_call`, same arguments (positional as torch_xla's), through
    `custom_call`: each call its own executable, checked at the call. api_version 0 (what
    torch_xla's own stablehlo_custom_call uses for targets XLA's compiler handles itself, such
    as "annotate_device_placement") goes to torch_xla's own, as before."""
    if api_version not in API_VERSIONS:
        return _torch_xla_own_custom_call(inputs, target, output_shapes, output_dtypes,
                                          has_side_effect, backend_config, api_version,
                                          frontend_attributes or {})
    return custom_call(inputs, target, output_shapes, output_dtypes,
                       has_side_effect=has_side_effect, backend_config=backend_config,
                       api_version=api_version, frontend_attributes=frontend_attributes)


def register_custom_call_target(name, function, platform, api_version=None):
    """torch_xla's `_xla_register_custom_call_target(name, capsule, platform)`, working:
    registers a legacy custom-call function or a typed FFI handler into the XLA that runs the
    graphs (binders/custom_call_targets.py). `api_version` (ours) says which it is; without
    it, the first call of the target does."""
    custom_call_targets.register(name, function, platform, api_version)


def install_torch_xla_entry_points():
    """Puts `gpu_custom_call`, `torch_xla_custom_call` and `register_custom_call_target` where
    torch_xla users call them."""
    global _torch_xla_own_custom_call
    from torch_xla import _XLAC

    if _XLAC._xla_custom_call is not torch_xla_custom_call:
        _torch_xla_own_custom_call = _XLAC._xla_custom_call
    _XLAC._xla_gpu_custom_call = gpu_custom_call
    _XLAC._xla_custom_call = torch_xla_custom_call
    _XLAC._xla_register_custom_call_target = register_custom_call_target
