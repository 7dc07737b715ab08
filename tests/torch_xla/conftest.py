"""Fixtures shared by the torch_xla tests (PJRT_DEVICE=CPU)."""

import os
import subprocess

import pytest

USER_KERNEL_SOURCE = os.path.join("tests", "user_kernel", "scale_kernel.cc")


@pytest.fixture(scope="session")
def xla_device():
    import torch_xla

    import torch_xla_ext  # noqa: F401  (the only setup a user does)

    return torch_xla.device()


@pytest.fixture(scope="session")
def user_kernel_library(tmp_path_factory):
    """Builds tests/user_kernel/scale_kernel.cc as a user would, with get_include()."""
    import torch_xla_ext

    out = tmp_path_factory.mktemp("user_kernel") / "libscale_kernel.so"
    includes = [f"-I{d}" for d in torch_xla_ext.get_include()]
    subprocess.run(["g++", "-shared", "-fPIC", "-O2", "-std=c++17", *includes, USER_KERNEL_SOURCE,
                    "-o", str(out)], check=True)
    return str(out)
