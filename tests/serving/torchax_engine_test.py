"""The same serving loop and model code through torchax (a jax.jit step; here JAX's CPU, with
our Host handlers): greedy tokens equal transformers' generate in float32, with async
scheduling on and off, one compile per token bucket, and the caches donated to the step."""

import pytest

from tests.serving.common import ARRIVALS, ENGINE_ARGS, MAX_NEW_TOKENS, count_runs, prompts
from torch_xla_ext.serving import Engine, hf


@pytest.fixture(scope="module")
def compiles():
    """A list that grows by one for every XLA compile JAX runs from now on."""
    import jax

    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: events.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    return events


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_tokens_equal_transformers_generate(compiles, async_scheduling):
    model = hf.random_model(hf.TINY, seed=0)
    eos = model.config.eos_token_id
    requests = prompts(model.config.vocab_size)
    expected = [hf.reference_generate(model, p, MAX_NEW_TOKENS, eos)[0] for p in requests]
    engine = Engine(model, backend="torchax", async_scheduling=async_scheduling, **ENGINE_ARGS)
    first_cache = engine.caches[0]  # a JAX array: the step is called on JAX arrays directly
    before = len(compiles)
    assert engine.generate(requests, MAX_NEW_TOKENS, ARRIVALS, eos_token_id=eos) == expected
    # Donated to the first step: its buffer now belongs to the step's result.
    assert first_cache.is_deleted()
    assert engine.buckets_used == {16, 32} and len(compiles) - before == 2
    assert engine.allocator.num_free == engine.num_pages
    before = len(compiles)
    assert engine.generate(requests, MAX_NEW_TOKENS, ARRIVALS, eos_token_id=eos) == expected
    assert len(compiles) == before


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_runs_of_decode_steps_give_the_same_tokens(compiles, async_scheduling):
    """max_decode_steps=4: the decodes between arrivals run 4 steps per launch (sequences with
    fewer tokens left idle for the rest of the run), one loop compiled for the decode bucket,
    the caches donated to it and not copied."""
    import numpy as np

    model = hf.random_model(hf.TINY, seed=0)
    eos = model.config.eos_token_id
    requests = prompts(model.config.vocab_size)
    new_tokens = 2 * MAX_NEW_TOKENS
    expected = [hf.reference_generate(model, p, new_tokens, eos)[0] for p in requests]
    engine = Engine(model, backend="torchax", async_scheduling=async_scheduling,
                    max_decode_steps=4, **dict(ENGINE_ARGS, num_pages=16))
    runs = count_runs(engine)
    before = len(compiles)
    assert engine.generate(requests, new_tokens, ARRIVALS, eos_token_id=eos) == expected
    assert runs and set(runs) == {4}, runs
    assert len(compiles) - before == len(engine.buckets_used) + 1
    assert engine.allocator.num_free == engine.num_pages
    (key, decodes), = [(k, f) for k, f in engine.backend._steps.items() if k[0] == "decodes"]
    layout = key[2]
    module = decodes.lower(engine.weights, engine.caches, np.zeros(layout.size, np.int32),
                           np.zeros(layout.max_num_seqs, np.int32),
                           engine._previous_tokens).compile().as_text()
    cache_type = "f32[{},{},{},{}]".format(*engine.caches[0].shape)
    header = module.splitlines()[0]
    assert header.count("may-alias") == hf.TINY["num_hidden_layers"], header
    assert not [line for line in module.splitlines()
                if f"= {cache_type}" in line and " copy(" in line]
