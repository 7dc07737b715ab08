"""transformers models for the serving loop: random ones of a given size (seeded; nothing is
downloaded), local checkpoints, and transformers' own greedy generation as the reference."""

import os

import torch

from torch_xla_ext.errors import TorchXlaExtError, import_dependency

TRANSFORMERS_INSTALL = "pip install transformers==4.57.6 (the version torch_xla_ext pins)"

# Model sizes below give their rotary embedding as transformers 5 does (rope_parameters);
# random_model passes it to transformers 4 as rope_theta and rope_scaling.

# A tiny Llama for tests, the CLI and CPU runs: grouped-query attention (4 query heads on 2 KV
# heads), head_dim 64 (a size the attention kernel takes).
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False)

# A 1B-class Llama (Llama 3.2 1B's sizes and rotary scaling) for the GPU benchmark.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})


# An 8B-class Llama (Llama 3.1 8B's sizes and rotary scaling) for the tensor parallel
# benchmark.
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})


def _transformers():
    return import_dependency("transformers", "torch_xla_ext.serving", TRANSFORMERS_INSTALL)


def random_model(config, seed=0, dtype=torch.float32, device="cpu"):
    """A LlamaForCausalLM with transformers' random initialisation under torch.manual_seed(seed),
    made on `device`, its RMSNorm weights then drawn around 1 (they start at exactly 1, which
    would leave the norms' scaling untested)."""
    transformers = _transformers()
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_for_transformers(
            config, int(transformers.__version__.split(".")[0]))))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    return model.to(dtype).eval()


def _for_transformers(config, major):
    """A LlamaConfig's arguments for transformers `major`: transformers 5 takes the rotary
    embedding as rope_parameters, 4 as rope_theta and, unless the default, rope_scaling (4
    keeps an unknown rope_parameters as an attribute and uses its default rotary)."""
    if major >= 5 or "rope_parameters" not in config:
        return config
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if rope["rope_type"] != "default":
        config["rope_scaling"] = rope
    return config


def load_checkpoint(path, dtype=None):
    """(model, tokenizer or None) from a local transformers checkpoint directory; never
    downloads."""
    transformers = _transformers()
    if not os.path.isdir(path):
        raise TorchXlaExtError(f"argument 'checkpoint': expected a local checkpoint directory "
                               f"(config.json and weights), got {path!r}, which is not a directory")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype or "auto").eval()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None  # a checkpoint without tokenizer files: prompts as token ids
    return model, tokenizer


def reference_generate(model, prompt, max_new_tokens, eos_token_id=None):
    """transformers' own greedy generation of one prompt: (tokens, [float32 logits per new
    token]). Stops at eos_token_id when given, as the engine does."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        # The mask said outright: generate would otherwise take token 0 (its pad_token_id
        # here) in the prompt for padding and mask it out.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=0,
                             eos_token_id=eos_token_id, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [step[0].float().cpu() for step in out.logits[:len(tokens)]]
