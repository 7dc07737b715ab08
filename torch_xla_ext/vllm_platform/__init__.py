"""vLLM on XLA devices other than TPUs: a vLLM platform plugin (entry point group
`vllm.platform_plugins`, name `xla`) that runs vLLM's own torch_xla path (the TPU worker, model
runner and Pallas attention backend) with torch_xla_ext's ops under it, on the device
PJRT_DEVICE names: the CPU, or an NVIDIA GPU through torch_xla_ext's CUDA PJRT plugin.

    pip install torch_xla_ext-*.whl vllm==0.13.0
    PJRT_DEVICE=CPU vllm serve <checkpoint> --dtype float32

vLLM asks every installed platform plugin whether it applies (`register()`); this one does
when PJRT_DEVICE is CPU or GPU, and nothing else is needed. What it changes of vLLM's TPU
platform, and why, is in xla_platform.py and worker.py.

vLLM starts its engine process by fork unless VLLM_WORKER_MULTIPROC_METHOD says otherwise.
A forked child of a process that already ran torch work cannot run: torch's OpenMP thread pool
and torch_xla's runtime (its PJRT client and thread pools) do not survive fork, and the child
hangs at its first parallel op, loading the weights. So where this platform applies, and the
variable is unset, vLLM spawns instead, as it does itself once CUDA is initialized; a script
then keeps its `LLM(...)` under `if __name__ == "__main__":`, as vLLM's docs ask for spawn.
"""

import os

# PJRT_DEVICE values torch_xla_ext serves (TPU is vLLM's own platform, or tpu_inference's).
DEVICES = ("CPU", "GPU")


def register():
    """vLLM's platform plugin entry point: the platform's class name where it applies."""
    if os.environ.get("PJRT_DEVICE", "").upper() not in DEVICES:
        return None
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return "torch_xla_ext.vllm_platform.xla_platform.XlaPlatform"
