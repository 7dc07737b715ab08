"""The built wheel: its tags, METADATA and RECORD, and an install into a fresh virtual
environment where `import torch_xla_ext` alone makes the user's example return [5, 7, 9]."""

import base64
import csv
import glob
import hashlib
import importlib.metadata
import io
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

WHEEL = glob.glob("torch_xla_ext-*.whl")


def test_wheel_name_tags_metadata_and_record():
    assert WHEEL == ["torch_xla_ext-0.1.0-cp311-cp311-linux_x86_64.whl"]
    with zipfile.ZipFile(WHEEL[0]) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read("torch_xla_ext-0.1.0.dist-info/METADATA").decode()
        assert "Tag: cp311-cp311-linux_x86_64" in wheel.read(
            "torch_xla_ext-0.1.0.dist-info/WHEEL").decode()
        for dist in ("torch", "torch_xla", "jax", "jaxlib"):
            version = importlib.metadata.version(dist)
            assert f"Requires-Dist: {dist}=={version}" in metadata
        assert {"torch_xla_ext/lib/libxla_ext_kernels.so", "torch_xla_ext/__init__.py",
                "torch_xla_ext/include/xla_ext/registry.h"} <= names
        record = list(csv.reader(io.StringIO(
            wheel.read("torch_xla_ext-0.1.0.dist-info/RECORD").decode())))
        assert {row[0] for row in record} == names
        for path, digest, size in record:
            if path.endswith("RECORD"):
                continue
            data = wheel.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + expected.decode() and int(size) == len(data)


def test_install_into_a_fresh_venv_and_run_the_users_example(tmp_path):
    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # The fresh venv takes its (large) dependencies from the project's venv; the wheel itself
    # is installed like any wheel, and nothing is downloaded.
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "project_deps.pth"), "w") as pth:
        pth.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    os.path.abspath(WHEEL[0])], check=True)
    script = textwrap.dedent("""
        import torch, torch_xla
        import torch_xla_ext
        assert torch_xla_ext.__file__.startswith(%r), torch_xla_ext.__file__
        dev = torch_xla.device()
        a = torch.tensor([1., 2., 3.], device=dev)
        b = torch.tensor([4., 5., 6.], device=dev)
        print(torch_xla._XLAC._xla_gpu_custom_call([a, b], "", [[3]], [torch.float32],
                                                   target="XlaGpuSimpleAdd")[0].cpu().tolist())
    """) % site
    result = subprocess.run([python, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=""))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[5.0, 7.0, 9.0]"
