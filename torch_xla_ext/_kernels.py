"""Loads a kernel library and reads its static handler table (kernels/registry/registry.h):
its handlers, and its ops' contracts (the values their sizes and dtypes may take, the shape
check a user's kernel declares, and the generic workspace query,
kernels/registry/kernel_table.h)."""

import ctypes
import dataclasses
import functools
import os
import threading

from torch_xla_ext.binders import TYPED_FFI
from torch_xla_ext.errors import TorchXlaExtError

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT_DIR = os.path.dirname(_PACKAGE_DIR)
_KERNELS_SO = "libxla_ext_kernels.so"


def _lib_dir():
    """Where the package's shared objects are: beside the package (a wheel, Bazel's runfiles,
    tools/device/build_kernels.sh) or, in a source checkout, in Bazel's output tree."""
    beside = os.path.join(_PACKAGE_DIR, "lib")
    bazel_bin = os.path.join(_CHECKOUT_DIR, "bazel-bin", "torch_xla_ext", "lib")
    if not os.path.exists(os.path.join(beside, _KERNELS_SO)) and \
            os.path.exists(os.path.join(_CHECKOUT_DIR, "WORKSPACE")) and \
            os.path.exists(os.path.join(bazel_bin, _KERNELS_SO)):
        return bazel_bin
    return beside


LIB_DIR = _lib_dir()
BUILTIN_LIBRARY = os.path.join(LIB_DIR, _KERNELS_SO)


def not_built_error(path):
    """The error for one of the package's shared objects (`path`) that is missing."""
    if os.path.exists(os.path.join(_CHECKOUT_DIR, "WORKSPACE")):
        how = ("This is a source checkout: build the libraries with `bazel build "
               "//torch_xla_ext/lib` (`./dev.sh demo` and `./dev.sh test` do), or with "
               "tools/device/build_kernels.sh on a machine without Bazel; or build and install "
               "the wheel: `bazel build //:wheel && pip install bazel-bin/torch_xla_ext-*.whl`.")
    else:
        how = ("The installation is incomplete: reinstall the torch_xla_ext wheel "
               "(`pip install --force-reinstall torch_xla_ext-*.whl`).")
    return TorchXlaExtError(f"torch_xla_ext's library {path} does not exist. "
                            + how)


@dataclasses.dataclass(frozen=True)
class Kernel:
    target: str
    platform: str  # "Host" or "CUDA"
    handler: int  # address of the XLA_FFI_Handler
    traits: int


@dataclasses.dataclass(frozen=True)
class Contract:
    """An op's contract as its C++ header declares it (kernel_table.h's XlaExtContract)."""

    target: str
    supported: tuple  # ((name, argument, values), ...), e.g. ("head_size", "query", (64, ...))
    check: int | None = None  # address of the library's XlaExtCheckFn (KernelLibrary.check runs it)

    def values(self, name, argument):
        """The values `name` of `argument` may take (sizes, or XLA FFI dtype numbers for
        "dtype"), in the order the C++ declares them."""
        for entry_name, entry_argument, values in self.supported:
            if (entry_name, entry_argument) == (name, argument):
                return values
        raise TorchXlaExtError(f"{self.target}'s contract lists no {name} of '{argument}'; it "
                               f"lists {[entry[:2] for entry in self.supported]}")


# kernel_table.h's structs of the contract and of the workspace query (fixed layouts: a new
# field would come in a new struct that a later version of XlaExtContract points to).
class _SupportedValues(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("argument", ctypes.c_char_p),
                ("num_values", ctypes.c_uint32), ("values", ctypes.POINTER(ctypes.c_int64))]


class _OperandShape(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("rank", ctypes.c_uint32),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _ScalarAttribute(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int32), ("value", ctypes.c_double)]


class _CallShape(ctypes.Structure):
    _fields_ = [("num_operands", ctypes.c_uint32), ("operands", ctypes.POINTER(_OperandShape)),
                ("num_attributes", ctypes.c_uint32),
                ("attributes", ctypes.POINTER(_ScalarAttribute))]


_CheckFn = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.POINTER(_CallShape))


def _call_shape(operands, attributes):
    """A _CallShape of `operands` [(XLA FFI dtype number, shape)] and `attributes`
    [(name, XLA FFI dtype number, value)]; the arrays it points to are returned beside it, to
    keep them alive."""
    dims = [(ctypes.c_int64 * len(shape))(*shape) for _, shape in operands]
    shapes = (_OperandShape * len(operands))(
        *(_OperandShape(dtype, len(shape), d) for (dtype, shape), d in zip(operands, dims)))
    attrs = (_ScalarAttribute * len(attributes))(
        *(_ScalarAttribute(name.encode(), dtype, value) for name, dtype, value in attributes))
    return _CallShape(len(operands), shapes, len(attributes), attrs), (dims, shapes, attrs)


class KernelLibrary:
    """A shared object with an `xla_ext_kernel_table` symbol, and the table it returns."""

    def __init__(self, path):
        self.path = os.path.abspath(path)
        if not os.path.exists(self.path):
            raise TorchXlaExtError(f"kernel library {self.path} does not exist")
        try:
            self._dll = ctypes.CDLL(self.path)
        except OSError as e:
            raise TorchXlaExtError(f"cannot load kernel library {self.path}: {e}") from e
        try:
            table_fn = self._dll.xla_ext_kernel_table
        except AttributeError:
            raise TorchXlaExtError(
                f"{self.path} exports no xla_ext_kernel_table: register its handlers with "
                "XLA_EXT_REGISTER_KERNEL from xla_ext/registry.h (torch_xla_ext.get_include())"
            ) from None
        table_fn.restype = ctypes.c_void_p
        self.table_address = table_fn()
        # The binder reads the table (kernel_table.h's layout, versioned by struct size).
        binder = binder_dll()
        major, minor, count = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_uint32()
        error, err = ctypes.c_char_p(), ctypes.create_string_buffer(2048)
        if binder.xla_ext_table_header(self.table_address, ctypes.byref(major),
                                       ctypes.byref(minor), ctypes.byref(count),
                                       ctypes.byref(error), err, len(err)) != 0:
            raise TorchXlaExtError(f"{self.path}: {err.value.decode()}")
        if error.value:
            raise TorchXlaExtError(f"{self.path}: {error.value.decode()}")
        self.ffi_version = (major.value, minor.value)
        self.kernels = tuple(_read_kernel(binder, self.table_address, i)
                             for i in range(count.value))
        self.contracts = {c.target: c for c in (
            _read_contract(binder, self.table_address, i)
            for i in range(binder.xla_ext_table_num_contracts(self.table_address)))}

    def function(self, name):
        """The library's exported C function `name` (ctypes: set its restype and argtypes)."""
        try:
            return getattr(self._dll, name)
        except AttributeError:
            raise TorchXlaExtError(f"{self.path} exports no {name}: it was built from other "
                                   "sources than this package; rebuild it") from None

    @functools.cached_property
    def _take_deferred(self):
        # Absent from a library built against a registry.h older than deferred failures.
        fn = getattr(self._dll, "xla_ext_take_deferred_failure", None)
        if fn is not None:
            fn.restype = ctypes.c_uint64
            fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        return fn, ctypes.create_string_buffer(4096)

    def take_deferred_failure(self):
        """(calls, the first one's message) of the library's calls that deferred their failure
        since the last take (registry.h, "A call's failure, deferred"), or None."""
        fn, message = self._take_deferred
        calls = fn(message, len(message)) if fn is not None else 0
        return (calls, message.value.decode(errors="replace")) if calls else None

    def targets(self):
        return sorted({k.target for k in self.kernels})

    def contract(self, target):
        """The contract the library declares for `target`."""
        try:
            return self.contracts[target]
        except KeyError:
            raise TorchXlaExtError(f"{self.path} declares no contract for {target}: it was built "
                                   "from other sources than this package; rebuild it") from None

    @functools.cached_property
    def _workspace_bytes(self):
        fn = self.function("xla_ext_workspace_bytes")
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(_CallShape)]
        return fn

    def workspace_bytes(self, target, device, operands, attributes):
        """Bytes of workspace `target`'s CUDA handler needs for a call of `operands`
        [(XLA FFI dtype number, shape)], in the order the handler binds them, and
        `attributes` [(name, XLA FFI dtype number, value)], on CUDA device `device` (-1: any
        visible one); 0 for a call the handler rejects or where no GPU is visible."""
        call, _arrays = _call_shape(operands, attributes)
        size = self._workspace_bytes(target.encode(), device, ctypes.byref(call))
        if size < 0:
            raise TorchXlaExtError(f"{self.path} has no workspace query for {target}: it was "
                                   "built from other sources than this package; rebuild it")
        return size

    def check(self, target, operands, attributes):
        """The message of `target`'s shape check for a call of `operands` (its arguments, then
        its results, as [(XLA FFI dtype number, shape)]) and scalar `attributes`
        [(name, XLA FFI dtype number, value)]: None where the check accepts the call or the
        library declares none."""
        contract = self.contracts.get(target)
        if contract is None or contract.check is None:
            return None
        call, _arrays = _call_shape(operands, attributes)
        message = _CheckFn(contract.check)(ctypes.byref(call))
        return None if message is None else message.decode(errors="replace")

    def __repr__(self):
        return f"KernelLibrary({self.path!r}, {len(self.kernels)} kernels)"


def _read_kernel(binder, table, index):
    target, platform = ctypes.c_char_p(), ctypes.c_char_p()
    handler, traits = ctypes.c_void_p(), ctypes.c_uint32()
    binder.xla_ext_table_kernel(table, index, ctypes.byref(target), ctypes.byref(platform),
                                ctypes.byref(handler), ctypes.byref(traits))
    return Kernel(target.value.decode(), platform.value.decode(), handler.value, traits.value)


def _read_contract(binder, table, index):
    target, count, supported = ctypes.c_char_p(), ctypes.c_uint32(), ctypes.c_void_p()
    binder.xla_ext_table_contract(table, index, ctypes.byref(target), ctypes.byref(count),
                                  ctypes.byref(supported))
    entries = ctypes.cast(supported, ctypes.POINTER(_SupportedValues))
    check = binder.xla_ext_table_contract_check(table, index)
    return Contract(target.value.decode(), tuple(
        (e.name.decode(), e.argument.decode(), tuple(e.values[:e.num_values]))
        for e in entries[:count.value]), check)


_builtin = None
_builtin_lock = threading.Lock()


def builtin_library():
    """torch_xla_ext's own kernels, loaded once."""
    global _builtin
    with _builtin_lock:
        if _builtin is None:
            if not os.path.exists(BUILTIN_LIBRARY):
                raise not_built_error(BUILTIN_LIBRARY)
            _builtin = KernelLibrary(BUILTIN_LIBRARY)
        return _builtin


@functools.lru_cache(maxsize=None)
def binder_dll():
    """The C helpers (torch_xla_ext/csrc/binder.cc) that read kernel tables and runtimes'
    versions, and register a table or one target into a runtime. Loaded with RTLD_GLOBAL: it
    also defines XLA's legacy custom-call status functions for users' kernels
    (csrc/custom_call_status.cc)."""
    dll = ctypes.CDLL(os.path.join(LIB_DIR, "libxla_ext_binder.so"), mode=os.RTLD_GLOBAL)
    for name in ("xla_ext_bind_ffi_api", "xla_ext_bind_pjrt_plugin"):
        fn = getattr(dll, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                       ctypes.c_size_t]
    for name in ("xla_ext_register_ffi_handler", "xla_ext_pjrt_register_ffi_handler"):
        fn = getattr(dll, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                       ctypes.c_uint32, ctypes.c_char_p, ctypes.c_size_t]
    dll.xla_ext_pjrt_register_legacy_target.restype = ctypes.c_int
    dll.xla_ext_pjrt_register_legacy_target.argtypes = [
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    dll.xla_ext_registry_lookup.restype = ctypes.c_void_p
    dll.xla_ext_registry_lookup.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                            ctypes.c_char_p]
    dll.xla_ext_registry_register.restype = ctypes.c_int
    dll.xla_ext_registry_register.argtypes = [ctypes.c_void_p] * 3 + [
        ctypes.c_char_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    dll.xla_ext_table_header.restype = ctypes.c_int
    dll.xla_ext_table_header.argtypes = [ctypes.c_void_p] + [ctypes.c_void_p] * 4 + [
        ctypes.c_char_p, ctypes.c_size_t]
    dll.xla_ext_table_kernel.restype = None
    dll.xla_ext_table_kernel.argtypes = [ctypes.c_void_p, ctypes.c_uint32] + [ctypes.c_void_p] * 4
    dll.xla_ext_table_num_contracts.restype = ctypes.c_uint32
    dll.xla_ext_table_num_contracts.argtypes = [ctypes.c_void_p]
    dll.xla_ext_table_contract.restype = None
    dll.xla_ext_table_contract.argtypes = [ctypes.c_void_p, ctypes.c_uint32] + [ctypes.c_void_p] * 3
    dll.xla_ext_table_contract_check.restype = ctypes.c_void_p
    dll.xla_ext_table_contract_check.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    dll.xla_ext_ffi_api_version.restype = None
    dll.xla_ext_ffi_api_version.argtypes = [ctypes.c_void_p] * 4
    dll.xla_ext_pjrt_api_version.restype = None
    dll.xla_ext_pjrt_api_version.argtypes = [ctypes.c_void_p] * 3
    return dll


def register_target(target, ffi_handler, legacy_function, where):
    """Runs one of the binder's single-target registrations: `ffi_handler(err, err_size)` for
    a typed FFI target, else `legacy_function(err, err_size)` (each a partial of a C function
    of csrc/binder.cc); raises with the runtime's message, naming `where`."""
    err = ctypes.create_string_buffer(1024)
    register = ffi_handler if target.kind == TYPED_FFI else legacy_function
    if register(err, len(err)) != 0:
        raise TorchXlaExtError(f"registering {target.name} for {target.platform} in {where}: "
                               f"{err.value.decode()}")


def call_binder(fn, runtime_api, library, platform):
    """Runs one of the binder's C functions; returns the number of kernels registered."""
    err = ctypes.create_string_buffer(2048)
    count = fn(runtime_api, library.table_address,
               platform.encode() if platform else None, err, len(err))
    if count < 0:
        raise TorchXlaExtError(f"{library.path}: {err.value.decode()}")
    return count
