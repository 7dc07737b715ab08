"""Argument checks for our ops, shared by every front end (torch.library, torch_xla, JAX).

The shape checks read only `.shape` and `.dtype` (torch, numpy or JAX arrays), so a bad call
fails at the call site, before anything is traced or executed, with the same message
everywhere. The value checks take NumPy arrays, where a front end has the values at hand.
The sizes and dtypes an op supports are its C++ contract's (`supported`), read from the
kernel library, never restated here.
"""

import functools

import numpy as np

from torch_xla_ext import _kernels, dtypes
from torch_xla_ext.dtypes import name as dtype_name
from torch_xla_ext.errors import TorchXlaExtError

PAGED_ATTENTION = "xla_ext.paged_attention"
RAGGED_PAGED_ATTENTION = "xla_ext.ragged_paged_attention"
_DTYPE_NAMES = {entry.ffi_id: name for name, entry in dtypes.DTYPES.items()}


@functools.lru_cache(maxsize=None)
def supported(target, name, argument):
    """The values `name` of `argument` may take in op `target`, as its C++ contract declares
    them (kernels/<op>/<op>.h, exported through the kernel table): a tuple of sizes, or of
    dtype names for name "dtype"."""
    values = _kernels.builtin_library().contract(target).values(name, argument)
    return tuple(_DTYPE_NAMES[v] for v in values) if name == "dtype" else values


FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2 ** 31 - 1


def _fail(op, arg, expected, actual):
    raise TorchXlaExtError(f"{op}: argument '{arg}': expected {expected}, got {actual}")


def _size(d):
    """A dimension as an int. A symbolic one (a dim dynamo traces as dynamic, as vLLM marks
    its token counts) is read as its example value without a guard: comparing it would
    specialise the traced graph to that size, which dynamo refuses for a dim marked dynamic."""
    if isinstance(d, int):
        return d
    if hasattr(d, "node"):  # torch.SymInt
        from torch.fx.experimental.symbolic_shapes import hint_int

        return hint_int(d)
    return int(d)


def _shape(x):
    return [_size(d) for d in x.shape]


def _check_rank(op, arg, x, rank, layout):
    if len(x.shape) != rank:
        _fail(op, arg, f"rank {rank} {layout}", f"shape {_shape(x)}")


def _check_dtype(op, arg, x, allowed):
    if dtype_name(x.dtype) not in allowed:
        names = ", ".join(allowed[:-1]) + " or " + allowed[-1] if len(allowed) > 1 else allowed[0]
        _fail(op, arg, "dtype " + names, f"dtype {dtype_name(x.dtype)}")


def _check_same_dtype(op, arg, x, ref_arg, ref):
    if dtype_name(x.dtype) != dtype_name(ref.dtype):
        _fail(op, arg, f"dtype {dtype_name(ref.dtype)} (the dtype of '{ref_arg}')",
              f"dtype {dtype_name(x.dtype)}")


def _check_same(op, arg, x, ref_arg, ref):
    if _shape(x) != _shape(ref):
        _fail(op, arg, f"shape {_shape(ref)} (the shape of '{ref_arg}')", f"shape {_shape(x)}")
    _check_same_dtype(op, arg, x, ref_arg, ref)


def simple_add(a, b):
    op = "XlaGpuSimpleAdd"
    _check_dtype(op, "a", a, supported(op, "dtype", "a"))
    _check_same(op, "b", b, "a", a)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, softcap,
                    alibi_slopes):
    op = PAGED_ATTENTION
    _check_rank(op, "query", query, 3, "[num_seqs, num_heads, head_size]")
    _check_dtype(op, "query", query, supported(op, "dtype", "query"))
    _check_rank(op, "key_cache", key_cache, 4,
                "[num_blocks, block_size, num_kv_heads, head_size]")
    _check_same_dtype(op, "key_cache", key_cache, "query", query)
    num_seqs, num_heads, head_size = _shape(query)
    _, block_size, num_kv_heads, cache_head_size = _shape(key_cache)
    head_sizes = supported(op, "head_size", "query")
    if head_size not in head_sizes:
        _fail(op, "query", f"head_size in {list(head_sizes)}", f"{head_size}")
    if cache_head_size != head_size:
        _fail(op, "key_cache", f"head_size {head_size} in dimension 3 (as 'query')",
              f"{cache_head_size}")
    block_sizes = supported(op, "block_size", "key_cache")
    if block_size not in block_sizes:
        _fail(op, "key_cache", f"block_size in {list(block_sizes)}", f"{block_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        _fail(op, "key_cache", f"num_kv_heads dividing num_heads={num_heads}", f"{num_kv_heads}")
    _check_same(op, "value_cache", value_cache, "key_cache", key_cache)
    _check_rank(op, "block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    _check_dtype(op, "block_tables", block_tables, ("int32",))
    if _shape(block_tables)[0] != num_seqs:
        _fail(op, "block_tables", f"{num_seqs} rows (num_seqs of 'query')",
              f"shape {_shape(block_tables)}")
    _check_dtype(op, "seq_lens", seq_lens, ("int32",))
    if _shape(seq_lens) != [num_seqs]:
        _fail(op, "seq_lens", f"shape [{num_seqs}]", f"shape {_shape(seq_lens)}")
    if alibi_slopes is not None:
        _check_dtype(op, "alibi_slopes", alibi_slopes, ("float32",))
        if _shape(alibi_slopes) != [num_heads]:
            _fail(op, "alibi_slopes", f"shape [{num_heads}]", f"shape {_shape(alibi_slopes)}")
    # Both reach the handlers as float32 attributes: beyond float32's range they become inf,
    # and an infinite scale or softcap makes the outputs NaN (inf - inf, inf * tanh(0)).
    if not abs(float(scale)) <= FLOAT32_MAX:
        _fail(op, "scale", "a finite float (within float32's range)", f"{scale}")
    if not 0.0 <= float(softcap) <= FLOAT32_MAX:
        _fail(op, "softcap", "a finite float >= 0 (within float32's range; 0 turns it off)",
              f"{softcap}")


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    op = "xla_ext.reshape_and_cache"
    _check_rank(op, "key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    _check_dtype(op, "key", key, supported(op, "dtype", "key"))
    _check_same(op, "value", value, "key", key)
    _check_rank(op, "key_cache", key_cache, 4,
                "[num_blocks, block_size, num_kv_heads, head_size]")
    _check_same_dtype(op, "key_cache", key_cache, "key", key)
    num_tokens, num_kv_heads, head_size = _shape(key)
    if _shape(key_cache)[2:] != [num_kv_heads, head_size]:
        _fail(op, "key_cache", f"[num_kv_heads, head_size] = {[num_kv_heads, head_size]} in "
              "dimensions 2-3 (as 'key')", f"shape {_shape(key_cache)}")
    _check_same(op, "value_cache", value_cache, "key_cache", key_cache)
    _check_dtype(op, "slot_mapping", slot_mapping, ("int64",))
    if _shape(slot_mapping) != [num_tokens]:
        _fail(op, "slot_mapping", f"shape [{num_tokens}]", f"shape {_shape(slot_mapping)}")


def paged_attention_values(seq_lens, block_tables, block_size, num_blocks):
    """Lengths within the block table, and the block ids they use within the cache."""
    op = "xla_ext.paged_attention"
    capacity = block_tables.shape[1] * block_size
    bad = np.flatnonzero((seq_lens < 0) | (seq_lens > capacity))
    if bad.size:
        i = int(bad[0])
        beyond = " (seq_len beyond the block table)" if seq_lens[i] > capacity else ""
        _fail(op, "seq_lens", f"0 <= seq_len <= max_blocks_per_seq * block_size = {capacity}",
              f"seq_lens[{i}] = {seq_lens[i]}{beyond}")
    used = np.arange(block_tables.shape[1])[None, :] * block_size < seq_lens[:, None]
    bad = np.argwhere(used & ((block_tables < 0) | (block_tables >= num_blocks)))
    if bad.size:
        s, b = map(int, bad[0])
        _fail(op, "block_tables", f"block ids in [0, num_blocks = {num_blocks})",
              f"block_tables[{s}][{b}] = {block_tables[s, b]}")


def slot_values(op, slot_mapping, num_slots, capacity):
    """Slots below num_slots (negative ones are skipped); `capacity` names that bound, e.g.
    "num_blocks * block_size"."""
    if slot_mapping.size and slot_mapping.max() >= num_slots:
        i = int(np.argmax(slot_mapping >= num_slots))
        _fail(op, "slot_mapping", f"slots < {capacity} = {num_slots}",
              f"slot_mapping[{i}] = {slot_mapping[i]}")


def kv_cache_update(key, value, kv_cache, slot_mapping):
    op = "xla_ext.kv_cache_update"
    _check_rank(op, "kv_cache", kv_cache, 4,
                "[num_pages, page_size, 2 * num_kv_heads, head_size]")
    _check_dtype(op, "kv_cache", kv_cache, supported(op, "dtype", "kv_cache"))
    _check_rank(op, "key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    _check_same_dtype(op, "key", key, "kv_cache", kv_cache)
    _check_same(op, "value", value, "key", key)
    num_tokens, num_kv_heads, head_size = _shape(key)
    if _shape(kv_cache)[2:] != [2 * num_kv_heads, head_size]:
        _fail(op, "kv_cache", f"[2 * num_kv_heads, head_size] = {[2 * num_kv_heads, head_size]} "
              "in dimensions 2-3 (from 'key')", f"shape {_shape(kv_cache)}")
    _check_dtype(op, "slot_mapping", slot_mapping, ("int32",))
    if _shape(slot_mapping) != [num_tokens]:
        _fail(op, "slot_mapping", f"shape [{num_tokens}]", f"shape {_shape(slot_mapping)}")


def rotary_kv_cache_update(qkv, cos, sin, kv_cache, slot_mapping):
    op = "xla_ext.rotary_kv_cache_update"
    _check_rank(op, "qkv", qkv, 3, "[num_tokens, num_q_heads + 2 * num_kv_heads, head_size]")
    _check_dtype(op, "qkv", qkv, supported(op, "dtype", "qkv"))
    _check_rank(op, "kv_cache", kv_cache, 4,
                "[num_pages, page_size, 2 * num_kv_heads, head_size]")
    _check_same_dtype(op, "kv_cache", kv_cache, "qkv", qkv)
    num_tokens, row_heads, head_size = _shape(qkv)
    combined, cache_head_size = _shape(kv_cache)[2:]
    if combined % 2 or combined == 0 or cache_head_size != head_size or head_size % 2:
        _fail(op, "kv_cache", f"[2 * num_kv_heads, {head_size}] in dimensions 2-3 (num_kv_heads "
              ">= 1; an even head_size, qkv's)", f"shape {_shape(kv_cache)}")
    if row_heads <= combined:
        _fail(op, "qkv", f"num_q_heads + 2 * num_kv_heads heads in dimension 1 with num_q_heads "
              f">= 1 (num_kv_heads = {combined // 2}, kv_cache's)", f"shape {_shape(qkv)}")
    for arg, table in (("cos", cos), ("sin", sin)):
        _check_same_dtype(op, arg, table, "qkv", qkv)
        if _shape(table) != [num_tokens, head_size]:
            _fail(op, arg, f"shape [{num_tokens}, {head_size}] (num_tokens, head_size of 'qkv')",
                  f"shape {_shape(table)}")
    _check_dtype(op, "slot_mapping", slot_mapping, ("int32",))
    if _shape(slot_mapping) != [num_tokens]:
        _fail(op, "slot_mapping", f"shape [{num_tokens}]", f"shape {_shape(slot_mapping)}")


def add_rms_norm(x, residual, weight, eps):
    op = "xla_ext.add_rms_norm"
    _check_rank(op, "x", x, 2, "[num_tokens, hidden]")
    _check_dtype(op, "x", x, supported(op, "dtype", "x"))
    _check_same(op, "residual", residual, "x", x)
    _check_same_dtype(op, "weight", weight, "x", x)
    hidden = _shape(x)[1]
    if _shape(weight) != [hidden]:
        _fail(op, "weight", f"shape [{hidden}] (hidden of 'x')", f"shape {_shape(weight)}")
    if not eps >= 0:
        _fail(op, "eps", ">= 0", eps)


def small_batch_linear(x, weight, residual, silu_gate):
    op = "xla_ext.small_batch_linear"
    _check_rank(op, "x", x, 2, "[num_tokens, in_features]")
    _check_dtype(op, "x", x, supported(op, "dtype", "x"))
    _check_rank(op, "weight", weight, 2, "[weight_rows, in_features]")
    _check_same_dtype(op, "weight", weight, "x", x)
    (num_tokens, in_features), (rows, weight_in) = _shape(x), _shape(weight)
    if weight_in != in_features:
        _fail(op, "weight", f"shape [weight_rows, {in_features}] (in_features of 'x')",
              f"shape {_shape(weight)}")
    if silu_gate not in (0, 1):
        _fail(op, "silu_gate", "0 or 1", silu_gate)
    if silu_gate and rows % 2:
        _fail(op, "weight", "an even number of rows with silu_gate (gate rows, then up rows)",
              f"shape {_shape(weight)}")
    if residual is not None:
        if silu_gate:
            _fail(op, "residual", "none with silu_gate", f"shape {_shape(residual)}")
        _check_same_dtype(op, "residual", residual, "x", x)
        if _shape(residual) != [num_tokens, rows]:
            _fail(op, "residual", f"shape [{num_tokens}, {rows}] (num_tokens, out_features)",
                  f"shape {_shape(residual)}")


def kv_cache_update_slices(kv, slot_mapping, kv_cache, num_kv_update_slices, page_size,
                           num_slices_per_block):
    """vLLM's names: `slot_mapping` holds the slices, int32 [3, max_slices]."""
    op = "xla_ext.kv_cache_update_slices"
    _check_rank(op, "kv_cache", kv_cache, 3,
                "[num_pages * page_size, num_combined_heads, head_size]")
    _check_dtype(op, "kv_cache", kv_cache, supported(op, "dtype", "kv_cache"))
    _check_rank(op, "kv", kv, 3, "[num_tokens, num_combined_heads, head_size]")
    _check_same_dtype(op, "kv", kv, "kv_cache", kv_cache)
    if _shape(kv_cache)[1:] != _shape(kv)[1:]:
        _fail(op, "kv_cache", f"[num_combined_heads, head_size] = {_shape(kv)[1:]} in "
              "dimensions 1-2 (as 'kv')", f"shape {_shape(kv_cache)}")
    _check_dtype(op, "slot_mapping", slot_mapping, ("int32",))
    if len(slot_mapping.shape) != 2 or _shape(slot_mapping)[0] != 3:
        _fail(op, "slot_mapping", "shape [3, max_slices] (cache_start, new_kv_start, length)",
              f"shape {_shape(slot_mapping)}")
    _check_dtype(op, "num_kv_update_slices", num_kv_update_slices, ("int32",))
    if _shape(num_kv_update_slices) != [1]:
        _fail(op, "num_kv_update_slices", "shape [1]", f"shape {_shape(num_kv_update_slices)}")
    rows = _shape(kv_cache)[0]
    if not isinstance(page_size, int) or page_size <= 0 or rows % page_size:
        _fail(op, "page_size", f"a positive divisor of num_cache_rows = {rows}", f"{page_size}")
    if not isinstance(num_slices_per_block, int) or num_slices_per_block <= 0:
        _fail(op, "num_slices_per_block", "a positive integer", f"{num_slices_per_block}")


def slice_values(slot_mapping, num_kv_update_slices, num_new_rows, num_cache_rows):
    """The first num_kv_update_slices[0] columns (cache_start, new_kv_start, length) of
    slot_mapping lie within kv and the cache."""
    op = "xla_ext.kv_cache_update_slices"
    count = int(num_kv_update_slices[0])
    if not 0 <= count <= slot_mapping.shape[1]:
        _fail(op, "num_kv_update_slices", f"a count in [0, max_slices = {slot_mapping.shape[1]}]",
              f"num_kv_update_slices[0] = {count}")
    start, new_start, length = (slot_mapping[r, :count].astype(np.int64) for r in range(3))
    bad = np.flatnonzero((length < 0) | (start < 0) | (new_start < 0) |
                         (start + length > num_cache_rows) | (new_start + length > num_new_rows))
    if bad.size:
        i = int(bad[0])
        _fail(op, "slot_mapping", f"slices within kv ({num_new_rows} rows) and kv_cache "
              f"({num_cache_rows} rows)", f"cache_start[{i}] = {start[i]}, new_kv_start[{i}] = "
              f"{new_start[i]}, length[{i}] = {length[i]}")


MAX_GQA_GROUP = 16


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale,
                           sliding_window, soft_cap, mask_value, k_scale, v_scale, max_q_len=0):
    op = RAGGED_PAGED_ATTENTION
    _check_rank(op, "q", q, 3, "[max_num_batched_tokens, num_q_heads, head_dim]")
    _check_dtype(op, "q", q, supported(op, "dtype", "q"))
    _check_rank(op, "kv_pages", kv_pages, 4,
                "[total_num_pages, page_size, 2 * num_kv_heads, head_dim]")
    fp8_ok = dtype_name(q.dtype) != "float32"
    if dtype_name(kv_pages.dtype) != dtype_name(q.dtype) and not (
            fp8_ok and dtype_name(kv_pages.dtype) == "float8_e4m3fn"):
        _fail(op, "kv_pages", f"dtype {dtype_name(q.dtype)} (the dtype of 'q')"
              + (" or float8_e4m3fn" if fp8_ok else ""), f"dtype {dtype_name(kv_pages.dtype)}")
    _, num_q_heads, head_dim = _shape(q)  # any number of rows: unowned ones are padding
    _, page_size, combined_heads, kv_head_dim = _shape(kv_pages)
    head_dims = supported(op, "head_dim", "q")
    if head_dim not in head_dims:
        _fail(op, "q", f"head_dim in {list(head_dims)}", f"{head_dim}")
    if kv_head_dim != head_dim:
        _fail(op, "kv_pages", f"head_dim {head_dim} in dimension 3 (as 'q')", f"{kv_head_dim}")
    page_sizes = supported(op, "page_size", "kv_pages")
    if page_size not in page_sizes:
        _fail(op, "kv_pages", f"page_size in {list(page_sizes)}", f"{page_size}")
    num_kv_heads = combined_heads // 2
    if combined_heads % 2 or num_kv_heads == 0 or num_q_heads % num_kv_heads \
            or num_q_heads // num_kv_heads > MAX_GQA_GROUP:
        _fail(op, "kv_pages", f"2 * num_kv_heads combined heads in dimension 2, num_kv_heads "
              f"dividing num_q_heads = {num_q_heads} into groups of at most {MAX_GQA_GROUP}",
              f"{combined_heads}")
    _check_rank(op, "page_indices", page_indices, 2, "[max_num_seqs, pages_per_seq]")
    _check_dtype(op, "page_indices", page_indices, ("int32",))
    max_num_seqs = _shape(page_indices)[0]
    for arg, x, length in (("kv_lens", kv_lens, max_num_seqs),
                           ("cu_q_lens", cu_q_lens, max_num_seqs + 1), ("num_seqs", num_seqs, 1)):
        _check_dtype(op, arg, x, ("int32",))
        if _shape(x) != [length]:
            _fail(op, arg, f"shape [{length}]", f"shape {_shape(x)}")
    # The floats reach the handler as float32 attributes (beyond float32's range: inf), the
    # window as an int32.
    for arg, value in (("sm_scale", sm_scale), ("k_scale", k_scale), ("v_scale", v_scale),
                       ("mask_value", mask_value)):
        if value is not None and not abs(float(value)) <= FLOAT32_MAX:
            _fail(op, arg, "a finite float (within float32's range)", f"{value}")
    if sliding_window is not None and not 1 <= sliding_window <= INT32_MAX:
        _fail(op, "sliding_window", f"a window in [1, {INT32_MAX}], or None", f"{sliding_window}")
    if soft_cap is not None and not 0.0 < float(soft_cap) <= FLOAT32_MAX:
        _fail(op, "soft_cap", "a finite cap > 0 (within float32's range), or None",
              f"{soft_cap}")
    if not 0 <= max_q_len <= INT32_MAX:
        _fail(op, "max_q_len", f"a bound in [1, {INT32_MAX}] on every q_len, or 0 for none",
              f"{max_q_len}")


def ragged_values(kv_lens, page_indices, cu_q_lens, num_seqs, num_tokens, page_size, num_pages,
                  max_q_len=0):
    """The first num_seqs sequences: monotone row ranges within the batch, q_len <= kv_len <=
    the pages' capacity, q_len <= max_q_len when that is set, and page ids in the cache.
    Entries past num_seqs are not read."""
    op = "xla_ext.ragged_paged_attention"
    count = int(num_seqs[0])
    if not 0 <= count <= kv_lens.shape[0]:
        _fail(op, "num_seqs", f"0 <= num_seqs <= max_num_seqs = {kv_lens.shape[0]}",
              f"num_seqs[0] = {count}")
    bounds = cu_q_lens[:count + 1].astype(np.int64)
    bad = np.flatnonzero(np.diff(bounds) < 0)
    if bounds.size and (bounds[0] < 0 or bounds[-1] > num_tokens or bad.size):
        i = int(bad[0]) + 1 if bad.size else (0 if bounds[0] < 0 else count)
        _fail(op, "cu_q_lens", f"0 <= cu_q_lens[0] <= ... <= cu_q_lens[num_seqs] <= "
              f"max_num_batched_tokens = {num_tokens}", f"cu_q_lens[{i}] = {cu_q_lens[i]}")
    q_lens, lens = np.diff(bounds), kv_lens[:count].astype(np.int64)
    capacity = page_indices.shape[1] * page_size
    bad = np.flatnonzero((lens < q_lens) | (lens > capacity))
    if bad.size:
        i = int(bad[0])
        _fail(op, "kv_lens", f"q_len <= kv_len <= pages_per_seq * page_size = {capacity}",
              f"kv_lens[{i}] = {kv_lens[i]} with q_len {q_lens[i]}")
    bad = np.flatnonzero(q_lens > max_q_len) if max_q_len else ()
    if len(bad):
        i = int(bad[0])
        _fail(op, "max_q_len", "a bound on every sequence's q_len (cu_q_lens[i + 1] - "
              "cu_q_lens[i])", f"{max_q_len} with sequence {i}'s q_len = {q_lens[i]}")
    used = np.arange(page_indices.shape[1])[None, :] * page_size < lens[:, None]
    pages = page_indices[:count]
    bad = np.argwhere(used & ((pages < 0) | (pages >= num_pages)))
    if bad.size:
        s, p = map(int, bad[0])
        _fail(op, "page_indices", f"page ids in [0, total_num_pages = {num_pages})",
              f"page_indices[{s}][{p}] = {pages[s, p]}")


def check_known_values(op, args):
    """Checks the data arguments (block ids, lengths, slots) of an op's call on XLA tensors on
    the host when their values already sit in device buffers: a bad request then fails here,
    before anything is built or run. Arguments still to be computed are checked by the
    handlers when the step runs."""
    if op.check_values is None:
        return
    import torch_xla

    tensors = [args[name] for name in op.value_args]
    if any(torch_xla._XLAC._check_tensor_need_materialization(tensors)):
        return
    op.check_values(args, {name: t.cpu().numpy() for name, t in zip(op.value_args, tensors)})
