"""Binders push every loaded kernel library, and every single target a user registered
(custom_call_targets.py), into every XLA runtime of the process.

A runtime is an object with `name`, `describe()` (a dict for doctor) and
`bind(library) -> [(target, platform), ...]`. A runtime that runs torch_xla's graphs also has
`platform` ("Host" or "CUDA"), `register_target(target)` and `has_legacy_target(name)`.
Libraries, targets and runtimes can arrive in any order (a user's library after torch_xla, JAX
imported last, a CUDA target before the GPU client starts); each pair is bound exactly once.
"""

import threading

# The two kinds of function a user's target can be; XLA keeps each in its own registry.
LEGACY = "legacy custom-call function (api_version 1, 2 or 3)"
TYPED_FFI = "typed FFI handler (XLA_FFI_Handler*, api_version 4)"

_lock = threading.RLock()
_libraries = []
_runtimes = {}
_bound_pairs = set()  # (runtime name, library path)
_registered = {}  # (target, platform) -> [runtime names]
_targets = []  # users' single targets whose kind is known (custom_call_targets.Target)
_bound_targets = set()  # (runtime name, target name, platform)


def _bind(runtime, library):
    key = (runtime.name, library.path)
    if key in _bound_pairs:
        return
    for target, platform in runtime.bind(library):
        where = _registered.setdefault((target, platform), [])
        if runtime.name not in where:
            where.append(runtime.name)
    _bound_pairs.add(key)


def add_library(library):
    """Binds `library` into every runtime known now and remembers it for later ones."""
    with _lock:
        if all(lib.path != library.path for lib in _libraries):
            _libraries.append(library)
        for runtime in list(_runtimes.values()):
            _bind(runtime, library)
        return library


def _bind_target(runtime, target):
    key = (runtime.name, target.name, target.platform)
    if key in _bound_targets or getattr(runtime, "platform", None) != target.platform or \
            not hasattr(runtime, "register_target"):
        return
    runtime.register_target(target)
    _bound_targets.add(key)


def add_target(target):
    """Registers a user's target (its kind known) into the torch_xla runtime of its platform,
    now or when that runtime appears. A runtime's refusal raises and records nothing."""
    with _lock:
        for runtime in list(_runtimes.values()):
            _bind_target(runtime, target)
        if target not in _targets:
            _targets.append(target)


def has_target(name, platform, kind):
    """Whether a torch_xla runtime running `platform` has a function of `kind` (LEGACY or
    TYPED_FFI) under `name` that no user registered through custom_call_targets (whose own
    record its callers read first): a loaded library's typed handler, or a legacy function
    registered into the CPU's XLA by other code."""
    with _lock:
        runtimes = [r for r in _runtimes.values()
                    if getattr(r, "platform", None) == platform and hasattr(r, "register_target")]
        if kind == TYPED_FFI:
            where = _registered.get((name, platform), [])
            return any(r.name in where for r in runtimes)
        return any(r.has_legacy_target(name) for r in runtimes)


def add_runtime(runtime):
    """Binds every known library and user's target into `runtime` (once per runtime name)."""
    with _lock:
        runtime = _runtimes.setdefault(runtime.name, runtime)
        for library in _libraries:
            _bind(runtime, library)
        for target in _targets:
            _bind_target(runtime, target)
        return runtime


def runtimes():
    with _lock:
        return list(_runtimes.values())


def libraries():
    with _lock:
        return list(_libraries)


def registrations():
    """[{"target", "platform", "registered_in"}] for every kernel of every library."""
    with _lock:
        rows = []
        for library in _libraries:
            for kernel in library.kernels:
                rows.append({
                    "target": kernel.target,
                    "platform": kernel.platform,
                    "registered_in": list(_registered.get((kernel.target, kernel.platform), [])),
                })
        for target in _targets:
            rows.append({
                "target": target.name,
                "platform": target.platform,
                "registered_in": [name for name, t, p in _bound_targets
                                  if (t, p) == (target.name, target.platform)],
            })
        return rows


def registered_targets(runtime_name):
    with _lock:
        return {t for (t, _), where in _registered.items() if runtime_name in where}
