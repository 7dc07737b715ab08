"""torch_xla 2.9 on a real NVIDIA GPU (PJRT_DEVICE=GPU), proved in two processes
(tools/device/torch_xla_gpu.sh run):

  check:   torch 2.9 + torch_xla 2.9 as staged (no CUDA torch), PJRT_DEVICE=GPU. The seed
           example; paged attention, ragged paged attention (vLLM's torch.ops.xla op) and the
           KV write through torch_xla on the GPU, each against its float64 reference; whether the
           KV write kept the cache's device buffer; Engine(backend="torch_xla") greedy tokens on
           the tiny float32 Llama against transformers'. Saves inputs, results and tokens.
  compare: the GPU machine's own torch (CUDA) and JAX. The saved inputs through the same CUDA
           handlers called eagerly on CUDA tensors (torch.ops.xla_ext), and the engine through
           torchax on the GPU; each set beside what check saved. Writes the record (JSON).

Each check is recorded with its numbers and a pass flag; the exit status is 1 if any failed.
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PAGED_SEQ_LENS = [1, 100, 200, 256]


def _max_error(got, want):
    return float((got.double() - want.double()).abs().max()) if got.numel() else 0.0


def _within(got, want, dtype):
    from torch_xla_ext import sample_inputs

    atol, rtol = sample_inputs.TOLERANCES[dtype]
    return bool(torch.allclose(got.double(), want.double(), atol=atol, rtol=rtol))


def check(args):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    import torch_xla_ext
    from tests import reference
    from tests.serving.common import ARRIVALS, ENGINE_ARGS, MAX_NEW_TOKENS, prompts
    from torch_xla_ext import plugin, sample_inputs
    from torch_xla_ext.serving import Engine, hf

    device = torch_xla.device()
    record = {"pjrt_device": os.environ.get("PJRT_DEVICE"), "device_type": xr.device_type(),
              "device": str(device), "devices": xr.global_runtime_device_count(),
              "torch": torch.__version__, "torch_xla": torch_xla.__version__,
              "torch_cuda_available": torch.cuda.is_available(), "plugin": plugin.status(),
              "checks": {}}
    saved = {}

    def checked(name, passed, **numbers):
        record["checks"][name] = {"passed": bool(passed), **numbers}
        print(f"{'PASS' if passed else 'FAIL'} {name} {numbers}", flush=True)

    # The seed example, verbatim.
    a = torch.tensor([1.0, 2.0, 3.0], device=device)
    b = torch.tensor([4.0, 5.0, 6.0], device=device)
    out = torch_xla._XLAC._xla_gpu_custom_call([a, b], "", [[3]], [torch.float32],
                                               target="XlaGpuSimpleAdd")[0]
    in_hlo = 'custom_call_target="XlaGpuSimpleAdd"' in torch_xla._XLAC._get_xla_tensors_hlo([out])
    result = out.cpu().tolist()
    checked("seed_example", result == [5.0, 7.0, 9.0] and in_hlo, result=result,
            custom_call_in_hlo=in_hlo)

    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        inputs = sample_inputs.paged_attention(PAGED_SEQ_LENS, num_heads=32, num_kv_heads=8,
                                               head_size=128, block_size=16, dtype=dtype)
        got = torch.ops.xla_ext.paged_attention(**{k: v.to(device) for k, v in inputs.items()},
                                                scale=0.088).cpu()
        want = reference.paged_attention_ref(**inputs, scale=0.088)
        checked(f"paged_attention_{tag}", _within(got, want, dtype),
                max_error_vs_reference=_max_error(got, want))
        saved[f"paged_attention_{tag}"] = {"inputs": inputs, "attrs": {"scale": 0.088},
                                           "xla": got}

        inputs = sample_inputs.ragged_paged_attention(
            **sample_inputs.MIXED_BATCH, num_q_heads=8, num_kv_heads=2, head_dim=128,
            page_size=16, dtype=dtype, max_num_seqs=8, padding_rows=5)
        attrs = dict(sm_scale=0.088, sliding_window=64, soft_cap=30.0)
        on_xla = {k: v.to(device) for k, v in inputs.items()}
        got = torch.ops.xla.ragged_paged_attention(**on_xla, **attrs)
        in_hlo = ('custom_call_target="xla_ext.ragged_paged_attention"'
                  in torch_xla._XLAC._get_xla_tensors_hlo([got]))
        got = got.cpu()
        want = reference.ragged_paged_attention_ref(**inputs, **attrs)
        rows = int(inputs["cu_q_lens"][int(inputs["num_seqs"][0])])
        checked(f"ragged_paged_attention_{tag}", _within(got[:rows], want[:rows], dtype)
                and in_hlo and not torch.count_nonzero(got[rows:]),
                max_error_vs_reference=_max_error(got[:rows], want[:rows]), rows=rows,
                custom_call_in_hlo=in_hlo)
        saved[f"ragged_paged_attention_{tag}"] = {"inputs": inputs, "attrs": attrs, "xla": got}

        inputs = sample_inputs.kv_cache_update(5, 2, 64, 6, 16, dtype, skipped=1)
        want = reference.kv_cache_update_ref(inputs["key"], inputs["value"], inputs["kv_cache"],
                                             inputs["slot_mapping"])
        cache = inputs["kv_cache"].to(device)
        torch_xla.sync()
        xm.wait_device_ops()  # the buffer exists once the step that makes it has run
        before = torch_xla._XLAC._unsafe_buffer_pointer(cache)
        torch.ops.xla_ext.kv_cache_update(inputs["key"].to(device), inputs["value"].to(device),
                                          cache, inputs["slot_mapping"].to(device))
        torch_xla.sync()
        xm.wait_device_ops()
        after = torch_xla._XLAC._unsafe_buffer_pointer(cache)
        got = cache.cpu()
        checked(f"kv_cache_update_{tag}", torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                and before == after, bit_equal_to_reference=torch.equal(got, want),
                same_device_buffer=before == after)
        saved[f"kv_cache_update_{tag}"] = {"inputs": inputs, "attrs": {}, "xla": got}

    model = hf.random_model(hf.TINY, seed=0)
    eos = model.config.eos_token_id
    expected = [hf.reference_generate(model, p, MAX_NEW_TOKENS, eos)[0]
                for p in prompts(model.config.vocab_size)]
    tokens = {}
    for mode in (True, False):
        engine = Engine(model, backend="torch_xla", async_scheduling=mode, **ENGINE_ARGS)
        tokens[mode] = engine.generate(prompts(model.config.vocab_size), MAX_NEW_TOKENS,
                                       ARRIVALS, eos_token_id=eos)
        checked(f"engine_torch_xla_{'async' if mode else 'sync'}_tokens_equal_transformers",
                tokens[mode] == expected, sequences=len(expected),
                tokens=sum(map(len, expected)))
    saved["engine_tokens"] = {"torch_xla": tokens[True], "transformers": expected}
    torch.save(saved, args.saved)
    with open(args.record, "w") as f:
        json.dump(record, f, indent=1)
    return all(c["passed"] for c in record["checks"].values())


def compare(args):
    import torch_xla_ext  # noqa: F401  (torch.ops.xla_ext.* on CUDA tensors)
    from tests.serving.common import ARRIVALS, ENGINE_ARGS, MAX_NEW_TOKENS, prompts
    from torch_xla_ext.serving import Engine, hf

    with open(args.record) as f:
        record = json.load(f)
    saved = torch.load(args.saved)
    record["compared_with"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    cuda_ops = {"paged_attention": torch.ops.xla_ext.paged_attention,
                "ragged_paged_attention": torch.ops.xla_ext.ragged_paged_attention}

    def checked(name, passed, **numbers):
        record["checks"][name] = {"passed": bool(passed), **numbers}
        print(f"{'PASS' if passed else 'FAIL'} {name} {numbers}", flush=True)

    for name, case in saved.items():
        if name == "engine_tokens":
            continue
        on_cuda = {k: v.cuda() for k, v in case["inputs"].items()}
        if name.startswith("kv_cache_update"):
            torch.ops.xla_ext.kv_cache_update(**on_cuda)
            got = on_cuda["kv_cache"].cpu()
        else:
            got = cuda_ops[name.rsplit("_", 1)[0]](**on_cuda, **case["attrs"]).cpu()
        xla = case["xla"]
        if name.startswith("ragged"):  # rows past the last sequence's are not compared
            rows = record["checks"][name]["rows"]
            got, xla = got[:rows], xla[:rows]
        checked(f"{name}: torch_xla GPU == torch CUDA op", torch.equal(got, xla),
                max_difference=_max_error(got, xla))

    model = hf.random_model(hf.TINY, seed=0)
    engine = Engine(model, backend="torchax", **ENGINE_ARGS)
    tokens = engine.generate(prompts(model.config.vocab_size), MAX_NEW_TOKENS, ARRIVALS,
                             eos_token_id=model.config.eos_token_id)
    checked("engine tokens: torch_xla GPU == torchax GPU",
            tokens == saved["engine_tokens"]["torch_xla"],
            sequences=len(tokens), tokens=sum(map(len, tokens)))
    record["all_passed"] = all(c["passed"] for c in record["checks"].values())
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}: all passed: {record['all_passed']}", flush=True)
    return record["all_passed"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["check", "compare"])
    parser.add_argument("--saved", default="/tmp/torch_xla_gpu_saved.pt",
                        help="inputs and results, from check to compare")
    parser.add_argument("--record", default="/tmp/torch_xla_gpu_check.json",
                        help="check's record, which compare completes")
    parser.add_argument("--out", help="compare: the record's path")
    args = parser.parse_args()
    sys.exit(0 if {"check": check, "compare": compare}[args.stage](args) else 1)


if __name__ == "__main__":
    main()
