"""Per-op cost at 4 KiB inside a compiled graph (bench/decode_bench.py's dispatch row: a chain of
500 adds, each behind a barrier, timed against a chain of 1000): XLA's add; XlaGpuSimpleAdd,
which XLA traces into a child graph; and the probe's copy of its kernel as a traced call and as
a Record-stage kernel node, with and without PDL, and with grids of 2-16 CTAs. See probe.cu.

    bench/record_probe/build.sh && python3 bench/record_probe/probe.py [--trace]

Run from the repository root with it on PYTHONPATH, on a GPU with JAX 0.11.2's CUDA plugin.
"""

import argparse
import ctypes
import json
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from bench.decode_bench import DISPATCH_CHAIN, add_chain, dispatch_operands, dispatch_seconds
from torch_xla_ext import jax_ops as xla_ext_jax

REPS = 30
ROUNDS = 3
LIBRARY = os.path.join(os.path.dirname(__file__), "..", "..", ".devbuild", "record_probe",
                       "libprobe.so")


def probe_add(target, uses_pdl, ctas=0):
    """ctas: 0 for XlaGpuSimpleAdd's grid, else that many CTAs."""
    def add(a, b):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(a.shape, a.dtype))(
            a, b, uses_pdl=uses_pdl, ctas=np.int32(ctas))
    return add


def trace(adds, a, b, length=20):
    """A CUPTI trace (torch.profiler) of a chain per add: each kernel's grid and block, its median
    duration and the median time from one kernel's start to the next one's."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for name, add in adds.items():
        run = add_chain(add)(length)
        jax.block_until_ready(run(a, b))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            jax.block_until_ready(run(a, b))
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            events = json.load(open(f.name))["traceEvents"]
        kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
        starts = [e["ts"] for e in kernels]
        print(f"trace {name}: {len(kernels)} kernels, e.g. {kernels[-1]['name'][:40]} grid "
              f"{kernels[-1]['args'].get('grid')} block {kernels[-1]['args'].get('block')}; "
              f"median duration {statistics.median(e['dur'] for e in kernels):.2f} us, start to "
              f"next start {statistics.median(y - x for x, y in zip(starts, starts[1:])):.2f} us")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", action="store_true", help="also a CUPTI trace per add")
    args = parser.parse_args()
    lib = ctypes.cdll.LoadLibrary(LIBRARY)
    lib.XlaExtProbeRegisterError.restype = ctypes.c_char_p
    for target, symbol in (("xla_ext_probe.bootstrap", lib.XlaExtProbeBootstrap),
                           ("xla_ext_probe.add_traced", lib.XlaExtProbeExecute)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="CUDA")
    jax.block_until_ready(jax.jit(lambda: jax.ffi.ffi_call(
        "xla_ext_probe.bootstrap", jax.ShapeDtypeStruct((1,), jnp.float32))())())
    if lib.XlaExtProbeRegistered() != 2:
        raise SystemExit("registering the record handler failed: " +
                         lib.XlaExtProbeRegisterError().decode())

    adds = {
        "xla_native": jnp.add,
        "xla_ext": xla_ext_jax.simple_add,
        "probe_traced": probe_add("xla_ext_probe.add_traced", True),
        "probe_record_pdl": probe_add("xla_ext_probe.add_record", True),
        "probe_record_no_pdl": probe_add("xla_ext_probe.add_record", False),
        **{f"probe_record_pdl_{ctas}_ctas": probe_add("xla_ext_probe.add_record", True, ctas)
           for ctas in (2, 4, 8, 16)},
    }
    a, b = dispatch_operands()
    want = np.asarray(add_chain(jnp.add)(DISPATCH_CHAIN)(a, b))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for round_index in range(ROUNDS):
        us = {}
        for name, add in adds.items():
            got = np.asarray(add_chain(add)(DISPATCH_CHAIN)(a, b))
            if not np.array_equal(got, want):
                raise SystemExit(f"{name}: chain result {got[:4]} differs from XLA's {want[:4]}")
            us[name] = 1e6 * dispatch_seconds(add, (a, b), REPS)
        print(f"round {round_index}: us per op " +
              ", ".join(f"{name} {value:.3f}" for name, value in us.items()) +
              f"; record_pdl / native {us['probe_record_pdl'] / us['xla_native']:.2f}", flush=True)
    if args.trace:
        trace(adds, a, b)
    print(f"probe handler: {lib.XlaExtProbeCount(0)} Execute calls, {lib.XlaExtProbeCount(1)} "
          f"kernel nodes created, {lib.XlaExtProbeCount(2)} updated")


if __name__ == "__main__":
    main()
