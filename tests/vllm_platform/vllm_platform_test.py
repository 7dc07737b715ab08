"""vLLM itself on XLA's CPU through torch_xla_ext.vllm_platform, as a user runs it: the built
wheel installed into a fresh venv (its entry point makes vLLM pick the platform; nothing else
is set but PJRT_DEVICE=CPU), a tiny random Llama saved as a checkpoint, then

- `vllm.LLM(...).generate` with prompt token ids: greedy tokens equal to transformers' and to
  our Engine's, for more requests than max_num_seqs, of different lengths, one longer than
  the step's token budget (chunked prefill), and logprobs equal to transformers'; the step's
  optimised HLO holds our custom calls (ragged attention, the KV write) and donates every
  layer's cache;
- `vllm serve` answering OpenAI /v1/completions on loopback, from an HTTP client, with the same
  tokens, streamed too, and vLLM's error for a bad request, after which it serves the next;
- the README's `vllm serve` line and `LLM` example, as written there (<checkpoint> filled in);
- `LLM` after torch work in the same process (a CPU matmul, a torch_xla graph, transformers'
  forward) starts, generates and exits without an error; killed, it leaves no engine process.
"""

import glob
import json
import os
import re
import shlex
import sys
import subprocess
import textwrap
import threading
import time

import pytest
import torch

from bench import vllm_serve_load
from tests.serving.common import PROMPT_LENS
from tests.vllm_platform.common import installed, vllm_env  # noqa: F401  (installed: a fixture)
from torch_xla_ext.serving import Engine, hf

README = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
MAX_TOKENS = 8
# More requests (8) than max_num_seqs (4); the last is longer than the token budget (64).
LIMITS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, model): a tiny random Llama in float32, saved as transformers saves it."""
    model = hf.random_model(hf.TINY, seed=0)
    directory = str(tmp_path_factory.mktemp("tiny_llama"))
    model.config.torch_dtype = torch.float32
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def prompts(checkpoint):
    g = torch.Generator().manual_seed(7)
    lens = PROMPT_LENS + [2, 100]
    return [torch.randint(0, hf.TINY["vocab_size"], (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def expected(checkpoint, prompts):
    _, model = checkpoint
    return [hf.reference_generate(model, p, MAX_TOKENS)[0] for p in prompts]


_GENERATE = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform
    directory, prompts, max_tokens, limits = json.loads(sys.argv[1])
    llm = LLM(model=directory, dtype="float32", skip_tokenizer_init=True, **limits)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    with_logprobs = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2))
    print("RESULT", json.dumps({"platform": type(current_platform).__qualname__,
                                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                                "logprobs": [{t: lp.logprob for t, lp in step.items()} for step
                                             in with_logprobs[0].outputs[0].logprobs]}),
          flush=True)
""")


def test_llm_generates_the_tokens_of_transformers_and_our_engine(installed, checkpoint, prompts,
                                                                  expected, tmp_path):
    python, _ = installed
    directory, model = checkpoint
    dump = tmp_path / "hlo"
    result = subprocess.run(
        [python, "-c", _GENERATE, json.dumps([directory, prompts, MAX_TOKENS, LIMITS])],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env=vllm_env(tmp_path, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    got, = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert got["platform"] == "XlaPlatform"
    assert got["tokens"] == expected
    # logprobs (vLLM 0.13's TPU runner returned them as the engine could not send them, and
    # the request hung): the top 2 of transformers' distribution at each token.
    _, logits = hf.reference_generate(model, prompts[0], MAX_TOKENS)
    for step, step_logits in zip(got["logprobs"], logits, strict=True):
        top = torch.log_softmax(step_logits, -1).topk(2)
        assert sorted(map(int, step)) == sorted(top.indices.tolist())
        for token, logprob in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(step[str(token)] - logprob) < 1e-3, (step, token, logprob)
    engine = Engine(model, backend="torchax", page_size=16, **LIMITS)
    assert engine.generate(prompts, MAX_TOKENS) == expected

    # vLLM's model step: our kernels in it, every layer's cache donated and none copied.
    steps = [open(p).read() for p in glob.glob(str(dump / "*after_optimizations.txt"))]
    steps = [m for m in steps if 'custom_call_target="xla_ext.ragged_paged_attention"' in m]
    assert steps, "no compiled module calls xla_ext.ragged_paged_attention"
    for module in steps:
        assert 'custom_call_target="xla_ext.kv_cache_update_slices"' in module
        # The cache keeps head size 64 ([pages, 16, 2 * 2 kv heads, 64]), unpadded to 128.
        assert re.search(r"f32\[\d+,16,4,64\]", module)
        assert not re.search(r"f32\[\d+,16,4,128\]", module)
        header = module.splitlines()[0]
        assert header.count("may-alias") >= hf.TINY["num_hidden_layers"], header
        caches = {line.split("= ")[1].split(" ")[0] for line in module.splitlines()
                  if 'custom_call_target="xla_ext.kv_cache_update_slices"' in line}
        assert not [line for line in module.splitlines()
                    if " copy(" in line and any(f"= {c}" in line for c in caches)]


_TORCH_WORK_FIRST = textwrap.dedent("""
    import json, sys, time
    import torch
    directory, limits = json.loads(sys.argv[1])
    torch.randn(512, 512) @ torch.randn(512, 512)                  # torch's CPU (OpenMP)
    import torch_xla
    (torch.ones(4, device=torch_xla.device()) * 2).cpu()           # a torch_xla graph
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(directory)(torch.tensor([[1, 2, 3]]))
    from vllm import LLM, SamplingParams
    llm = LLM(model=directory, dtype="float32", skip_tokenizer_init=True, **limits)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    print("RESULT", json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
    if len(sys.argv) > 2:
        print("READY", flush=True)
        time.sleep(600)  # until killed
""")


def test_llm_starts_after_torch_work_and_exits_cleanly(installed, checkpoint, tmp_path):
    python, _ = installed
    directory, model = checkpoint
    result = subprocess.run([python, "-c", _TORCH_WORK_FIRST, json.dumps([directory, LIMITS])],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env=vllm_env(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    got, = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert got == hf.reference_generate(model, [1, 2, 3], 4)[0]
    errors = [line for line in (result.stdout + result.stderr).splitlines()
              if "ERROR" in line or "died unexpectedly" in line]
    assert errors == [], "\n".join(errors)


def test_a_killed_llm_process_leaves_no_engine_process(installed, checkpoint, tmp_path):
    import psutil

    python, _ = installed
    directory, _ = checkpoint
    process = subprocess.Popen([python, "-c", _TORCH_WORK_FIRST, json.dumps([directory, LIMITS]),
                                "wait"], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, env=vllm_env(tmp_path))
    ready = threading.Event()

    def watch():
        for line in process.stdout:
            if line.startswith("READY"):
                ready.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        assert ready.wait(timeout=600), "LLM did not start within 600 s"
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "vLLM started no engine process"
        process.kill()
        process.wait()
        gone, alive = psutil.wait_procs(children, timeout=60)
        assert alive == [], [" ".join(p.cmdline()) for p in alive]
    finally:
        process.kill()


def test_a_max_model_len_the_pallas_backend_pages_by_256_starts(installed, tmp_path):
    """vLLM's Pallas backend picks page size 256 for max_model_len 2049-8192; our kernels take
    8-128, so the platform takes 128, and the model generates transformers' tokens."""
    python, _ = installed
    model = hf.random_model(dict(hf.TINY, max_position_embeddings=8192), seed=1)
    model.config.torch_dtype = torch.float32
    directory = str(tmp_path / "long")
    model.save_pretrained(directory)
    limits = dict(LIMITS, max_model_len=4096)
    result = subprocess.run([python, "-c", _GENERATE, json.dumps([directory, [[5, 6, 7]], 4, limits])],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env=vllm_env(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert "KV page size 128 (the Pallas backend chose 256" in result.stderr + result.stdout
    got, = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert got["tokens"] == [hf.reference_generate(model, [5, 6, 7], 4)[0]]


def test_the_readmes_llm_example(installed, checkpoint, tmp_path):
    python, _ = installed
    directory, model = checkpoint
    example, = [b for b in re.findall(r"```python\n(.*?)```", README, re.S)
                if b.startswith("from vllm import LLM")]
    result = subprocess.run([python, "-c", example.replace("<checkpoint>", directory)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=900,
                            env=vllm_env(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    printed = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert printed[-1] == str(hf.reference_generate(model, [1, 2, 3], 8)[0])


def _readme_serve_command(directory):
    """The README's `vllm serve` line, <checkpoint> filled in, without its PJRT_DEVICE=CPU
    prefix (the environment gives it)."""
    line, = [line for line in README.splitlines() if " vllm serve " in line]
    words = shlex.split(line.replace("<checkpoint>", directory))
    assert words[0] == "PJRT_DEVICE=CPU" and words[1:3] == ["vllm", "serve"], words
    return words[1:]


@pytest.fixture(scope="module")
def server(installed, checkpoint, tmp_path_factory):
    """The README's `vllm serve <checkpoint> ...` on loopback: vLLM's console script, which
    finds the platform through the wheel installed in the fresh venv; its base URL."""
    _, site = installed
    directory, _ = checkpoint
    tmp = tmp_path_factory.mktemp("serve")
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")  # the project venv's script
    command = [vllm, *_readme_serve_command(directory)[1:]]
    with vllm_serve_load.running_server(command, tmp / "server.log", cwd=tmp,
                                        env=dict(vllm_env(tmp), PYTHONPATH=site)) as (url, _):
        yield url, directory


def _completion(url, model, prompt, **fields):
    import httpx

    return httpx.post(url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **fields})


def test_vllm_serve_answers_completions_with_the_same_tokens(server, prompts, expected):
    url, model = server
    for prompt, want in zip(prompts[:3], expected[:3]):
        response = _completion(url, model, prompt)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == want


def test_vllm_serve_streams_the_same_tokens(server, prompts, expected):
    import httpx

    url, model = server
    tokens = []
    with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": prompts[1], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
    assert tokens == expected[1]


def test_a_bad_request_gets_vllms_error_and_the_next_is_served(server, prompts, expected):
    url, model = server
    out_of_vocabulary = _completion(url, model, [1, 2, hf.TINY["vocab_size"] + 5])
    assert out_of_vocabulary.status_code == 400, out_of_vocabulary.text
    assert "Token id 517 is out of vocabulary" in out_of_vocabulary.text
    too_long = _completion(url, model, prompts[0], max_tokens=1000)
    assert too_long.status_code == 400 and "maximum context length" in too_long.text, too_long.text
    good = _completion(url, model, prompts[2])
    assert good.status_code == 200 and good.json()["choices"][0]["token_ids"] == expected[2]


@pytest.mark.parametrize("fields, named", [
    ({"logit_bias": {"5": 100.0}}, "logit_bias"),
    ({"allowed_token_ids": [7]}, "allowed_token_ids"),
    ({"repetition_penalty": 10.0}, "repetition_penalty=10.0"),
    ({"presence_penalty": 2.0}, "presence_penalty=2.0"),
    ({"frequency_penalty": 1.0}, "frequency_penalty=1.0"),
    ({"prompt_logprobs": 1}, "prompt_logprobs=1"),
])
def test_a_sampling_field_the_xla_sampler_ignores_is_refused_by_name(server, prompts, expected,
                                                                     fields, named):
    """vLLM's XLA sampler keeps these but never applies them (a greedy request with them
    returned the plain greedy tokens): refused with a 400 naming the field, then the next
    request is served."""
    url, model = server
    refused = _completion(url, model, prompts[0], **fields)
    assert refused.status_code == 400, refused.text
    assert "Unsupported sampling parameters on the XLA platform" in refused.text
    assert named in refused.text, refused.text
    good = _completion(url, model, prompts[2])
    assert good.status_code == 200 and good.json()["choices"][0]["token_ids"] == expected[2]


def test_the_kv_cache_on_the_cpu_stays_within_its_budget(monkeypatch):
    """On the CPU the cache takes what max_num_seqs sequences of max_model_len need, within
    VLLM_CPU_KVCACHE_SPACE GiB (vLLM's own CPU backend's budget), else half the host's memory."""
    import psutil
    from types import SimpleNamespace

    from torch_xla_ext.vllm_platform.worker import XlaWorker

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    page = 1 << 20  # bytes per block, all layers

    def worker(max_num_seqs, max_model_len):
        return SimpleNamespace(
            cache_config=SimpleNamespace(kv_cache_memory_bytes=None, block_size=16),
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
            model_config=SimpleNamespace(max_model_len=max_model_len),
            model_runner=SimpleNamespace(get_kv_cache_spec=lambda: {
                "layer": SimpleNamespace(page_size_bytes=page)}))

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert XlaWorker.determine_available_memory(worker(4, 128)) == 4 * 8 * page
    assert XlaWorker.determine_available_memory(worker(1024, 4096)) == 1 << 30
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert XlaWorker.determine_available_memory(worker(1 << 20, 1 << 20)) == \
        psutil.virtual_memory().total // 2


def test_the_kv_cache_on_a_gpu_leaves_the_profile_runs_peak_and_a_slack():
    """On a GPU the cache takes the allocator's limit less the profile run's peak (weights and a
    step's working memory) and GPU_SLACK of the limit; the bytes in use stand in for a peak the
    plugin does not report; a limit the peak fills leaves no cache rather than a negative one."""
    from torch_xla_ext.vllm_platform.worker import GPU_SLACK, gpu_kv_cache_bytes

    gib = 1 << 30
    limit = 100 * gib
    assert gpu_kv_cache_bytes({"bytes_limit": limit, "bytes_used": 3 * gib,
                               "peak_bytes_used": 5 * gib}) == limit - 5 * gib - GPU_SLACK * limit
    assert gpu_kv_cache_bytes({"bytes_limit": limit, "bytes_used": 3 * gib}) == \
        limit - 3 * gib - GPU_SLACK * limit
    assert gpu_kv_cache_bytes({"bytes_limit": limit, "bytes_used": limit,
                               "peak_bytes_used": limit}) == 0
