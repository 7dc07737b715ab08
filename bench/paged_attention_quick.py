"""Quick GPU timing of xla_ext.paged_attention (through JAX's XLA) against the device's copy
bandwidth measured in the same process. Prints one JSON object.

    python bench/paged_attention_quick.py [--reps N]

Each timed function is jitted with `CHAIN` dependent calls (the output feeds the next
query), so kernel time dominates host dispatch; time per call = median wall time / CHAIN.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from torch_xla_ext import jax as xla_ext_jax

CHAIN = 20
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
SHAPES = [(32, 4096), (8, 16384), (64, 1024), (1, 32768)]


def median_seconds(fn, args, reps):
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / CHAIN


def copy_gbps(reps):
    x = jnp.ones((1 << 29,), jnp.bfloat16)  # 1 GiB

    @jax.jit
    def chain(x, factor):
        for _ in range(CHAIN):
            x = x * factor  # one read and one write of x
        return x

    seconds = median_seconds(chain, (x, jnp.bfloat16(1)), reps)
    return 2 * x.nbytes / seconds / 1e9


def paged_attention_row(batch, seq_len, reps, copy):
    key = jax.random.PRNGKey(0)
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    k1, k2, k3, k4 = jax.random.split(key, 4)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key_cache = jax.random.normal(k1, cache_shape, jnp.bfloat16)
    value_cache = jax.random.normal(k2, cache_shape, jnp.bfloat16)
    query = jax.random.normal(k3, (batch, NUM_HEADS, HEAD_SIZE), jnp.bfloat16)
    # Blocks scattered over the cache, as after a serving engine's allocations.
    block_tables = jax.random.permutation(k4, num_blocks).astype(jnp.int32).reshape(
        batch, blocks_per_seq)
    seq_lens = jnp.full((batch,), seq_len, jnp.int32)

    @jax.jit
    def chain(query, key_cache, value_cache, block_tables, seq_lens):
        for _ in range(CHAIN):
            query = xla_ext_jax.paged_attention(query, key_cache, value_cache, block_tables,
                                                seq_lens, scale=HEAD_SIZE ** -0.5)
        return query

    seconds = median_seconds(chain, (query, key_cache, value_cache, block_tables, seq_lens), reps)
    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_SIZE * 2
    gbps = kv_bytes / seconds / 1e9
    return {"op": "paged_attention", "shape": f"B={batch},L={seq_len},block={BLOCK_SIZE}",
            "impl": "xla_ext", "time_us": round(seconds * 1e6, 1), "gbps": round(gbps, 1),
            "pct_of_copy": round(100 * gbps / copy, 1)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    copy = copy_gbps(args.reps)
    rows = [paged_attention_row(b, l, args.reps, copy) for b, l in SHAPES]
    print(json.dumps({"device": str(jax.devices()[0].device_kind), "copy_gbps": round(copy, 1),
                      "chain": CHAIN, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
