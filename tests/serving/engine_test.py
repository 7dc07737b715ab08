"""The serving loop through torch_xla (PJRT_DEVICE=CPU) on a tiny random Llama (grouped-query
attention): greedy tokens equal transformers' own generate in float32 for prompts of different
lengths arriving at different steps, with async scheduling (the default: a step's tokens fed to
the next on the device) and without, pages freed and reused, one compile per token bucket, and
a step's graph donating every layer's cache instead of copying it."""

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.serving.common import ARRIVALS, ENGINE_ARGS, MAX_NEW_TOKENS, count_runs, prompts
from torch_xla_ext.serving import Engine, hf

@pytest.fixture(scope="module")
def model():
    return hf.random_model(hf.TINY, seed=0)


@pytest.fixture(scope="module")
def expected(model):
    eos = model.config.eos_token_id
    return [hf.reference_generate(model, p, MAX_NEW_TOKENS, eos)[0]
            for p in prompts(model.config.vocab_size)]


def _generate(engine, model, steps):
    """Runs the prompts; records each step and which pages each sequence held."""
    pages_of = {}

    def on_step(out):
        steps.append(out)
        for seq in engine.scheduler.running:
            pages_of.setdefault(seq.seq_id, set()).update(engine.allocator.table(seq.seq_id))

    tokens = engine.generate(prompts(model.config.vocab_size), MAX_NEW_TOKENS, ARRIVALS,
                             eos_token_id=model.config.eos_token_id, on_step=on_step)
    return tokens, pages_of


def test_tokens_equal_transformers_generate_and_pages_are_reused(model, expected):
    import torch_xla.debug.metrics as met

    engine = Engine(model, backend="torch_xla", **ENGINE_ARGS)
    compiles_before = met.metric_data("CompileTime")[0]
    reads_before = (met.metric_data("TransferFromDeviceTime") or [0])[0]
    steps = []
    tokens, pages_of = _generate(engine, model, steps)
    assert tokens == expected
    # One device-to-host read per step (the token ids): the ops did not read the step's
    # metadata back (the engine checked it on the host instead; batch.py).
    assert met.metric_data("TransferFromDeviceTime")[0] - reads_before == len(steps)
    # Continuous batching: prefill chunks ran beside decodes, within the budget and max_num_seqs.
    assert any(0 < s.num_prefill_tokens < s.num_tokens for s in steps)
    assert all(s.num_tokens <= 32 and s.num_seqs <= 4 for s in steps)
    # Pages went back to the pool and were handed out again to later sequences.
    holders = {}
    for seq_id, pages in pages_of.items():
        for page in pages:
            holders.setdefault(page, set()).add(seq_id)
    assert any(len(h) > 1 for h in holders.values())
    assert engine.allocator.num_free == engine.num_pages and not engine.scheduler.running
    # One compile per token bucket the steps used (buckets 16 and 32), none for anything else.
    compiles = met.metric_data("CompileTime")[0] - compiles_before
    assert engine.buckets_used == {16, 32} and compiles == len(engine.buckets_used)
    # The same engine again: the pool is reused and nothing compiles.
    again, _ = _generate(engine, model, [])
    assert again == expected
    assert met.metric_data("CompileTime")[0] - compiles_before == compiles


def test_the_synchronous_loop_gives_the_same_tokens(model, expected):
    """async_scheduling=False: each step launched and read back in the same step() call."""
    import torch_xla.debug.metrics as met

    engine = Engine(model, backend="torch_xla", async_scheduling=False, **ENGINE_ARGS)
    reads_before = (met.metric_data("TransferFromDeviceTime") or [0])[0]
    steps = []
    tokens, _ = _generate(engine, model, steps)
    assert tokens == expected
    assert met.metric_data("TransferFromDeviceTime")[0] - reads_before == len(steps)
    assert engine.allocator.num_free == engine.num_pages


def test_tied_embeddings_and_llama3_rope(expected):
    """A model whose lm_head is its embedding and whose rotary frequencies are llama3-scaled."""
    config = dict(hf.TINY, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64})
    tied = hf.random_model(config, seed=3)
    assert tied.model.rotary_emb.rope_type == "llama3"
    tied_prompts = prompts(tied.config.vocab_size, seed=4)[:3]
    engine = Engine(tied, backend="torch_xla", **ENGINE_ARGS)
    assert "lm_head" not in engine.weights
    got = engine.generate(tied_prompts, 6, [0, 1, 2])
    assert got == [hf.reference_generate(tied, p, 6)[0] for p in tied_prompts]


def test_logits_of_each_new_token_equal_transformers_forward(model):
    """with_logits: each new token's logits, against transformers' forward of the same tokens
    (what bench/serving_compare.py reports on the GPU)."""
    engine = Engine(model, backend="torch_xla", with_logits=True, **ENGINE_ARGS)
    requests = prompts(model.config.vocab_size)[:3]
    logits = {}
    tokens = engine.generate(requests, 3, [0, 0, 1], on_step=lambda out: [
        logits.setdefault(seq_id, []).append(row) for seq_id, row in out.logits.items()])
    for i, (prompt, generated) in enumerate(zip(requests, tokens)):
        with torch.no_grad():
            want = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1:]
        for step, row in enumerate(logits[i]):
            torch.testing.assert_close(torch.as_tensor(row), want[step], atol=2e-5, rtol=0)


def test_every_token_bucket_runs_its_own_compiled_step(model):
    """Nine buckets, more than the eight graphs dynamo compiles for one function before it
    refuses (fullgraph): each layout's step is a function of its own."""
    engine = Engine(model, backend="torch_xla", max_num_seqs=4, max_num_batched_tokens=4096,
                    page_size=16, max_model_len=4200)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 20, 40, 100, 200, 400, 900, 2000, 4000]
    for n in lengths:
        prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
        assert engine.generate([prompt], 1) == [hf.reference_generate(model, prompt, 1)[0]]
    assert sorted(engine.buckets_used) == [16 << i for i in range(9)]


def test_bad_requests_name_the_argument(model):
    from torch_xla_ext import TorchXlaExtError

    engine = Engine(model, backend="torch_xla", **ENGINE_ARGS)
    with pytest.raises(TorchXlaExtError, match=r"argument 'prompt': expected integer token ids "
                       r"in \[0, vocab_size = 512\), got prompt\[1\] = 512"):
        engine.add_request([1, 512], 4)
    with pytest.raises(TorchXlaExtError, match=r"argument 'prompt': .* got prompt\[0\] = 1.5"):
        engine.add_request([1.5, 2], 4)
    with pytest.raises(TorchXlaExtError, match=r"argument 'prompt': .* got prompt\[0\] = True"):
        engine.add_request([True], 4)
    with pytest.raises(TorchXlaExtError, match="argument 'prompt': expected at least one token"):
        engine.add_request([], 4)
    with pytest.raises(TorchXlaExtError, match=r"argument 'eos_token_id': expected None or an "
                       r"integer token id in \[0, vocab_size = 512\), got 600"):
        engine.add_request([1, 2], 4, eos_token_id=600)
    for bad in (0, 2.0, None):
        with pytest.raises(TorchXlaExtError, match="argument 'max_new_tokens': expected a "
                           "positive integer"):
            engine.add_request([1, 2], bad)
    # Refused requests took no id, no page and no place in the queue.
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.num_pages
    assert engine.add_request([1, 2], 1) == 0
    out = engine.step()
    assert list(out.finished) == [0] and len(out.finished[0]) == 1
    assert not engine.has_unfinished()
    with pytest.raises(TorchXlaExtError, match="exceeds max_model_len = 128"):
        engine.add_request([1] * 120, 10)
    with pytest.raises(TorchXlaExtError, match="nothing to run; add a request first"):
        engine.step()
    with pytest.raises(TorchXlaExtError, match="argument 'backend': expected one of"):
        Engine(model, backend="cuda")


# A few engine steps in a child process that dumps XLA's optimised HLO.
_STEPS = textwrap.dedent("""
    from torch_xla_ext.serving import Engine, hf
    model = hf.random_model(hf.TINY, seed=0)
    engine = Engine(model, backend="torch_xla", max_num_seqs=4, max_num_batched_tokens=32,
                    max_model_len=128, num_pages=16)
    print(engine.generate([[1, 2, 3], list(range(20))], 3))
""")


def test_a_step_donates_every_cache(tmp_path):
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"),
               XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text")
    result = subprocess.run([sys.executable, "-c", _STEPS], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [open(p).read() for p in glob.glob(str(tmp_path / "*after_optimizations.txt"))]
    steps = [m for m in steps if 'custom_call_target="xla_ext.ragged_paged_attention"' in m]
    assert len(steps) == 2  # one module per token bucket used (16 and 32)
    cache_type = f"f32[16,16,{2 * hf.TINY['num_key_value_heads']},64]"
    for module in steps:
        header = module.splitlines()[0]
        # Each layer's cache is donated to its new value ...
        assert header.count("may-alias") == hf.TINY["num_hidden_layers"], header
        # ... and no instruction copies a whole cache.
        assert not [line for line in module.splitlines()
                    if f"= {cache_type}" in line and " copy(" in line]


def test_runs_of_decode_steps_give_the_same_tokens(model):
    """max_decode_steps=4 through torch_xla: a run's steps are launched one after another with
    no scheduling or packing between them, the batch advanced on the device."""
    eos = model.config.eos_token_id
    requests = prompts(model.config.vocab_size)
    new_tokens = 2 * MAX_NEW_TOKENS
    expected = [hf.reference_generate(model, p, new_tokens, eos)[0] for p in requests]
    engine = Engine(model, backend="torch_xla", max_decode_steps=4,
                    **dict(ENGINE_ARGS, num_pages=16))
    runs = count_runs(engine)
    assert engine.generate(requests, new_tokens, ARRIVALS, eos_token_id=eos) == expected
    assert runs and set(runs) == {4}, runs
    assert engine.allocator.num_free == engine.num_pages
