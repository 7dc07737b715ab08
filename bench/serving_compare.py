"""The serving loop against transformers on the same GPU: greedy tokens and logits of a batch of
prompts of different lengths arriving at different steps, through the engine (torchax, one
jax.jit step, our CUDA handlers) and through transformers' own generate (torch, sdpa), per
request: whether the tokens are equal, the first new token where they differ, the largest
logit difference up to there (the inputs are the same until then) and the margin between
transformers' top two logits at that token (a near-tie flips on rounding).

Cases: the 1B-class Llama in bfloat16 (random weights), and the tiny Llama in float32 with
XLA's matmuls at full float32 precision (JAX's default on GPUs is TF32; torch's is float32),
where the tokens should be equal.

    python bench/serving_compare.py --out bench/results/h100-serving-compare.json
    python bench/serving_compare.py --device cpu --cases tiny_float32,tiny_bfloat16 --out /tmp/compare.json
"""

import argparse
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

from torch_xla_ext.serving import Engine, hf  # noqa: E402

PROMPT_LENS = [7, 33, 100, 260, 511, 1000, 64, 17]
ARRIVALS = [0, 0, 1, 2, 3, 5, 8, 13]
CASES = {"llama_1b_bfloat16": (hf.LLAMA_1B, torch.bfloat16),
         "tiny_float32": (hf.TINY, torch.float32),
         "tiny_bfloat16": (hf.TINY, torch.bfloat16)}
DEFAULT_CASES = "tiny_float32,llama_1b_bfloat16"


def compare_request(ours, our_logits, want, want_logits):
    """What differs between our tokens/logits and transformers' for one request."""
    first = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None)
    if first is None and len(ours) != len(want):
        first = min(len(ours), len(want))
    # Both saw the same tokens up to and including step `last`.
    last = min(len(ours), len(want)) - 1 if first is None else min(first, len(ours) - 1,
                                                                  len(want) - 1)
    diffs = [float((torch.as_tensor(our_logits[i]) - want_logits[i]).abs().max())
             for i in range(last + 1)]
    result = {"tokens_equal": ours == want, "num_tokens": [len(ours), len(want)],
              "first_divergence": first,
              "max_abs_logit_diff_up_to_divergence": round(max(diffs), 5),
              "abs_logit_diff_first_token": round(diffs[0], 5),
              "max_abs_logit": round(float(want_logits[0].abs().max()), 3)}
    if first is not None and first < min(len(ours), len(want)):
        top2 = want_logits[first].topk(2).values
        result.update(ours_at_divergence=ours[first], transformers_at_divergence=want[first],
                      transformers_top2_margin=round(float(top2[0] - top2[1]), 5))
    return result


def run_case(name, args):
    import jax

    config, dtype = CASES[name]
    # Full float32 matmuls in XLA for the float32 case (JAX's GPU default is TF32).
    jax.config.update("jax_default_matmul_precision",
                      "highest" if dtype == torch.float32 else None)
    model = hf.random_model(config, args.seed, dtype, args.device)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, config["vocab_size"], (n,), generator=g).tolist()
               for n in PROMPT_LENS]
    eos = model.config.eos_token_id
    start = time.perf_counter()
    engine = Engine(model, backend="torchax", dtype=dtype, max_num_seqs=len(prompts),
                    max_num_batched_tokens=512, smallest_bucket=64,
                    max_model_len=max(PROMPT_LENS) + args.max_new_tokens, with_logits=True)
    logits = {}

    def on_step(out):
        for seq_id, row in out.logits.items():
            logits.setdefault(seq_id, []).append(row)

    ours = engine.generate(prompts, args.max_new_tokens, ARRIVALS, eos_token_id=eos,
                           on_step=on_step)
    engine_s = time.perf_counter() - start
    buckets = sorted(engine.buckets_used)
    del engine
    requests = []
    # Sequence ids follow arrival order, which is prompt order here (ARRIVALS ascends).
    for i, prompt in enumerate(prompts):
        want, want_logits = hf.reference_generate(model, prompt, args.max_new_tokens, eos)
        # transformers' own forward of the prompt against its generate's first logits (on the
        # CPU, transformers 5.17's generate differs from its forward for some long prompts).
        with torch.no_grad():
            forward = model(torch.tensor([prompt], device=args.device)).logits[0, -1].float()
        requests.append(dict(
            prompt_len=len(prompt), arrival_step=ARRIVALS[i],
            **compare_request(ours[i], logits[i], want, want_logits),
            abs_logit_diff_first_token_vs_transformers_forward=round(
                float((torch.as_tensor(logits[i][0]) - forward.cpu()).abs().max()), 5),
            transformers_forward_vs_generate_first_token=round(
                float((forward.cpu() - want_logits[0]).abs().max()), 5)))
    summary = {"case": name, "dtype": str(dtype).replace("torch.", ""),
               "requests_equal": sum(r["tokens_equal"] for r in requests),
               "requests": requests, "engine_s": round(engine_s, 1),
               "compiled_buckets": buckets}
    print(f"{name}: {summary['requests_equal']}/{len(requests)} requests equal to "
          f"transformers; first divergences {[r['first_divergence'] for r in requests]}; "
          f"max logit diff up to divergence "
          f"{max(r['max_abs_logit_diff_up_to_divergence'] for r in requests):.4g}", flush=True)
    return summary


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "prompt_lens": PROMPT_LENS, "arrival_steps": ARRIVALS,
              "max_new_tokens": args.max_new_tokens, "cases": []}
    for name in args.cases.split(","):
        result["cases"].append(run_case(name, args))
        with open(args.out, "w") as f:  # after every case: a run cut short keeps what it did
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
