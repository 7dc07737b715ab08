"""torch_xla runs our custom calls after `import torch_xla_ext` and nothing else."""

import ctypes
import glob
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch


def test_users_example_returns_5_7_9(xla_device):
    import torch_xla

    a = torch.tensor([1.0, 2.0, 3.0], device=xla_device)
    b = torch.tensor([4.0, 5.0, 6.0], device=xla_device)
    (out,) = torch_xla._XLAC._xla_gpu_custom_call([a, b], "", [[3]], [torch.float32],
                                                  target="XlaGpuSimpleAdd")
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out])
    assert 'custom_call_target="XlaGpuSimpleAdd"' in hlo
    assert "api_version=API_VERSION_TYPED_FFI" in hlo
    assert out.cpu().tolist() == [5.0, 7.0, 9.0]


# A legacy function that is registered but never run: only the HLO is read.
_UNUSED_LEGACY_FUNCTION = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p)(lambda out, ins, status: None)


def test_gpu_custom_call_keeps_the_2_8_default_target(xla_device):
    import torch_xla

    a = torch.ones(2, device=xla_device)
    # torch_xla 2.8's default target, with no function registered: refused at the call.
    with pytest.raises(RuntimeError, match="custom call triton_kernel_call: no legacy "
                                           "custom-call function"):
        torch_xla._XLAC._xla_gpu_custom_call([a], "opaque", [[2]], [torch.float32])
    platform = "CUDA" if os.environ.get("PJRT_DEVICE") == "GPU" else "Host"
    torch_xla._XLAC._xla_register_custom_call_target("triton_kernel_call",
                                                     _UNUSED_LEGACY_FUNCTION, platform)
    (out,) = torch_xla._XLAC._xla_gpu_custom_call([a], "opaque", [[2]], [torch.float32])
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out])
    assert 'custom_call_target="triton_kernel_call"' in hlo
    assert "API_VERSION_STATUS_RETURNING" in hlo and 'backend_config="opaque"' in hlo


def test_optimized_hlo_keeps_the_custom_call_even_for_constants(tmp_path):
    # A fresh process, so that XLA_FLAGS is read: XLA may fold everything around the call
    # (the inputs are constants) but must keep the opaque custom call.
    script = textwrap.dedent("""
        import torch, torch_xla, torch_xla_ext
        dev = torch_xla.device()
        a = torch.full((3,), 2.0, device=dev)
        b = torch.arange(3, dtype=torch.float32, device=dev) * 0 + 1
        out = torch.ops.xla_ext.simple_add(a, b)
        print(out.cpu().tolist())
    """)
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"), XLA_FLAGS=f"--xla_dump_to={tmp_path}")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[3.0, 3.0, 3.0]"
    optimized = [open(p).read() for p in glob.glob(str(tmp_path / "*after_optimizations.txt"))]
    assert optimized, os.listdir(tmp_path)
    calls = [line for text in optimized for line in text.splitlines() if "custom-call(" in line]
    assert len(calls) == 1, calls
    assert 'custom_call_target="XlaGpuSimpleAdd"' in calls[0]
    assert "api_version=API_VERSION_TYPED_FFI" in calls[0]


def test_each_call_gets_its_own_executable(xla_device, user_kernel_library):
    """torch_xla 2.9's own `_xla_custom_call` hashes only the target: a second call differing
    only in its attribute reused the first executable (scale 10 returned scale 2's result).
    After `import torch_xla_ext`, `_xla_custom_call` (same arguments) and `custom_call` give
    each call its own."""
    import torch_xla

    import torch_xla_ext

    torch_xla_ext.load_kernels(user_kernel_library)
    x = torch.tensor([1.0, 2.0, 3.0], device=xla_device)

    def through_torch_xla(factor):
        (out,) = torch_xla._XLAC._xla_custom_call([x], "user.scale", [[3]], [torch.float32], False,
                                                  f"{{factor = {factor} : f32}}", 4, {})
        return out.cpu().tolist()

    def ours(factor):
        (out,) = torch_xla_ext.custom_call([x], "user.scale", [[3]], [torch.float32],
                                           attrs={"factor": factor})
        return out.cpu().tolist()

    for call in (through_torch_xla, ours):
        assert call(2.0) == [2.0, 4.0, 6.0]
        assert call(10.0) == [10.0, 20.0, 30.0]
        assert call(2.0) == [2.0, 4.0, 6.0]


def test_calls_differing_only_in_output_shape_or_dtype(xla_device):
    import torch_xla_ext

    a = torch.ones(3, device=xla_device)
    b = torch.ones(3, device=xla_device, dtype=torch.bfloat16)
    (f32,) = torch_xla_ext.custom_call([a, a], "XlaGpuSimpleAdd", [[3]], [torch.float32])
    (bf16,) = torch_xla_ext.custom_call([b, b], "XlaGpuSimpleAdd", [[3]], [torch.bfloat16])
    (grid,) = torch_xla_ext.custom_call([a.view(1, 3), a.view(1, 3)], "XlaGpuSimpleAdd", [[1, 3]],
                                        [torch.float32])
    assert f32.cpu().dtype == torch.float32 and f32.cpu().tolist() == [2.0] * 3
    assert bf16.cpu().dtype == torch.bfloat16 and bf16.cpu().tolist() == [2.0] * 3
    assert grid.cpu().shape == (1, 3)


@pytest.mark.parametrize("attrs, expected", [
    ({"n": 3}, "{n = 3 : i64}"),
    ({"x": 0.1}, "{x = 0.1 : f32}"),
    ({"x": __import__("numpy").float64(0.1)}, "{x = 0.1 : f64}"),
    ({"k": __import__("numpy").int32(-2)}, "{k = -2 : i32}"),
    ({"on": True, "name": 'a "q"'}, '{name = "a \\"q\\"", on = true}'),
    ({"v": [1, 2, 3]}, "{v = array<i64: 1, 2, 3>}"),
    ({"d": {"b": 1.5, "a": 1}}, "{d = {a = 1 : i64, b = 1.5 : f32}}"),
    ({"inf": float("inf")}, "{inf = 0x7F800000 : f32}"),
])
def test_attributes_become_exactly_typed_mlir(attrs, expected):
    from torch_xla_ext import mlir_dictionary

    assert mlir_dictionary(attrs) == expected


def test_bad_arguments_name_what_is_wrong(xla_device):
    from torch_xla_ext import TorchXlaExtError, custom_call

    a = torch.ones(3, device=xla_device)
    cases = [
        (lambda: custom_call(a, "t", [[3]], [torch.float32]), "inputs: expected a list"),
        (lambda: custom_call([torch.ones(3)], "t", [[3]], [torch.float32]),
         r"inputs\[0\]: expected a tensor on an XLA device, got one on cpu"),
        (lambda: custom_call([a], "", [[3]], [torch.float32]), "target: expected a non-empty"),
        (lambda: custom_call([a], "t", [[3]], []), "output_shapes, output_dtypes"),
        (lambda: custom_call([a], "t", [[3]], [torch.complex64]), "dtype torch.complex64"),
        (lambda: custom_call([a], "t", [[3]], [torch.float32], attrs={"x": object()}),
         r"attrs\['x'\]: expected int, float"),
        (lambda: custom_call([a], "t", [[3]], [torch.float32], aliases={0: 5}),
         "aliases: {0: 5} is out of range"),
        (lambda: custom_call([a], "t", [[3]], [torch.float32], api_version=7), "api_version"),
    ]
    for call, message in cases:
        with pytest.raises(TorchXlaExtError, match=message):
            call()
    # The process goes on: a good call still works.
    from torch_xla_ext import custom_call as call_ok
    (out,) = call_ok([a, a], "XlaGpuSimpleAdd", [[3]], [torch.float32])
    assert out.cpu().tolist() == [2.0] * 3


def test_a_call_of_one_of_our_targets_is_checked_at_the_call_and_records_nothing(xla_device):
    """The issue's case: the seed call with a wrong output shape raises at the call, naming
    the argument, and the next unrelated step, read with .cpu(), runs."""
    import torch_xla

    from torch_xla_ext import TorchXlaExtError, custom_call, op_catalog, sample_inputs, workspace

    a = torch.tensor([1.0, 2.0, 3.0], device=xla_device)
    with pytest.raises(TorchXlaExtError, match=re.escape(
            "XlaGpuSimpleAdd: output_shapes[0]: expected [3] for these inputs, got [5]")):
        torch_xla._XLAC._xla_gpu_custom_call([a, a], "", [[5]], [torch.float32],
                                             target="XlaGpuSimpleAdd")
    b = torch.tensor([4.0, 5.0, 6.0], device=xla_device)
    assert torch.ops.xla_ext.simple_add(a, b).cpu().tolist() == [5.0, 7.0, 9.0]

    inputs = sample_inputs.paged_attention([5, 30], 8, 2, 64, 16, torch.float32)
    operands = [v.to(xla_device) for v in inputs.values()]
    no_alibi = torch.empty(0, device=xla_device)
    attrs = {"scale": 0.1, "softcap": 0.0}
    # The handler's results: the output, then its workspace (no bytes off the GPU).
    results = op_catalog.PAGED_ATTENTION.handler_results(  # attributes as NumPy scalars
        {**inputs, "alibi_slopes": None, **attrs}, {k: np.float32(v) for k, v in attrs.items()},
        workspace.xla_device_gpu())
    shapes, dtypes = [list(s) for s, _ in results], [d for _, d in results]
    query_shape = list(inputs["query"].shape)
    target = "xla_ext.paged_attention"
    bad_table = inputs["block_tables"].clone()
    bad_table[1, 1] = 99
    cases = [
        (lambda: custom_call([a, b, a], "XlaGpuSimpleAdd", [[3]], [torch.float32]),
         r"XlaGpuSimpleAdd: inputs: expected 2 operands \(a, b\), got 3"),
        (lambda: custom_call([a, b], "XlaGpuSimpleAdd", [[3]], [torch.float16]),
         r"XlaGpuSimpleAdd: output_dtypes\[0\]: expected float32, got float16"),
        (lambda: custom_call([a, a.half()], "XlaGpuSimpleAdd", [[3]], [torch.float32]),
         r"XlaGpuSimpleAdd: argument 'b': expected dtype float32"),
        (lambda: custom_call(operands + [no_alibi], target, [query_shape], [torch.float32],
                             attrs=attrs),
         r"output_shapes: expected 2 results \(\[2, 8, 64\] float32, \[\d+\] uint8\), got 1"),
        (lambda: custom_call(operands + [no_alibi], target, shapes, dtypes,
                             attrs={"scale": 0.1}),
         r"attrs: expected \{scale: float32, softcap: float32\}, got \{scale: float32\}"),
        (lambda: custom_call(operands + [no_alibi], target, shapes, dtypes,
                             attrs={"scale": 1, "softcap": 0.0}),
         r"attrs\['scale'\]: expected float32, got int64"),
        (lambda: torch_xla._XLAC._xla_gpu_custom_call(
            operands[:3] + [bad_table.to(xla_device), operands[4], no_alibi],
            "{scale = 0.1 : f32, softcap = 0.0 : f32}", shapes, dtypes,
            target=target), r"argument 'block_tables'.*block_tables\[1\]\[1\] = 99"),
    ]
    for call, message in cases:
        with pytest.raises(TorchXlaExtError, match=message):
            call()
    # Called directly, as described, the target gives the op's result.
    direct, _ = custom_call(operands + [no_alibi], target, shapes, dtypes, attrs=attrs)
    payload, _ = torch_xla._XLAC._xla_gpu_custom_call(
        operands + [no_alibi], "{scale = 0.1 : f32, softcap = 0.0 : f32}", shapes, dtypes,
        target=target)
    want = torch.ops.xla_ext.paged_attention(*operands, scale=0.1).cpu()
    assert torch.equal(direct.cpu(), want) and torch.equal(payload.cpu(), want)


def test_user_kernel_through_gpu_custom_call(xla_device, user_kernel_library):
    import torch_xla

    import torch_xla_ext

    library = torch_xla_ext.load_kernels(user_kernel_library)
    assert [(k.target, k.platform) for k in library.kernels] == [("user.scale", "Host")]
    x = torch.tensor([1.0, -2.0], device=xla_device)
    (out,) = torch_xla._XLAC._xla_gpu_custom_call([x], "{factor = 3.0 : f32}", [[2]],
                                                  [torch.float32], target="user.scale")
    assert out.cpu().tolist() == [3.0, -6.0]
    rows = {(r["target"], r["platform"]): r["registered_in"]
            for r in torch_xla_ext.binders.registrations()}
    assert "torch_xla" in rows[("user.scale", "Host")]


def test_torch_xla_own_stablehlo_custom_call_keeps_working(xla_device):
    """torch_xla's stablehlo_custom_call (host offloading, StableHLO export) calls
    `_xla_custom_call` with api_version 0 for targets XLA's compiler handles itself: that still
    goes to torch_xla's own call."""
    import torch_xla
    from torch_xla.experimental.stablehlo_custom_call import stablehlo_custom_call

    a = torch.ones(3, device=xla_device)
    out = stablehlo_custom_call([a], "annotate_device_placement", [a.shape], [a.dtype],
                                has_side_effect=True,
                                frontend_attributes={"_xla_buffer_placement": "device"})
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out])
    assert 'custom_call_target="annotate_device_placement"' in hlo
    assert "_xla_buffer_placement" in hlo
