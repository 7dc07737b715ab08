"""A bfloat16 model's steps with the layer ops the engine leaves off by default, forced on the
CPU, against the same steps without them, through both backends: the linear layers on
xla_ext.small_batch_linear (XLA_EXT_SERVING_SMALL_BATCH_TOKENS=16) and the residual adds with
their norms on xla_ext.add_rms_norm (XLA_EXT_SERVING_ADD_RMS_NORM=1). The logits of every new
token agree within bfloat16's roundings, and torchax's compiled steps call the op where it
applies: small_batch_linear 4 times a layer and for the head in the 16-token bucket, for the
head alone (its 4 rows) in the 32-token one; add_rms_norm twice a layer but the last (whose
second add is the final norm's, of the sampled rows alone)."""

import numpy as np
import pytest
import torch

from tests.serving.common import ENGINE_ARGS, prompts
from torch_xla_ext.serving import Engine, hf

LAYERS = hf.TINY["num_hidden_layers"]
KNOBS = {  # op -> (its environment variable, its value on, its calls per step by token bucket)
    "small_batch_linear": ("XLA_EXT_SERVING_SMALL_BATCH_TOKENS", "16",
                           {16: 4 * LAYERS + 1, 32: 1}),
    "add_rms_norm": ("XLA_EXT_SERVING_ADD_RMS_NORM", "1",
                     {16: 2 * LAYERS - 1, 32: 2 * LAYERS - 1}),
}


@pytest.fixture(scope="module")
def model():
    return hf.random_model(hf.TINY, seed=0, dtype=torch.bfloat16)


def _logits(model, backend, knob, value, monkeypatch):
    monkeypatch.setenv(knob, value)
    engine = Engine(model, backend=backend, with_logits=True, **ENGINE_ARGS)
    logits = {}
    tokens = engine.generate(prompts(model.config.vocab_size)[:3], 4, [0, 0, 1],
                             on_step=lambda out: [logits.setdefault(seq_id, []).append(
                                 np.asarray(row, np.float32))
                                 for seq_id, row in out.logits.items()])
    assert engine.buckets_used == {16, 32}
    return engine, tokens, logits


@pytest.mark.parametrize("op", sorted(KNOBS))
@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_logits_agree_without_the_op(model, backend, op, monkeypatch):
    knob, on, calls = KNOBS[op]
    engine, _, got = _logits(model, backend, knob, on, monkeypatch)
    _, _, want = _logits(model, backend, knob, "0", monkeypatch)
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
        found = {t: m.count(f'custom_call_target="xla_ext.{op}"') for t, m in modules.items()}
        assert found == calls, found
