"""GPU benchmark of ragged paged attention (prefill chunks and decodes in one call), one process:

    python3 bench/ragged_bench.py --out bench/results/h100-ragged.json

Rows: bf16, H=32, KVH=8, D=128, page 16, through XLA GPU (JAX):
  xla_ext     our CUDA handler, jax_ops.ragged_paged_attention;
  xla_native  the same function written in plain JAX (gather each sequence's pages, pad its
              rows to the batch's longest, masked einsum/softmax/einsum), compiled by XLA;
  flashinfer_prefill  with --flashinfer: FlashInfer 0.2.14's BatchPrefillWithPagedKVCache-
              Wrapper (causal, right-aligned as ours) on the same pages, split into its K and V
              caches (NHD), torch CUDA tensors, CUDA-graph replay of a chain of calls
              (tools/device/flashinfer_tree.sh; eager launches if its run cannot be captured).
Each row's roofline is max(bytes / copy bandwidth, causal flops / bf16 matmul rate), both
measured in this run: bytes = q + the K/V rows read + out; flops = 4 * head_dim per (query
head, query row, visible position). Timing as bench/decode_bench.py (a jitted chain of calls
behind optimization barriers; per call = (chain of 40 - chain of 20) / 20).
"""

import argparse
import json

import decode_bench  # noqa: F401  (sets XLA_PYTHON_CLIENT_PREALLOCATE before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from torch_xla_ext import jax_ops, sample_inputs  # noqa: E402

H, KVH, D, PAGE = 32, 8, 128, 16
SCALE = D ** -0.5
# (name, q_lens, kv_lens): what a serving step brings.
MIXES = [
    ("decode 64 x 2048", [1] * 64, [2048] * 64),
    ("decode 32 x 4096", [1] * 32, [4096] * 32),
    ("decode long tail: 1 x 32768 + 31 x 512", [1] * 32, [32768] + [512] * 31),
    ("prefill 4 x 2048", [2048] * 4, [2048] * 4),
    ("mixed: one 512-token chunk (of 2048) + 63 decodes x 2048", [512] + [1] * 63, [2048] * 64),
    ("mixed: 4 chunks of 256 + 60 decodes x 1024", [256] * 4 + [1] * 60, [1024] * 64),
]


def matmul_tflops(reps):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    seconds = decode_bench.torch_seconds(lambda: a @ b, reps)
    return 2 * 8192 ** 3 / seconds / 1e12


def cost(q_lens, kv_lens):
    """(bytes, flops) a call must move and compute at least."""
    rows = sum(q_lens)
    kv_bytes = sum(kv_lens) * 2 * KVH * D * 2
    visible = sum(sum(kv - q + j + 1 for j in range(q)) for q, kv in zip(q_lens, kv_lens))
    return 2 * rows * H * D * 2 + kv_bytes, 4 * D * H * visible


def native(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, scale, max_q_len):
    """Plain-JAX ragged attention: each sequence's pages gathered, its rows padded to max_q_len."""
    num_seqs_max, pages_per_seq = page_indices.shape
    length = pages_per_seq * PAGE
    pages = kv_pages[page_indices]  # [S, P, page, 2 KVH, D]
    k = pages[:, :, :, 0::2].reshape(num_seqs_max, length, KVH, D)
    v = pages[:, :, :, 1::2].reshape(num_seqs_max, length, KVH, D)
    starts, q_lens = cu_q_lens[:-1], cu_q_lens[1:] - cu_q_lens[:-1]
    j = jnp.arange(max_q_len)
    rows = jnp.clip(starts[:, None] + j[None, :], 0, q.shape[0] - 1)  # [S, Qmax]
    qs = q[rows].reshape(num_seqs_max, max_q_len, KVH, H // KVH, D)
    scores = jnp.einsum("sqkgd,slkd->skgql", qs.astype(jnp.float32), k.astype(jnp.float32))
    q_pos = (kv_lens - q_lens)[:, None] + j[None, :]  # [S, Qmax]
    visible = jnp.arange(length)[None, None, :] <= q_pos[:, :, None]
    scores = jnp.where(visible[:, None, None], scores * scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("skgql,slkd->sqkgd", probs, v.astype(jnp.float32)).astype(q.dtype)
    out = out.reshape(num_seqs_max * max_q_len, H, D)
    owned = (j[None, :] < q_lens[:, None]).reshape(-1)
    target = jnp.where(owned, rows.reshape(-1), q.shape[0])  # padding rows dropped
    return jnp.zeros_like(q).at[target].set(out, mode="drop")


def flashinfer_prefill(data, q_lens, kv_lens):
    """A call of FlashInfer's paged prefill on `data`'s pages, and what it keeps alive."""
    import flashinfer
    from decode_mixes_bench import flashinfer_page_table

    kv_indptr, kv_indices, last_page_len = flashinfer_page_table(data["page_indices"], kv_lens,
                                                                 PAGE)
    kv_pages = data["kv_pages"].cuda()
    caches = (kv_pages[:, :, 0::2].contiguous(), kv_pages[:, :, 1::2].contiguous())
    q = data["q"].cuda()
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(data["cu_q_lens"][:len(q_lens) + 1].cuda(), kv_indptr, kv_indices,
                 last_page_len, H, KVH, D, PAGE, causal=True,
                 sm_scale=SCALE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return (lambda: wrapper.run(q, caches)), (wrapper, workspace, caches, q)


def flashinfer_row(data, q_lens, kv_lens, reps):
    """(seconds per call, how it was timed, its output as float32 NumPy)."""
    import decode_mixes_bench

    call, _keep = flashinfer_prefill(data, q_lens, kv_lens)
    out = call().float().cpu().numpy()
    try:
        return decode_mixes_bench.graph_seconds(call, reps), "cuda_graph", out
    except RuntimeError:  # a run that cannot be captured: eager launches, GPU time
        torch.cuda.synchronize()
        return decode_mixes_bench.eager_seconds(call, reps)[0], "eager", out


def chained(attention):
    def chain(length):
        @jax.jit
        def run(*state):
            for _ in range(length):
                state = jax.lax.optimization_barrier(state)
                state = (attention(*state),) + state[1:]
            return state[0]
        return run
    return chain


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--flashinfer", action="store_true")
    parser.add_argument("--impls", default="xla_ext,xla_native",
                        help="comma-separated: xla_ext, xla_native (FlashInfer: --flashinfer)")
    parser.add_argument("--only", help="run only mixes whose name contains one of these "
                        "'|'-separated parts")
    args = parser.parse_args()
    copy = decode_bench.copy_gbps(args.reps)
    tflops = matmul_tflops(args.reps)
    print(f"copy {copy:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    rows = []
    for name, q_lens, kv_lens in MIXES:
        if args.only and not any(part in name for part in args.only.split("|")):
            continue
        data = sample_inputs.ragged_paged_attention(q_lens, kv_lens, H, KVH, D, PAGE,
                                                    torch.bfloat16)
        inputs = [jnp.asarray(np.asarray(t.view(torch.int16).numpy()).view(jnp.bfloat16))
                  if t.dtype == torch.bfloat16 else jnp.asarray(t.numpy())
                  for t in data.values()]
        nbytes, flops = cost(q_lens, kv_lens)
        roofline = max(nbytes / (copy * 1e9), flops / (tflops * 1e12))
        impls = {
            "xla_ext": lambda *a: jax_ops.ragged_paged_attention(*a, sm_scale=SCALE),
            "xla_native": lambda *a, m=max(q_lens): native(*a, SCALE, m),
        }
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
        if args.flashinfer:
            impls["flashinfer_prefill"] = None
        outputs = {}
        for impl, fn in impls.items():
            timing = "xla_chain"
            try:
                if fn is None:
                    seconds, timing, outputs[impl] = flashinfer_row(data, q_lens, kv_lens,
                                                                    args.reps)
                else:
                    outputs[impl] = np.asarray(jax.jit(fn)(*inputs), dtype=np.float32)
                    seconds = decode_bench.jax_seconds(chained(fn), inputs, args.reps)
            except Exception as e:  # e.g. the padded native path running out of memory
                print(f"{name:58} {impl:10} failed: {str(e).splitlines()[0][:120]}", flush=True)
                rows.append({"op": "ragged_paged_attention", "shape": name, "impl": impl,
                             "error": repr(e)[:300]})
                continue
            row = {"op": "ragged_paged_attention", "shape": name, "impl": impl, "timing": timing,
                   "time_us": round(seconds * 1e6, 1), "bytes": nbytes, "flops": flops,
                   "roofline_us": round(roofline * 1e6, 1),
                   "x_roofline": round(seconds / roofline, 2),
                   "pct_of_copy": round(100 * nbytes / seconds / (copy * 1e9), 1)}
            if impl != "xla_ext" and "xla_ext" in outputs:
                row["max_abs_diff_vs_xla_ext"] = float(np.abs(outputs[impl] -
                                                              outputs["xla_ext"]).max())
                if impl == "xla_native":  # ours is checked against it; FlashInfer is recorded
                    assert row["max_abs_diff_vs_xla_ext"] < 5e-2, row
            rows.append(row)
            print(f"{name:58} {impl:10} {row['time_us']:9.1f} us  roofline "
                  f"{row['roofline_us']:8.1f} us  x{row['x_roofline']:.2f}", flush=True)
        del inputs
        with open(args.out, "w") as f:  # after every mix: a run cut short keeps its rows
            json.dump({"copy_gbps": round(copy, 1), "matmul_tflops": round(tflops, 1),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
