"""`vllm serve` through torch_xla_ext.vllm_platform on XLA's CPU, under a storm of what users
send (bench/vllm_serve_load.run_storm): 200 /v1/completions requests, 32 at a time, streamed
and not, one in five left mid-stream, one in twenty bad (a token id past the vocabulary,
max_tokens 0 and -1, a prompt longer than max_model_len, a sampling field the platform refuses).
The server runs with VLLM_XLA_CHECK_RECOMPILATION=1, so a graph compiled after its warm-up
fails the step, and with it the storm. Then:

- every good request's tokens are those of its prompt sent alone;
- every bad one got a 4xx whose message names what was wrong;
- the server still answers, no request is left in flight and the KV cache is empty again;
- the server's resident memory (its processes together) is within 10% of what it was after
  the first requests.

VLLM_STORM_REQUESTS sets the storm's size (200 in CI; more for a longer run).
"""

import os
import sys

import psutil
import pytest
import torch

from bench import vllm_serve_load
from tests.vllm_platform.common import installed, vllm_env  # noqa: F401  (installed: a fixture)
from torch_xla_ext.serving import hf

REQUESTS = int(os.environ.get("VLLM_STORM_REQUESTS", "200"))
LIMITS = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = hf.random_model(hf.TINY, seed=3)
    model.config.torch_dtype = torch.float32
    directory = str(tmp_path_factory.mktemp("tiny_llama"))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(installed, checkpoint, tmp_path_factory):
    """`vllm serve` on the checkpoint on loopback: (url, process, log path)."""
    _, site = installed
    tmp = tmp_path_factory.mktemp("serve")
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    command = [vllm, "serve", checkpoint, "--dtype", "float32", "--skip-tokenizer-init",
               *[f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]]
    with vllm_serve_load.running_server(command, tmp / "server.log", cwd=tmp,
                                        env=dict(vllm_env(tmp), PYTHONPATH=site)) as (url, process):
        yield url, process, tmp / "server.log"


def _resident_bytes(process):
    """The resident memory of the server: its process and all of its children."""
    tree = psutil.Process(process.pid)
    return sum(p.memory_info().rss for p in [tree, *tree.children(recursive=True)])


def test_the_server_survives_a_storm_and_comes_back_to_rest(server, checkpoint):
    url, process, log_path = server
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, hf.TINY["vocab_size"], (n,), generator=g).tolist()
               for n in (3, 9, 17, 30, 64, 100)]
    for prompt in prompts:  # warm-up: the first requests, then the memory to come back to
        assert vllm_serve_load.complete(url, checkpoint, prompt, 16)["status"] == 200
    rested = _resident_bytes(process)

    result = vllm_serve_load.run_storm(url, checkpoint, prompts, hf.TINY["vocab_size"],
                                       LIMITS["max_model_len"], count=REQUESTS, concurrency=32)
    assert result["wrong"] == {"good": [], "bad": [], "left": []}, result
    assert abs(result["requests"]["bad"] - REQUESTS / 20) <= 1, result["requests"]
    assert abs(result["requests"]["left"] - REQUESTS / 5) <= 1, result["requests"]

    seconds = vllm_serve_load.wait_until_idle(url)
    assert seconds is not None, (f"60 s after the storm: {vllm_serve_load.in_flight(url)} "
                                 f"requests in flight, KV cache usage "
                                 f"{vllm_serve_load.kv_cache_usage(url)}")
    after = vllm_serve_load.complete(url, checkpoint, prompts[2], 16)
    assert after["status"] == 200 and after["tokens"] == \
        vllm_serve_load.complete(url, checkpoint, prompts[2], 16)["tokens"]
    assert process.poll() is None
    grown = _resident_bytes(process) / rested
    assert grown < 1.10, f"resident memory grew {grown:.2f}x over the storm"
    # The API server logs each refused prompt as an ERROR with its traceback; the engine
    # process must log none (a recompilation after warm-up would be one).
    engine_errors = [line for line in log_path.read_text().splitlines()
                     if "EngineCore" in line and " ERROR " in line]
    assert engine_errors == [], "\n".join(engine_errors[-20:])
