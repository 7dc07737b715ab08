"""Tensor parallelism over heads: one decoder layer's serving step on TP devices against TP=1.

The layer (Megatron-style): q, k, v projections split by columns (each device computes its
own heads), this step's K/V written into the donated, head-split caches (xla_ext
reshape_and_cache), decode attention on each device's heads (xla_ext paged_attention), the
output projection split by rows (its partial sums all-reduced), then an MLP (up by columns,
down by rows: a second all-reduce). Plain jax.jit with NamedShardings: the custom calls are
split by their partitioning rules (jax_ops), the matmuls by XLA.

Checks, TP=n against TP=1 on the same inputs: the caches bit for bit, the attention output,
the layer output within bf16 tolerance; the compiled TP=n step holds the two all-reduces and
no other collective (none on the caches). Measures the step time (wall clock, caches fed
back donated) and, from a CUPTI trace (bench/gpu_trace.py) on GPUs, the share of each
device's step spent in collective kernels.

    python bench/tp_bench.py --tp 2 [--out FILE]            # two GPUs: the comparison
    python bench/tp_bench.py --tp 1 [--out FILE]            # one GPU: the single-device half
    python bench/tp_bench.py --platform cpu --small --tp 2  # CPU check of the same code
      (needs XLA_FLAGS=--xla_force_host_platform_device_count=2)

`tools/device/run.sh tp1` and `tp2` write bench/results/<gpu>-tp1.json and <gpu>-tp2.json.
"""

import argparse
import functools
import json
import os
import re
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # reshape_and_cache's slot_mapping is int64

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from torch_xla_ext import jax_ops  # noqa: E402

# Llama-3-8B-like attention (32 query heads, 8 kv heads, head size 128) and a 4x MLP.
FULL = dict(heads=32, kv_heads=8, head_size=128, ffn=14336, seqs=32, context=2048, block=16,
            dtype="bfloat16")
SMALL = dict(heads=8, kv_heads=4, head_size=64, ffn=512, seqs=4, context=64, block=16,
             dtype="float32")
COLLECTIVE_HLO = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|"
                            r"reduce-scatter)(-start)?\(")


def make_inputs(cfg, seed=0):
    """Host (NumPy) parameters, one token per sequence, the caches and their metadata."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, d = cfg["heads"], cfg["kv_heads"], cfg["head_size"]
    hidden, seqs, block = heads * d, cfg["seqs"], cfg["block"]
    dtype = jnp.dtype(cfg["dtype"])

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    blocks_per_seq = cfg["context"] // block
    num_blocks = seqs * blocks_per_seq
    params = dict(wq=normal(hidden, heads * d, scale=hidden ** -0.5),
                  wk=normal(hidden, kv_heads * d, scale=hidden ** -0.5),
                  wv=normal(hidden, kv_heads * d, scale=hidden ** -0.5),
                  wo=normal(heads * d, hidden, scale=hidden ** -0.5),
                  w_up=normal(hidden, cfg["ffn"], scale=hidden ** -0.5),
                  w_down=normal(cfg["ffn"], hidden, scale=cfg["ffn"] ** -0.5))
    block_tables = rng.permutation(num_blocks).astype(np.int32).reshape(seqs, blocks_per_seq)
    seq_lens = rng.integers(cfg["context"] // 2, cfg["context"] + 1, seqs).astype(np.int32)
    last = seq_lens - 1  # this step's token sits at the last position of its sequence
    slots = (block_tables[np.arange(seqs), last // block].astype(np.int64) * block
             + last % block)
    cache_shape = (num_blocks, block, kv_heads, d)
    data = dict(x=normal(seqs, hidden), key_cache=normal(*cache_shape),
                value_cache=normal(*cache_shape), block_tables=block_tables, seq_lens=seq_lens,
                slots=slots)
    return params, data


def layer(params, x, key_cache, value_cache, block_tables, seq_lens, slots, *, cfg):
    seqs, heads, kv_heads, d = x.shape[0], cfg["heads"], cfg["kv_heads"], cfg["head_size"]
    q = (x @ params["wq"]).reshape(seqs, heads, d)
    k = (x @ params["wk"]).reshape(seqs, kv_heads, d)
    v = (x @ params["wv"]).reshape(seqs, kv_heads, d)
    key_cache, value_cache = jax_ops.reshape_and_cache(k, v, key_cache, value_cache, slots)
    attention = jax_ops.paged_attention(q, key_cache, value_cache, block_tables, seq_lens,
                                        d ** -0.5)
    # Row-parallel matmuls: partial sums (float32) all-reduced across the heads' devices.
    h = x + jnp.dot(attention.reshape(seqs, heads * d), params["wo"],
                    preferred_element_type=jnp.float32).astype(x.dtype)
    up = jax.nn.gelu(h @ params["w_up"])
    y = h + jnp.dot(up, params["w_down"], preferred_element_type=jnp.float32).astype(x.dtype)
    return y, attention, key_cache, value_cache


def shardings(mesh):
    """Megatron's split over axis "tp": columns of q/k/v and up, rows of o and down, heads of
    the caches; activations and metadata replicated."""
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    params = dict(wq=s(None, "tp"), wk=s(None, "tp"), wv=s(None, "tp"), wo=s("tp", None),
                  w_up=s(None, "tp"), w_down=s("tp", None))
    cache = s(None, None, "tp", None)
    inputs = (params, s(), cache, cache, s(), s(), s())
    outputs = (s(), s(None, "tp", None), cache, cache)
    return inputs, outputs


class Step:
    """The jitted layer on `devices`, caches donated, with its inputs placed."""

    def __init__(self, cfg, devices, params, data):
        self.mesh = Mesh(np.array(devices), ("tp",))
        in_shardings, out_shardings = shardings(self.mesh)
        self.fn = jax.jit(functools.partial(layer, cfg=cfg), in_shardings=in_shardings,
                          out_shardings=out_shardings, donate_argnums=(2, 3))
        args = (params, data["x"], data["key_cache"], data["value_cache"], data["block_tables"],
                data["seq_lens"], data["slots"])
        self.args = list(jax.device_put(args, in_shardings))
        self.compiled = self.fn.lower(*self.args).compile()
        self.hlo = self.compiled.as_text()

    def __call__(self):
        y, attention, key_cache, value_cache = self.compiled(*self.args)
        self.args[2], self.args[3] = key_cache, value_cache  # the next step writes into these
        return y, attention, key_cache, value_cache


def time_steps(step, count):
    jax.block_until_ready(step())  # warm up
    start = time.perf_counter()
    for _ in range(count):
        out = step()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / count * 1e6


def trace_steps(step, count):
    """Per device, from a CUPTI trace of `count` steps: span (first kernel start to last end),
    kernel time and collective kernel time per step, in us, and the collective kernels seen."""
    from gpu_trace import COLLECTIVE_KERNEL, gpu_events

    def steps():
        for _ in range(count):
            out = step()
        jax.block_until_ready(out)

    jax.block_until_ready(step())
    per_device = {}
    for e in gpu_events(steps):
        per_device.setdefault(e.device_index, []).append(e)
    result = {}
    for device, kernels in sorted(per_device.items()):
        span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
        collective = [e for e in kernels if COLLECTIVE_KERNEL.search(e.name)]
        busy = sum(e.time_range.elapsed_us() for e in kernels)
        in_collectives = sum(e.time_range.elapsed_us() for e in collective)
        result[str(device)] = {
            "span_us_per_step": round(span / count, 2),
            "kernel_us_per_step": round(busy / count, 2),
            "collective_us_per_step": round(in_collectives / count, 2),
            "collective_share_of_span": round(in_collectives / span, 4) if span else None,
            "collective_kernels": sorted({e.name[:80] for e in collective}),
        }
    return result


def compare(got, want, dtype):
    y, attention, key_cache, value_cache = (np.asarray(a, dtype=np.float64) for a in got)
    y_ref, attention_ref, key_ref, value_ref = (np.asarray(a, dtype=np.float64) for a in want)
    # Relative to each tensor's largest value: split bf16 projections sum in another order
    # than whole ones and round differently, so the caches (K and V projected by a column
    # split) are not bit-equal on GPUs, only close (in float32 on the CPU, to 1e-4).
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-4
    result = {"tolerance": tolerance, "relative_to": "each tensor's largest absolute value"}
    ok = True
    for name, got_, want in (("key_cache", key_cache, key_ref),
                             ("value_cache", value_cache, value_ref),
                             ("attention", attention, attention_ref),
                             ("layer_output", y, y_ref)):
        diff, scale = float(np.abs(got_ - want).max()), max(float(np.abs(want).max()), 1.0)
        result[f"{name}_max_abs_diff"] = diff
        result[f"{name}_max_abs"] = scale
        ok = ok and diff <= tolerance * scale
    result["ok"] = ok
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="devices to split heads over")
    parser.add_argument("--platform", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small float32 layer (CPU)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    cfg = SMALL if args.small else FULL
    devices = jax.devices(args.platform)
    if len(devices) < args.tp:
        sys.exit(f"--tp {args.tp}: needs {args.tp} {args.platform} devices, {len(devices)} "
                 "visible")
    params, data = make_inputs(cfg)
    result = {"config": cfg, "tp": args.tp, "devices": [str(d) for d in devices[:args.tp]],
              "jax": jax.__version__, "runs": {}}

    # Each step writes the same slots with the same values, so the caches after the first step
    # are what every later step sees: one step of each, on fresh caches, is the comparison.
    sizes = sorted({1, args.tp})
    outputs = {}
    for tp in sizes:
        step = Step(cfg, devices[:tp], params, data)
        outputs[tp] = jax.tree.map(np.asarray, step())
        collectives = sorted({m.group(1) for m in COLLECTIVE_HLO.finditer(step.hlo)})
        run = {"hlo_collectives": collectives,
               "hlo_all_reduces": len(re.findall(r"= \S+ all-reduce(-start)?\(", step.hlo)),
               "step_us": round(time_steps(step, args.steps), 2)}
        if args.platform == "cuda":
            run["trace"] = trace_steps(step, 20)
        result["runs"][str(tp)] = run
        print(f"TP={tp}: {run['step_us']} us per step; collectives in HLO: {collectives} "
              f"({run['hlo_all_reduces']} all-reduce)", flush=True)
        for device, t in run.get("trace", {}).items():
            print(f"  GPU {device}: span {t['span_us_per_step']} us, kernels "
                  f"{t['kernel_us_per_step']} us, collectives {t['collective_us_per_step']} us "
                  f"({100 * (t['collective_share_of_span'] or 0):.1f}% of span)", flush=True)
        del step
    status = 0
    if args.tp > 1:
        check = compare(outputs[args.tp], outputs[1], cfg["dtype"])
        tp_run = result["runs"][str(args.tp)]
        check["hlo_only_all_reduce"] = tp_run["hlo_collectives"] == ["all-reduce"]
        check["ok"] = check["ok"] and check["hlo_only_all_reduce"]
        result["tp_vs_1"] = check
        print(f"TP={args.tp} vs TP=1: {json.dumps(check)}", flush=True)
        status = 0 if check["ok"] else 1
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    sys.exit(status)


if __name__ == "__main__":
    main()
