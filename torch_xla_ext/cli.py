"""python -m torch_xla_ext {demo,doctor,generate}."""

import importlib.metadata
import importlib.util
import json
import os
import re
import sys

from absl import app, flags, logging

flags.DEFINE_bool("json", False, "doctor: print the report as JSON")
flags.DEFINE_string("checkpoint", None, "generate: a local transformers Llama checkpoint "
                    "directory (default: a tiny random Llama; nothing is downloaded)")
flags.DEFINE_integer("seed", 0, "generate: seed of the random model and the random prompts")
flags.DEFINE_list("prompt_lens", ["5", "17", "40", "9"],
                  "generate: lengths of random token prompts (unless --prompt is given)")
flags.DEFINE_multi_string("prompt", [], "generate: a text prompt (needs --checkpoint with a "
                          "tokenizer); repeat for several")
flags.DEFINE_integer("max_new_tokens", 16, "generate: tokens to generate per prompt")
flags.DEFINE_integer("arrive_every", 2, "generate: request i arrives at step i * this")
flags.DEFINE_enum("backend", "torch_xla", ["torch_xla", "torchax"], "generate: where steps run")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                  "generate: weights and caches (default: the model's)")
flags.DEFINE_integer("max_num_seqs", 4, "generate: sequences per step at most")
flags.DEFINE_integer("max_num_batched_tokens", 32, "generate: tokens per step at most "
                     "(longer prompts are prefilled in chunks)")
flags.DEFINE_integer("page_size", 16, "generate: tokens per KV-cache page")
flags.DEFINE_bool("async_scheduling", True, "generate: launch each step before the previous "
                  "one's tokens are read back (--noasync_scheduling: one step at a time)")
flags.DEFINE_bool("check", False, "generate: compare each request's tokens with transformers' "
                  "own greedy generate (exit status 1 where they differ)")
FLAGS = flags.FLAGS

USAGE = "usage: python -m torch_xla_ext {demo,doctor [--json],generate [--help for its flags]}"


def _custom_call_lines(hlo):
    """Each custom call of the HLO, shortened to what identifies it."""
    keep = ("custom_call_target=", "api_version=", "backend_config=", "output_to_operand_aliasing=")
    lines = []
    for line in hlo.splitlines():
        if "custom-call(" not in line:
            continue
        name, _, rest = line.strip().removeprefix("ROOT ").partition(" = ")
        shape = rest.split(" custom-call(")[0]
        fields = [f for f in re.split(r", (?=[a-z_]+=)", rest) if f.startswith(keep)]
        lines.append(f"{name} = {shape} custom-call(...), {', '.join(fields)}")
    return lines


def _check(name, got, want, atol, lines):
    import torch

    error = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    ok = got.shape == want.shape and error <= atol
    lines.append(f"  {name}: max |error| vs PyTorch = {error:.3g} (tolerance {atol:g}) "
                 f"{'OK' if ok else 'MISMATCH'}")
    return ok and torch.isfinite(got).all().item()


def _paged_attention_torch(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Decode attention the plain PyTorch way: gather each sequence's blocks, then SDPA."""
    import torch

    outputs = []
    block_size = key_cache.shape[1]
    for i, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : (seq_len + block_size - 1) // block_size].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].double()  # [seq_len, kv_heads, head]
        v = value_cache[blocks].flatten(0, 1)[:seq_len].double()
        q = query[i].double().unsqueeze(1)  # [heads, 1, head]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(1))
    return torch.stack(outputs)


def demo():
    import torch
    import torch_xla

    import torch_xla_ext
    from torch_xla_ext import sample_inputs

    device = torch_xla.device()
    print(f"torch_xla_ext {torch_xla_ext.__version__} on {device} "
          f"(PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}); no registration step was run.\n")
    ok = True

    print("1. The user's kernel, through the restored _xla_gpu_custom_call(target=...):")
    a = torch.tensor([1.0, 2.0, 3.0], device=device)
    b = torch.tensor([4.0, 5.0, 6.0], device=device)
    (out,) = torch_xla._XLAC._xla_gpu_custom_call([a, b], "", [[3]], [torch.float32],
                                                  target="XlaGpuSimpleAdd")
    for line in _custom_call_lines(torch_xla._XLAC._get_xla_tensors_hlo([out])):
        print("  HLO:", line)
    result = out.cpu()
    print(f"  [1, 2, 3] + [4, 5, 6] = {result.tolist()}")
    lines = []
    ok &= _check("XlaGpuSimpleAdd", result, torch.tensor([5.0, 7.0, 9.0]), 0.0, lines)

    print("\n2. One decode step: write this step's K/V into the paged cache, then attend:")
    torch.manual_seed(0)
    num_seqs, num_heads, num_kv_heads, head_size, block_size = 3, 8, 2, 64, 16
    # Lengths including this step's token.
    inputs = sample_inputs.paged_attention([5, 17, 33], num_heads, num_kv_heads, head_size,
                                           block_size, torch.float32)
    query, key_cache, value_cache = inputs["query"], inputs["key_cache"], inputs["value_cache"]
    block_tables, seq_lens = inputs["block_tables"], inputs["seq_lens"]
    new_key = torch.randn(num_seqs, num_kv_heads, head_size)
    new_value = torch.randn(num_seqs, num_kv_heads, head_size)
    positions = (seq_lens - 1).long()
    slots = block_tables.long().gather(1, (positions // block_size)[:, None])[:, 0] * block_size \
        + positions % block_size
    scale = head_size ** -0.5

    xla_key_cache, xla_value_cache = key_cache.to(device), value_cache.to(device)
    torch.ops.xla_ext.reshape_and_cache(new_key.to(device), new_value.to(device), xla_key_cache,
                                        xla_value_cache, slots.to(device))
    attn = torch.ops.xla_ext.paged_attention(query.to(device), xla_key_cache, xla_value_cache,
                                             block_tables.to(device), seq_lens.to(device), scale)
    for line in _custom_call_lines(torch_xla._XLAC._get_xla_tensors_hlo([attn, xla_key_cache])):
        print("  HLO:", line)
    torch_xla.sync()

    want_key_cache, want_value_cache = key_cache.clone(), value_cache.clone()
    want_key_cache.view(-1, num_kv_heads, head_size)[slots] = new_key
    want_value_cache.view(-1, num_kv_heads, head_size)[slots] = new_value
    want_attn = _paged_attention_torch(query, want_key_cache, want_value_cache, block_tables,
                                       seq_lens, scale)
    ok &= _check("xla_ext.reshape_and_cache (key_cache)", xla_key_cache.cpu(), want_key_cache, 0.0,
                 lines)
    ok &= _check("xla_ext.reshape_and_cache (value_cache)", xla_value_cache.cpu(),
                 want_value_cache, 0.0, lines)
    ok &= _check("xla_ext.paged_attention", attn.cpu(), want_attn, 1e-4, lines)

    print("\nResults against PyTorch:")
    print("\n".join(lines))
    print("\nAll results match PyTorch." if ok else "\nSOME RESULTS DO NOT MATCH PyTorch.")
    return 0 if ok else 1


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def doctor_report():
    import torch_xla_ext
    from torch_xla_ext import binders

    try:  # JAX is optional; where installed, its XLA gets the kernels too.
        import torch_xla_ext.jax_ops  # noqa: F401
    except ImportError as e:
        logging.info("JAX front end not available: %s", e)
    kernels_ffi = sorted({"%d.%d" % lib.ffi_version for lib in binders.libraries()})
    report = {
        "versions": {
            "torch_xla_ext": torch_xla_ext.__version__,
            "torch": _version("torch"),
            "torch_xla": _version("torch_xla"),
            "jax": _version("jax"),
            "jaxlib": _version("jaxlib"),
            "kernels_ffi_api": kernels_ffi[0] if len(kernels_ffi) == 1 else kernels_ffi,
        },
        "libraries": [{"path": lib.path, "ffi_api": "%d.%d" % lib.ffi_version,
                       "kernels": len(lib.kernels)} for lib in binders.libraries()],
        "runtimes": [runtime.describe() for runtime in binders.runtimes()],
        "targets": binders.registrations(),
    }
    if importlib.util.find_spec("torch_xla") is not None:
        from torch_xla_ext import plugin

        report["gpu_plugin"] = plugin.status()
    return report


def doctor():
    report = doctor_report()
    if FLAGS.json:
        print(json.dumps(report, indent=2))
        return 0
    print("versions:")
    for name, version in report["versions"].items():
        print(f"  {name:16} {version}")
    print("runtimes:")
    for runtime in report["runtimes"]:
        extra = f", FFI API {runtime['ffi_api']}" if "ffi_api" in runtime else ""
        print(f"  {runtime['name']:10} {runtime['kind']} {runtime['version']}{extra}; "
              f"platforms {', '.join(runtime['platforms'])}")
    if "gpu_plugin" in report:
        gpu = report["gpu_plugin"]
        state = "active in this process" if gpu["active"] else (
            "selected" if gpu["selected"] else "not selected")
        where = (f"{gpu['shim']} wrapping {gpu['wraps']}" if gpu["wraps"]
                 else f"unavailable: {gpu['problem']}")
        print(f"gpu plugin (PJRT_DEVICE={gpu['pjrt_device']}): {state}; {where}")
    print("targets:")
    for row in report["targets"]:
        where = ", ".join(row["registered_in"]) or "not registered in any runtime"
        print(f"  {row['target']:28} {row['platform']:5} -> {where}")
    return 0


def _generate_inputs():
    """(model, tokenizer or None, prompts as token ids, a line describing the model)."""
    import torch

    from torch_xla_ext.serving import hf

    dtype = getattr(torch, FLAGS.dtype) if FLAGS.dtype else None
    if FLAGS.checkpoint:
        model, tokenizer = hf.load_checkpoint(FLAGS.checkpoint, dtype)
        origin = f"checkpoint {FLAGS.checkpoint}"
    else:
        model, tokenizer = hf.random_model(hf.TINY, FLAGS.seed, dtype or torch.float32), None
        origin = f"random Llama (seed {FLAGS.seed})"
    c = model.config
    if FLAGS.prompt:
        if tokenizer is None:
            raise TorchXlaExtError("generate: --prompt needs a tokenizer: give --checkpoint a "
                                   "directory with tokenizer files, or use --prompt_lens")
        prompts = [tokenizer(text)["input_ids"] for text in FLAGS.prompt]
    else:
        g = torch.Generator().manual_seed(FLAGS.seed)
        prompts = [torch.randint(0, c.vocab_size, (int(n),), generator=g).tolist()
                   for n in FLAGS.prompt_lens]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    about = (f"{origin}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
             f"{c.num_attention_heads} heads on {c.num_key_value_heads} KV heads (head_dim "
             f"{head_dim}), vocab {c.vocab_size}, {str(model.dtype).replace('torch.', '')}")
    return model, tokenizer, prompts, about


def generate():
    """Runs prompts through the serving loop, printing tokens as they come and each step."""
    import time

    from torch_xla_ext.serving import Engine, hf

    model, tokenizer, prompts, about = _generate_inputs()
    eos = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else None

    def show(tokens):
        return repr(tokenizer.decode(tokens)) if tokenizer else " ".join(map(str, tokens))

    max_model_len = max(map(len, prompts)) + FLAGS.max_new_tokens
    engine = Engine(model, backend=FLAGS.backend, page_size=FLAGS.page_size,
                    max_num_seqs=FLAGS.max_num_seqs,
                    max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                    max_model_len=max_model_len, async_scheduling=FLAGS.async_scheduling)
    print(f"model: {about}")
    print(f"engine: {engine.backend.name} on {engine.backend.device}, "
          f"{'async' if engine.async_scheduling else 'synchronous'} scheduling; up to {FLAGS.max_num_seqs} "
          f"sequences and {FLAGS.max_num_batched_tokens} tokens per step, token buckets "
          f"{engine.buckets}, {engine.num_pages} KV pages of {FLAGS.page_size}")
    arrivals = [i * FLAGS.arrive_every for i in range(len(prompts))]
    for i, (prompt, step) in enumerate(zip(prompts, arrivals)):
        print(f"request {i}: {len(prompt)} prompt tokens, arrives at step {step}")
    total = len(prompts) * FLAGS.max_new_tokens
    generated = []
    start = time.perf_counter()

    def on_step(out):
        generated.extend(out.new_tokens.values())
        new = " ".join(f"r{i}={show([t])}" for i, t in out.new_tokens.items())
        print(f"step {out.step:4d} | seqs {out.num_seqs:2d} | tokens {out.num_tokens:4d} "
              f"({out.num_prefill_tokens} prefill, {out.num_tokens - out.num_prefill_tokens} "
              f"decode) | bucket {out.bucket:4d}{' (compiled)' if out.first_use_of_bucket else ''}"
              f" | {out.seconds * 1e3:8.1f} ms | generated {len(generated)}/{total} | {new}",
              flush=True)
        for i, tokens in out.finished.items():
            print(f"request {i} done: {show(tokens)}", flush=True)

    outputs = engine.generate(prompts, FLAGS.max_new_tokens, arrivals, eos_token_id=eos,
                              on_step=on_step)
    seconds = time.perf_counter() - start
    print(f"summary: {len(prompts)} requests, {len(generated)} tokens generated in "
          f"{engine.num_steps} steps, {seconds:.2f} s ({len(generated) / seconds:.1f} tokens/s); "
          f"{len(engine.buckets_used)} step graph(s) compiled (buckets "
          f"{sorted(engine.buckets_used)})")
    if not FLAGS.check:
        return 0
    differ = 0
    for i, (prompt, got) in enumerate(zip(prompts, outputs)):
        want, _ = hf.reference_generate(model, prompt, FLAGS.max_new_tokens, eos)
        if got == want:
            print(f"request {i}: equal to transformers' generate ({len(got)} tokens)")
            continue
        differ += 1
        at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        print(f"request {i}: DIFFERS from transformers' generate at new token {at}: ours "
              f"{show(got[at:at + 1])}, transformers {show(want[at:at + 1])}")
    return 1 if differ else 0


def main(argv):
    commands = {"demo": demo, "doctor": doctor, "generate": generate}
    if len(argv) != 2 or argv[1] not in commands:
        print(USAGE, file=sys.stderr)
        return 2
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    return commands[argv[1]]()


def run():
    app.run(main)
