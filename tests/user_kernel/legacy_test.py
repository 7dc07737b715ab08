"""A user's kernel written the way the guides show it: XLA's legacy custom-call ABI (api_version
1, 2, 3), built with the system compiler at test time, loaded with ctypes, registered by capsule
through `torch_xla._XLAC._xla_register_custom_call_target`, called with `_xla_custom_call`; and
a typed FFI handler registered the same way (api_version 4). On torch_xla's CPU ("Host").

The guides' script itself runs in a fresh process per api_version (legacy/guides_flow.py); the
rest share one process, as a user's session would, each error followed by a correct call."""

import ctypes
import glob
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

LEGACY = os.path.join("tests", "user_kernel", "legacy")
FLOW = os.path.join(LEGACY, "guides_flow.py")


def _compile(tmp_path_factory, source, name, *flags):
    out = tmp_path_factory.mktemp("legacy") / name
    compiler = "gcc" if source.endswith(".c") else "g++"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", *flags, os.path.join(LEGACY, source),
                    "-o", str(out)], check=True)
    return str(out)


@pytest.fixture(scope="module")
def simple_add(tmp_path_factory):
    """The user's XlaGpuSimpleAdd for the CPU, per api_version."""
    return {v: _compile(tmp_path_factory, "simple_add_host.c", f"libsimple_add_v{v}.so",
                        f"-DAPI_VERSION={v}") for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def xla_device():
    import torch_xla

    import torch_xla_ext  # noqa: F401  (the one line the guides' flow adds without the wheel)

    return torch_xla.device()


def _capsule(address):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(address, b"xla._CUSTOM_CALL_TARGET", None)


def _function(library, symbol):
    return ctypes.cast(getattr(ctypes.CDLL(library, ctypes.RTLD_GLOBAL), symbol),
                       ctypes.c_void_p).value


def _add(target, api_version, a=(1.0, 2.0, 3.0), b=(4.0, 5.0, 6.0), backend_config=""):
    import torch_xla

    dev = torch_xla.device()
    x, y = torch.tensor(a, device=dev), torch.tensor(b, device=dev)
    (out,) = torch_xla._XLAC._xla_custom_call([x, y], target, [[3]], [torch.float32], False,
                                              backend_config, api_version, {})
    return out


@pytest.mark.parametrize("api_version", [1, 2, 3])
def test_the_guides_flow_prints_5_7_9(simple_add, api_version):
    result = subprocess.run(
        [sys.executable, FLOW, simple_add[api_version], str(api_version), "Host",
         "--with-import"], capture_output=True, text=True, env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[5.0, 7.0, 9.0]"


def test_a_failing_kernel_raises_its_message_and_the_next_call_works(xla_device, simple_add):
    import torch_xla

    torch_xla._XLAC._xla_register_custom_call_target(
        "XlaGpuSimpleAddChecked", _capsule(_function(simple_add[2], "XlaGpuSimpleAddChecked")),
        "Host")
    bad = _add("XlaGpuSimpleAddChecked", 2, a=(1.0, float("nan"), 3.0))
    with pytest.raises(RuntimeError, match="XlaGpuSimpleAddChecked: an input holds a NaN"):
        bad.cpu()
    assert _add("XlaGpuSimpleAddChecked", 2).cpu().tolist() == [5.0, 7.0, 9.0]
    assert _add("XlaGpuSimpleAddChecked", 2, a=(0.5, 0.5, 0.5)).cpu().tolist() == [4.5, 5.5, 6.5]


def test_a_typed_ffi_handler_by_capsule_at_api_version_4(xla_device, tmp_path_factory):
    import torch_xla

    import torch_xla_ext

    library = _compile(tmp_path_factory, "ffi_add.cc", "libffi_add.so", "-std=c++17",
                       *[f"-I{d}" for d in torch_xla_ext.get_include()])
    torch_xla._XLAC._xla_register_custom_call_target(
        "user.ffi_add", _capsule(_function(library, "UserFfiAdd")), "CPU")
    out = _add("user.ffi_add", 4)
    assert 'custom_call_target="user.ffi_add"' in torch_xla._XLAC._get_xla_tensors_hlo([out])
    assert out.cpu().tolist() == [5.0, 7.0, 9.0]
    # Called with a legacy api_version, the handler would be called with the wrong arguments.
    with pytest.raises(RuntimeError, match=r"user.ffi_add is called with api_version=1.*"
                                           r"registered for Host as a typed FFI handler"):
        _add("user.ffi_add", 1)
    assert _add("user.ffi_add", 4, b=(1.0, 1.0, 1.0)).cpu().tolist() == [2.0, 3.0, 4.0]


def test_a_legacy_function_called_as_typed_ffi_is_refused(xla_device, simple_add):
    import torch_xla

    torch_xla._XLAC._xla_register_custom_call_target(
        "user.legacy_add", _capsule(_function(simple_add[1], "XlaGpuSimpleAdd")), "Host")
    assert _add("user.legacy_add", 1).cpu().tolist() == [5.0, 7.0, 9.0]
    with pytest.raises(RuntimeError, match=r"user.legacy_add is called with api_version=4.*"
                                           r"as a legacy custom-call function"):
        _add("user.legacy_add", 4)
    assert _add("user.legacy_add", 1).cpu().tolist() == [5.0, 7.0, 9.0]


def test_registering_twice(xla_device, simple_add):
    import torch_xla

    register = torch_xla._XLAC._xla_register_custom_call_target
    v1 = _capsule(_function(simple_add[1], "XlaGpuSimpleAdd"))
    register("user.twice", v1, "Host")
    register("user.twice", v1, "Host")  # the same function again: fine
    other = _capsule(_function(simple_add[2], "XlaGpuSimpleAdd"))
    with pytest.raises(RuntimeError, match=r"user.twice is already registered for Host with "
                                           r"another function"):
        register("user.twice", other, "Host")
    assert _add("user.twice", 1).cpu().tolist() == [5.0, 7.0, 9.0]


def test_a_registration_after_compiled_graphs_serves_new_graphs(xla_device, simple_add):
    import torch_xla

    for _ in range(2):  # graphs of our own target, compiled and cached
        assert _add("XlaGpuSimpleAdd", 4).cpu().tolist() == [5.0, 7.0, 9.0]
    with pytest.raises(RuntimeError, match=r"custom call user.late: no legacy custom-call "
                                           r"function \(api_version 1, 2 or 3\) is registered "
                                           r"under that name for Host"):
        _add("user.late", 3)
    torch_xla._XLAC._xla_register_custom_call_target(
        "user.late", _capsule(_function(simple_add[3], "XlaGpuSimpleAdd")), "Host")
    assert _add("user.late", 3).cpu().tolist() == [5.0, 7.0, 9.0]
    assert _add("XlaGpuSimpleAdd", 4).cpu().tolist() == [5.0, 7.0, 9.0]


def test_clear_errors_each_followed_by_a_correct_call(xla_device, simple_add):
    import torch_xla

    register = torch_xla._XLAC._xla_register_custom_call_target
    v2 = _capsule(_function(simple_add[2], "XlaGpuSimpleAdd"))
    cases = [
        # A platform this torch_xla does not have: the message lists the ones it has.
        (lambda: register("user.e", v2, "ROCM"), r"platform: expected one of \['CUDA', 'Host'\]"),
        # A target with no function: named, and how to register it, at the call.
        (lambda: _add("user.unregistered", 2),
         r"custom call user.unregistered: no legacy custom-call function \(api_version 1, 2 or "
         r"3\) is registered under that name for Host.*_xla_register_custom_call_target\("
         r"'user.unregistered'"),
        # Our own typed handler of the user's name, called with the legacy ABI before the
        # user registered theirs.
        (lambda: _add("XlaGpuSimpleAdd", 1), r"typed FFI handler of that name needs api_version=4"),
        # Capsules holding no function: a DLPack tensor, a data pointer.
        (lambda: register("user.e", torch.utils.dlpack.to_dlpack(torch.ones(3)), "Host"),
         r"function: the capsule holds 0x[0-9a-f]+, which is not the address of a function"),
        (lambda: register("user.e", ctypes.addressof(ctypes.c_int(3)), "Host"),
         r"not the address of a function"),
        (lambda: register("user.e", "XlaGpuSimpleAdd", "Host"),
         r"function: expected a PyCapsule holding the function's address"),
        # Registered for CUDA only, called on the CPU.
        (lambda: (register("user.cuda_only", v2, "CUDA"), _add("user.cuda_only", 2)),
         r"it is registered for CUDA only, and this process runs graphs on Host"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
        register("user.e", v2, "Host")
        assert _add("user.e", 2).cpu().tolist() == [5.0, 7.0, 9.0]


def test_the_torch_library_form_runs_and_dumps_one_custom_call(simple_add, tmp_path):
    script = f"""
import ctypes, torch, torch_xla, torch_xla_ext
lib = ctypes.CDLL({simple_add[2]!r}, ctypes.RTLD_GLOBAL)
new = ctypes.pythonapi.PyCapsule_New
new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
torch_xla._XLAC._xla_register_custom_call_target(
    "XlaGpuSimpleAdd", new(ctypes.cast(lib.XlaGpuSimpleAdd, ctypes.c_void_p).value, None, None),
    "Host")
library = torch.library.Library("my_ops", "DEF")
library.define("simple_add(Tensor a, Tensor b) -> Tensor")

@torch.library.impl(library, "simple_add", "XLA")
def simple_add(a, b):
    out, = torch_xla._XLAC._xla_custom_call([a, b], "XlaGpuSimpleAdd", [list(a.shape)],
                                             [a.dtype], False, "", 2, {{}})
    return out

dev = torch_xla.device()
a = torch.tensor([1.0, 2.0, 3.0], device=dev)
print(torch.ops.my_ops.simple_add(a, a + 3).cpu().tolist())
"""
    env = dict(os.environ, PJRT_DEVICE="CPU", XLA_FLAGS=f"--xla_dump_to={tmp_path}")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[5.0, 7.0, 9.0]"
    dumps = glob.glob(str(tmp_path / "*after_optimizations.txt"))
    calls = [line for path in dumps for line in open(path).read().splitlines()
             if "custom-call(" in line]
    assert len(calls) == 1, calls
    assert 'custom_call_target="XlaGpuSimpleAdd"' in calls[0]
    assert "API_VERSION_STATUS_RETURNING" in calls[0]


def test_a_legacy_reshape_and_cache_with_sizes_in_opaque_writes_its_aliased_cache(
        xla_device, tmp_path_factory):
    import torch_xla

    import torch_xla_ext

    library = _compile(tmp_path_factory, "reshape_and_cache_host.c", "libreshape_and_cache.so")
    torch_xla._XLAC._xla_register_custom_call_target(
        "LegacyReshapeAndCache", _capsule(_function(library, "LegacyReshapeAndCache")), "Host")
    tokens, heads, head_size, blocks, block_size = 5, 2, 8, 4, 4
    rng = np.random.default_rng(0)
    key, value = (torch.tensor(rng.standard_normal((tokens, heads, head_size)), dtype=torch.float32)
                  for _ in range(2))
    caches = [torch.tensor(rng.standard_normal((blocks, block_size, heads, head_size)),
                           dtype=torch.float32) for _ in range(2)]
    slots = torch.tensor([3, 0, -1, 15, 9])
    opaque = struct.pack("<5q", tokens, heads, head_size, blocks, block_size)
    dev = torch_xla.device()

    def call(slot_mapping):
        inputs = [t.to(dev) for t in (key, value, *caches, slot_mapping)]
        return torch_xla_ext.custom_call(inputs, "LegacyReshapeAndCache",
                                         [caches[0].shape] * 2, [torch.float32] * 2,
                                         backend_config=opaque, api_version=3,
                                         aliases={0: 2, 1: 3})

    key_cache, value_cache = call(slots)
    expected = [c.clone().view(-1, heads, head_size) for c in caches]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0][slot], expected[1][slot] = key[t], value[t]
    assert torch.equal(key_cache.cpu().view(-1, heads, head_size), expected[0])
    assert torch.equal(value_cache.cpu().view(-1, heads, head_size), expected[1])
    bad_key_cache, _ = call(torch.tensor([3, 0, -1, 16, 9]))
    with pytest.raises(RuntimeError, match=r"slot_mapping\[3\] = 16 is not below 16 slots"):
        bad_key_cache.cpu()
    key_cache, _ = call(slots)
    assert torch.equal(key_cache.cpu().view(-1, heads, head_size), expected[0])
