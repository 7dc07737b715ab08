"""The CLI: `demo` (the README's main job) and `doctor --json`."""

import json
import os
import subprocess
import sys

ENV = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))


def test_demo_checks_every_result_against_pytorch():
    result = subprocess.run([sys.executable, "-m", "torch_xla_ext", "demo"], env=ENV,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "[1, 2, 3] + [4, 5, 6] = [5.0, 7.0, 9.0]" in out
    for target in ("XlaGpuSimpleAdd", "xla_ext.reshape_and_cache", "xla_ext.paged_attention"):
        assert f'custom_call_target="{target}"' in out
    assert out.count(" OK") == 4 and "All results match PyTorch." in out


def test_doctor_json_lists_runtimes_and_targets():
    result = subprocess.run([sys.executable, "-m", "torch_xla_ext", "doctor", "--json"], env=ENV,
                            capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    assert set(report) >= {"versions", "runtimes", "targets"}
    assert report["versions"]["torch_xla"] == "2.9.0" and report["versions"]["jax"] == "0.7.1"
    assert report["versions"]["kernels_ffi_api"] == "0.1"
    runtimes = {r["name"]: r for r in report["runtimes"]}
    assert runtimes["torch_xla"]["ffi_api"] == "0.1" and "jax" in runtimes
    rows = {(t["target"], t["platform"]): t["registered_in"] for t in report["targets"]}
    for target in ("XlaGpuSimpleAdd", "xla_ext.paged_attention", "xla_ext.reshape_and_cache"):
        assert rows[(target, "Host")] == ["torch_xla", "jax"]
        assert rows[(target, "CUDA")] == ["jax"]


def test_unknown_command_prints_usage():
    result = subprocess.run([sys.executable, "-m", "torch_xla_ext", "frobnicate"], env=ENV,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "usage: python -m torch_xla_ext" in result.stderr
