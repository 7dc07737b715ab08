"""bench/tp_bench.py (what `tools/device/run.sh tp2` runs on two GPUs), here on 2 virtual CPU
devices with its small float32 layer: the same code checks TP=2 against TP=1."""

import json
import os
import subprocess
import sys


def test_tp2_layer_matches_tp1_on_cpu_devices(tmp_path):
    out = tmp_path / "tp.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, os.path.join("bench", "tp_bench.py"), "--platform",
                             "cpu", "--small", "--tp", "2", "--steps", "3", "--out", str(out)],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    check = report["tp_vs_1"]
    assert check["ok"] and check["hlo_only_all_reduce"] and check["tolerance"] == 1e-4
    assert check["key_cache_max_abs_diff"] <= 1e-4 * check["key_cache_max_abs"]
    assert report["runs"]["1"]["hlo_collectives"] == []
    assert report["runs"]["2"]["hlo_all_reduces"] == 2  # attention output and MLP projections
