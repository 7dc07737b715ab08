"""A failed torch_xla execution raises its error once, and never again at a later, unrelated
call.

Why torch_xla 2.9 raises it again. A graph runs on torch_xla's thread pool holding the device
lock (torch::lazy's DeviceLocker) until it has run. When it fails, the error goes two ways: to
the caller waiting for that graph (a read of its results: `.cpu()`, `.item()`, printing;
`torch_xla.sync(wait=True)`), and, as a copy, into the device lock, which raises it and drops it
at the next call that takes the lock. The copy is meant for a graph nobody waits for (launched
by `torch_xla.sync()`, which returns at once), but xla_graph_executor.cpp waits through
`async->mwait.Wait()` directly, not through `LazyGraphExecutor::Async::Wait()`, which drops the
copy of an error it has seen. So after a failed read, the next read or step, however unrelated,
raises the same error again. And when that next call is a `torch_xla.sync()`, it has already
detached its own tensors from their graphs when the lock raises: they are lost too.

What `import torch_xla_ext` installs (install_failure_hooks), so that neither happens:
- Reads: torch_xla's XLA kernels of `_to_copy` to the CPU (`.cpu()`, `.to("cpu")`, printing,
  `.tolist()`) and of `_to_cpu` (`.item()` and every op that falls back to the CPU), and
  `_XLAC._xla_get_cpu_tensors`: when one raises, the device lock is taken once more, which
  drops the copy of that error.
- Launches: `_XLAC._xla_step_marker` (`torch_xla.sync()`, `xm.mark_step()`) and
  `_XLAC._xla_sync_multi` (`xm.unlazy`, the dynamo bridge) take the device lock first, before
  they touch a tensor: the failure of a graph launched earlier that nobody waited for is raised
  there, once, and the call's own tensors stay as they were (calling it again launches them).
  When the call itself raises, the copy is dropped as for a read.
So a graph launched by `torch_xla.sync()`, which fails after that call has returned, raises at
the next call that waits for the device, whatever it reads, and only there. Not hooked: reads
inside torch_xla's C++ that do not go through those kernels (`torch.equal`, a CPU tensor's
`copy_` from an XLA one). A tensor left pending on a graph that failed (a read that computes a
value from it, like `.item()`, leaves it pending, as torch_xla does) fails again in any later
sync that includes it: let it go.

A tensor whose buffer the failed graph was to produce, or was to update in place (a donated
cache), holds no buffer afterwards, and torch_xla aborts the process when it is read
("PjRt buffer is null") or crashes when a later graph takes it as an input. Once a failure has
been raised in the process, the read hooks and `_xla_sync_multi` first look at the buffers the
read or graph would use (`_refuse_lost_buffers`), and one that holds none raises
TorchXlaExtError naming the failure that lost it. A step marker (`torch_xla.sync()`,
`xm.mark_step()`) runs every live tensor's pending graph: after a failure that left tensors
without a value (found among those Python holds when it is raised), it first looks at the
pending tensors Python holds the same way, until none takes a lost buffer and no lost tensor
lives. That look walks the Python heap (about 0.2 s in a process that imported transformers),
at each step marker while a lost tensor lives: let lost tensors go, or make them again. Not
covered: a pending graph only torch_xla's C++ holds.

A failure of one of our ops' calls goes another way, so that the caches it updates in place
are not lost with the graph. The call asks its handler to defer a failure
(kernels/registry/registry.h): the handler leaves those caches as they were, its other results
are garbage, the graph runs to its end, and the calls of our ops after it write nothing until
the failure is taken. The next hooked call that waits for the device takes it (and
`step.sync()`, after its wait): it makes every tensor Python holds that the failed graph may
have computed hold no value, then raises TorchXlaExtError with the handler's message. Those
tensors are the ones torch_xla numbered from the first result of our ops in a graph not yet
known to have run well (every value computed since, and every tensor traced since: a tensor
id rises with each new value, under torch_xla's functionalization (its default) an in-place
update's too), less the caches' new values
(note_deferring_call). The caches keep their values from before the failed call and stay
usable; what was computed before our first call keeps its value. Writes by our calls that ran
before the failed one in the same graph stay. Under torch.compile (`_run_cached_graph`) the
graph's results, and so the inputs it updates in place, hold no value after the failure.
"""

import contextlib
import functools
import gc
import warnings
import weakref

import torch

from torch_xla_ext.errors import TorchXlaExtError

# How the error of a step that failed on the device begins (both serving backends).
STEP_FAILED = "the XLA step failed: "

_library = None  # our XLA kernels of _to_copy and _to_cpu are registered while this lives
_torch_xla_sync_multi = None  # torch_xla's own _xla_sync_multi: takes the lock, unwrapped
_sync_multi = None  # and wrapped by _launch_reporting_once
_get_cpu_tensors = None  # torch_xla's _xla_get_cpu_tensors, wrapped by _read_reporting_once
_lock_anchors = {}  # XLA device -> a scalar held as device data on it
_last_failure = None  # the message of the last failure raised, once there was one
# The tensors failed graphs left without a value, while they live, by id (a tensor's == is
# elementwise, which a WeakSet would call).
_lost = weakref.WeakValueDictionary()
_check_pending = False  # step markers look at pending graphs (after a failure that lost tensors)
# Where a deferred failure's graph may have begun (see the docstring): the tensor id of the
# first value our ops computed in graphs launched by step markers or torch.compile and not yet
# known to have run well, and in the graph traced since the last step marker (which reads may
# run in part); and the ids of the values our ops wrote in place meanwhile (the caches').
_first_unchecked = None
_first_open = None
_in_place = set()
_open_results = []  # weak references to our ops' results in the graph traced since then


def _xla_device(values):
    """The device of the first XLA tensor among `values` (tensors or lists of them), or None."""
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor) and item.device.type == "xla":
                return item.device
    return None


def _default_device():
    import torch_xla

    return torch.device(torch_xla._XLAC._xla_get_default_device())


def _take_device_lock(device):
    """Takes and releases `device`'s lock, launching nothing; returns the failure torch_xla
    had stored there (now dropped), or None."""
    anchor = _lock_anchors.get(device)
    if anchor is None:
        anchor = _lock_anchors[device] = torch.zeros(()).to(device)
    try:
        # A tensor with data and no graph: syncing it only uploads it (once) and takes the lock.
        _torch_xla_sync_multi([anchor], [], wait=False, sync_xla_data=False)
    except RuntimeError as stored:
        return stored
    return None


def _xla_tensors():
    """The XLA tensors Python holds (the garbage collector's view: slow, for after a failure)."""
    return [obj for obj in gc.get_objects() if _is_xla_tensor(obj)]


def _is_xla_tensor(obj):
    if not issubclass(type(obj), torch.Tensor):  # type(): an object's own __class__ may warn
        return False
    try:
        return obj.device.type == "xla"
    except Exception:  # a tensor subclass whose device cannot be told is not ours to check
        return False


def _holds_no_value(tensor):
    """Whether `tensor` is data whose buffer is gone (not a pending graph, which has none yet)."""
    import torch_xla

    info = torch_xla._XLAC._get_xla_tensor_debug_info(tensor)
    return "Data Handle: None" in info and "XLAData: None" not in info


def _refuse_pending_over_lost(args, kwargs):
    """A step marker's check (it runs every live tensor's pending graph, and torch_xla crashes
    the process on one that takes a buffer a failed graph lost): after a failure that lost
    tensors, raises if a pending tensor Python holds takes one. Once none does and no lost
    tensor lives, step markers stop looking. Returns no tensors for the launch to check."""
    global _check_pending
    if not _check_pending:
        return []
    if _take_lost_buffers(_pending_tensors()):
        gc.collect()  # what the garbage collector holds may be garbage: a failed call's frames
        _refuse_lost_buffers(_pending_tensors())
    _check_pending = bool(_lost)
    return []


def _pending_tensors():
    import torch_xla

    tensors = _xla_tensors()
    needs = torch_xla._XLAC._check_tensor_need_materialization(tensors) if tensors else []
    return [t for t, pending in zip(tensors, needs) if pending]


def _take_lost_buffers(tensors):
    """Whether a graph computing `tensors` (or reading them) would take a buffer that a failed
    graph left empty."""
    import torch_xla

    tensors = [t for t in tensors if _is_xla_tensor(t)]
    if not tensors:
        return False
    _, inputs = torch_xla._XLAC._get_tensors_xla_device_data_node(tensors)
    return any(_holds_no_value(t) for t in inputs)


def _refuse_lost_buffers(tensors):
    """After a failure: raises if a graph computing `tensors` (or reading them) would use a
    buffer that a failed graph left empty, dropping the copy of a failure the device lock may
    hold (as a read that raises does)."""
    if _last_failure is None or not _take_lost_buffers(tensors):
        return
    error = TorchXlaExtError(
        "a tensor this needs holds no value: a graph that was to compute it, or update it "
        f"in place (a KV cache), failed ({_last_failure}). Make it again (copy a cache from "
        "its source) before using it, and let go of pending tensors computed from it.")
    _drop_stored_copy(error, _xla_device([tensors]))
    raise error


def _drop_stored_copy(error, device):
    """After `error` reached the caller, drops the copy of it that torch_xla keeps in the
    device lock, and returns what it took (None: nothing was stored). A different stored
    failure (of a graph nobody waited for) is not dropped silently: it goes with `error` as a
    note."""
    stored = _take_device_lock(device)
    if stored is not None and str(stored) != str(error):
        error.add_note(f"A graph launched earlier on {device} failed too: {stored}")
    return stored


def _remember(error, lost=None):
    """Keeps the failure's message, and which tensors it left without a value (`lost`, or
    those Python holds that hold none)."""
    global _last_failure, _check_pending
    _last_failure = str(error).splitlines()[0] if str(error) else type(error).__name__
    if lost is None:
        lost = [t for t in _xla_tensors() if _holds_no_value(t)]
    _lost.update((id(t), t) for t in lost)
    _check_pending = _check_pending or bool(_lost)


def note_deferring_call(results, in_place):
    """op_custom_call's note of a call that asks its handler to defer a failure: its results
    (XLA tensors, in order) and the indices of those written in place."""
    global _first_open
    import torch_xla

    tensor_id = torch_xla._XLAC._xla_get_tensor_id
    if _first_open is None:
        _first_open = tensor_id(results[0])
    _in_place.update(tensor_id(results[i]) for i in in_place)
    _open_results.extend(weakref.ref(r) for r in results)


def _open_results_pending():
    """Whether a result of our ops in the graph traced since the last step marker still
    waits to be computed (torch.compile's trace of a graph leaves none behind)."""
    import torch_xla

    alive = [r for r in (ref() for ref in _open_results) if r is not None]
    return bool(alive) and any(torch_xla._XLAC._check_tensor_need_materialization(alive))


def _take_deferred_failure():
    """(calls, the first one's message) that our kernel libraries' calls deferred, or None."""
    from torch_xla_ext import binders

    taken = [t for t in (library.take_deferred_failure() for library in binders.libraries()) if t]
    return (sum(calls for calls, _ in taken), taken[0][1]) if taken else None


def _raise_deferred_failure(waited_for):
    """After a wait for graphs on the device, raises the failure a call deferred, once the
    tensors its graph may have computed hold no value; else notes what ran well. waited_for:
    "earlier" (before a launch: every graph launched so far), "all" (after a launch that
    waited: those and its own) or "some" (a read: the graphs that computed what it read)."""
    global _first_unchecked, _first_open
    taken = _take_deferred_failure()
    if taken is None:
        if waited_for != "some":
            _first_unchecked = None
        # Left open by a graph traced and never launched (torch.compile's trace of one).
        if waited_for != "earlier" and _first_open is not None and not _open_results_pending():
            _first_open = None
            _open_results.clear()
        if _first_open is None and _first_unchecked is None:
            _in_place.clear()
        return
    calls, message = taken
    starts = [s for s in (_first_unchecked, _first_open) if s is not None]
    dead = _make_dead(min(starts)) if starts else []
    _first_unchecked = _first_open = None
    _in_place.clear()
    _open_results.clear()
    later = f"; {calls - 1} later calls of the graph did not run" if calls > 1 else ""
    error = TorchXlaExtError(
        f"{message} (a custom call failed when its graph ran, and the graph ran on without it: "
        f"the tensors it computed hold no value, but for the caches our ops were to update in "
        f"place, which keep their values unless torch.compile's graph returned them{later})")
    _remember(error, dead)
    raise error


def _make_dead(first):
    """Makes every tensor Python holds that torch_xla numbered from `first` on hold no value
    (a placeholder's), except the caches our ops wrote in place and the lock anchors; returns
    them. Those are the values that a failed graph may have computed, and the tensors traced
    after it, which may take them."""
    import torch_xla
    from torch_xla.core import xla_builder

    tensor_id = torch_xla._XLAC._xla_get_tensor_id
    anchors = {id(a) for a in _lock_anchors.values()}
    dead = []
    for tensor in _xla_tensors():
        if id(tensor) in anchors:
            continue
        try:
            number = tensor_id(tensor)
        except RuntimeError:  # not torch_xla's (torch.compile's fake tensors): holds no data
            continue
        if number < first or number in _in_place or _holds_no_value(tensor):
            continue
        torch_xla._XLAC._replace_xla_tensor(
            tensor, xla_builder.create_placeholder_tensor(tensor.shape, tensor.dtype))
        dead.append(tensor)
    return dead


def _read_reporting_once(read):
    @functools.wraps(read)
    def call(*args, **kwargs):
        _refuse_lost_buffers(args[0] if args else [])
        try:
            values = read(*args, **kwargs)
        except RuntimeError as error:
            _remember(error)
            device = _xla_device(args)
            if device is not None:
                _drop_stored_copy(error, device)
            raise
        _raise_deferred_failure("some")  # values a failed graph computed: garbage
        return values
    return call


def _launch_reporting_once(launch, device_of, tensors_of, launches_all=False):
    """launches_all: the launch runs every pending graph (a step marker)."""
    @functools.wraps(launch)
    def call(*args, **kwargs):
        global _first_unchecked, _first_open
        device = device_of(args, kwargs)
        if device is None:
            return launch(*args, **kwargs)
        earlier = _take_device_lock(device)
        if earlier is not None:
            _remember(earlier)
            earlier.add_note(
                "The failure of a graph launched earlier without waiting for it "
                "(torch_xla.sync()), raised before this call ran anything: that graph's "
                "results hold no value; this call's own tensors are as they were.")
            raise earlier
        _raise_deferred_failure("earlier")
        _refuse_lost_buffers(tensors_of(args, kwargs))
        if launches_all and _first_open is not None:
            _first_unchecked = _first_open if _first_unchecked is None else _first_unchecked
            _first_open = None
            _open_results.clear()
        try:
            result = launch(*args, **kwargs)
        except RuntimeError as error:
            _remember(error)
            _drop_stored_copy(error, device)
            raise
        if kwargs.get("wait", args[2] if len(args) > 2 else True):
            _raise_deferred_failure("all")
        return result
    return call


def _cached_graph_noting(run):
    """torch_xla's _run_cached_graph (torch.compile's graphs), noting where its results begin
    (see _first_unchecked): a failure one of its calls deferred makes them hold no value."""
    @functools.wraps(run)
    def call(*args, **kwargs):
        global _first_unchecked
        results = run(*args, **kwargs)
        if results and _first_unchecked is None:
            import torch_xla

            _first_unchecked = torch_xla._XLAC._xla_get_tensor_id(results[0])
        return results
    return call


def _step_marker_device(args, kwargs):
    device = args[0] if args else kwargs.get("device", "")
    return torch.device(device) if device else _default_device()


def _sync_multi_tensors(args, kwargs):
    return args[0] if args else kwargs.get("tensors", [])


def _sync_multi_device(args, kwargs):
    return _xla_device([_sync_multi_tensors(args, kwargs)])


# The read kernels wait and transfer through _xla_sync_multi and _xla_get_cpu_tensors, which let
# go of the GIL meanwhile, as torch_xla's kernels do when torch calls them. A Python kernel holds
# the GIL, and torch_xla 2.9 returns from a failed transfer without taking back a GIL it let go.

def _to_copy_kernel(torch_xla_kernel):
    def to_copy(keyset, tensor, *, device=None, **options):
        if device is None or device.type != "cpu":  # a copy on the device: a graph, no read
            return torch_xla_kernel.call_boxed(keyset, tensor, device=device, **options)
        # As torch_xla's kernel: the tensor's pending graph runs and the tensor keeps its result.
        _sync_multi([tensor], [], wait=True, sync_xla_data=False)
        (host,) = _get_cpu_tensors([tensor])
        return torch.ops.aten._to_copy.default(host, device=device, **options)
    return to_copy


def _to_cpu_kernel(keyset, tensors):
    return _get_cpu_tensors(tensors)


def install_failure_hooks():
    """Wraps torch_xla's reads and launches as the module docstring says (once)."""
    global _library, _torch_xla_sync_multi, _sync_multi, _get_cpu_tensors
    if _library is not None:
        return
    from torch_xla import _XLAC

    _torch_xla_sync_multi = _XLAC._xla_sync_multi
    _sync_multi = _launch_reporting_once(_XLAC._xla_sync_multi, _sync_multi_device,
                                         _sync_multi_tensors)
    _get_cpu_tensors = _read_reporting_once(_XLAC._xla_get_cpu_tensors)
    _XLAC._xla_sync_multi = _sync_multi
    _XLAC._xla_get_cpu_tensors = _get_cpu_tensors
    _XLAC._xla_step_marker = _launch_reporting_once(_XLAC._xla_step_marker, _step_marker_device,
                                                    _refuse_pending_over_lost, launches_all=True)
    _XLAC._run_cached_graph = _cached_graph_noting(_XLAC._run_cached_graph)
    library = torch.library.Library("aten", "IMPL")
    to_copy = _to_copy_kernel(torch.library.get_kernel("aten::_to_copy", "XLA"))
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
        warnings.simplefilter("ignore", UserWarning)
        library.impl("_to_copy", to_copy, "XLA", with_keyset=True, allow_override=True)
        library.impl("_to_cpu", _to_cpu_kernel, "XLA", with_keyset=True, allow_override=True)
    _library = library


@contextlib.contextmanager
def failures_reported():
    """Runs torch_xla work (a sync that launches a step, a read of its results): a failed
    execution raises TorchXlaExtError and leaves no stale copy of its error behind, whatever
    inside the block waited for it."""
    try:
        yield
    except TorchXlaExtError as e:  # raised here with what it lost already noted
        raise TorchXlaExtError(f"{STEP_FAILED}{e}") from e
    except RuntimeError as e:
        _remember(e)
        _drop_stored_copy(e, _default_device())
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
        _raise_deferred_failure("all")
