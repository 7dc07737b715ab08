"""Binders push every loaded kernel library into every XLA runtime of the process.

A runtime is an object with `name`, `describe()` (a dict for doctor) and
`bind(library) -> [(target, platform), ...]`. Libraries and runtimes can arrive in any order
(a user's library after torch_xla, JAX imported last); each pair is bound exactly once.
"""

import threading

_lock = threading.RLock()
_libraries = []
_runtimes = {}
_bound_pairs = set()  # (runtime name, library path)
_registered = {}  # (target, platform) -> [runtime names]


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


def add_runtime(runtime):
    """Binds every known library into `runtime` (once per runtime name)."""
    with _lock:
        runtime = _runtimes.setdefault(runtime.name, runtime)
        for library in _libraries:
            _bind(runtime, library)
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
        return rows


def registered_targets(runtime_name):
    with _lock:
        return {t for (t, _), where in _registered.items() if runtime_name in where}
