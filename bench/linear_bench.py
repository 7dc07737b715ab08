"""xla_ext.small_batch_linear against cuBLAS (torch's F.linear) on the linear layers of a
Llama decode step, in one process on one GPU: each projection of the 1B- and 8B-class models
at 1 to 64 tokens, as a plain product, with the residual add after it (o and down), and as
the SwiGLU of gate_up (silu(gate) * up after the product: torch's eager ops, three kernels,
where ours is one).

Each call reads one of enough copies of the weight to cover 4x the GPU's L2 in turn, so every
weight comes from HBM as in a step; 100 calls are captured in a CUDA graph (as XLA runs a
step's kernels back to back) and CUDA events time its replay, the median of 5.
Bandwidth is the weight's bytes over the time, beside the device-to-device copy bandwidth
measured eagerly (bytes read + written) in the same run.

    python bench/linear_bench.py --out h200-layer-ops.json   (tools/device/run.sh layer_ops)
"""

import argparse
import json

import torch
import torch.nn.functional as F

import torch_xla_ext  # noqa: F401  (torch.ops.xla_ext)
from bench.gpu_trace import copy_gbps, graph_seconds

# (model, projection, weight rows, in_features, form)
LAYERS = [
    ("1b", "qkv", 3072, 2048, "plain"),
    ("1b", "o", 2048, 2048, "residual"),
    ("1b", "gate_up", 16384, 2048, "silu_gate"),
    ("1b", "down", 2048, 8192, "residual"),
    ("1b", "lm_head", 128256, 2048, "plain"),
    ("8b", "qkv", 6144, 4096, "plain"),
    ("8b", "o", 4096, 4096, "residual"),
    ("8b", "gate_up", 28672, 4096, "silu_gate"),
    ("8b", "down", 4096, 14336, "residual"),
]
TOKENS = [1, 8, 16, 32, 64]


def time_us(fn, calls=100, repeats=5):
    """GPU µs per call of fn (gpu_trace.graph_seconds: calls captured in a CUDA graph)."""
    return graph_seconds(fn, calls, repeats) * 1e6


def cycling(tensors):
    """A function returning the tensors in turn."""
    state = {"i": 0}

    def next_one():
        state["i"] = (state["i"] + 1) % len(tensors)
        return tensors[state["i"]]

    return next_one


def bench_layer(model, proj, rows, k, form, tokens, l2_bytes, dtype=torch.bfloat16):
    weight_bytes = rows * k * 2
    copies = max(2, -(-4 * l2_bytes // weight_bytes))
    weights = [torch.randn(rows, k, device="cuda").to(dtype) / 16 for _ in range(copies)]
    next_weight = cycling(weights)
    out_features = rows // 2 if form == "silu_gate" else rows
    results = []
    for m in tokens:
        x = torch.randn(m, k, device="cuda").to(dtype)
        residual = torch.randn(m, out_features, device="cuda").to(dtype)
        gate = int(form == "silu_gate")
        res = residual if form == "residual" else None

        def ours(w):
            return torch.ops.xla_ext.small_batch_linear(x, w, res, gate)

        def cublas(w):
            y = F.linear(x, w)
            if form == "silu_gate":
                g, u = y.chunk(2, dim=-1)
                return F.silu(g) * u
            return y if res is None else res + y

        want = cublas(weights[0]).float()
        error = float((ours(weights[0]).float() - want).abs().max() / want.abs().max())
        ours_us = time_us(lambda: ours(next_weight()))
        cublas_us = time_us(lambda: cublas(next_weight()))
        results.append({
            "model": model, "proj": proj, "form": form, "tokens": m, "weight_rows": rows,
            "in_features": k, "weight_mb": round(weight_bytes / 1e6, 1),
            "ours_us": round(ours_us, 2), "cublas_us": round(cublas_us, 2),
            "ours_gbps": round(weight_bytes / ours_us / 1e3, 1),
            "cublas_gbps": round(weight_bytes / cublas_us / 1e3, 1),
            "speedup": round(cublas_us / ours_us, 3),
            "max_rel_error_vs_cublas": round(error, 5),
        })
        r = results[-1]
        print(f"{model} {proj:8s} {form:9s} M={m:2d}: ours {r['ours_us']:8.2f} us "
              f"({r['ours_gbps']:6.0f} GB/s)  cuBLAS {r['cublas_us']:8.2f} us "
              f"({r['cublas_gbps']:6.0f} GB/s)  x{r['speedup']:.2f}  err {error:.1e}", flush=True)
    del weights
    torch.cuda.empty_cache()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--models", nargs="+", default=["1b", "8b"])
    parser.add_argument("--only", nargs="+", help="projections to run (e.g. qkv lm_head)")
    args = parser.parse_args()
    copy = copy_gbps()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy:.0f} GB/s (read + written), "
          f"L2 {l2_bytes / 2**20:.0f} MiB", flush=True)
    rows = []
    for layer in LAYERS:
        if layer[0] in args.models and (not args.only or layer[1] in args.only):
            rows += bench_layer(*layer, args.tokens, l2_bytes)
    result = {"device": torch.cuda.get_device_name(), "copy_gbps": round(copy, 1),
              "dtype": "bfloat16", "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
