"""vLLM 0.13's own engine generating through XLA and torch_xla_ext's kernels, on a GPU
(PJRT_DEVICE=GPU) or on the CPU: `tools/device/torch_xla_gpu.sh run vllm` runs it on the GPU
machine, in the staged torch_xla + vLLM tree (torch_xla_closure.py stage --vllm).

    python3 tools/device/vllm_gpu.py --out FILE [--models tiny,1b]

Each model is a random-weight Llama saved with save_pretrained, as a user's checkpoint:
- tiny: float32 (hf.TINY); vLLM's greedy tokens against transformers' greedy generate;
- 1b: the serving benchmark's 1B-class config in bfloat16; vLLM's greedy tokens against our
  Engine's (backend torch_xla) on the same device, each in its own process, with the first
  divergence where they differ.
vLLM and the Engine each run in a process of their own (each takes the device's memory), and
the record holds, per model, the tokens, whether they agree, vLLM's start time (process start
to its first token, every compile included), its KV cache (blocks, shape), and errors.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 16
PROMPT_LENS = (5, 17, 40, 9)
LIMITS = {"tiny": dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64),
          "1b": dict(max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=256)}
# vLLM's TPU model runner made the KV cache with torch.zeros on the host, then moved it: sized
# from the GPU's free memory (0.9 of 141 GB) it outgrew the host's and the engine process was
# killed. Our worker's model runner now makes it on the device (vllm_platform/worker.py), not
# yet run on a GPU; until it has, these runs give vLLM a cache size.
KV_CACHE_BYTES = 4 << 30


def _prompts(vocab_size):
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _config(model):
    from torch_xla_ext.serving import hf

    return {"tiny": hf.TINY, "1b": hf.LLAMA_1B}[model]


def save_checkpoint(model, directory):
    import torch

    from torch_xla_ext.serving import hf

    dtype = torch.float32 if model == "tiny" else torch.bfloat16
    llama = hf.random_model(_config(model), seed=0, dtype=dtype)
    llama.config.torch_dtype = dtype
    llama.save_pretrained(directory)
    return llama


def run_vllm(model, directory):
    """In this process: vLLM's LLM on the checkpoint; its tokens and what it chose."""
    started = time.time()
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    dtype = "float32" if model == "tiny" else "bfloat16"
    llm = LLM(model=directory, dtype=dtype, skip_tokenizer_init=True,
              kv_cache_memory_bytes=KV_CACHE_BYTES, **LIMITS[model])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts(_config(model)["vocab_size"])
    first = llm.generate([{"prompt_token_ids": prompts[0]}],
                         SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    start_s = time.time() - started
    tic = time.time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    generate_s = time.time() - tic
    cache = llm.llm_engine.vllm_config.cache_config
    return {"platform": type(current_platform).__qualname__,
            "device": current_platform.get_device_name(),
            "first_token": list(first[0].outputs[0].token_ids),
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "start_to_first_token_s": round(start_s, 1),
            "generate_s": round(generate_s, 2),
            "num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
            "gpu_memory_utilization": cache.gpu_memory_utilization}


def run_engine(model, directory):
    """In this process: our Engine (torch_xla backend) on the same checkpoint."""
    import torch
    import transformers

    from torch_xla_ext.serving import Engine

    dtype = torch.float32 if model == "tiny" else torch.bfloat16
    llama = transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=dtype).eval()
    engine = Engine(llama, backend="torch_xla", dtype=dtype, page_size=16, **LIMITS[model])
    return {"tokens": engine.generate(_prompts(_config(model)["vocab_size"]), MAX_TOKENS)}


def run_transformers(model, directory):
    import torch
    import transformers

    from torch_xla_ext.serving import hf

    llama = transformers.LlamaForCausalLM.from_pretrained(directory,
                                                          torch_dtype=torch.float32).eval()
    return {"tokens": [hf.reference_generate(llama, p, MAX_TOKENS)[0]
                       for p in _prompts(_config(model)["vocab_size"])]}


def _child(what, model, directory, timeout):
    """Runs one of run_vllm, run_engine, run_transformers in a process of its own."""
    tic = time.time()
    result = subprocess.run([sys.executable, __file__, "--child", what, model, directory],
                            capture_output=True, text=True, timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        tail = [line for line in result.stderr.splitlines()
                if "Error" in line or "error" in line or "Traceback" in line][-12:]
        return {"error": f"exit {result.returncode}", "stderr_tail": tail or
                result.stderr.splitlines()[-20:], "wall_s": round(time.time() - tic, 1)}
    return {**json.loads(lines[-1][len("RESULT "):]), "wall_s": round(time.time() - tic, 1)}


def _divergence(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return {"prompt": i, "token": next(k for k, (x, y) in enumerate(zip(a + [None], b))
                                               if x != y)}
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=False)
    parser.add_argument("--models", default="tiny,1b")
    parser.add_argument("--work", default="/tmp/vllm_gpu")
    parser.add_argument("--child", nargs=3, metavar=("WHAT", "MODEL", "DIR"))
    args = parser.parse_args()
    sys.path.append(ROOT)  # after PYTHONPATH, which may hold another build of the package
    if args.child:
        what, model, directory = args.child
        fn = {"vllm": run_vllm, "engine": run_engine, "transformers": run_transformers}[what]
        print("RESULT " + json.dumps(fn(model, directory)), flush=True)
        return 0
    record = {"pjrt_device": os.environ.get("PJRT_DEVICE"), "models": {}}
    status = 0
    for model in args.models.split(","):
        directory = os.path.join(args.work, model)
        if not os.path.exists(os.path.join(directory, "config.json")):
            save_checkpoint(model, directory)
        entry = {"vllm": _child("vllm", model, directory, 900)}
        reference = "transformers" if model == "tiny" else "engine"
        entry[reference] = _child(reference, model, directory, 900)
        got, want = entry["vllm"].get("tokens"), entry[reference].get("tokens")
        entry["equal_to"] = reference
        entry["equal"] = got is not None and got == want
        entry["first_divergence"] = _divergence(got, want) if got and want else None
        status |= not entry["equal"]
        record["models"][model] = entry
        print(f"{'PASS' if entry['equal'] else 'FAIL'} {model}: vLLM tokens "
              f"{'==' if entry['equal'] else '!='} {reference}'s; vLLM start to first token "
              f"{entry['vllm'].get('start_to_first_token_s')} s; blocks "
              f"{entry['vllm'].get('num_gpu_blocks')}; errors "
              f"{[k for k, v in entry.items() if isinstance(v, dict) and 'error' in v]}",
              flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
