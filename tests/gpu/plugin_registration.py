"""On the GPU machine: registers our CUDA handlers into JAX's own CUDA PJRT plugin through
the plugin's FFI extension (torch_xla_ext.binders.pjrt_plugin, not jax.ffi), then runs them
with jax.ffi.ffi_call and checks the results. Prints a report; exits 1 on any mismatch.

    python3 tests/gpu/plugin_registration.py
"""

import glob
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_plugins
from torch_xla_ext import _kernels, binders, op_catalog, workspace
from torch_xla_ext.binders.pjrt_plugin import PjrtPluginRuntime


def main():
    print("devices:", jax.devices())  # starts the CUDA backend: the plugin is loaded now
    candidates = [p for d in jax_plugins.__path__ for p in glob.glob(os.path.join(d, "*", "*.so"))
                  if "cuda" in os.path.basename(p)]
    print("plugin:", candidates)
    binders.add_library(_kernels.builtin_library())
    runtime = binders.add_runtime(PjrtPluginRuntime("jax_cuda_plugin", candidates[0]))
    print("runtime:", runtime.describe())
    for row in binders.registrations():
        print("registered:", row)
    assert not any("jax" == name for row in binders.registrations() for name in row["registered_in"])

    ok = True
    a = jnp.arange(1024 * 1024, dtype=jnp.float32)
    b = jnp.full_like(a, 0.5)
    out = jax.jit(lambda a, b: jax.ffi.ffi_call(
        "XlaGpuSimpleAdd", jax.ShapeDtypeStruct(a.shape, a.dtype))(a, b))(a, b)
    hlo = jax.jit(lambda a, b: jax.ffi.ffi_call(
        "XlaGpuSimpleAdd", jax.ShapeDtypeStruct(a.shape, a.dtype))(a, b)).lower(a, b).compile().as_text()
    print("compiled HLO custom call:", [l.strip()[:140] for l in hlo.splitlines() if "custom-call" in l])
    good = bool(jnp.array_equal(out, a + b))
    print("XlaGpuSimpleAdd on", out.devices(), "matches a + b:", good)
    ok &= good

    rng = np.random.default_rng(0)
    num_blocks, block_size, kv_heads, head, heads = 8, 16, 2, 64, 8
    key_cache = rng.standard_normal((num_blocks, block_size, kv_heads, head), np.float32)
    value_cache = rng.standard_normal((num_blocks, block_size, kv_heads, head), np.float32)
    query = rng.standard_normal((2, heads, head), np.float32)
    block_tables = np.array([[3, 1, 0], [5, 2, 7]], np.int32)
    seq_lens = np.array([20, 40], np.int32)
    # Its scratch is a last result the front ends size and drop (torch_xla_ext/workspace.py).
    operands = (query, key_cache, value_cache, block_tables, seq_lens, np.zeros((0,), np.float32))
    op = op_catalog.PAGED_ATTENTION
    workspace_bytes = workspace.workspace_bytes(op, dict(zip(op.operands, operands)), {},
                                                workspace.ANY_GPU)
    out, _ = jax.ffi.ffi_call("xla_ext.paged_attention",
                              (jax.ShapeDtypeStruct(query.shape, query.dtype),
                               jax.ShapeDtypeStruct((workspace_bytes,), np.uint8)))(
        *operands, scale=np.float32(0.125), softcap=np.float32(0.0))
    want = np.zeros_like(query)
    for s in range(2):
        rows = np.concatenate([np.arange(b * block_size, (b + 1) * block_size)
                               for b in block_tables[s]])[: seq_lens[s]]
        k = key_cache.reshape(-1, kv_heads, head)[rows]
        v = value_cache.reshape(-1, kv_heads, head)[rows]
        for h in range(heads):
            logits = k[:, h // (heads // kv_heads)] @ query[s, h] * 0.125
            p = np.exp(logits - logits.max())
            want[s, h] = (p / p.sum()) @ v[:, h // (heads // kv_heads)]
    err = float(np.abs(np.asarray(out) - want).max())
    print("xla_ext.paged_attention max |error| vs NumPy:", err)
    ok &= err < 1e-4
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
