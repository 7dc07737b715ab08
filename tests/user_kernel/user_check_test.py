"""A user's kernel library built the README way, with the shape check it registers
(XLA_EXT_REGISTER_CHECK, scale_kernel.cc): a bad call of its target raises at the call with
the check's message, through custom_call and torch_xla's _xla_gpu_custom_call, and records
nothing; a library that declares no check (negate_kernel.cc) is checked when the step runs,
as before."""

import importlib
import os
import re
import subprocess

import pytest
import torch

SOURCES = os.path.join("tests", "user_kernel")


@pytest.fixture(scope="module")
def xla_device():
    import torch_xla

    import torch_xla_ext  # noqa: F401  (the only setup a user does)

    return torch_xla.device()


def _build(tmp_path_factory, source):
    """Builds a user's kernel source as the README shows, with get_include()."""
    import torch_xla_ext

    out = tmp_path_factory.mktemp("user_kernel") / ("lib" + source.replace(".cc", ".so"))
    includes = [f"-I{d}" for d in torch_xla_ext.get_include()]
    subprocess.run(["g++", "-shared", "-fPIC", "-O2", "-std=c++17", *includes,
                    os.path.join(SOURCES, source), "-o", str(out)], check=True)
    return str(out)


@pytest.fixture(scope="module")
def scale_library(xla_device, tmp_path_factory):
    import torch_xla_ext

    return torch_xla_ext.load_kernels(_build(tmp_path_factory, "scale_kernel.cc"))


@pytest.fixture(scope="module")
def negate_library(xla_device, tmp_path_factory):
    import torch_xla_ext

    return torch_xla_ext.load_kernels(_build(tmp_path_factory, "negate_kernel.cc"))


def test_the_library_exports_its_check(scale_library):
    f32 = 11  # XLA FFI dtype number
    factor = [("factor", f32, 2.0)]
    assert scale_library.check("user.scale", [(f32, (3,)), (f32, (3,))], factor) is None
    assert scale_library.check("user.scale", [(f32, (3,)), (f32, (4,))], factor) == \
        "argument 'out': expected the shape of 'x', [3], got [4]"
    s64 = 5
    assert scale_library.check("user.scale", [(f32, (3,)), (f32, (3,))],
                               [("factor", s64, 2.0)]) == \
        "attribute 'factor': expected a float (f32), got s64"


def test_a_bad_call_raises_at_the_call_with_the_checks_message(xla_device, scale_library):
    import torch_xla

    from torch_xla_ext import TorchXlaExtError, custom_call

    # The module, which the package's function of the same name hides.
    custom_call_module = importlib.import_module("torch_xla_ext.custom_call")

    x = torch.tensor([1.0, 2.0, 3.0], device=xla_device)
    cases = [
        (lambda: custom_call([x], "user.scale", [[4]], [torch.float32], attrs={"factor": 2.0}),
         "user.scale: argument 'out': expected the shape of 'x', [3], got [4]"),
        (lambda: custom_call([x], "user.scale", [[3]], [torch.float16], attrs={"factor": 2.0}),
         "user.scale: argument 'out': expected dtype f32, got f16"),
        (lambda: custom_call([x.to(torch.bfloat16)], "user.scale", [[3]], [torch.float32],
                             attrs={"factor": 2.0}),
         "user.scale: argument 'x': expected dtype f32, got bf16"),
        (lambda: custom_call([x], "user.scale", [[3]], [torch.float32], attrs={"scale": 2.0}),
         "user.scale: attribute 'factor': expected a float, got no attribute of that name"),
        (lambda: custom_call([x], "user.scale", [[3]], [torch.float32], attrs={"factor": 2}),
         "user.scale: attribute 'factor': expected a float (f32), got s64"),
        (lambda: torch_xla._XLAC._xla_gpu_custom_call([x], "{factor = 2 : i32}", [[3]],
                                                      [torch.float32], target="user.scale"),
         "user.scale: attribute 'factor': expected a float (f32), got s32"),
        (lambda: torch_xla._XLAC._xla_gpu_custom_call([x], "{factor = 2.0 : f32}", [[3, 1]],
                                                      [torch.float32], target="user.scale"),
         "user.scale: argument 'out': expected the shape of 'x', [3], got [3, 1]"),
        (lambda: torch_xla._XLAC._xla_gpu_custom_call([x], "", [[3]], [torch.float32],
                                                      target="user.scale"),
         "user.scale: attribute 'factor': expected a float, got no attribute of that name"),
    ]
    for call, message in cases:
        recorded = len(custom_call_module._computations)
        with pytest.raises(TorchXlaExtError, match=re.escape(message)):
            call()
        # Raised before the call's module was built for torch_xla: nothing recorded.
        assert len(custom_call_module._computations) == recorded

    (out,) = custom_call([x], "user.scale", [[3]], [torch.float32], attrs={"factor": 2.0})
    assert out.cpu().tolist() == [2.0, 4.0, 6.0]
    (out,) = torch_xla._XLAC._xla_gpu_custom_call([x], "{factor = -1.0 : f32}", [[3]],
                                                  [torch.float32], target="user.scale")
    assert out.cpu().tolist() == [-1.0, -2.0, -3.0]
    b = torch.tensor([4.0, 5.0, 6.0], device=xla_device)
    assert torch.ops.xla_ext.simple_add(x, b).cpu().tolist() == [5.0, 7.0, 9.0]


def test_a_library_without_a_check_is_checked_when_the_step_runs(xla_device, negate_library):
    import torch_xla
    import torch_xla.core.xla_model as xm

    from torch_xla_ext import custom_call

    assert "user.negate" not in negate_library.contracts
    x = torch.tensor([1.0, 2.0, 3.0], device=xla_device)
    # On the device before the failing graph launches, so the CPU client runs it at once
    # (failed_graph_test.py says why).
    torch_xla.sync()
    xm.wait_device_ops()
    (bad,) = custom_call([x], "user.negate", [[4]], [torch.float32])  # recorded, unchecked
    with pytest.raises(RuntimeError, match="user.negate: argument 'out': expected as many "
                                           "elements as 'x'"):
        bad.cpu()
    del bad
    (out,) = custom_call([x], "user.negate", [[3]], [torch.float32])
    assert out.cpu().tolist() == [-1.0, -2.0, -3.0]
