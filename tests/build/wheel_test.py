"""The built wheel: its tags, METADATA and RECORD, and an install into a fresh virtual
environment where `import torch_xla_ext` alone makes the user's example return [5, 7, 9], and
where the guides' legacy flow runs with no added line at all (torch_xla's plugin entry points
import the package)."""

import base64
import csv
import glob
import hashlib
import importlib.metadata
import io
import os
import subprocess
import textwrap
import zipfile

import pytest

from tests.build import fresh_venv

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
        assert {"torch_xla_ext/lib/libxla_ext_kernels.so", "torch_xla_ext/lib/libxla_ext_torch.so",
                "torch_xla_ext/__init__.py",
                "torch_xla_ext/include/xla_ext/registry.h"} <= names
        entry_points = wheel.read("torch_xla_ext-0.1.0.dist-info/entry_points.txt").decode()
        assert "[vllm.platform_plugins]\nxla = torch_xla_ext.vllm_platform:register" in \
            entry_points
        assert 'Requires-Dist: vllm==0.13.0; extra == "vllm"' in metadata
        record = list(csv.reader(io.StringIO(
            wheel.read("torch_xla_ext-0.1.0.dist-info/RECORD").decode())))
        assert {row[0] for row in record} == names
        for path, digest, size in record:
            if path.endswith("RECORD"):
                continue
            data = wheel.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + expected.decode() and int(size) == len(data)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    return fresh_venv.install(WHEEL[0], tmp_path_factory.mktemp("wheel"))


def _run(args, cwd):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=""))


def test_install_into_a_fresh_venv_and_run_the_users_example(installed, tmp_path):
    python, site = installed
    script = textwrap.dedent("""
        import torch, torch_xla
        import torch_xla_ext
        assert torch_xla_ext.__file__.startswith(%r), torch_xla_ext.__file__
        dev = torch_xla.device()
        a = torch.tensor([1., 2., 3.], device=dev)
        b = torch.tensor([4., 5., 6.], device=dev)
        print(torch_xla._XLAC._xla_gpu_custom_call([a, b], "", [[3]], [torch.float32],
                                                   target="XlaGpuSimpleAdd")[0].cpu().tolist())
        # The torch op on CPU tensors: the wheel's C++ kernel (lib/libxla_ext_torch.so).
        print(torch.ops.xla_ext.simple_add(a.cpu(), b.cpu()).tolist())
    """) % site
    result = _run([python, "-c", script], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-2:] == ["[5.0, 7.0, 9.0]"] * 2


@pytest.mark.parametrize("how", ["console_script", "python_m", "package_main_as_a_file"])
def test_the_installed_demo_runs_however_it_is_started(installed, tmp_path, how):
    python, site = installed
    package = os.path.join(site, "torch_xla_ext")
    args, cwd = {
        "console_script": ([os.path.join(os.path.dirname(python), "torch-xla-ext"), "demo"],
                           tmp_path),
        "python_m": ([python, "-m", "torch_xla_ext", "demo"], tmp_path),
        # Python puts the package folder first on sys.path: nothing there may shadow `jax`.
        "package_main_as_a_file": ([python, os.path.join(package, "__main__.py"), "demo"],
                                   package),
    }[how]
    result = _run(args, cwd=cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "All results match PyTorch." in result.stdout


@pytest.mark.parametrize("api_version", [1, 2, 3])
def test_the_guides_legacy_flow_runs_with_no_added_line(installed, tmp_path, api_version):
    """The user's script as the guides write it (tests/user_kernel/legacy/guides_flow.py, no
    `import torch_xla_ext`): `import torch_xla` loads the installed wheel's `torch_xla.plugins`
    entry point, which imports the package (XLA_REGISTER_INSTALLED_PLUGINS unset, torch_xla's
    default)."""
    python, _ = installed
    library = tmp_path / f"libsimple_add_v{api_version}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", f"-DAPI_VERSION={api_version}",
                    os.path.abspath("tests/user_kernel/legacy/simple_add_host.c"), "-o",
                    str(library)], check=True)
    result = _run([python, os.path.abspath("tests/user_kernel/legacy/guides_flow.py"),
                   str(library), str(api_version), "Host"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[5.0, 7.0, 9.0]"
