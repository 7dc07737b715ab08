"""The torch_xla binder: idempotent, thread-safe, and clear when it cannot bind."""

import ctypes
import threading

import pytest


def test_binding_is_idempotent_and_thread_safe(xla_device):
    from torch_xla_ext import _kernels, binders
    from torch_xla_ext.binders.torch_xla_runtime import TorchXlaRuntime

    before = binders.registrations()
    errors = []

    def bind_again():
        try:
            binders.add_library(_kernels.builtin_library())
            binders.add_runtime(TorchXlaRuntime())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=bind_again) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert binders.registrations() == before
    host = {r["target"] for r in before if r["platform"] == "Host" and "torch_xla" in r["registered_in"]}
    assert {"XlaGpuSimpleAdd", "xla_ext.paged_attention", "xla_ext.reshape_and_cache"} <= host


def test_missing_symbol_is_one_clear_error(xla_device, monkeypatch):
    from torch_xla_ext import TorchXlaExtError
    from torch_xla_ext.binders import torch_xla_runtime as binder

    monkeypatch.setattr(binder, "_symbol_values", lambda path, names: {n: None for n in names})
    with pytest.raises(TorchXlaExtError) as info:
        binder.TorchXlaRuntime()
    message = str(info.value)
    assert "_ZN3xla3ffi12GetXlaFfiApiEv is not in the symbol table" in message
    assert "Supported: torch_xla 2.9.0" in message and "Install torch_xla==2.9.0" in message


def test_other_ffi_version_is_one_clear_error(xla_device, monkeypatch):
    from torch_xla_ext import TorchXlaExtError
    from torch_xla_ext.binders import torch_xla_runtime as binder

    monkeypatch.setattr(binder, "_read_version", lambda dll, api: (208, (0, 3)))
    with pytest.raises(TorchXlaExtError, match=r"speaks XLA FFI API 0\.3 .*supported: torch_xla 2\.9\.0"):
        binder.TorchXlaRuntime()


class _FakeApi(ctypes.Structure):
    # XLA_FFI_Api up to its Handler_Register field.
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("version_struct_size", ctypes.c_size_t), ("version_ext", ctypes.c_void_p),
                ("major", ctypes.c_int32), ("minor", ctypes.c_int32),
                ("internal_api", ctypes.c_void_p), ("error_create", ctypes.c_void_p),
                ("error_get_message", ctypes.c_void_p), ("error_destroy", ctypes.c_void_p),
                ("handler_register", ctypes.c_void_p), ("rest", ctypes.c_void_p * 14)]


def test_binder_refuses_a_runtime_older_than_the_handlers_and_registers_nothing():
    from torch_xla_ext import TorchXlaExtError, _kernels

    calls = []
    register = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda args: calls.append(1))
    api = _FakeApi(struct_size=192, major=0, minor=0,
                   handler_register=ctypes.cast(register, ctypes.c_void_p).value)
    binder = _kernels.binder_dll()
    with pytest.raises(TorchXlaExtError, match=r"built against XLA FFI API 0\.1 but this runtime "
                                               r"speaks 0\.0"):
        _kernels.call_binder(binder.xla_ext_bind_ffi_api, ctypes.addressof(api),
                             _kernels.builtin_library(), "Host")
    api.minor, api.struct_size = 1, 100
    with pytest.raises(TorchXlaExtError, match="XLA_FFI_Api is 100 bytes, smaller than the 192"):
        _kernels.call_binder(binder.xla_ext_bind_ffi_api, ctypes.addressof(api),
                             _kernels.builtin_library(), "Host")
    assert calls == []


def test_kernel_library_errors_name_the_library(tmp_path):
    from torch_xla_ext import TorchXlaExtError, load_kernels

    with pytest.raises(TorchXlaExtError, match="does not exist"):
        load_kernels(str(tmp_path / "missing.so"))
    not_a_library = tmp_path / "notes.so"
    not_a_library.write_text("hello")
    with pytest.raises(TorchXlaExtError, match="cannot load kernel library"):
        load_kernels(str(not_a_library))
    from torch_xla_ext import _kernels
    with pytest.raises(TorchXlaExtError, match="exports no xla_ext_kernel_table"):
        load_kernels(_kernels.LIB_DIR + "/libxla_ext_binder.so")
