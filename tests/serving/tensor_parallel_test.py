"""Engine(tensor_parallel_size=N) through torchax on JAX's CPU split into 4 devices: a tiny
float32 Llama with 4 kv heads split over 2 and 4 devices gives the tokens of one device on the
serving workload (arrivals, pages reused, async scheduling, runs of decode steps); each step
runs our ops on each device's heads with 2 all-reduces per layer and gathers nothing but each
device's best token, and the caches stay split by kv heads."""

import re
import warnings

import numpy as np
import pytest

from tests.serving.common import (
    ARRIVALS, ENGINE_ARGS, MAX_NEW_TOKENS, TP_CONFIG, prompts, workload_tokens)
from torch_xla_ext import TorchXlaExtError
from torch_xla_ext.serving import Engine, hf


@pytest.fixture(scope="module")
def model():
    return hf.random_model(TP_CONFIG, seed=0)


@pytest.fixture(scope="module")
def one_device(model):
    return workload_tokens(model, "torchax")


@pytest.mark.parametrize("tensor_parallel_size", [2, 4])
@pytest.mark.parametrize("max_decode_steps", [1, 3])
def test_tokens_equal_one_device(model, one_device, tensor_parallel_size, max_decode_steps):
    import jax

    assert len(jax.devices()) >= 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=4"
    requests, want = one_device
    engine = Engine(model, backend="torchax", tensor_parallel_size=tensor_parallel_size,
                    max_decode_steps=max_decode_steps, **ENGINE_ARGS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a ShardingWarning: an op's operands gathered
        assert engine.generate(requests, MAX_NEW_TOKENS, ARRIVALS) == want
    assert engine.allocator.num_free == engine.num_pages
    for cache in engine.caches:
        assert tuple(cache.sharding.spec) in ((None, None, "tp"), (None, None, "tp", None))
        assert len(cache.sharding.device_set) == tensor_parallel_size


def _collectives(engine):
    """(result type, kind) of each collective in the compiled step of the first bucket used."""
    (key, step), *_ = engine.backend._steps.items()
    module = step.lower(engine.weights, engine.caches, np.zeros(key[1].size, np.int32),
                        engine._previous_tokens).compile().as_text()
    return re.findall(r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                      r"collective-permute)\(", module)


@pytest.mark.parametrize("tied", [False, True])
def test_a_step_all_reduces_twice_per_layer_and_gathers_only_the_argmax(tied):
    """The layers' two all-reduces of [tokens, hidden]; the head split by vocabulary, whose
    argmax gathers each device's best value and index per sequence ([max_num_seqs, devices]);
    a tied head's embedding split too: one more all-reduce, of the embedded tokens."""
    model = hf.random_model(dict(TP_CONFIG, tie_word_embeddings=tied), seed=0)
    engine = Engine(model, backend="torchax", tensor_parallel_size=2, **ENGINE_ARGS)
    requests = prompts(model.config.vocab_size)[:2]
    want = [hf.reference_generate(model, p, 3)[0] for p in requests]
    assert engine.generate(requests, 3) == want
    assert tuple(engine.weights["embed" if tied else "lm_head"].sharding.spec) == ("tp",)
    rows, hidden, seqs = 32, TP_CONFIG["hidden_size"], ENGINE_ARGS["max_num_seqs"]
    reduces = 2 * TP_CONFIG["num_hidden_layers"] + tied
    assert sorted(_collectives(engine)) == sorted(
        [(f"f32[{rows},{hidden}]{{1,0}}", "all-reduce")] * reduces
        + [(f"f32[{seqs},2]{{0,1}}", "all-gather"), (f"s32[{seqs},2]{{0,1}}", "all-gather")])


def test_sizes_it_cannot_split_name_the_argument(model):
    with pytest.raises(TorchXlaExtError, match=r"tensor_parallel_size: expected a divisor of the "
                       r"model's num_key_value_heads = 4, got 3"):
        Engine(model, backend="torchax", tensor_parallel_size=3, **ENGINE_ARGS)
    with pytest.raises(TorchXlaExtError, match=r"argument 'tensor_parallel_size': expected 1 \.\.\. "
                       r"4 \(the cpu devices JAX sees\), got 8"):
        Engine(model, backend="torchax", tensor_parallel_size=8, **ENGINE_ARGS)
    with pytest.raises(TorchXlaExtError, match="expected a positive integer, got 2.0"):
        Engine(model, backend="torchax", tensor_parallel_size=2.0, **ENGINE_ARGS)
