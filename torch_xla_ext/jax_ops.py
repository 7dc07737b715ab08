"""JAX front end: torch_xla_ext's kernels as JAX functions, made from op_catalog.OPS, each one
`jax.ffi.ffi_call` of its XLA FFI target (an opaque custom call in the HLO), usable eagerly,
under jax.jit and under jax.vmap (each call of a batch runs in turn).

Importing this module registers the built-in kernels into JAX's XLA (CPU, and CUDA where a
CUDA PJRT plugin is installed). Arguments are checked here, with errors naming the argument;
data such as block ids is checked here too where its values are known (outside jit), and by
the Host handlers. An op that writes into an argument (a KV cache) returns the new value,
aliased to that argument: donate it to jax.jit to write in place.

Under jax.jit with sharded arguments each op splits itself over the devices by its layout
(op_catalog; heads, and batch where natural: custom_partitioning), so each device runs the
kernel on its own heads with no collective; `sharded` gives the same under jax.shard_map.
"""

import warnings

import numpy as np

from torch_xla_ext.errors import JAX_INSTALL, TorchXlaExtError, import_dependency

jax = import_dependency("jax", "torch_xla_ext.jax_ops", JAX_INSTALL)
import jax.numpy as jnp  # noqa: E402
from jax.experimental.custom_partitioning import (  # noqa: E402
    ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from torch_xla_ext import _kernels, binders, partitioning, workspace  # noqa: E402
from torch_xla_ext.binders.jax_runtime import JaxRuntime  # noqa: E402
from torch_xla_ext.op_catalog import OPS  # noqa: E402

binders.add_library(_kernels.builtin_library())
binders.add_runtime(JaxRuntime())


def _concrete(x):
    """x as a NumPy array when its values are known here (not inside jit), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _empty(shape, dtype_name, like):
    return jnp.zeros(shape, getattr(jnp, dtype_name))


def _check(op, args):
    try:
        op.check(**args)
    except TorchXlaExtError as e:
        if "expected dtype int64, got dtype int32" in str(e) and not jax.config.jax_enable_x64:
            raise TorchXlaExtError(f"{e} (JAX keeps int64 arrays only with "
                                   "jax.config.update('jax_enable_x64', True))") from None
        raise


def workspace_gpu():
    """The GPU an op's workspace result is sized for (OpDef.handler_results): jit places calls
    on the default backend's devices, and sizing for any GPU covers each of them."""
    return workspace.ANY_GPU if jax.default_backend() in ("gpu", "cuda") else None


def _ffi(op, attributes):
    """The op's custom call on whatever arrays it is given (global or one device's pieces)."""

    def call(*operands):
        named = {**dict(attributes), **dict(zip(op.operands, operands))}
        results = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in
                   op.handler_results(named, dict(attributes), workspace_gpu())]
        ffi = jax.ffi.ffi_call(op.target, results[0] if len(results) == 1 else tuple(results),
                               input_output_aliases={i: out for out, i in op.aliases().items()},
                               vmap_method="sequential")
        out = ffi(*operands, **dict(attributes))
        if op.workspace is None:
            return out
        return out[0] if len(out) == 2 else tuple(out[:-1])

    return call


def _layout_dims(op, operands, absent, attributes):
    shapes = {name: x.shape for name, x in zip(op.operands, operands)}
    named = {**dict(attributes), **dict(zip(op.operands, operands))}
    for index, (shape, _) in enumerate(op.results(named)):
        shapes[partitioning.result_name(index)] = shape
    return op.layout.dims(shapes, absent), shapes


def _sharding_rule(op, operands, absent, attributes):
    """The layout as a Shardy rule (how jit's propagation carries shardings through the call)."""
    dims, shapes = _layout_dims(op, operands, absent, attributes)
    whole = {d[0] for ds in dims.values() for d in ds if len(d) == 1}
    sizes = op.layout.factor_sizes(dims, shapes)

    def mapping(tensor):
        return ArrayMapping(*(d[0] if len(d) == 1 else CompoundFactor(*d) for d in dims[tensor]))

    return SdyShardingRule(
        tuple(mapping(name) for name in op.operands),
        tuple(mapping(partitioning.result_name(i)) for i in range(len(op.layout.results))),
        **{name: size for name, size in sizes.items()
           if name not in whole and any(name in d for ds in dims.values() for d in ds)})


def _shardings(op, arg_shapes, absent, attributes, mesh):
    """(mesh, operand shardings, result shardings) the op runs with, given the shardings its
    operands arrive with. Dimensions it cannot split are gathered, with a ShardingWarning.

    Runs inside XLA's partitioner, where a Python exception aborts the process: every case
    returns shardings."""
    dims, shapes = _layout_dims(op, arg_shapes, absent, attributes)
    shardings = [arg.sharding for arg in arg_shapes]
    if mesh.empty:  # no mesh in context and no NamedSharding to take one from
        devices = set().union(*(s.device_set for s in shardings if s is not None))
        mesh = jax.sharding.Mesh(np.array(sorted(devices, key=lambda d: d.id)), ("devices",))
        warnings.warn(f"{op.target}: its operands' shardings name no mesh, so it runs whole on "
                      "every device (XLA gathers its operands); give jit NamedShardings to split "
                      "it", partitioning.ShardingWarning)
        shardings = [None] * len(shardings)
    incoming = {name: partitioning.normalize_spec(
                    s.spec if isinstance(s, NamedSharding) else (), len(arg.shape))
                for name, s, arg in zip(op.operands, shardings, arg_shapes)}
    _, specs, notes = op.layout.choose(dims, shapes, incoming, dict(mesh.shape))
    for note in notes:
        warnings.warn(f"{op.target}: {note}", partitioning.ShardingWarning)
    operand_shardings = tuple(NamedSharding(mesh, P(*specs[name])) for name in op.operands)
    result_shardings = tuple(NamedSharding(mesh, P(*specs[partitioning.result_name(i)]))
                             for i in range(len(op.layout.results)))
    return mesh, operand_shardings, result_shardings


def _partitioned(op, attributes, absent):
    """The op as a jitted function of its operands that XLA's SPMD partitioner splits by the
    op's layout (custom_partitioning), and that vmap runs call by call (custom_vmap: the
    partitioning primitive has no batching rule of its own)."""
    ffi = _ffi(op, attributes)
    single = len(op.layout.results) == 1

    def partition(mesh, arg_shapes, result_shape):
        mesh, operand_shardings, result_shardings = _shardings(op, arg_shapes, absent,
                                                               attributes, mesh)
        return mesh, ffi, result_shardings[0] if single else result_shardings, operand_shardings

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        _, _, result_shardings = _shardings(op, arg_shapes, absent, attributes, mesh)
        return result_shardings[0] if single else result_shardings

    @jax.custom_batching.custom_vmap
    def batchable(*operands):
        # Made here, where the operands' shapes are known: the Shardy rule needs the sizes.
        call = custom_partitioning(ffi)
        call.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands,
                           sharding_rule=_sharding_rule(op, operands, absent, attributes))
        return call(*operands)

    @batchable.def_vmap
    def run_each(axis_size, in_batched, *operands):
        out = jax.vmap(ffi, in_axes=[0 if b else None for b in in_batched])(*operands)
        return out, True if single else (True,) * len(op.layout.results)

    return jax.jit(batchable)


_PARTITIONED = {}


def _function(op):
    tensors = set(op.tensor_args())

    def call(*args, **kwargs):
        a = op.bind(args, kwargs)
        a = {k: jnp.asarray(v) if k in tensors and v is not None else v for k, v in a.items()}
        _check(op, a)
        if op.check_values is not None:
            values = {name: _concrete(a[name]) for name in op.value_args}
            if all(v is not None for v in values.values()):
                op.check_values(a, values)
        attributes = tuple(sorted(op.attribute_values(a).items()))
        absent = tuple(name for name in op.operands if a[name] is None)
        key = (op.name, attributes, absent)
        if key not in _PARTITIONED:
            _PARTITIONED[key] = _partitioned(op, attributes, absent)
        out = _PARTITIONED[key](*op.operand_values(a, _empty))
        return tuple(out) if isinstance(out, (tuple, list)) else out

    call.__name__ = call.__qualname__ = op.name
    call.__doc__ = op.doc
    return call


_FUNCTIONS = {op.name: _function(op) for op in OPS}
globals().update(_FUNCTIONS)
_OPS = {op.name: op for op in OPS}


def sharded(name, mesh, heads=None, batch=None):
    """The op `name` under jax.shard_map over `mesh`, with the op's signature: its tensors
    split by its layout (op_catalog), heads over mesh axis (or axes) `heads`, batch (sequences)
    over `batch`, everything else replicated; each device runs the kernel on its pieces, with
    no collective. Raises a TorchXlaExtError when the op cannot split that way (a name it has
    no heads or batch for, heads that do not divide over the axis). Plain jax.jit with sharded
    arguments needs no helper: the ops partition themselves the same way."""
    if name not in _OPS:
        raise TorchXlaExtError(f"name: expected one of {sorted(_OPS)}, got {name!r}")
    op = _OPS[name]
    request = op.layout.roles(op.target, heads, batch)
    tensors = op.tensor_args()

    def call(*args, **kwargs):
        a = op.bind(args, kwargs)
        present = [n for n in tensors if a[n] is not None]
        arrays = [jnp.asarray(a[n]) for n in present]
        absent = tuple(n for n in op.operands if a[n] is None)
        dims, shapes = _layout_dims(op, op.operand_values({**a, **dict(zip(present, arrays))},
                                                          _empty), absent,
                                    op.attribute_values(a).items())
        specs = op.layout.request(dims, shapes, request, dict(mesh.shape), op.target)

        def local(*pieces):
            return _FUNCTIONS[name](**{**a, **dict(zip(present, pieces))})

        results = [P(*specs[partitioning.result_name(i)]) for i in range(len(op.layout.results))]
        return jax.shard_map(local, mesh=mesh, in_specs=tuple(P(*specs[n]) for n in present),
                             out_specs=results[0] if len(results) == 1 else tuple(results))(
                                 *arrays)

    call.__name__ = call.__qualname__ = f"sharded_{name}"
    return call


def ragged_paged_attention_v3(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                              distribution, sm_scale=1.0, sliding_window=None, soft_cap=None,
                              mask_value=None, k_scale=None, v_scale=None):
    """vllm-project/tpu-inference's "v3" ragged attention signature: writes this step's keys
    and values ([max_num_batched_tokens, num_kv_heads, head_dim], one row per query token) into
    kv_cache at their positions, then attends as ragged_paged_attention does. Returns
    (out, kv_cache), the cache aliased to the argument: donate it to jit to write in place.
    distribution: int32 [3], (decode-only sequences, + prefill-only, + mixed); its last entry
    is num_seqs. Rows no sequence owns write nothing."""
    queries, kv_lens, page_indices, cu_q_lens, distribution = map(
        jnp.asarray, (queries, kv_lens, page_indices, cu_q_lens, distribution))
    num_seqs = distribution[2:3]
    num_tokens, page_size = queries.shape[0], kv_cache.shape[1]
    # Entries past num_seqs are junk (cu_q_lens holds 1 there): keep the bounds monotone.
    index = jnp.arange(cu_q_lens.shape[0])
    bounds = jnp.where(index <= num_seqs[0], cu_q_lens, num_tokens + 1)
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(bounds, rows, side="right") - 1, 0, kv_lens.shape[0] - 1)
    position = kv_lens[seq] - (bounds[seq + 1] - bounds[seq]) + (rows - bounds[seq])
    page = jnp.clip(position // page_size, 0, page_indices.shape[1] - 1)
    owned = (rows >= bounds[0]) & (rows < bounds[num_seqs[0]]) & (position >= 0)
    slots = jnp.where(owned, page_indices[seq, page] * page_size + position % page_size, -1)
    kv_cache = _FUNCTIONS["kv_cache_update"](keys, values, kv_cache, slots.astype(jnp.int32))
    out = _FUNCTIONS["ragged_paged_attention"](
        queries, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale, sliding_window,
        soft_cap, mask_value, k_scale, v_scale)
    return out, kv_cache


__all__ = [*_FUNCTIONS, "ragged_paged_attention_v3", "sharded"]
