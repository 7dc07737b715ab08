"""The workspace result of an op whose CUDA handler takes its scratch from one (OpDef.workspace).

It is a uint8 vector that the front ends add to the custom call's results and drop from what
they return. XLA allocates it with the call's other buffers, so XLA may record the call into a
command buffer (a CUDA graph) and replay it; scratch allocated at every call could not be
replayed. Its size is the handler's own planning for the call's shapes on the GPU, asked of the
kernel library through its one generic query (xla_ext_workspace_bytes: the call's operands'
dtypes and dims and its attributes); off the GPU it is empty (the Host handlers need none).
"""

import functools

from torch_xla_ext import _kernels, dtypes

ANY_GPU = -1  # size for whichever visible GPU needs the most


def xla_device_gpu():
    """The `gpu` of workspace functions for torch_xla's device: ANY_GPU on a GPU, else None."""
    import torch_xla.runtime

    return ANY_GPU if torch_xla.runtime.device_type() in ("GPU", "CUDA") else None


def workspace_bytes(op, args, attributes, gpu):
    """Bytes of workspace op's CUDA handler needs for the call (`args` by name, `attributes`
    {name: NumPy scalar}) on CUDA device `gpu`: 0 for a call its checks reject, which takes
    none."""
    operands = []
    for name in op.operands:
        x = args[name]
        shape, dtype = op.absent[name] if x is None else (x.shape, x.dtype)
        entry = dtypes.lookup(dtype)
        if entry is None:  # a dtype no handler takes: the checks reject the call
            return 0
        operands.append((entry.ffi_id, tuple(int(d) for d in shape)))
    return _bytes(op.target, gpu, tuple(operands),
                  tuple(sorted((name, dtypes.lookup(value.dtype).ffi_id, float(value))
                               for name, value in attributes.items())))


@functools.lru_cache(maxsize=1024)
def _bytes(target, gpu, operands, attributes):
    return _kernels.builtin_library().workspace_bytes(target, gpu, operands, attributes)
