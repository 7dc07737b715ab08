"""What a jitted JAX call whose custom call fails leaves behind (the torch_xla side is
tests/torch_xla/failure_matrix_test.py): the bad values computed inside the jit, so only the
handler sees them, the cache donated to it, as a serving step donates it. On XLA's CPU client
the call runs, and fails, before it returns: it raises naming the argument; the donated cache
is deleted, as JAX deletes every donated array at the call, and reading it or passing it to the
next jit raises JAX's "Array has been deleted" (never a crash or old or wrong values); the next
call runs. All cases run in one process of their own, printing a line per step, so that a
crash fails the test and names the case it reached."""

import os
import subprocess
import sys
import textwrap

_CASES = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np, torch
    from torch_xla_ext import jax_ops as ops, sample_inputs

    jax.config.update("jax_enable_x64", True)  # reshape_and_cache's slots are int64, as vLLM's

    def j(t):
        return jnp.asarray(t.numpy())

    rows = jnp.asarray(np.random.randn(2, 2, 64).astype(np.float32))
    ragged = {k: j(v) for k, v in sample_inputs.ragged_paged_attention(
        **sample_inputs.MIXED_BATCH, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
        dtype=torch.float32).items()}
    pages = np.asarray(ragged["page_indices"])

    def attend(c, page_indices):
        return ops.ragged_paged_attention(ragged["q"], c, ragged["kv_lens"], page_indices,
                                          ragged["cu_q_lens"], ragged["num_seqs"], sm_scale=0.125)

    def kv_update(c, bad):
        return ops.kv_cache_update(rows, rows, c, jnp.asarray([1, 0], jnp.int32) + bad)

    def reshape_and_cache(c, bad):
        caches = ops.reshape_and_cache(rows, rows, c, c + 1, jnp.asarray([1, 0]) + bad)
        return caches[0]

    def step(c, bad):  # the K/V write, then attention over the cache with a page id past it
        c = ops.kv_cache_update(ragged["q"][:2, :2], ragged["q"][:2, :2], c,
                                jnp.asarray([0, 1], jnp.int32))
        return c, attend(c, jnp.asarray(pages).at[1, 0].add(bad))

    CASES = {  # name: (the jitted call of (cache, bad), the cache, the bad value, what it names)
        "kv_cache_update, a slot past the cache":
            (kv_update, jnp.asarray(np.random.randn(4, 16, 4, 64).astype(np.float32)), 99,
             "slot_mapping"),
        "reshape_and_cache, a slot past the cache":
            (reshape_and_cache, jnp.asarray(np.random.randn(4, 16, 2, 64).astype(np.float32)), 64,
             "slot_mapping"),
        "a step: the K/V write, then attention with a page id past the cache":
            (step, ragged["kv_pages"], 999, "page_indices"),
    }

    for name, (call, cache, bad, argument) in CASES.items():
        before = np.asarray(cache).copy()
        run = jax.jit(call, donate_argnums=0)
        try:
            jax.block_until_ready(run(cache, bad))
            print(f"{name} | call: no error", flush=True)
        except Exception as e:
            named = f"argument '{argument}'" in str(e)
            print(f"{name} | call: {type(e).__name__} naming {argument}: {named}", flush=True)
        for use, read in (("cache read", lambda: np.asarray(cache)),
                          ("cache in a new jit", lambda: jax.jit(lambda c: c * 2)(cache))):
            try:
                read()
                print(f"{name} | {use}: no error", flush=True)
            except Exception as e:
                print(f"{name} | {use}: {type(e).__name__} {str(e).splitlines()[0]}", flush=True)
        print(f"{name} | next: {float(jnp.ones(3).sum())}", flush=True)
''')


def test_a_failed_jitted_call_raises_and_its_donated_cache_is_refused_by_jax():
    result = subprocess.run([sys.executable, "-c", _CASES], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    context = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, context
    lines = [line.split(" | ", 1)[1] for line in result.stdout.splitlines() if " | " in line]
    assert len(lines) == 3 * 4, context
    for line in lines:
        what, got = line.split(": ", 1)
        deleted = "RuntimeError Array has been deleted"
        want = {"call": "XlaRuntimeError naming", "cache read": deleted,
                "cache in a new jit": deleted, "next": "3.0"}[what]
        assert got.startswith(want) and not got.endswith("False"), (line, context)
