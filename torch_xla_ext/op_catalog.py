"""Every op of torch_xla_ext, written down once (see opdef.py for what each field means).

Adding an op: a kernel folder kernels/<op>/ (handlers registered under `target`), its checks
in checks.py, one OpDef here, and tests; the torch.library op, the JAX function and the
torchax lowering follow from the OpDef (README: "Adding an op").
"""

import numpy as np

from torch_xla_ext import checks, workspace
from torch_xla_ext.opdef import OpDef
from torch_xla_ext.partitioning import Layout


def _same_as(arg):
    return lambda a: [(a[arg].shape, a[arg].dtype)]


def _caches(*names):
    return lambda a: [(a[n].shape, a[n].dtype) for n in names]


def _rotary_results(a):
    """(q, the new cache): q is qkv without its k and v heads. (Shapes stay valid for the calls
    the handler itself refuses: qkv of another rank, too few heads.)"""
    qkv, cache = a["qkv"], a["kv_cache"]
    q = list(qkv.shape)
    if len(q) >= 2 and len(cache.shape) >= 3:
        q[1] = max(q[1] - cache.shape[2], 0)
    return [(tuple(q), qkv.dtype), (cache.shape, cache.dtype)]


SIMPLE_ADD = OpDef(
    name="simple_add",
    target="XlaGpuSimpleAdd",
    schema="(Tensor a, Tensor b) -> Tensor",
    doc="a + b elementwise (float32, float16 or bfloat16; same shape and dtype).",
    operands=("a", "b"),
    results=_same_as("a"),
    check=checks.simple_add,
    # Elementwise: any split works ("..." names dimensions dim0, dim1, ...); the helpers'
    # batch= splits the first.
    layout=Layout(operands={"a": "...", "b": "..."}, results=("...",), batch="dim0"),
)

PAGED_ATTENTION = OpDef(
    name="paged_attention",
    target="xla_ext.paged_attention",
    schema="(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
           "Tensor seq_lens, float scale, float softcap=0.0, Tensor? alibi_slopes=None) -> Tensor",
    doc="""Decode attention over a paged KV cache (vLLM semantics).

    query [num_seqs, num_heads, head_size]; key_cache, value_cache
    [num_blocks, block_size, num_kv_heads, head_size] (same dtype as query); block_tables
    [num_seqs, max_blocks_per_seq] int32; seq_lens [num_seqs] int32; alibi_slopes float32
    [num_heads] or None. Returns [num_seqs, num_heads, head_size] in the query's dtype.""",
    operands=("query", "key_cache", "value_cache", "block_tables", "seq_lens", "alibi_slopes"),
    absent={"alibi_slopes": ((0,), "float32")},  # the handlers read [0] elements as no ALiBi
    attributes={"scale": "float32", "softcap": "float32"},
    results=_same_as("query"),
    workspace=workspace.workspace_bytes,
    check=checks.paged_attention,
    layout=Layout(
        operands={"query": "seqs (kv_heads group) head_size",
                  "key_cache": "blocks block_size kv_heads head_size",
                  "value_cache": "blocks block_size kv_heads head_size",
                  "block_tables": "seqs blocks_per_seq", "seq_lens": "seqs",
                  "alibi_slopes": "(kv_heads group)"},
        results=("seqs (kv_heads group) head_size",), heads="kv_heads", batch="seqs"),
    value_args=("seq_lens", "block_tables"),
    check_values=lambda a, v: checks.paged_attention_values(
        v["seq_lens"], v["block_tables"], a["key_cache"].shape[1], a["key_cache"].shape[0]),
)

RESHAPE_AND_CACHE = OpDef(
    name="reshape_and_cache",
    target="xla_ext.reshape_and_cache",
    schema="(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
           "Tensor slot_mapping) -> ()",
    doc="""Writes token i's key/value rows [num_kv_heads, head_size] into slot slot_mapping[i]
    (int64; block * block_size + offset; negative = skip) of the NHD caches key_cache and
    value_cache [num_blocks, block_size, num_kv_heads, head_size], in place.""",
    operands=("key", "value", "key_cache", "value_cache", "slot_mapping"),
    results=_caches("key_cache", "value_cache"),
    writes={0: "key_cache", 1: "value_cache"},
    check=checks.reshape_and_cache,
    # Tokens do not split: every device holding a cache must write every token into it.
    layout=Layout(
        operands={"key": "tokens kv_heads head_size", "value": "tokens kv_heads head_size",
                  "key_cache": "blocks block_size kv_heads head_size",
                  "value_cache": "blocks block_size kv_heads head_size", "slot_mapping": "tokens"},
        results=("blocks block_size kv_heads head_size",) * 2, heads="kv_heads"),
    value_args=("slot_mapping",),
    check_values=lambda a, v: checks.slot_values(
        "xla_ext.reshape_and_cache", v["slot_mapping"],
        a["key_cache"].shape[0] * a["key_cache"].shape[1], "num_blocks * block_size"),
)

KV_CACHE_UPDATE = OpDef(
    name="kv_cache_update",
    target="xla_ext.kv_cache_update",
    schema="(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
    doc="""Writes token i's key and value rows [num_kv_heads, head_size] into slot
    slot_mapping[i] (int32; page * page_size + offset; negative = skip) of the combined cache
    kv_cache [num_pages, page_size, 2 * num_kv_heads, head_size] (K of kv head h at combined
    head 2h, V at 2h + 1: ragged_paged_attention's kv_pages), in place.""",
    operands=("key", "value", "kv_cache", "slot_mapping"),
    results=_caches("kv_cache"),
    writes={0: "kv_cache"},
    check=checks.kv_cache_update,
    # Combined head 2h + j holds K (j = 0) or V (j = 1) of kv head h: "(kv_heads kv)".
    layout=Layout(
        operands={"key": "tokens kv_heads head_size", "value": "tokens kv_heads head_size",
                  "kv_cache": "pages page_size (kv_heads kv) head_size", "slot_mapping": "tokens"},
        results=("pages page_size (kv_heads kv) head_size",), heads="kv_heads", sizes={"kv": 2}),
    value_args=("slot_mapping",),
    check_values=lambda a, v: checks.slot_values(
        "xla_ext.kv_cache_update", v["slot_mapping"],
        a["kv_cache"].shape[0] * a["kv_cache"].shape[1], "num_pages * page_size"),
)

ROTARY_KV_CACHE_UPDATE = OpDef(
    name="rotary_kv_cache_update",
    target="xla_ext.rotary_kv_cache_update",
    schema="(Tensor qkv, Tensor cos, Tensor sin, Tensor kv_cache, Tensor slot_mapping) "
           "-> (Tensor, Tensor)",
    doc="""A decoder layer's rotary embedding and K/V write in one kernel: qkv
    [num_tokens, num_q_heads + 2 * num_kv_heads, head_size] (each token's q heads, then k heads,
    then v heads), cos and sin [num_tokens, head_size] (each token's rows of the rotary tables),
    all of kv_cache's dtype (float32, float16 or bfloat16). Rotates the q and k heads as
    transformers' Llama does (x * cos + rotate_half(x) * sin, rounded as torch's eager ops
    round it) and writes token i's rotated k heads and its v heads into slot slot_mapping[i]
    (int32; negative = skip) of kv_cache [num_pages, page_size, 2 * num_kv_heads, head_size]
    (K of kv head h at combined head 2h, V at 2h + 1). Returns (q [num_tokens, num_q_heads,
    head_size] rotated, the new cache), the cache written into kv_cache's buffer where the
    caller lets it (a donated jit argument, or torch_xla's step aliasing).""",
    operands=("qkv", "cos", "sin", "kv_cache", "slot_mapping"),
    results=_rotary_results,
    writes={1: "kv_cache"},
    check=checks.rotary_kv_cache_update,
    # The q, k and v heads share qkv's dimension 1 unevenly: heads do not split it, and the
    # tokens write anywhere in the cache; a split call runs whole on every device.
    layout=Layout(
        operands={"qkv": "tokens qkv_heads head_size", "cos": "tokens head_size",
                  "sin": "tokens head_size", "kv_cache": "pages page_size combined head_size",
                  "slot_mapping": "tokens"},
        results=("tokens q_heads head_size", "pages page_size combined head_size")),
    value_args=("slot_mapping",),
    check_values=lambda a, v: checks.slot_values(
        "xla_ext.rotary_kv_cache_update", v["slot_mapping"],
        a["kv_cache"].shape[0] * a["kv_cache"].shape[1], "num_pages * page_size"),
)

ADD_RMS_NORM = OpDef(
    name="add_rms_norm",
    target="xla_ext.add_rms_norm",
    schema="(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    doc="""A decoder layer's residual add and the RMSNorm after it, in one kernel: x, residual
    [num_tokens, hidden] and weight [hidden], one dtype (float32, float16 or bfloat16). Returns
    (residual + x, the RMSNorm of that sum scaled by weight), rounded as torch's eager ops and
    transformers' LlamaRMSNorm round: the sum to the dtype, the row normalised in float32 with
    rsqrt(mean(sum ** 2) + eps) then cast to the dtype, and its product with weight.""",
    operands=("x", "residual", "weight"),
    attributes={"eps": "float32"},
    results=lambda a: [(a["x"].shape, a["x"].dtype)] * 2,
    check=checks.add_rms_norm,
    # Rows split; a row's hidden dimension is one reduction.
    layout=Layout(operands={"x": "tokens hidden", "residual": "tokens hidden", "weight": "hidden"},
                  results=("tokens hidden", "tokens hidden"), batch="tokens"),
)


def _linear_results(a):
    """[num_tokens, out_features]: weight's rows, or half of them with silu_gate. (Shapes stay
    valid for the calls the handler itself refuses.)"""
    rows = a["weight"].shape[0] if len(a["weight"].shape) else 0
    out_features = rows // 2 if a["silu_gate"] else rows
    return [((a["x"].shape[0] if len(a["x"].shape) else 0, out_features), a["x"].dtype)]


SMALL_BATCH_LINEAR = OpDef(
    name="small_batch_linear",
    target="xla_ext.small_batch_linear",
    schema="(Tensor x, Tensor weight, Tensor? residual=None, int silu_gate=0) -> Tensor",
    doc="""A linear layer over a few rows, the tokens of a decode batch, where its time is the
    weight's bytes: x [num_tokens, in_features] (float16 or bfloat16), weight [weight_rows,
    in_features] (torch's Linear layout), x's dtype. silu_gate=0: returns x @ weight.T, plus
    residual [num_tokens, weight_rows] where given. silu_gate=1: weight is a SwiGLU's gate rows
    then its up rows; returns silu(x @ gate.T) * (x @ up.T) [num_tokens, weight_rows / 2] (no
    residual). Accumulates in float32 and rounds where torch's eager ops round: each product,
    the sum with the residual, silu's result and the final product. The CUDA kernel streams
    the weight once on tensor cores; it is for small num_tokens (any is correct).""",
    operands=("x", "weight", "residual"),
    absent={"residual": ((0,), "float32")},
    attributes={"silu_gate": "int32"},
    results=_linear_results,
    check=checks.small_batch_linear,
    # Tokens split; the weight's rows do not (a gate row and its up row must stay together).
    layout=Layout(
        operands={"x": "tokens in_features", "weight": "weight_rows in_features",
                  "residual": "tokens outputs"},
        results=("tokens outputs",), batch="tokens"),
)

KV_CACHE_UPDATE_SLICES = OpDef(
    name="kv_cache_update_slices",
    target="xla_ext.kv_cache_update_slices",
    schema="(Tensor kv, Tensor slot_mapping, Tensor kv_cache, Tensor num_kv_update_slices, "
           "int page_size, int num_slices_per_block) -> Tensor",
    doc="""vLLM's kv_cache_update_op: for each of the first num_kv_update_slices[0] columns
    (cache_start, new_kv_start, length) of slot_mapping (int32 [3, max_slices]), copies rows
    kv[new_kv_start:+length] into kv_cache[cache_start:+length]. kv [num_tokens,
    num_combined_heads, head_size]; kv_cache [num_pages * page_size, num_combined_heads,
    head_size]. Returns the new cache, written into kv_cache's buffer where the caller lets it
    (a donated jit argument, or torch_xla's step aliasing).""",
    operands=("kv", "slot_mapping", "kv_cache", "num_kv_update_slices"),
    attributes={"page_size": "int64", "num_slices_per_block": "int64"},
    results=_caches("kv_cache"),
    writes={0: "kv_cache"},
    check=checks.kv_cache_update_slices,
    layout=Layout(
        operands={"kv": "tokens combined_heads head_size", "slot_mapping": "three slices",
                  "kv_cache": "rows combined_heads head_size", "num_kv_update_slices": "one"},
        results=("rows combined_heads head_size",), heads="combined_heads"),
    value_args=("slot_mapping", "num_kv_update_slices"),
    check_values=lambda a, v: checks.slice_values(
        v["slot_mapping"], v["num_kv_update_slices"], a["kv"].shape[0], a["kv_cache"].shape[0]),
    also_as=("xla", "kv_cache_update_op"),
)

# torch_xla's default for masked scores (torch_xla/experimental/custom_kernel.py).
DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

RAGGED_PAGED_ATTENTION = OpDef(
    name="ragged_paged_attention",
    target="xla_ext.ragged_paged_attention",
    schema="(Tensor q, Tensor kv_pages, Tensor kv_lens, Tensor page_indices, Tensor cu_q_lens, "
           "Tensor num_seqs, float sm_scale=1.0, int? sliding_window=None, float? soft_cap=None, "
           "float? mask_value=None, float? k_scale=None, float? v_scale=None, "
           "int max_q_len=0) -> Tensor",
    doc="""Attention of a ragged batch (prefill chunks and decodes side by side) over the combined
    paged cache, with torch_xla 2.9's ragged_paged_attention semantics: q [max_num_batched_tokens,
    num_q_heads, head_dim]; kv_pages [total_num_pages, page_size, 2 * num_kv_heads, head_dim]
    (K of kv head h at combined head 2h, V at 2h + 1; q's dtype, or float8_e4m3fn dequantised
    with k_scale, v_scale); kv_lens [max_num_seqs], page_indices [max_num_seqs, pages_per_seq],
    cu_q_lens [max_num_seqs + 1], num_seqs [1], all int32. Sequence i < num_seqs[0] owns query
    rows cu_q_lens[i]..cu_q_lens[i + 1], causal over its kv_lens[i] tokens (the new ones
    included), within the last sliding_window positions when set; soft_cap caps the scores.
    Rows no sequence owns are zeros; entries past num_seqs are never read. max_q_len (not in
    torch_xla's schema): 0, or a bound on every sequence's q_len that the caller promises; 1, a
    batch of decode steps only, lets the CUDA handler run its decode kernel alone (a sequence
    with more rows then gets NaN rows there; the checks and the Host handler refuse it; two such
    calls must not run at once on one GPU, on two streams).""",
    operands=("q", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"),
    attributes={"sm_scale": "float32", "sliding_window": "int32", "soft_cap": "float32",
                "mask_value": "float32", "k_scale": "float32", "v_scale": "float32",
                "max_q_len": "int32"},
    attribute_none={"sliding_window": 0, "soft_cap": 0.0, "mask_value": DEFAULT_MASK_VALUE,
                    "k_scale": 1.0, "v_scale": 1.0},
    results=_same_as("q"),
    workspace=workspace.workspace_bytes,
    check=checks.ragged_paged_attention,
    # Tokens do not split: cu_q_lens numbers them across the whole batch.
    layout=Layout(
        operands={"q": "tokens (kv_heads group) head_dim",
                  "kv_pages": "pages page_size (kv_heads kv) head_dim", "kv_lens": "seqs",
                  "page_indices": "seqs pages_per_seq", "cu_q_lens": "seqs_plus_one",
                  "num_seqs": "one"},
        results=("tokens (kv_heads group) head_dim",), heads="kv_heads", sizes={"kv": 2}),
    value_args=("kv_lens", "page_indices", "cu_q_lens", "num_seqs"),
    check_values=lambda a, v: checks.ragged_values(
        v["kv_lens"], v["page_indices"], v["cu_q_lens"], v["num_seqs"], a["q"].shape[0],
        a["kv_pages"].shape[1], a["kv_pages"].shape[0], a["max_q_len"]),
)

OPS = (SIMPLE_ADD, PAGED_ATTENTION, RESHAPE_AND_CACHE, KV_CACHE_UPDATE, KV_CACHE_UPDATE_SLICES,
       ROTARY_KV_CACHE_UPDATE, RAGGED_PAGED_ATTENTION, SMALL_BATCH_LINEAR, ADD_RMS_NORM)
