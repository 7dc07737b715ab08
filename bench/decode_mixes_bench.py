"""Paged decode attention on the batches a serving system sees, not only uniform ones.

    python bench/decode_mixes_bench.py --out bench/results/h100-decode-mixes.json [--flashinfer]

One process, bf16, D=128, block 16, H=32/KVH=8 unless the mix says otherwise (tensor-parallel
shards of that model have fewer heads per GPU; a 1B-class Llama, as the serving benchmark runs,
has D=64). Each mix (MIXES) is timed as:
  xla_ext          ours inside an XLA GPU graph (JAX; decode_bench.jax_seconds: the difference
                   of a 40-call and a 20-call chain, so the executable's launch cancels);
  torch_graph      ours through torch.ops.xla_ext.paged_attention on CUDA tensors, CUDA-graph
                   replay of 20 calls (GPU time per call);
  torch_eager      the same 20 calls launched eagerly (CUDA events), host_us: the host's
                   time per eager call (submission only, the GPU runs behind it), and
                   eager_minus_graph_us: what eager launching adds per call to the graph's
                   time (the host time the GPU could not hide);
  uniform_xla_ext  ours through XLA on the uniform batch with the same number of sequences and
                   the same total tokens (the target: no mix slower than 1.15x of it);
  flashinfer_cuda_core, flashinfer_tensor_core   FlashInfer 0.2.14's BatchDecodeWithPagedKV-
                   CacheWrapper (use_tensor_cores False / True) on the very same NHD caches and
                   block ids, CUDA-graph replay of 20 calls (--flashinfer; see
                   tools/device/flashinfer_tree.sh).
Each row: time per call, GB/s of the K and V bytes the batch reads, % of the copy bandwidth
measured in this run. Outputs of ours (torch), ours (XLA) and FlashInfer are compared.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_bench  # noqa: E402
import gpu_trace  # noqa: E402

import torch_xla_ext  # noqa: E402,F401  (registers torch.ops.xla_ext.*)
from torch_xla_ext import sample_inputs  # noqa: E402

D, BLOCK = decode_bench.D, 16
CHAIN = decode_bench.CHAIN


def _pareto(n, low, high, alpha, seed):
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(low * (1 + rng.pareto(alpha, n)), low, high)]


def _uniform(n, low, high, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(low, high + 1, n)]


# name: (sequence lengths, query heads, kv heads[, head size: D])
MIXES = {
    "uniform 32 x 4096": ([4096] * 32, 32, 8),
    "1 x 32768 + 31 x 256": ([32768] + [256] * 31, 32, 8),
    "2 x 65536 + 62 x 512": ([65536] * 2 + [512] * 62, 32, 8),
    "long tail: 64, Pareto(1.2) from 64 to 32768": (_pareto(64, 64, 32768, 1.2, 0), 32, 8),
    "bimodal 16 x 8192 + 48 x 128": ([8192] * 16 + [128] * 48, 32, 8),
    "128 uniform in [1, 4096]": (_uniform(128, 1, 4096, 1), 32, 8),
    "many very short: 256 x 32": ([32] * 256, 32, 8),
    "length 1 beside long: 64 x 1 + 16 x 4096": ([1] * 64 + [4096] * 16, 32, 8),
    "1 x 131072 alone": ([131072], 32, 8),
    "TP=2 shard (H=16, KVH=4): 1 x 32768 + 31 x 256": ([32768] + [256] * 31, 16, 4),
    "TP=8 shard (H=4, KVH=1): long tail 64": (_pareto(64, 64, 32768, 1.2, 0), 4, 1),
    "1B-class Llama step (D=64): 64 x 2048": ([2048] * 64, 32, 8, 64),
}


def kv_bytes(lengths, kv_heads, head_size):
    return 2 * sum(lengths) * kv_heads * head_size * 2


def uniform_like(lengths):
    """Same number of sequences, same total tokens, lengths as equal as can be."""
    n, total = len(lengths), sum(lengths)
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def xla_seconds(data, reps, head_size):
    """Ours through XLA GPU: (seconds per call in a chain, one call's output as float32)."""
    args = decode_bench.jax_args(data)
    out = jax.jit(lambda *a: decode_bench.ours(*a, head_size ** -0.5))(*args)
    seconds = decode_bench.jax_seconds(decode_bench.chained(decode_bench.ours), args, reps)
    return seconds, np.asarray(out.astype(jnp.float32))


def graph_seconds(fn, reps):
    """GPU time per call: CUDA-graph replay of CHAIN calls of fn."""
    return gpu_trace.graph_seconds(fn, CHAIN, reps)


def eager_seconds(fn, reps):
    """(GPU time per call of CHAIN eager launches, host time per call)."""
    fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(CHAIN):
            fn()
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / 1e3)
    return statistics.median(gpu) / CHAIN, statistics.median(host) / CHAIN


def flashinfer_page_table(block_tables, lengths, page_size):
    """Our page table as FlashInfer's paged KV cache takes it, on the GPU: each sequence's
    pages as (indptr, indices, last_page_len), int32."""
    lengths = torch.as_tensor(lengths).long().cpu()
    pages = (lengths + page_size - 1) // page_size
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    indices = torch.cat([block_tables[i, :int(n)].cpu() for i, n in enumerate(pages.tolist())])
    last_page_len = lengths - (pages - 1) * page_size
    return indptr.cuda(), indices.int().cuda(), last_page_len.int().cuda()


def flashinfer_wrappers(data, heads, kv_heads, head_size):
    import flashinfer

    indptr, indices, last_page_len = flashinfer_page_table(data["block_tables"],
                                                           data["seq_lens"], BLOCK)
    wrappers = {}
    for name, tensor_cores in (("flashinfer_cuda_core", False), ("flashinfer_tensor_core", True)):
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tensor_cores)
        wrapper.plan(indptr, indices, last_page_len, heads, kv_heads, head_size, BLOCK,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        wrappers[name] = (wrapper, workspace)
    return wrappers


def row(mix, impl, seconds, nbytes, copy, **extra):
    gbps = nbytes / seconds / 1e9
    return {"op": "paged_attention", "shape": mix, "impl": impl,
            "time_us": round(seconds * 1e6, 2), "gbps": round(gbps, 1),
            "pct_of_copy": round(100 * gbps / copy, 1)} | extra


def mix_rows(mix, lengths, heads, kv_heads, head_size, reps, copy, with_flashinfer):
    nbytes = kv_bytes(lengths, kv_heads, head_size)
    data = sample_inputs.paged_attention(lengths, heads, kv_heads, head_size, BLOCK,
                                         torch.bfloat16, device="cuda")
    meta = {"num_seqs": len(lengths), "total_tokens": sum(lengths), "max_len": max(lengths),
            "heads": heads, "kv_heads": kv_heads, "head_size": head_size,
            "kv_mb": round(nbytes / 1e6, 1)}
    rows = []
    seconds, xla_out = xla_seconds(data, reps, head_size)
    rows.append(row(mix, "xla_ext", seconds, nbytes, copy, **meta))

    args = (data["query"], data["key_cache"], data["value_cache"], data["block_tables"],
            data["seq_lens"], head_size ** -0.5)
    call = lambda: torch.ops.xla_ext.paged_attention(*args)  # noqa: E731
    torch_out = call().float()
    diff_xla = float((torch_out.cpu() - torch.from_numpy(xla_out)).abs().max())
    in_graph = graph_seconds(call, reps)
    rows.append(row(mix, "torch_graph", in_graph, nbytes, copy,
                    max_abs_diff_vs_xla_ext=diff_xla))
    gpu, host = eager_seconds(call, reps)
    rows.append(row(mix, "torch_eager", gpu, nbytes, copy, host_us=round(host * 1e6, 2),
                    eager_minus_graph_us=round((gpu - in_graph) * 1e6, 2)))

    if with_flashinfer:
        try:
            for name, (wrapper, _) in flashinfer_wrappers(data, heads, kv_heads,
                                                          head_size).items():
                q, k, v = data["query"], data["key_cache"], data["value_cache"]
                run = lambda w=wrapper: w.run(q, (k, v))  # noqa: E731
                diff = float((run().float() - torch_out).abs().max())
                rows.append(row(mix, name, graph_seconds(run, reps), nbytes, copy,
                                max_abs_diff_vs_ours=diff))
        except Exception as e:  # FlashInfer's failure is its row's, not the mix's
            rows.append({"op": "paged_attention", "shape": mix, "impl": "flashinfer",
                         "error": repr(e)[:300]})
    del data, args
    uniform = uniform_like(lengths)
    data = sample_inputs.paged_attention(uniform, heads, kv_heads, head_size, BLOCK,
                                         torch.bfloat16, device="cuda")
    seconds, _ = xla_seconds(data, reps, head_size)
    rows.append(row(mix, "uniform_xla_ext", seconds, nbytes, copy, lengths=uniform[0]))
    del data
    torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--flashinfer", action="store_true")
    parser.add_argument("--only", help="run only mixes whose name contains one of these "
                                       "|-separated strings")
    args = parser.parse_args()
    copy = decode_bench.copy_gbps(args.reps)
    result = {"copy_gbps": round(copy, 1), "device": torch.cuda.get_device_name(),
              "block_size": BLOCK, "head_size": D, "dtype": "bfloat16", "rows": []}
    for mix, (lengths, heads, kv_heads, *head_size) in MIXES.items():
        if args.only and not any(part in mix for part in args.only.split("|")):
            continue
        try:
            rows = mix_rows(mix, lengths, heads, kv_heads, head_size[0] if head_size else D,
                            args.reps, copy, args.flashinfer)
        except Exception as e:  # a failing row is reported, and the others still run
            rows = [{"op": "paged_attention", "shape": mix, "error": repr(e)[:300]}]
        result["rows"] += rows
        for r in rows:
            print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
