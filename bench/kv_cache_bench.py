"""KV-cache write step time against cache size: does a step cost O(new tokens), not O(cache)?

    python bench/kv_cache_bench.py --frontends torch_xla --out bench/results/cpu-kv-cache.json
    python bench/kv_cache_bench.py --frontends jax,torchax --out bench/results/h100-kv-cache.json

A step writes NEW_TOKENS tokens' K/V rows (bf16, 8 kv heads, head size 128, page size 16) into
one combined cache (`kv_pages` layout) with xla_ext.kv_cache_update, as its own executable:
  torch_xla  torch.ops.xla_ext.kv_cache_update on XLA tensors, then torch_xla.sync() (lazy
             tensors; the step's graph donates the cache);
  jax        torch_xla_ext.jax_ops.kv_cache_update under jax.jit with the cache donated;
  torchax    torch.ops.xla_ext.kv_cache_update under torchax.interop.jax_jit, cache donated.
Each row: wall time per step over REPS steps run back to back (inputs already on the device;
one wait at the end), after WARMUP steps. Flat across sizes means the cache is updated in
place; a copy would add cache_bytes / copy bandwidth per step: on a GPU, the copy bandwidth
is measured in the same run and each row gives that cost ("cache_copy_us") beside the step.
"""

import argparse
import json
import os
import platform
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

NEW_TOKENS, KV_HEADS, HEAD_SIZE, PAGE_SIZE = 32, 8, 128, 16
SLOT_BYTES = 2 * KV_HEADS * HEAD_SIZE * 2  # K and V rows of one token, bf16
REPS, WARMUP = 30, 5


def _pages(mib):
    return max(1, (mib << 20) // (PAGE_SIZE * SLOT_BYTES))


def _step_inputs(num_pages, step):
    gen = torch.Generator().manual_seed(step)
    key = torch.randn(NEW_TOKENS, KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)
    value = torch.randn(NEW_TOKENS, KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_pages * PAGE_SIZE, generator=gen)[:NEW_TOKENS].int()
    return key, value, slots


def _step_seconds(step_inputs, run_step, wait):
    """Seconds per step: REPS steps back to back (each its own executable, as a serving loop
    runs them), then one wait; after WARMUP steps likewise. `step_inputs` are on the device
    already, so what is timed is dispatch and the device's work."""
    for inputs in step_inputs[:WARMUP]:
        run_step(*inputs)
    wait()
    start = time.perf_counter()
    for inputs in step_inputs[WARMUP:]:
        run_step(*inputs)
    wait()
    return (time.perf_counter() - start) / REPS


def _all_step_inputs(num_pages):
    return [_step_inputs(num_pages, step) for step in range(WARMUP + REPS)]


def torch_xla_step_seconds(num_pages):
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_ext  # noqa: F401

    device = torch_xla.device()
    cache = torch.zeros(num_pages, PAGE_SIZE, 2 * KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16,
                        device=device)
    host_inputs = _all_step_inputs(num_pages)
    step_inputs = [[t.to(device) for t in inputs] for inputs in host_inputs]
    torch_xla.sync()
    xm.wait_device_ops()

    def run_step(key, value, slots):
        torch.ops.xla_ext.kv_cache_update(key, value, cache, slots)
        torch_xla.sync()

    seconds = _step_seconds(step_inputs, run_step, xm.wait_device_ops)
    _check_last_step(cache.cpu(), *host_inputs[-1])
    return seconds


def jax_step_seconds(num_pages):
    import jax
    import jax.numpy as jnp

    from torch_xla_ext import jax_ops

    step_fn = jax.jit(jax_ops.kv_cache_update, donate_argnums=(2,))
    host_inputs = _all_step_inputs(num_pages)
    step_inputs = [[_to_jax(t) for t in inputs] for inputs in host_inputs]
    state = {"cache": jnp.zeros((num_pages, PAGE_SIZE, 2 * KV_HEADS, HEAD_SIZE), jnp.bfloat16)}

    def run_step(key, value, slots):
        state["cache"] = step_fn(key, value, state["cache"], slots)

    seconds = _step_seconds(step_inputs, run_step, lambda: state["cache"].block_until_ready())
    got = torch.from_numpy(np.asarray(state["cache"]).view(np.int16).copy()).view(torch.bfloat16)
    _check_last_step(got, *host_inputs[-1])
    return seconds


def torchax_step_seconds(num_pages):
    import jax

    import torch_xla_ext.torchax_ops  # noqa: F401  (before the environment exists)
    import torchax
    import torchax.interop

    env = torchax.default_env()

    def write(key, value, cache, slots):
        torch.ops.xla_ext.kv_cache_update(key, value, cache, slots)
        return cache

    step_fn = torchax.interop.jax_jit(write, kwargs_for_jax_jit={"donate_argnums": (2,)})
    host_inputs = _all_step_inputs(num_pages)  # outside the environment: torch's generator
    with env:
        step_inputs = [[t.to("jax") for t in inputs] for inputs in host_inputs]
        state = {"cache": torch.zeros(num_pages, PAGE_SIZE, 2 * KV_HEADS, HEAD_SIZE,
                                      dtype=torch.bfloat16, device="jax")}

        def run_step(key, value, slots):
            state["cache"] = step_fn(key, value, state["cache"], slots)

        seconds = _step_seconds(step_inputs, run_step,
                                lambda: jax.block_until_ready(state["cache"].jax()))
        got = np.asarray(state["cache"].jax())
    got = torch.from_numpy(got.view(np.int16).copy()).view(torch.bfloat16)
    _check_last_step(got, *host_inputs[-1])
    return seconds


def _to_jax(t):
    import jax

    array = t.view(torch.int16).numpy().view("bfloat16") if t.dtype == torch.bfloat16 \
        else t.numpy()
    return jax.device_put(array)


def _check_last_step(cache, key, value, slots):
    """The last step's rows are in the cache: the timed steps did write."""
    rows = cache.reshape(-1, 2 * KV_HEADS, HEAD_SIZE)[slots.long()]
    assert torch.equal(rows[:, 0::2], key) and torch.equal(rows[:, 1::2], value), \
        "the last step's K/V rows are not in the cache"


FRONTENDS = {"torch_xla": torch_xla_step_seconds, "jax": jax_step_seconds,
             "torchax": torchax_step_seconds}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--frontends", default="torch_xla")
    parser.add_argument("--sizes-mib", default="4,64,512,2048")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from gpu_trace import copy_gbps

    copy = copy_gbps()
    if copy:
        print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    for frontend in args.frontends.split(","):
        for mib in map(int, args.sizes_mib.split(",")):
            num_pages = _pages(mib)
            seconds = FRONTENDS[frontend](num_pages)
            cache_mib = num_pages * PAGE_SIZE * SLOT_BYTES / 2**20
            rows.append({"op": "kv_cache_update_step", "impl": frontend,
                         "shape": f"cache={cache_mib:.0f}MiB,tokens={NEW_TOKENS}",
                         "cache_bytes": num_pages * PAGE_SIZE * SLOT_BYTES,
                         "time_us": round(seconds * 1e6, 1)})
            # What copying the cache once (read + write) would add to a step.
            copy_note = ""
            if copy:
                rows[-1]["cache_copy_us"] = round(2 * rows[-1]["cache_bytes"] / copy / 1e3, 1)
                copy_note = f" (a copy of the cache: {rows[-1]['cache_copy_us']:.1f} us)"
            print(f"{frontend:10} cache {cache_mib:7.0f} MiB: {seconds * 1e6:10.1f} us per step"
                  + copy_note, flush=True)
        times = [r["time_us"] for r in rows if r["impl"] == frontend]
        print(f"{frontend:10} largest / smallest cache: {times[-1] / times[0]:.2f}")
    with open(args.out, "w") as f:
        json.dump({"machine": platform.node(), "new_tokens": NEW_TOKENS, "copy_gbps":
                   round(copy, 1) if copy else None, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
