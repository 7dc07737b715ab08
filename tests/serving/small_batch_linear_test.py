"""A bfloat16 model's steps with their linear layers on xla_ext.small_batch_linear (the GPU's
default for steps of few tokens, forced here on the CPU with XLA_EXT_SERVING_SMALL_BATCH_TOKENS)
against the same steps on XLA's dots, through both backends: the logits of every new token
agree within bfloat16's roundings; the 16-token bucket's step calls the op in every layer and
the 32-token bucket's only for the head (its 4 rows)."""

import numpy as np
import pytest
import torch

from tests.serving.common import ENGINE_ARGS, prompts
from torch_xla_ext.serving import Engine, hf


@pytest.fixture(scope="module")
def model():
    return hf.random_model(hf.TINY, seed=0, dtype=torch.bfloat16)


def _logits(model, backend, small_batch_tokens, monkeypatch):
    monkeypatch.setenv("XLA_EXT_SERVING_SMALL_BATCH_TOKENS", str(small_batch_tokens))
    engine = Engine(model, backend=backend, with_logits=True, **ENGINE_ARGS)
    logits = {}
    tokens = engine.generate(prompts(model.config.vocab_size)[:3], 4, [0, 0, 1],
                             on_step=lambda out: [logits.setdefault(seq_id, []).append(
                                 np.asarray(row, np.float32))
                                 for seq_id, row in out.logits.items()])
    assert engine.buckets_used == {16, 32}
    return engine, tokens, logits


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_logits_agree_with_xla_dots(model, backend, monkeypatch):
    engine, tokens, got = _logits(model, backend, 16, monkeypatch)
    _, want_tokens, want = _logits(model, backend, 0, monkeypatch)
    assert got.keys() == want.keys()
    for seq_id in want:
        for row, want_row in zip(got[seq_id], want[seq_id]):
            scale = float(np.abs(want_row).max())
            np.testing.assert_allclose(row, want_row, atol=2 ** -6 * scale, rtol=0)
    if backend == "torchax":
        modules = {key[1].num_tokens: step.lower(
            engine.weights, engine.caches, np.zeros(key[1].size, np.int32),
            engine._previous_tokens).compile().as_text()
            for key, step in engine.backend._steps.items()}
        calls = {t: m.count('custom_call_target="xla_ext.small_batch_linear"')
                 for t, m in modules.items()}
        # Four per layer and the head in the 16-token step; the head alone (4 rows) in the other.
        assert calls == {16: 4 * hf.TINY["num_hidden_layers"] + 1, 32: 1}, calls
