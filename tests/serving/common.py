"""The workload the serving tests share: prompts of different lengths arriving at different
steps, and an engine small enough that not all of them fit in the cache at once; and a counter
of the runs of decode steps an engine launches; the unsplit engine's tokens for the tensor
parallel tests."""

import torch

from torch_xla_ext.serving import Engine, hf

# Lengths chosen to cross page (16) and budget (32) boundaries; arrivals spread over 6 steps.
PROMPT_LENS = [5, 17, 40, 9, 23, 3]
ARRIVALS = [0, 0, 1, 3, 3, 6]
MAX_NEW_TOKENS = 10
# 8 pages of 16 tokens: the requests need 12 at once, so pages must be freed and reused.
ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=16, max_model_len=128,
                   num_pages=8)
# The tensor parallel tests' model: 8 query heads on 4 kv heads, head_dim 64, which split over
# 2 and 4 devices.
TP_CONFIG = dict(hf.TINY, num_attention_heads=8, num_key_value_heads=4, head_dim=64)


def count_runs(engine):
    """A list that gets each run of decode steps' length as the engine launches it."""
    runs, run_decodes = [], engine.backend.run_decodes

    def counted(shape, layout, page_size, num_steps, *args):
        runs.append(num_steps)
        return run_decodes(shape, layout, page_size, num_steps, *args)

    engine.backend.run_decodes = counted
    return runs


def prompts(vocab_size, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def workload_tokens(model, backend):
    """(the workload's prompts, their tokens through an unsplit engine of `backend`): what the
    tensor parallel tests compare the split engine with."""
    requests = prompts(model.config.vocab_size)
    return requests, Engine(model, backend=backend, **ENGINE_ARGS).generate(
        requests, MAX_NEW_TOKENS, ARRIVALS)
