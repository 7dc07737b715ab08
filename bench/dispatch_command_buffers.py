"""Per-op cost of XlaGpuSimpleAdd against XLA's add at 4 KiB inside a compiled graph, with and
without XLA's command buffers (CUDA graphs), to show where the custom call's extra cost lies.

    python bench/dispatch_command_buffers.py      # one line per XLA_FLAGS setting

Each setting runs in a child process (XLA reads XLA_FLAGS once). Per call: (median time of a
1000-call chain - median of a 500-call chain) / 500, bench/decode_bench.py's dispatch row.
Run from the repository root with it on PYTHONPATH (tools/device/run.sh does: its `bench` phase
keeps the lines in bench/results/h100-dispatch-command-buffers.txt).
"""

import os
import subprocess
import sys

SETTINGS = [
    "",  # XLA's defaults: command buffers on
    "--xla_gpu_enable_command_buffer=",  # off: every op a separate launch from the host
    # On, but XLA's kernel nodes without programmatic (PDL) edges between them; our custom
    # call is a captured child graph either way.
    "--xla_gpu_enable_pdl=false",
]
REPS = 30


def measure():
    import jax.numpy as jnp

    from bench.decode_bench import dispatch_operands, dispatch_seconds
    from torch_xla_ext import jax_ops as xla_ext_jax

    operands = dispatch_operands()
    us = {impl: round(1e6 * dispatch_seconds(add, operands, REPS), 3)
          for impl, add in (("xla_ext", xla_ext_jax.simple_add), ("xla_native", jnp.add))}
    flags = os.environ.get("XLA_FLAGS") or "(defaults)"
    print(f"XLA_FLAGS={flags}: us per call {us}, ours / native "
          f"{us['xla_ext'] / us['xla_native']:.2f}", flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        measure()
        return
    for flags in SETTINGS:
        env = dict(os.environ, XLA_FLAGS=flags)
        subprocess.run([sys.executable, __file__, "--measure"], env=env, check=True)


if __name__ == "__main__":
    main()
