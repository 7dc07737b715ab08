"""A Llama-architecture model's step over a ragged batch (RMSNorm, rotary embeddings, grouped-
query attention, SwiGLU), written in plain torch over our ops, so that one function runs under
torch_xla (lazy tensors: one XLA graph per step) and under torchax (a jax.jit function).

Weights come from a `transformers` LlamaForCausalLM (`weights_from_hf`); q/k/v and gate/up
projections are concatenated so that a layer runs three matmuls, not seven. Each layer rotates
its q and k heads and writes this step's K/V into its paged cache with
torch.ops.xla_ext.rotary_kv_cache_update (one kernel, where XLA made three fusions of the
rotation's concatenates and slices and the write was a fourth launch; split over devices, and
through torch_xla (backends.py says why), the rotation in torch and
torch.ops.xla_ext.kv_cache_update, in place) and attends with
torch.ops.xla_ext.ragged_paged_attention. Its linear layers are XLA's dots, and its residual
adds and norms XLA's fusions, or where LayerOps asks (off by default: backends.py says why)
torch.ops.xla_ext.small_batch_linear with the residual adds and the SwiGLU fused in, and
torch.ops.xla_ext.add_rms_norm. The step ends with greedy sampling (argmax) of each sequence's
last row, so only token ids leave the device.
"""

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from torch_xla_ext.errors import TorchXlaExtError

# Rotary types whose frequencies change with the sequence length (transformers'
# dynamic_rope_update): the step's table is computed once, so these are refused.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The sizes a step is traced with (hashable: a jit's static argument)."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    # Tensor parallel shards: the q/k/v and gate/up rows are grouped shard by shard (each
    # shard's q, k and v rows, then the next's), so that splitting them into `shards` equal
    # pieces gives each device whole heads and its own gate and up rows (weights_from_hf).
    shards: int = 1

    @property
    def sm_scale(self):
        return self.head_dim ** -0.5


def weights_from_hf(model, dtype=None, max_model_len=None, shards=1):
    """(LlamaShape, weights): the weights of a transformers LlamaForCausalLM as a nested dict of
    CPU tensors in `dtype` (default: the model's), with rotary cos/sin tables for positions
    0 ... max_model_len - 1 (default: config.max_position_embeddings), computed as transformers
    computes them (float32, then scaled and cast); q/k/v and gate/up rows grouped for `shards`
    tensor parallel shards (LlamaShape.shards)."""
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        raise TorchXlaExtError(f"weights_from_hf: argument 'model': expected a Llama model "
                               f"(config.model_type 'llama'), got {config.model_type!r}")
    if config.hidden_act != "silu":
        raise TorchXlaExtError(f"weights_from_hf: config.hidden_act: expected 'silu' (SwiGLU), "
                               f"got {config.hidden_act!r}")
    rotary = model.model.rotary_emb
    if rotary.rope_type in _LENGTH_DEPENDENT_ROPE:
        raise TorchXlaExtError(f"weights_from_hf: rope type {rotary.rope_type!r} changes with "
                               "the sequence length and is not supported; supported: every "
                               "other transformers rope type (default, linear, llama3, yarn, ...)")
    dtype = dtype or model.dtype
    max_model_len = max_model_len or config.max_position_embeddings
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = LlamaShape(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                       num_heads=config.num_attention_heads,
                       num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                       vocab_size=config.vocab_size, rms_norm_eps=float(config.rms_norm_eps),
                       shards=shards)
    for name, count in (("num_key_value_heads", shape.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if count % shards:
            raise TorchXlaExtError(f"tensor_parallel_size: expected a divisor of the model's "
                                   f"{name} = {count}, got {shards}")

    state = {k: v.detach() for k, v in model.state_dict().items()}

    def get(name):
        return state[name].to(dtype).contiguous()

    def cat(*names):
        """The tensors' rows, shard by shard: shard i's rows of each, then shard i + 1's."""
        pieces = [get(n).chunk(shards) for n in names]
        return torch.cat([p[i] for i in range(shards) for p in pieces]).contiguous()

    def bias(*names):
        return cat(*names) if all(n in state for n in names) else None

    layers = []
    for i in range(shape.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = [attn + p + "_proj.weight" for p in "qkv"]
        layers.append({
            "input_norm": get(f"model.layers.{i}.input_layernorm.weight"),
            "qkv": cat(*qkv),
            "qkv_bias": bias(*[n.replace("weight", "bias") for n in qkv]),
            "o": get(attn + "o_proj.weight"),
            "o_bias": bias(attn + "o_proj.bias"),
            "post_norm": get(f"model.layers.{i}.post_attention_layernorm.weight"),
            "gate_up": cat(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
            "gate_up_bias": bias(mlp + "gate_proj.bias", mlp + "up_proj.bias"),
            "down": get(mlp + "down_proj.weight"),
            "down_bias": bias(mlp + "down_proj.bias"),
        })
    # As transformers' LlamaRotaryEmbedding: angles position * inv_freq in float32, repeated
    # for both halves, cos/sin scaled by attention_scaling, then cast to the model's dtype.
    angles = torch.outer(torch.arange(max_model_len, dtype=torch.float32),
                         rotary.inv_freq.detach().float().cpu())
    angles = torch.cat([angles, angles], dim=-1)
    weights = {
        "embed": get("model.embed_tokens.weight"),
        "rope_cos": (angles.cos() * rotary.attention_scaling).to(dtype),
        "rope_sin": (angles.sin() * rotary.attention_scaling).to(dtype),
        "layers": layers,
        "norm": get("model.norm.weight"),
    }
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if not tied:  # a tied head is the embedding itself: one copy on the device
        weights["lm_head"] = get("lm_head.weight")
    return shape, weights


def _rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm: normalised in float32, cast back, then scaled."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate(x, cos, sin):
    """Rotary embedding of x [tokens, heads, head_dim] (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclasses.dataclass(frozen=True)
class LayerOps:
    """The ops a layer runs: write_kv(key, value, cache, slot_mapping) returns the cache
    holding the step's K/V (the same tensor, written in place, or a new one), and
    attend(q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=..., max_q_len=...)
    is ragged_paged_attention. rotary_write_kv(qkv, cos, sin, cache, slot_mapping) ->
    (q, cache), where given, rotates q and k and writes K/V in one call instead of the
    rotation in torch and write_kv (rotary_kv_cache_update; the model's heads whole).
    add_rms_norm(x, residual, weight, eps) -> (residual + x, its RMSNorm), where given, runs
    each residual add and the norm after it as one call (add_rms_norm) instead of XLA's two
    fusions. small_batch_tokens: a linear layer without bias over at most this many rows (0:
    none), in float16 or bfloat16, runs on torch.ops.xla_ext.small_batch_linear instead of
    XLA's dot, with the residual add or the SwiGLU after it fused in (the model's heads
    whole)."""
    write_kv: Callable
    attend: Callable
    rotary_write_kv: Optional[Callable] = None
    add_rms_norm: Optional[Callable] = None
    small_batch_tokens: int = 0


def write_kv_in_place(key, value, cache, slot_mapping):
    torch.ops.xla_ext.kv_cache_update(key, value, cache, slot_mapping)
    return cache


def forward(shape, layout, with_logits, weights, caches, packed, previous_tokens, ops=None):
    """One step: the batch `packed` (batch.StepLayout `layout`) through every layer, each
    writing its K/V into caches[layer]. A token id -1 - r in the batch is the token the
    previous step sampled in its row r: previous_tokens[r] (int32 [max_num_seqs], that step's
    first result, still on the device). `ops` (LayerOps): default our ops on whole
    tensors, the caches written in place; torch_xla's tensor parallel step passes them split
    over its mesh (spmd.sharded), returning new caches. Returns ((token ids [max_num_seqs]
    int32, the greedy pick for each sequence's last row in this step) + (logits
    [max_num_seqs, vocab] when with_logits), the caches written)."""
    if ops is None:
        ops = LayerOps(write_kv_in_place, torch.ops.xla_ext.ragged_paged_attention,
                       torch.ops.xla_ext.rotary_kv_cache_update)
    inputs = layout.unpack(packed)
    t, h, kvh, d = layout.num_tokens, shape.num_heads, shape.num_kv_heads, shape.head_dim
    n = shape.shards
    positions = inputs["positions"]
    cos, sin = weights["rope_cos"][positions], weights["rope_sin"][positions]
    token_ids = inputs["token_ids"]
    fed_back = previous_tokens[(-1 - token_ids).clamp(min=0)]
    x = F.embedding(torch.where(token_ids >= 0, token_ids, fed_back), weights["embed"])
    eps = shape.rms_norm_eps

    def small(x, bias):
        return (n == 1 and bias is None and x.shape[0] <= ops.small_batch_tokens
                and x.dtype in (torch.float16, torch.bfloat16))

    def linear(x, weight, bias, residual=None):
        """x @ weight.T (+ bias) (+ residual)."""
        if small(x, bias):
            return torch.ops.xla_ext.small_batch_linear(x, weight, residual)
        y = F.linear(x, weight, bias)
        return y if residual is None else residual + y

    def swiglu(x, gate_up, bias):
        """silu(x @ gate.T) * (x @ up.T), gate_up = each shard's gate rows, then its up rows."""
        if small(x, bias):
            return torch.ops.xla_ext.small_batch_linear(x, gate_up, None, 1)
        gate, up = F.linear(x, gate_up, bias).reshape(t, n, 2, -1).unbind(2)
        return (F.silu(gate) * up).reshape(t, -1)

    def add_norm(x, features, weight, bias, norm):
        """(x + features @ weight.T (+ bias), its RMSNorm scaled by `norm`, or None without)."""
        if norm is None or ops.add_rms_norm is None or small(features, bias):
            x = linear(features, weight, bias, x)
            return x, None if norm is None else _rms_norm(x, norm, eps)
        return ops.add_rms_norm(linear(features, weight, bias), x, norm, eps)

    layers = weights["layers"]
    normed = _rms_norm(x, layers[0]["input_norm"], eps)
    written = []
    for i, (layer, cache) in enumerate(zip(layers, caches)):
        qkv = linear(normed, layer["qkv"], layer["qkv_bias"])
        if ops.rotary_write_kv is not None and n == 1:  # rows q, k, v: [t, h + 2 kvh, d]
            q, cache = ops.rotary_write_kv(qkv.reshape(t, h + 2 * kvh, d), cos, sin, cache,
                                           inputs["slot_mapping"])
        else:
            # Shard by shard (LlamaShape.shards): each shard's q, k and v rows.
            q, k, v = qkv.reshape(t, n, -1).split([h // n * d, kvh // n * d, kvh // n * d],
                                                  dim=-1)
            q = _rotate(q.reshape(t, h, d), cos, sin)
            k = _rotate(k.reshape(t, kvh, d), cos, sin)
            cache = ops.write_kv(k, v.reshape(t, kvh, d), cache, inputs["slot_mapping"])
        written.append(cache)
        attn = ops.attend(
            q, cache, inputs["kv_lens"], inputs["page_indices"], inputs["cu_q_lens"],
            inputs["num_seqs"], sm_scale=shape.sm_scale, max_q_len=layout.max_q_len)
        x, normed = add_norm(x, attn.reshape(t, h * d), layer["o"], layer["o_bias"],
                             layer["post_norm"])
        act = swiglu(normed, layer["gate_up"], layer["gate_up_bias"])
        # The next layer's input norm, after this one's residual add (the last layer's norm is
        # of the sampled rows alone).
        x, normed = add_norm(x, act, layer["down"], layer["down_bias"],
                             layers[i + 1]["input_norm"] if i + 1 < len(layers) else None)
    last = _rms_norm(x[inputs["sample_rows"]], weights["norm"], eps)
    logits = linear(last, weights.get("lm_head", weights["embed"]), None)
    token_ids = logits.argmax(dim=-1).to(torch.int32)
    return ((token_ids, logits.float()) if with_logits else (token_ids,)), written


def next_decode_batch(layout, page_size, packed, steps_left):
    """(The packed batch of the next decode step, steps_left - 1), for a run of decode steps
    on `packed` (batch.StepLayout `layout`), where row i is sequence i, one token each, and
    steps_left[i] is how many steps of the run, from this one, sequence i runs. A sequence
    with a step left runs, in the next step, the token this step samples for it (placeholder
    -1 - i: previous_tokens[i] of the next step), one position further, written into the slot
    its block table gives for that position (the scheduler gave it the page), one more token
    in its cache. Any other row, padding included, stays as it is but writes nothing (its
    step's token is not used); so do block tables, cu_q_lens, num_seqs and sample_rows."""
    arrays = layout.unpack(packed)
    steps_left = steps_left - 1
    seqs = torch.arange(layout.max_num_seqs, dtype=packed.dtype, device=packed.device)
    runs = (seqs < arrays["num_seqs"]) & (steps_left > 0)
    rows = torch.arange(layout.num_tokens, dtype=packed.dtype, device=packed.device)
    row_seq = rows.clamp(max=layout.max_num_seqs - 1)
    row_runs = (rows < layout.max_num_seqs) & runs[row_seq]
    positions = arrays["positions"] + row_runs.to(packed.dtype)
    # Clamped: past a sequence's last step its position may be past its pages; never used.
    pages = arrays["page_indices"][row_seq,
                                   (positions // page_size).clamp(max=layout.pages_per_seq - 1)]
    arrays.update(
        token_ids=torch.where(row_runs, -1 - rows, arrays["token_ids"]),
        positions=positions,
        slot_mapping=torch.where(row_runs, pages * page_size + positions % page_size, -1),
        kv_lens=arrays["kv_lens"] + runs.to(packed.dtype))
    return torch.cat([arrays[name].reshape(-1) for name in layout.sizes]), steps_left
