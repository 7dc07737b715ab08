"""The PJRT shim (lib/libxla_ext_pjrt_shim.so) around a fake CUDA plugin: the API passes
through with only the platform name changed, the FFI extension stays reachable so our CUDA
handlers register through it, a 0.76 plugin gets the two structs that changed in 0.76 in its
own layout, and a plugin of another PJRT version is refused."""

import ctypes
import importlib.metadata
import os
import shutil

import pytest

from torch_xla_ext import _kernels, plugin
from torch_xla_ext.binders.pjrt_plugin import PjrtPluginRuntime
from torch_xla_ext.errors import TorchXlaExtError

FAKE_PLUGIN = os.path.abspath("tests/plugin/libfake_pjrt_plugin_0_75.so")
FAKE_PLUGIN_0_76 = os.path.abspath("tests/plugin/libfake_pjrt_plugin_0_76.so")
FAKE_PLUGIN_0_81 = os.path.abspath("tests/plugin/libfake_pjrt_plugin_0_81.so")
API_SIZE = 960  # PJRT_Api at PJRT C API 0.75
# Byte offsets in PJRT_Api of the functions the shim replaces, and of the error functions.
CLIENT_PLATFORM_NAME, TOPOLOGY_PLATFORM_NAME = 136, 712
EXECUTE, UPDATE_GLOBAL_PROCESS_INFO = 480, 944  # replaced for a 0.76 plugin only
ERROR_DESTROY, ERROR_MESSAGE = 40, 48


class PlatformNameArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("client_or_topology", ctypes.c_void_p), ("platform_name", ctypes.c_void_p),
                ("platform_name_size", ctypes.c_size_t)]


class ErrorArgs(ctypes.Structure):  # PJRT_Error_Message_Args; its prefix is _Destroy_Args
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("error", ctypes.c_void_p), ("message", ctypes.c_void_p),
                ("message_size", ctypes.c_size_t)]


class ExecuteOptions075(ctypes.Structure):  # PJRT_ExecuteOptions as torch_xla 2.9 fills it
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("send_callbacks", ctypes.c_void_p), ("recv_callbacks", ctypes.c_void_p),
                ("num_send_ops", ctypes.c_size_t), ("num_recv_ops", ctypes.c_size_t),
                ("launch_id", ctypes.c_int), ("non_donatable_input_indices", ctypes.c_void_p),
                ("num_non_donatable_input_indices", ctypes.c_size_t),
                ("context", ctypes.c_void_p)]


class ExecuteArgs(ctypes.Structure):  # the prefix of PJRT_LoadedExecutable_Execute_Args
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("executable", ctypes.c_void_p),
                ("options", ctypes.POINTER(ExecuteOptions075))]


class ProcessInfo075(ctypes.Structure):  # PJRT_ProcessInfo at 0.75: no struct_size
    _fields_ = [("task_id", ctypes.c_int), ("incarnation_id", ctypes.c_uint64),
                ("state", ctypes.c_int), ("error_code", ctypes.c_int),
                ("error_message", ctypes.c_char_p), ("error_message_size", ctypes.c_size_t)]


class UpdateGlobalProcessInfoArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("client", ctypes.c_void_p),
                ("process_infos", ctypes.POINTER(ProcessInfo075)),
                ("num_process_infos", ctypes.c_size_t)]


def function(api, offset, argtype):
    address = ctypes.c_void_p.from_address(api + offset).value
    return ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(argtype))(address)


def platform_name(api, offset, handle):
    """(name, None) or (None, the error's message) from a PlatformName function."""
    args = PlatformNameArgs(ctypes.sizeof(PlatformNameArgs), None, handle, None, 0)
    error = function(api, offset, PlatformNameArgs)(ctypes.byref(args))
    if error is None:
        return ctypes.string_at(args.platform_name, args.platform_name_size).decode(), None
    message = ErrorArgs(ctypes.sizeof(ErrorArgs), None, error, None, 0)
    function(api, ERROR_MESSAGE, ErrorArgs)(ctypes.byref(message))
    text = ctypes.string_at(message.message, message.message_size).decode()
    function(api, ERROR_DESTROY, ErrorArgs)(ctypes.byref(message))
    return None, text


def get_api(library):
    library.GetPjrtApi.restype = ctypes.c_void_p
    return library.GetPjrtApi()


@pytest.fixture
def fresh_shim(tmp_path):
    """A private copy of the shim: a new instance, with nothing wrapped yet."""
    path = tmp_path / "libxla_ext_pjrt_shim.so"
    shutil.copy(plugin.SHIM_LIBRARY, path)
    return str(path)


def shim_load(shim_path):
    shim = ctypes.CDLL(shim_path)
    shim.xla_ext_pjrt_shim_load.restype = ctypes.c_void_p
    err = ctypes.create_string_buffer(2048)
    return shim.xla_ext_pjrt_shim_load(err, ctypes.c_size_t(len(err))), err.value.decode()


def test_the_shim_passes_the_api_through_and_presents_the_platform_as_gpu(fresh_shim,
                                                                          monkeypatch):
    monkeypatch.setenv(plugin.PLUGIN_PATH_VARIABLE, FAKE_PLUGIN)
    real = get_api(ctypes.CDLL(FAKE_PLUGIN))
    wrapped = get_api(ctypes.CDLL(fresh_shim))
    assert wrapped and wrapped != real
    assert shim_load(fresh_shim) == (wrapped, "")  # one wrapped API per process

    real_bytes = ctypes.string_at(real, API_SIZE)
    wrapped_bytes = ctypes.string_at(wrapped, API_SIZE)
    replaced = {CLIENT_PLATFORM_NAME, TOPOLOGY_PLATFORM_NAME}
    for offset in range(0, API_SIZE, 8):
        same = real_bytes[offset:offset + 8] == wrapped_bytes[offset:offset + 8]
        assert same != (offset in replaced), f"PJRT_Api byte offset {offset}"
    # struct_size, extension_start (the FFI extension's chain) and the version, unchanged:
    assert ctypes.c_size_t.from_address(wrapped).value == API_SIZE
    assert (ctypes.c_int32.from_address(wrapped + 32).value,
            ctypes.c_int32.from_address(wrapped + 36).value) == (0, 75)

    fake_handle = 0x1234
    for offset in (CLIENT_PLATFORM_NAME, TOPOLOGY_PLATFORM_NAME):
        assert platform_name(real, offset, fake_handle) == ("cuda", None)
        assert platform_name(wrapped, offset, fake_handle) == ("gpu", None)
        # The real plugin is asked first, so its errors come through unchanged.
        assert platform_name(wrapped, offset, None) == (None, "fake PJRT plugin: null client")


def test_our_cuda_handlers_register_through_the_shim(fresh_shim, monkeypatch):
    monkeypatch.setenv(plugin.PLUGIN_PATH_VARIABLE, FAKE_PLUGIN)
    library = _kernels.builtin_library()
    runtime = PjrtPluginRuntime("test_shim", fresh_shim, platform="CUDA", wraps=FAKE_PLUGIN)
    assert runtime.pjrt_version == (0, 75)

    bound = runtime.bind(library)

    cuda_kernels = [k for k in library.kernels if k.platform == "CUDA"]
    assert cuda_kernels and bound == [(k.target, "CUDA") for k in cuda_kernels]
    assert "XlaGpuSimpleAdd" in {k.target for k in cuda_kernels}
    fake = ctypes.CDLL(FAKE_PLUGIN)
    target, platform = ctypes.create_string_buffer(256), ctypes.create_string_buffer(256)
    handler, traits = ctypes.c_void_p(), ctypes.c_uint32()
    recorded = []
    for i in range(fake.fake_pjrt_registrations()):
        assert fake.fake_pjrt_registration(i, target, platform, ctypes.byref(handler),
                                           ctypes.byref(traits)) == 0
        recorded.append((target.value.decode(), platform.value.decode(), handler.value,
                         traits.value))
    assert recorded == [(k.target, "CUDA", k.handler, k.traits) for k in cuda_kernels]
    assert f"wrapping {FAKE_PLUGIN}" in runtime.describe()["kind"]


def test_a_0_76_plugin_gets_torch_xla_s_0_75_execute_options_and_process_infos_upgraded(
        fresh_shim, monkeypatch):
    monkeypatch.setenv(plugin.PLUGIN_PATH_VARIABLE, FAKE_PLUGIN_0_76)
    fake = ctypes.CDLL(FAKE_PLUGIN_0_76)
    real, wrapped = get_api(fake), get_api(ctypes.CDLL(fresh_shim))
    assert wrapped and ctypes.c_int32.from_address(wrapped + 36).value == 76
    replaced = {CLIENT_PLATFORM_NAME, TOPOLOGY_PLATFORM_NAME, EXECUTE, UPDATE_GLOBAL_PROCESS_INFO}
    real_bytes, wrapped_bytes = ctypes.string_at(real, API_SIZE), ctypes.string_at(wrapped, API_SIZE)
    for offset in range(0, API_SIZE, 8):
        same = real_bytes[offset:offset + 8] == wrapped_bytes[offset:offset + 8]
        assert same != (offset in replaced), f"PJRT_Api byte offset {offset}"

    # Execute: the plugin refuses torch_xla's 80-byte options by itself, and gets 88 bytes
    # (call_location null) through the shim; the caller keeps its own options.
    options = ExecuteOptions075(ctypes.sizeof(ExecuteOptions075), launch_id=7)
    assert ctypes.sizeof(options) == 80
    args = ExecuteArgs(ctypes.sizeof(ExecuteArgs), None, 0x5678, ctypes.pointer(options))
    error = function(real, EXECUTE, ExecuteArgs)(ctypes.byref(args))
    assert error is not None  # "Unexpected PJRT_ExecuteOptions size: expected 88, got 80"
    function(real, ERROR_DESTROY, ErrorArgs)(ctypes.byref(ErrorArgs(40, None, error, None, 0)))
    assert function(wrapped, EXECUTE, ExecuteArgs)(ctypes.byref(args)) is None
    size, launch_id, call_location = ctypes.c_size_t(), ctypes.c_int(), ctypes.c_void_p()
    fake.fake_pjrt_seen_execute(ctypes.byref(size), ctypes.byref(launch_id),
                                ctypes.byref(call_location))
    assert (size.value, launch_id.value, call_location.value) == (88, 7, None)
    assert ctypes.addressof(args.options.contents) == ctypes.addressof(options)

    # UpdateGlobalProcessInfo: each 40-byte entry arrives as 48 bytes, its fields in place.
    infos = (ProcessInfo075 * 2)(ProcessInfo075(3, 30, 1, 0, b"first", 5),
                                 ProcessInfo075(4, 40, 2, 13, b"second one", 10))
    args = UpdateGlobalProcessInfoArgs(ctypes.sizeof(UpdateGlobalProcessInfoArgs), None, 0x9,
                                       infos, 2)
    assert function(wrapped, UPDATE_GLOBAL_PROCESS_INFO,
                    UpdateGlobalProcessInfoArgs)(ctypes.byref(args)) is None
    seen, struct_size, task_id = [], ctypes.c_size_t(), ctypes.c_int()
    message = ctypes.create_string_buffer(256)
    while fake.fake_pjrt_seen_process_info(len(seen), ctypes.byref(struct_size),
                                           ctypes.byref(task_id), message) == 0:
        seen.append((struct_size.value, task_id.value, message.value.decode()))
    assert seen == [(48, 3, "first"), (48, 4, "second one")]
    assert ctypes.addressof(args.process_infos.contents) == ctypes.addressof(infos)


def test_a_plugin_of_another_pjrt_version_is_refused(fresh_shim, monkeypatch, capfd):
    monkeypatch.setenv(plugin.PLUGIN_PATH_VARIABLE, FAKE_PLUGIN_0_81)
    expected = (f"{FAKE_PLUGIN_0_81} speaks PJRT C API 0.81, but torch_xla 2.9 speaks 0.75 "
                "(0.76 is adapted to it); install a matching plugin: pip install "
                "'torch_xla_ext[gpu]' (jax-cuda12-pjrt==0.7.1, CUDA 12) or "
                "'torch_xla_ext[gpu-cuda13]' (jax-cuda13-pjrt==0.7.2, CUDA 13)")
    assert shim_load(fresh_shim) == (None, expected)
    # torch_xla's own call can only get null; the reason goes to stderr.
    assert get_api(ctypes.CDLL(fresh_shim)) is None
    assert f"torch_xla_ext PJRT shim: {expected}\n" in capfd.readouterr().err
    # The Python side checks first and raises.
    with pytest.raises(TorchXlaExtError, match="PJRT_DEVICE=GPU: .* speaks PJRT C API 0.81"):
        plugin.load_shim()


def test_an_unset_plugin_path_is_explained(fresh_shim, monkeypatch):
    monkeypatch.delenv(plugin.PLUGIN_PATH_VARIABLE, raising=False)
    api, message = shim_load(fresh_shim)
    assert api is None
    assert message.startswith("$TORCH_XLA_EXT_PJRT_PLUGIN is not set; it names the PJRT plugin")


def test_a_missing_plugin_path_raises_a_clear_error(monkeypatch):
    missing = "/nonexistent/xla_cuda_plugin.so"
    monkeypatch.setenv(plugin.PLUGIN_PATH_VARIABLE, missing)
    with pytest.raises(TorchXlaExtError,
                       match=f"PJRT_DEVICE=GPU: cannot load the PJRT plugin {missing} "
                             r"\(\$TORCH_XLA_EXT_PJRT_PLUGIN\): .*No such file"):
        plugin.load_shim()
    with pytest.raises(TorchXlaExtError, match=f"{missing} is not a loadable PJRT plugin"):
        PjrtPluginRuntime("missing", missing)


def test_without_the_gpu_extra_the_error_says_what_to_install(monkeypatch):
    monkeypatch.delenv(plugin.PLUGIN_PATH_VARIABLE, raising=False)

    def not_installed(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(TorchXlaExtError) as error:
        plugin.CudaPlugin().library_path()
    assert str(error.value) == (
        "PJRT_DEVICE=GPU needs jax-cuda12-pjrt==0.7.1 or jax-cuda13-pjrt==0.7.2; neither is "
        "installed: pip install 'torch_xla_ext[gpu]' (jax-cuda12-pjrt==0.7.1) or "
        "pip install 'torch_xla_ext[gpu-cuda13]' (jax-cuda13-pjrt==0.7.2)")

    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.7.0")
    with pytest.raises(TorchXlaExtError, match=(
            r"needs jax-cuda12-pjrt==0.7.1 or jax-cuda13-pjrt==0.7.2; found jax-cuda12-pjrt "
            r"0.7.0 \(PJRT C API 0.75 is jax-cuda12-pjrt==0.7.1's\), jax-cuda13-pjrt 0.7.0")):
        plugin.cuda_plugin_path()
    status = plugin.status()
    assert status["wraps"] is None and "found jax-cuda12-pjrt 0.7.0" in status["problem"]
    assert not status["active"]
