"""Running a torch_xla step so that one failed step does not fail the next one.

torch_xla 2.9 reports a failed execution twice: at the sync that ran it, and once more, as a
copy it keeps in the device lock (DeviceLocker::exptr_), at the next call that takes that lock,
usually the next, unrelated step (xla_graph_executor.cpp waits on `async->mwait` directly, not
through LazyGraphExecutor::Async::Wait(), which would drop the copy). Waiting for the device
right after the failure raises that copy and drops it.
"""

import contextlib

from torch_xla_ext.errors import TorchXlaExtError

# How the error of a step that failed on the device begins (both serving backends).
STEP_FAILED = "the XLA step failed: "


@contextlib.contextmanager
def failures_reported():
    """Runs torch_xla work (a sync that launches a step, a read of its results): a failed
    execution raises TorchXlaExtError and leaves no stale copy of its error behind."""
    import torch_xla.core.xla_model as xm

    try:
        yield
    except RuntimeError as e:
        try:
            xm.wait_device_ops()  # raises torch_xla's stored copy of the error once, then drops it
        except RuntimeError:
            pass
        raise TorchXlaExtError(f"{STEP_FAILED}{e}") from e


def sync():
    """torch_xla.sync() and wait for the step. On failure, raises TorchXlaExtError and leaves
    no stale error behind, so the next valid step runs. Tensors the failed step was to compute
    or update (a cache written in place) hold no value afterwards; the ops check the data they
    can see on the host before the step (see ops.py) so that a bad request rarely gets here."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    with failures_reported():
        torch_xla.sync()
        xm.wait_device_ops()
