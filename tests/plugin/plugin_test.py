"""The GPU plugin as torch_xla sees it, on CPU: the built wheel declares the `gpu` entry
point and extra; with its metadata on the path, `import torch_xla` registers the plugin, and
PJRT_DEVICE=GPU starts it through the shim around a fake CUDA plugin, registering our CUDA
handlers before the client is created (the fake then refuses to create one, listing the create
options it got: the allocator's, from torch_xla's PJRT_ALLOCATOR_* variables), or raises our
error for a plugin of another PJRT version."""

import glob
import os
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest
from elftools.elf.elffile import ELFFile

from torch_xla_ext import _kernels, plugin
from torch_xla_ext.errors import TorchXlaExtError

WHEEL = glob.glob("torch_xla_ext-*.whl")
DIST_INFO = "torch_xla_ext-0.1.0.dist-info"
FAKE_PLUGIN = os.path.abspath("tests/plugin/libfake_pjrt_plugin_0_75.so")
FAKE_PLUGIN_0_81 = os.path.abspath("tests/plugin/libfake_pjrt_plugin_0_81.so")


def test_the_wheel_declares_the_plugin_entry_point_the_gpu_extra_and_ships_the_shim():
    with zipfile.ZipFile(WHEEL[0]) as wheel:
        entry_points = wheel.read(f"{DIST_INFO}/entry_points.txt").decode()
        metadata = wheel.read(f"{DIST_INFO}/METADATA").decode().splitlines()
        names = wheel.namelist()
    assert "[torch_xla.plugins]\ngpu = torch_xla_ext.plugin:CudaPlugin\n" in entry_points
    assert "Provides-Extra: gpu" in metadata
    assert 'Requires-Dist: jax-cuda12-pjrt==0.7.1; extra == "gpu"' in metadata
    assert 'Requires-Dist: jax-cuda13-pjrt==0.7.2; extra == "gpu-cuda13"' in metadata
    assert 'Requires-Dist: nvidia-cuda-runtime-cu12>=12.1.105; extra == "gpu"' in metadata
    # The extra's requirements come after its Provides-Extra line, none without a marker.
    gpu = [line for line in metadata if line.endswith('extra == "gpu"')]
    assert metadata.index("Provides-Extra: gpu") < metadata.index(gpu[0])
    assert "torch_xla_ext/lib/libxla_ext_pjrt_shim.so" in names


def test_the_shim_exports_only_the_plugin_entry_point_and_its_loader():
    with open(plugin.SHIM_LIBRARY, "rb") as f:
        dynsym = ELFFile(f).get_section_by_name(".dynsym")
        exported = {s.name for s in dynsym.iter_symbols()
                    if s["st_shndx"] != "SHN_UNDEF" and s["st_info"]["bind"] == "STB_GLOBAL"}
    assert exported == {"GetPjrtApi", "xla_ext_pjrt_shim_load"}


def start_torch_xla_on_gpu(tmp_path, **env):
    """Output of a fresh process that imports torch_xla with the wheel's metadata on its path
    and makes a tensor on PJRT_DEVICE=GPU."""
    with zipfile.ZipFile(WHEEL[0]) as wheel:
        for name in ("METADATA", "entry_points.txt"):
            wheel.extract(f"{DIST_INFO}/{name}", tmp_path)
    script = textwrap.dedent("""
        import torch, torch_xla
        from torch_xla.experimental import plugins
        print("registered:", type(plugins._plugin_registry["GPU"]).__module__)
        try:
            torch.ones(2, device=torch_xla.device()).cpu()
        except Exception as e:
            print(f"client start failed: {type(e).__name__}: {e}")
        from torch_xla_ext.cli import doctor_report
        report = doctor_report()
        print("active:", report["gpu_plugin"]["active"])
        print("XlaGpuSimpleAdd on CUDA in torch_xla_gpu:", [
            "torch_xla_gpu" in t["registered_in"] for t in report["targets"]
            if (t["target"], t["platform"]) == ("XlaGpuSimpleAdd", "CUDA")])
    """)
    env = dict(os.environ, PJRT_DEVICE="GPU", JAX_PLATFORMS="cpu", **env,
               PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "registered: torch_xla_ext.plugin" in output, output[-3000:]
    return output


def test_torch_xla_starts_the_plugin_and_our_handlers_are_registered_first(tmp_path):
    output = start_torch_xla_on_gpu(tmp_path, TORCH_XLA_EXT_PJRT_PLUGIN=FAKE_PLUGIN)
    cuda_kernels = [k for k in _kernels.builtin_library().kernels if k.platform == "CUDA"]
    assert (f"client start failed: RuntimeError: fake PJRT plugin: no devices; "
            f"{len(cuda_kernels)} handlers were registered before PJRT_Client_Create"
            in output), output[-3000:]
    assert "active: True" in output, output[-3000:]
    assert "XlaGpuSimpleAdd on CUDA in torch_xla_gpu: [True]" in output, output[-3000:]
    assert "PJRT_Client_Create; options: []" in output, output[-3000:]


def test_the_allocator_variables_torch_xla_reads_reach_the_plugin(tmp_path):
    output = start_torch_xla_on_gpu(tmp_path, TORCH_XLA_EXT_PJRT_PLUGIN=FAKE_PLUGIN,
                                    PJRT_ALLOCATOR_FRACTION="0.5",
                                    PJRT_ALLOCATOR_PREALLOCATE="false")
    listed, = re.findall(r"options: \[(.*?)\]", output)
    # torch_xla passes them in its map's order
    assert sorted(listed.split()) == ["memory_fraction=0.500000", "preallocate=false"], output


@pytest.mark.parametrize("variable, value, expected", [
    ("PJRT_ALLOCATOR_FRACTION", "1.5", "a number in (0, 1]"),
    ("PJRT_ALLOCATOR_FRACTION", "most", "a number in (0, 1]"),
    ("PJRT_ALLOCATOR_PREALLOCATE", "yes", "true, false, 1 or 0"),
])
def test_a_bad_allocator_variable_is_refused_by_name(variable, value, expected):
    with pytest.raises(TorchXlaExtError) as raised:
        plugin.allocator_options({variable: value})
    assert str(raised.value) == f"{variable}: expected {expected}, got {value!r}"


@pytest.mark.parametrize("environ, flags", [
    ({}, ""),
    ({"XLA_FLAGS": "--xla_dump_to=/tmp/d"}, "--xla_dump_to=/tmp/d"),
    ({"XLA_EXT_DEBUG_CHECKS": "0"}, ""),
    ({"XLA_EXT_DEBUG_CHECKS": "1"}, "--xla_gpu_enable_command_buffer="),
    ({"XLA_EXT_DEBUG_CHECKS": "1", "XLA_FLAGS": "--xla_dump_to=/tmp/d"},
     "--xla_dump_to=/tmp/d --xla_gpu_enable_command_buffer="),
    ({"XLA_EXT_DEBUG_CHECKS": "1", "XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION"},
     "--xla_gpu_enable_command_buffer=FUSION"),
])
def test_debug_checks_turn_xla_command_buffers_off_unless_the_user_sets_them(environ, flags):
    """A CUDA call captured into a command buffer reports a violation only at the next call
    that is not captured; in debug mode each call must fail its own step."""
    assert plugin.xla_flags(environ) == flags


def test_torch_xla_raises_our_error_for_a_plugin_of_another_pjrt_version(tmp_path):
    output = start_torch_xla_on_gpu(tmp_path, TORCH_XLA_EXT_PJRT_PLUGIN=FAKE_PLUGIN_0_81)
    assert (f"client start failed: TorchXlaExtError: PJRT_DEVICE=GPU: {FAKE_PLUGIN_0_81} "
            "speaks PJRT C API 0.81, but torch_xla 2.9 speaks 0.75" in output), output[-3000:]
    assert "active: False" in output, output[-3000:]
