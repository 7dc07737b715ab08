"""torch.library ops in namespace `xla_ext`: one schema each, implemented for XLA tensors (our
custom call inside the lazy graph), CPU and CUDA tensors (the same handlers, run eagerly),
and fake tensors (shapes only, for torch.compile and opcheck)."""

import torch

from torch_xla_ext import checks, eager
from torch_xla_ext.custom_call import custom_call
from torch_xla_ext.errors import TorchXlaExtError

SIMPLE_ADD_TARGET = "XlaGpuSimpleAdd"
PAGED_ATTENTION_TARGET = "xla_ext.paged_attention"
RESHAPE_AND_CACHE_TARGET = "xla_ext.reshape_and_cache"
KV_CACHE_UPDATE_TARGET = "xla_ext.kv_cache_update"
KV_CACHE_UPDATE_SLICES_TARGET = "xla_ext.kv_cache_update_slices"

_lib = torch.library.Library("xla_ext", "DEF")
_lib.define("simple_add(Tensor a, Tensor b) -> Tensor")
_lib.define(
    "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, float scale, float softcap=0.0, Tensor? alibi_slopes=None) -> Tensor")
_lib.define(
    "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping) -> ()")
# What reshape_and_cache becomes under functionalization (torch_xla's lazy tensors): the
# updated caches as results, each aliased to its input inside the XLA custom call.
_lib.define(
    "reshape_and_cache_functional(Tensor key, Tensor value, Tensor key_cache, "
    "Tensor value_cache, Tensor slot_mapping) -> (Tensor, Tensor)")


def _impl(name, eager_fn, xla_fn, fake_fn):
    for key in ("CPU", "CUDA"):
        _lib.impl(name, eager_fn, key)
    _lib.impl(name, xla_fn, "XLA")
    torch.library.register_fake(f"xla_ext::{name}", fake_fn, lib=_lib)


def _check_contiguous(op, name, tensor):
    if not tensor.is_contiguous():
        raise TorchXlaExtError(f"{op}: argument '{name}': expected a contiguous tensor (it is "
                               "written in place)")


def _no_alibi(query):
    # The handlers take ALiBi slopes as an input; [0] elements means none.
    return query.new_empty((0,), dtype=torch.float32)


# simple_add

def _simple_add_fake(a, b):
    checks.simple_add(a, b)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _simple_add_eager(a, b):
    out = _simple_add_fake(a, b)
    eager.run(SIMPLE_ADD_TARGET, [a.contiguous(), b.contiguous()], [out])
    return out


def _simple_add_xla(a, b):
    checks.simple_add(a, b)
    return custom_call([a, b], SIMPLE_ADD_TARGET, [a.shape], [a.dtype])[0]


_impl("simple_add", _simple_add_eager, _simple_add_xla, _simple_add_fake)


# paged_attention

def _paged_attention_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                          softcap=0.0, alibi_slopes=None):
    checks.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, softcap,
                           alibi_slopes)
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _paged_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes):
    alibi = _no_alibi(query) if alibi_slopes is None else alibi_slopes
    return [query, key_cache, value_cache, block_tables, seq_lens, alibi]


def _paged_attention_eager(query, key_cache, value_cache, block_tables, seq_lens, scale,
                           softcap=0.0, alibi_slopes=None):
    out = _paged_attention_fake(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                softcap, alibi_slopes)
    inputs = _paged_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens,
                                     alibi_slopes)
    eager.run(PAGED_ATTENTION_TARGET, [t.contiguous() for t in inputs], [out],
              {"scale": ("f32", scale), "softcap": ("f32", softcap)})
    return out


def _paged_attention_xla(query, key_cache, value_cache, block_tables, seq_lens, scale,
                         softcap=0.0, alibi_slopes=None):
    import numpy as np

    checks.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, softcap,
                           alibi_slopes)
    inputs = _paged_attention_inputs(query, key_cache, value_cache, block_tables, seq_lens,
                                     alibi_slopes)
    return custom_call(inputs, PAGED_ATTENTION_TARGET, [query.shape], [query.dtype],
                       attrs={"scale": np.float32(scale), "softcap": np.float32(softcap)})[0]


_impl("paged_attention", _paged_attention_eager, _paged_attention_xla, _paged_attention_fake)


# reshape_and_cache

def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping):
    checks.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _reshape_and_cache_eager(key, value, key_cache, value_cache, slot_mapping):
    checks.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_contiguous("xla_ext.reshape_and_cache", name, cache)
    # The handler writes into its outputs; passing each cache as both input and output is the
    # aliasing XLA sets up, so only the new rows are written.
    eager.run(RESHAPE_AND_CACHE_TARGET,
              [key.contiguous(), value.contiguous(), key_cache, value_cache,
               slot_mapping.contiguous()],
              [key_cache, value_cache])


def _reshape_and_cache_functional_xla(key, value, key_cache, value_cache, slot_mapping):
    checks.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return tuple(custom_call(
        [key, value, key_cache, value_cache, slot_mapping], RESHAPE_AND_CACHE_TARGET,
        [key_cache.shape, value_cache.shape], [key_cache.dtype, value_cache.dtype],
        aliases={0: 2, 1: 3}))


def _reshape_and_cache_functional_fake(key, value, key_cache, value_cache, slot_mapping):
    checks.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return torch.empty_like(key_cache), torch.empty_like(value_cache)


def _reshape_and_cache_functional_eager(key, value, key_cache, value_cache, slot_mapping):
    new_key_cache, new_value_cache = key_cache.clone(), value_cache.clone()
    _reshape_and_cache_eager(key, value, new_key_cache, new_value_cache, slot_mapping)
    return new_key_cache, new_value_cache


def _functionalize_in_place(functional_op, args, mutated):
    """Runs `functional_op` (an in-place op's functional variant) below functionalization and
    makes its results the new values of args[i], i in `mutated`, as functionalization does for
    ATen's in-place ops."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for t in tensors:
        torch._sync(t)
    unwrapped = [torch._from_functional_tensor(a) if isinstance(a, torch.Tensor) else a
                 for a in args]
    with torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
        results = functional_op(*unwrapped)
    results = results if isinstance(results, (tuple, list)) else (results,)
    for i, new in zip(mutated, results):
        target, old = args[i], unwrapped[i]
        # As for ATen's in-place ops: lets torch_xla donate the old buffer to the new value
        # (input/output aliasing of the step), so the call writes into it in place.
        if old.device.type == "xla":
            torch._propagate_xla_data(old, new)
        torch._functionalize_replace(target, new)
        torch._functionalize_commit_update(target)
        torch._functionalize_sync(target)


def _reshape_and_cache_functionalize(key, value, key_cache, value_cache, slot_mapping):
    _functionalize_in_place(torch.ops.xla_ext.reshape_and_cache_functional,
                            [key, value, key_cache, value_cache, slot_mapping], (2, 3))


def _reshape_and_cache_xla(key, value, key_cache, value_cache, slot_mapping):
    # Reached only with torch_xla's functionalization off (XLA_DISABLE_FUNCTIONALIZATION=1).
    new_key_cache, new_value_cache = _reshape_and_cache_functional_xla(
        key, value, key_cache, value_cache, slot_mapping)
    key_cache.copy_(new_key_cache)
    value_cache.copy_(new_value_cache)


_impl("reshape_and_cache", _reshape_and_cache_eager, _reshape_and_cache_xla,
      _reshape_and_cache_fake)
_lib.impl("reshape_and_cache", _reshape_and_cache_functionalize, "Functionalize")
_impl("reshape_and_cache_functional", _reshape_and_cache_functional_eager,
      _reshape_and_cache_functional_xla, _reshape_and_cache_functional_fake)


# kv_cache_update: new K/V rows into the combined cache of ragged_paged_attention, by slot.
_lib.define(
    "kv_cache_update(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()")
_lib.define(
    "kv_cache_update_functional(Tensor key, Tensor value, Tensor kv_cache, Tensor slot_mapping) "
    "-> Tensor")


def _kv_cache_update_fake(key, value, kv_cache, slot_mapping):
    checks.kv_cache_update(key, value, kv_cache, slot_mapping)


def _kv_cache_update_eager(key, value, kv_cache, slot_mapping):
    checks.kv_cache_update(key, value, kv_cache, slot_mapping)
    _check_contiguous("xla_ext.kv_cache_update", "kv_cache", kv_cache)
    eager.run(KV_CACHE_UPDATE_TARGET,
              [key.contiguous(), value.contiguous(), kv_cache, slot_mapping.contiguous()],
              [kv_cache])


def _kv_cache_update_functional_xla(key, value, kv_cache, slot_mapping):
    checks.kv_cache_update(key, value, kv_cache, slot_mapping)
    return custom_call([key, value, kv_cache, slot_mapping], KV_CACHE_UPDATE_TARGET,
                       [kv_cache.shape], [kv_cache.dtype], aliases={0: 2})[0]


def _kv_cache_update_functional_fake(key, value, kv_cache, slot_mapping):
    checks.kv_cache_update(key, value, kv_cache, slot_mapping)
    return torch.empty_like(kv_cache)


def _kv_cache_update_functional_eager(key, value, kv_cache, slot_mapping):
    new_cache = kv_cache.clone()
    _kv_cache_update_eager(key, value, new_cache, slot_mapping)
    return new_cache


def _kv_cache_update_functionalize(key, value, kv_cache, slot_mapping):
    _functionalize_in_place(torch.ops.xla_ext.kv_cache_update_functional,
                            [key, value, kv_cache, slot_mapping], (2,))


def _kv_cache_update_xla(key, value, kv_cache, slot_mapping):
    # Reached only with torch_xla's functionalization off (XLA_DISABLE_FUNCTIONALIZATION=1).
    kv_cache.copy_(_kv_cache_update_functional_xla(key, value, kv_cache, slot_mapping))


_impl("kv_cache_update", _kv_cache_update_eager, _kv_cache_update_xla, _kv_cache_update_fake)
_lib.impl("kv_cache_update", _kv_cache_update_functionalize, "Functionalize")
_impl("kv_cache_update_functional", _kv_cache_update_functional_eager,
      _kv_cache_update_functional_xla, _kv_cache_update_functional_fake)


# vLLM's slice form, under the name and schema its torch_xla backend called:
# torch.ops.xla.kv_cache_update_op(kv, slot_mapping, kv_cache, num_kv_update_slices, page_size,
# num_slices_per_block) -> the new cache (which the caller copies back into kv_cache).
def _kv_cache_update_op_fake(kv, slot_mapping, kv_cache, num_kv_update_slices, page_size,
                             num_slices_per_block):
    checks.kv_cache_update_slices(kv, slot_mapping, kv_cache, num_kv_update_slices, page_size,
                                  num_slices_per_block)
    return torch.empty_like(kv_cache)


def _kv_cache_update_op_eager(kv, slot_mapping, kv_cache, num_kv_update_slices, page_size,
                              num_slices_per_block):
    new_cache = _kv_cache_update_op_fake(kv, slot_mapping, kv_cache, num_kv_update_slices,
                                         page_size, num_slices_per_block)
    new_cache.copy_(kv_cache)
    eager.run(KV_CACHE_UPDATE_SLICES_TARGET,
              [kv.contiguous(), slot_mapping.contiguous(), new_cache,
               num_kv_update_slices.contiguous()], [new_cache],
              {"page_size": ("i64", page_size), "num_slices_per_block": ("i64", num_slices_per_block)})
    return new_cache


def _kv_cache_update_op_xla(kv, slot_mapping, kv_cache, num_kv_update_slices, page_size,
                            num_slices_per_block):
    import numpy as np

    checks.kv_cache_update_slices(kv, slot_mapping, kv_cache, num_kv_update_slices, page_size,
                                  num_slices_per_block)
    return custom_call([kv, slot_mapping, kv_cache, num_kv_update_slices],
                       KV_CACHE_UPDATE_SLICES_TARGET, [kv_cache.shape], [kv_cache.dtype],
                       attrs={"page_size": np.int64(page_size),
                              "num_slices_per_block": np.int64(num_slices_per_block)},
                       aliases={0: 2})[0]


def _define_kv_cache_update_op():
    """torch.ops.xla.kv_cache_update_op, unless torch_xla (or vLLM) already defines it."""
    if hasattr(torch.ops.xla, "kv_cache_update_op"):
        return None
    lib = torch.library.Library("xla", "FRAGMENT")
    lib.define("kv_cache_update_op(Tensor kv, Tensor slot_mapping, Tensor kv_cache, "
               "Tensor num_kv_update_slices, int page_size, int num_slices_per_block) -> Tensor")
    for key in ("CPU", "CUDA"):
        lib.impl("kv_cache_update_op", _kv_cache_update_op_eager, key)
    lib.impl("kv_cache_update_op", _kv_cache_update_op_xla, "XLA")
    torch.library.register_fake("xla::kv_cache_update_op", _kv_cache_update_op_fake, lib=lib)
    return lib


_xla_lib = _define_kv_cache_update_op()
