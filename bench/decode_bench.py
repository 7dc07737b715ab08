"""GPU benchmark of paged decode attention against its baselines, one process.

    python bench/decode_bench.py --out bench/results/h100.json
    python bench/decode_bench.py --skip-add --out bench/results/h100-decode-uniform.json

(`tools/device/run.sh bench` runs the first, `run.sh decode` the second; bench/README.md says
what the fields mean.)
Rows: paged_attention decode, bf16, H=32, KVH=8, D=128, through
  xla_ext     our CUDA handler inside an XLA GPU graph (JAX, jax.ffi.ffi_call),
  sdpa_cudnn  torch SDPA, cuDNN backend, on the same data as a contiguous KV cache,
  sdpa_flash  torch SDPA, flash backend, same,
  xla_gather  plain JAX: gather the blocks, then einsum/softmax/einsum, compiled by XLA;
simple_add at 1 GiB (f32) against XLA's own add; and "dispatch": one 4 KiB add, ours against
XLA's, as the per-op cost inside a compiled graph. Each row: median time per call, GB/s of the
bytes that must move, and % of the device-to-device copy bandwidth measured in this run.

Timing: JAX functions are jitted chains of CHAIN calls, each behind an optimization_barrier
over all its inputs, so XLA can neither fuse the steps nor hoist work that does not depend on
the previous step (the gather of the cache, say) out of the chain; timed by wall clock around
block_until_ready, as the difference between chains of 2*CHAIN and CHAIN calls (see
jax_seconds). torch functions are CHAIN back-to-back launches timed with CUDA events.
Per call = median over reps / CHAIN.
"""

import argparse
import json
import os
import statistics
import time

# JAX and torch share the GPU in this process: stop JAX from taking 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from torch_xla_ext import jax_ops as xla_ext_jax  # noqa: E402
from torch_xla_ext import sample_inputs  # noqa: E402

CHAIN = 20
DISPATCH_CHAIN = 500
ONLY = None  # --only: the one impl to measure
H, KVH, D = 32, 8, 128
SCALE = D ** -0.5
SHAPES = [(32, 4096, 16), (8, 16384, 16), (64, 1024, 16), (1, 32768, 16), (32, 4096, 32)]


def jax_seconds(chain, args, reps, length=CHAIN):
    """Seconds of one call inside a compiled graph. chain(n) is a jitted chain of n calls; the
    result is the median time of chain(2 * length) minus the median of chain(length), over
    length (the two timed alternately). The difference cancels what running an executable
    costs once (launch, and waiting for it: about 20 us per call of a 20-call chain on the
    H100), which a model's decode step, with all its layers in one executable, pays once too."""
    fns = {n: chain(n) for n in (length, 2 * length)}
    times = {n: [] for n in fns}
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compile, warm up
    for _ in range(reps):
        for n, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[n].append(time.perf_counter() - start)
    return (statistics.median(times[2 * length]) - statistics.median(times[length])) / length


def torch_seconds(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CHAIN):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / CHAIN


def copy_gbps(reps):
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = torch_seconds(lambda: dst.copy_(src), reps)
    return 2 * src.numel() / seconds / 1e9  # read + write


def wanted(impl):
    return ONLY is None or impl == ONLY


def row(op, shape, impl, seconds, nbytes, copy):
    gbps = nbytes / seconds / 1e9
    return {"op": op, "shape": shape, "impl": impl, "time_us": round(seconds * 1e6, 2),
            "gbps": round(gbps, 1), "pct_of_copy": round(100 * gbps / copy, 1)}


def xla_gather_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Paged decode attention in plain JAX, as XLA compiles it without a custom kernel."""
    batch, blocks = block_tables.shape
    block_size = key_cache.shape[1]
    k = key_cache[block_tables].reshape(batch, blocks * block_size, KVH, D)
    v = value_cache[block_tables].reshape(batch, blocks * block_size, KVH, D)
    q = query.reshape(batch, KVH, H // KVH, D)
    logits = jnp.einsum("bkgd,blkd->bkgl", q, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.arange(blocks * block_size)[None, None, None, :] < seq_lens[:, None, None, None]
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgl,blkd->bkgd", probs.astype(v.dtype), v)
    return out.reshape(batch, H, D)


def paged_attention_data(batch, seq_len, block_size):
    """The benchmark's inputs as torch CUDA tensors, and the bytes of K and V a call reads."""
    # Blocks scattered over the cache, as a serving engine's allocator leaves them.
    data = sample_inputs.paged_attention([seq_len] * batch, H, KVH, D, block_size,
                                         torch.bfloat16, device="cuda")
    return data, 2 * batch * seq_len * KVH * D * 2


def jax_args(data):
    """The same arrays in JAX, in the op's argument order."""
    return tuple(jnp.asarray(t.cpu().float().numpy()).astype(
        jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.int32) for t in data.values())


def chained(attention):
    """chain(length): a jitted chain of `length` attention calls, each behind a barrier, each
    one's output the next one's query."""
    def chain(length):
        @jax.jit
        def run(*state):
            for _ in range(length):
                state = jax.lax.optimization_barrier(state)
                state = (attention(*state, SCALE),) + state[1:]
            return state[0]
        return run
    return chain


def ours(*args):
    return xla_ext_jax.paged_attention(*args[:5], scale=args[5])


def contiguous_qkv(data):
    """The same query, keys and values as torch SDPA takes them, the keys and values laid out
    contiguously: q [B, H, 1, D], k and v [B, KVH, L, D]."""
    batch, seq_len = data["block_tables"].shape[0], int(data["seq_lens"][0])
    order = data["block_tables"].long().reshape(-1)
    k = data["key_cache"][order].reshape(batch, seq_len, KVH, D).transpose(1, 2).contiguous()
    v = data["value_cache"][order].reshape(batch, seq_len, KVH, D).transpose(1, 2).contiguous()
    return data["query"].unsqueeze(2), k, v


def sdpa_call(qkv, backend):
    """torch SDPA with one backend on contiguous_qkv's tensors."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = qkv

    def sdpa():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=SCALE,
                                                                    enable_gqa=True)
    return sdpa


def paged_attention_callable(batch, seq_len, block_size, impl, calls):
    """A no-argument function that runs `calls` calls of impl and waits for them (for
    bench/kernel_times.py)."""
    data, _ = paged_attention_data(batch, seq_len, block_size)
    if impl == "sdpa_cudnn":
        from torch.nn.attention import SDPBackend

        sdpa = sdpa_call(contiguous_qkv(data), SDPBackend.CUDNN_ATTENTION)
        del data

        def run_torch():
            for _ in range(calls):
                sdpa()
        return run_torch
    args = jax_args(data)
    del data
    fn = chained(ours if impl == "xla_ext" else xla_gather_attention)(calls)
    return lambda: jax.block_until_ready(fn(*args))


def paged_attention_rows(batch, seq_len, block_size, reps, copy):
    shape = f"B={batch},L={seq_len},block={block_size}"
    data, kv_bytes = paged_attention_data(batch, seq_len, block_size)
    rows = []
    args = jax_args(data)
    if wanted("xla_ext"):
        # One un-chained call of each, to show both compute the same attention.
        one = jax.jit(lambda *a: ours(*a, SCALE))(*args)
        reference = jax.jit(lambda *a: xla_gather_attention(*a, SCALE))(*args)
        err = float(jnp.max(jnp.abs(one.astype(jnp.float32) - reference.astype(jnp.float32))))
        rows.append(row("paged_attention", shape, "xla_ext",
                        jax_seconds(chained(ours), args, reps), kv_bytes, copy)
                    | {"max_abs_diff_vs_xla_gather": err})
    if wanted("xla_gather"):
        rows.append(row("paged_attention", shape, "xla_gather",
                        jax_seconds(chained(xla_gather_attention), args, reps), kv_bytes, copy))
    del args

    from torch.nn.attention import SDPBackend

    backends = [(impl, backend) for impl, backend in (
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION))
        if wanted(impl)]
    qkv = contiguous_qkv(data) if backends else None
    for impl, backend in backends:
        try:
            rows.append(row("paged_attention", shape, impl,
                            torch_seconds(sdpa_call(qkv, backend), reps), kv_bytes, copy))
        except RuntimeError as e:  # a backend that refuses this shape is reported, not hidden
            rows.append({"op": "paged_attention", "shape": shape, "impl": impl,
                         "error": str(e).splitlines()[0][:200]})
    del data
    torch.cuda.empty_cache()
    return rows


def add_chain(add):
    """chain(length): a jitted chain of `length` calls add(a, b), each behind a barrier."""
    def chain(length):
        @jax.jit
        def run(a, b):
            for _ in range(length):
                a, b = jax.lax.optimization_barrier((a, b))
                a = add(a, b)
            return a
        return run
    return chain


def dispatch_operands():
    """The dispatch row's operands: 4 KiB of f32 each, so the cost is dispatching the op, not
    moving bytes."""
    return jnp.ones((1024,), jnp.float32), jnp.full((1024,), 0.5, jnp.float32)


def dispatch_seconds(add, operands, reps):
    """Seconds of one add on dispatch_operands inside a compiled graph. A call costs about a
    microsecond: long chains, so that the difference of two chains stands well above the
    run-to-run jitter of an executable's launch."""
    return jax_seconds(add_chain(add), operands, reps, length=DISPATCH_CHAIN)


def simple_add_rows(reps, copy):
    rows = []
    n = (1 << 30) // 4  # 1 GiB of f32 per operand
    a = jnp.ones((n,), jnp.float32)
    b = jnp.full((n,), 0.5, jnp.float32)

    adds = [(impl, add) for impl, add in (("xla_ext", xla_ext_jax.simple_add),
                                          ("xla_native", jnp.add)) if wanted(impl)]
    for impl, add in adds:
        rows.append(row("simple_add", "f32,1GiB", impl, jax_seconds(add_chain(add), (a, b), reps),
                        3 * 4 * n, copy))
    del a, b

    operands = dispatch_operands()
    for impl, add in adds:
        rows.append(row("dispatch", "f32,4KiB", impl, dispatch_seconds(add, operands, reps),
                        3 * operands[0].nbytes, copy))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", help="keep the rows of this impl only (e.g. xla_ext), for tuning")
    parser.add_argument("--skip-add", action="store_true", help="paged attention rows only")
    args = parser.parse_args()
    global ONLY
    ONLY = args.only
    copy = copy_gbps(args.reps)
    rows = []
    for batch, seq_len, block_size in SHAPES:
        rows += paged_attention_rows(batch, seq_len, block_size, args.reps, copy)
        print(json.dumps([r for r in rows if r["shape"].startswith(f"B={batch},L={seq_len},")
                          and r["shape"].endswith(f"block={block_size}")]), flush=True)
    if not args.skip_add:
        rows += simple_add_rows(args.reps, copy)
    result = {
        "device": torch.cuda.get_device_name(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
        "method": (f"JAX: (median of {args.reps} reps of a {2 * CHAIN}-call chain - median of "
                   f"a {CHAIN}-call chain) / {CHAIN} ({DISPATCH_CHAIN} and "
                   f"{2 * DISPATCH_CHAIN} calls for dispatch); torch: median of {args.reps} reps "
                   f"of {CHAIN} calls / {CHAIN}; see bench/decode_bench.py"),
        "copy_gbps": round(copy, 1),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
