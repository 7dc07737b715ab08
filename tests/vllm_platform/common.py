"""What the vLLM platform tests share: the built wheel installed into a fresh venv, and the
environment vLLM runs in there."""

import glob
import os

import pytest

from tests.build import fresh_venv

WHEEL = glob.glob("torch_xla_ext-*.whl")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, site-packages) of a fresh venv holding only the built wheel."""
    return fresh_venv.install(WHEEL[0], tmp_path_factory.mktemp("wheel"))


def vllm_env(tmp_path, **extra):
    """The environment a user's shell would have: PJRT_DEVICE=CPU, and vLLM's caches in a
    temporary directory (no persistent XLA cache, no usage reports, nothing downloaded). With
    VLLM_XLA_CHECK_RECOMPILATION=1, vLLM's TPU model runner fails a step that compiles a graph
    after its warm-up: every shape a request can take was compiled before the first one."""
    return dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH="", JAX_PLATFORMS="cpu",
                VLLM_CACHE_ROOT=str(tmp_path / "vllm_cache"), VLLM_XLA_CACHE_PATH="",
                VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
                VLLM_XLA_CHECK_RECOMPILATION="1", **extra)
