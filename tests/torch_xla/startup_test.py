"""Every way of starting the package works, no module of it can shadow a dependency, and the
errors a newcomer meets say what to do."""

import importlib.metadata
import os
import pkgutil
import shutil
import subprocess
import sys

import torch_xla_ext

PACKAGE_DIR = os.path.dirname(torch_xla_ext.__file__)
ENV = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))


def _module_names(path):
    """The name of every module and subpackage of the package, at every level."""
    names = set()
    for info in pkgutil.walk_packages([path]):
        names.add(info.name.rpartition(".")[2])
    for root, _, files in os.walk(path):
        names.update(f[:-3] for f in files if f.endswith(".py"))
    return names - {"__init__", "__main__"}


def test_no_module_shares_a_name_with_a_dependency_or_the_standard_library():
    installed = set(importlib.metadata.packages_distributions())
    assert {"jax", "torch", "torch_xla", "torchax", "numpy"} <= installed  # the check can see them
    taken = installed | set(sys.stdlib_module_names)
    assert sorted(_module_names(PACKAGE_DIR) & taken) == []


def _run(args, **kwargs):
    return subprocess.run(args, env=kwargs.pop("env", ENV), capture_output=True, text=True,
                          **kwargs)


def test_the_package_main_run_as_a_file_works():
    # `python .../torch_xla_ext/__main__.py`: Python puts the package folder first on sys.path.
    result = _run([sys.executable, os.path.join(PACKAGE_DIR, "__main__.py"), "doctor", "--json"],
                  cwd=PACKAGE_DIR)
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"jax"' in result.stdout and '"XlaGpuSimpleAdd"' in result.stdout


def _copy_without_libraries(tmp_path, checkout):
    root = tmp_path / ("checkout" if checkout else "site-packages")
    shutil.copytree(PACKAGE_DIR, root / "torch_xla_ext",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    if checkout:
        (root / "WORKSPACE").write_text('workspace(name = "torch_xla_ext")\n')
    return root


def test_a_source_checkout_without_built_libraries_says_how_to_build_them(tmp_path):
    root = _copy_without_libraries(tmp_path, checkout=True)
    result = _run([sys.executable, "-m", "torch_xla_ext", "doctor"], cwd=root)
    assert result.returncode != 0
    assert "libxla_ext_kernels.so does not exist" in result.stderr
    assert "bazel build //torch_xla_ext/lib" in result.stderr
    assert "tools/device/build_kernels.sh" in result.stderr


def test_an_installation_without_libraries_says_to_reinstall(tmp_path):
    root = _copy_without_libraries(tmp_path, checkout=False)
    result = _run([sys.executable, "-c", "import torch_xla_ext"], cwd=root)
    assert result.returncode != 0
    assert "pip install --force-reinstall torch_xla_ext" in result.stderr


def _import_without(module, blocked):
    script = f"import sys; sys.modules[{blocked!r}] = None; import {module}"
    return _run([sys.executable, "-c", script])


def test_the_jax_front_end_without_jax_says_what_to_install():
    result = _import_without("torch_xla_ext.jax_ops", "jax")
    assert result.returncode != 0
    assert "TorchXlaExtError: torch_xla_ext.jax_ops needs jax" in result.stderr
    assert "pip install jax==0.7.1 jaxlib==0.7.1" in result.stderr


def test_the_torchax_front_end_without_torchax_says_what_to_install():
    result = _import_without("torch_xla_ext.torchax_ops", "torchax")
    assert result.returncode != 0
    assert "TorchXlaExtError: torch_xla_ext.torchax_ops needs torchax.ops.jaten" in result.stderr
    assert "flax" in result.stderr
