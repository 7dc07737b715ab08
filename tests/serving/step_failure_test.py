"""A step that fails on the device, through both backends on the CPU: a slot out of the cache's
range reaches the KV write's handler (the host's checks are bypassed to put it there), which
refuses it when the step runs. The engine ends every running request with that error
(StepOutput.failed), reports no token of them afterwards, frees their pages, leaves the waiting
request alone, starts again on new caches, and serves what comes next with the right tokens."""

import pytest

from tests.serving.common import ENGINE_ARGS, prompts
from torch_xla_ext import TorchXlaExtError
from torch_xla_ext.serving import Engine, hf


@pytest.fixture(scope="module")
def model():
    return hf.random_model(hf.TINY, seed=0)


def _corrupt_next_pack(engine):
    """The next step's first slot points past the cache, after the host's checks."""
    pack = engine.host_batch.pack

    def corrupted(*args, **kwargs):
        layout, packed = pack(*args, **kwargs)
        layout.unpack(packed)["slot_mapping"][0] = engine.num_pages * engine.page_size + 5
        engine.host_batch.pack = pack
        return layout, packed

    engine.host_batch.pack = corrupted


@pytest.mark.parametrize("backend", ["torchax", "torch_xla"])
def test_a_failed_step_ends_the_running_requests_and_the_engine_goes_on(model, backend):
    engine = Engine(model, backend=backend, **dict(ENGINE_ARGS, num_pages=16))
    requests = prompts(model.config.vocab_size)
    running = [engine.add_request(p, 12) for p in requests[:4]]  # max_num_seqs = 4
    waiting = engine.add_request(requests[5], 6)
    for _ in range(3):  # the prompts' chunks (a budget of 32 tokens per step)
        engine.step()
    assert {s.seq_id for s in engine.scheduler.running} == set(running)
    assert [s.seq_id for s in engine.scheduler.waiting] == [waiting]
    _corrupt_next_pack(engine)
    outs = [engine.step() for _ in range(3)]
    failures = [o for o in outs if o.failed]
    assert len(failures) == 1, [o.failed for o in outs]
    failed = failures[0]
    assert set(failed.failed) == set(running)
    assert all("slot" in error for error in failed.failed.values()), failed.failed
    after = outs[outs.index(failed) + 1:]
    assert not any(set(o.new_tokens) & set(running) for o in after)
    held = sum(len(engine.allocator.table(s.seq_id)) for s in engine.scheduler.running)
    assert engine.num_pages - engine.allocator.num_free == held
    # The waiting request runs on the new caches to its right tokens.
    tokens = []
    for out in outs:
        tokens += [t for seq_id, t in out.new_tokens.items() if seq_id == waiting]
    while engine.has_unfinished():
        tokens += [t for seq_id, t in engine.step().new_tokens.items() if seq_id == waiting]
    assert tokens == hf.reference_generate(model, requests[5], 6)[0]
    assert engine.allocator.num_free == engine.num_pages
    # And the next requests too.
    assert engine.generate(requests[:2], 4) == [hf.reference_generate(model, p, 4)[0]
                                                for p in requests[:2]]


def test_generate_names_the_prompts_a_failed_step_ended(model):
    engine = Engine(model, backend="torchax", **ENGINE_ARGS)
    _corrupt_next_pack(engine)
    with pytest.raises(TorchXlaExtError, match=r"generate: prompts \[0, 1\] failed in a step on "
                       r"the device \(the others ran to their end\): the XLA step failed: .*slot"):
        engine.generate(prompts(model.config.vocab_size)[:2], 3)
    assert engine.allocator.num_free == engine.num_pages and not engine.has_unfinished()
