"""The block allocator and the scheduler on the host alone (no model, no device): pages freed and
reused, the token budget, chunked prefill, arrivals at any step, and the errors."""

import pytest

from torch_xla_ext import TorchXlaExtError
from torch_xla_ext.serving import batch
from torch_xla_ext.serving.blocks import BlockAllocator
from torch_xla_ext.serving.scheduler import Scheduler, Sequence


def test_allocator_grows_tables_and_reuses_freed_pages():
    alloc = BlockAllocator(num_blocks=6, page_size=4)
    assert alloc.grow("a", 5) == [0, 1]
    assert alloc.grow("b", 4) == [2]
    assert alloc.grow("a", 8) == [0, 1]  # still two pages
    assert alloc.grow("a", 9) == [0, 1, 3]
    assert alloc.num_free == 2
    alloc.free("a")
    assert alloc.num_free == 5 and alloc.table("a") == []
    # The pages that were free before come first, then a's, in the order a held them.
    assert alloc.grow("c", 16) == [4, 5, 0, 1]


def test_allocator_exhausted_says_what_to_do():
    alloc = BlockAllocator(num_blocks=2, page_size=16)
    alloc.grow("a", 20)
    with pytest.raises(TorchXlaExtError, match=r"sequence 'b' needs 1 more page\(s\) for 1 tokens, "
                       r"0 of 2 are free\. Give the cache more pages \(num_pages\)"):
        alloc.grow("b", 1)
    with pytest.raises(TorchXlaExtError, match="argument 'num_blocks': expected a positive"):
        BlockAllocator(0, 16)


def _scheduler(num_blocks=64, page_size=4, max_num_seqs=4, budget=16, max_model_len=64):
    return Scheduler(BlockAllocator(num_blocks, page_size), max_num_seqs, budget, max_model_len)


def _run_step(sched, sample=lambda seq: 7):
    """One step: schedule, then feed back a token for each chunk; returns (chunks, finished)."""
    chunks = sched.schedule()
    finished = sched.update(chunks, [sample(c.seq) for c in chunks])
    return chunks, finished


def test_chunked_prefill_respects_the_budget_and_decodes_come_first():
    sched = _scheduler(budget=16)
    long = Sequence(0, list(range(40)), max_new_tokens=3)
    sched.add(long)
    plan = []
    for _ in range(3):
        chunks, _ = _run_step(sched)
        plan.append([(c.seq.seq_id, c.start, c.num_tokens, c.samples) for c in chunks])
    # 40 prompt tokens in chunks of 16, 16, 8; only the last chunk samples a token.
    assert plan == [[(0, 0, 16, False)], [(0, 16, 16, False)], [(0, 32, 8, True)]]
    assert long.output == [7] and long.num_computed == 40
    short = Sequence(1, list(range(30)), max_new_tokens=2)
    sched.add(short)  # arrives now: the running decode comes first, the prompt takes the rest
    chunks, _ = _run_step(sched)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in chunks] == [(0, 40, 1), (1, 0, 15)]
    assert sum(c.num_tokens for c in chunks) <= 16


def test_max_num_seqs_and_arrivals_at_different_steps():
    sched = _scheduler(max_num_seqs=2, budget=64)
    seqs = [Sequence(i, [1, 2, 3], max_new_tokens=2) for i in range(3)]
    sched.add(seqs[0])
    sched.add(seqs[1])
    sched.add(seqs[2])
    chunks, _ = _run_step(sched)
    assert [c.seq.seq_id for c in chunks] == [0, 1]  # the third waits for a free slot
    chunks, finished = _run_step(sched)
    assert [s.seq_id for s in finished] == [0, 1]
    late = Sequence(3, [4, 5], max_new_tokens=1)
    sched.add(late)  # arrives at step 2, behind the waiting one
    chunks, finished = _run_step(sched)
    assert [c.seq.seq_id for c in chunks] == [2, 3]
    assert [s.seq_id for s in finished] == [3]  # one token wanted: done after its prefill
    assert late.output == [7] and late.finish_reason == "length"


def test_finished_sequences_free_their_pages_for_waiting_ones():
    # 4 pages of 4 tokens: each request needs 2 pages at its longest (5 + 4 - 1 = 8 tokens).
    sched = _scheduler(num_blocks=4, page_size=4, max_num_seqs=8, budget=64)
    for i in range(4):
        sched.add(Sequence(i, [9] * 5, max_new_tokens=4))
    chunks, _ = _run_step(sched)
    assert [c.seq.seq_id for c in chunks] == [0, 1]  # pages for two at once
    tables = {c.seq.seq_id: list(sched.allocator.table(c.seq.seq_id)) for c in chunks}
    for _ in range(3):
        _, finished = _run_step(sched)
    assert [s.seq_id for s in finished] == [0, 1] and sched.allocator.num_free == 4
    chunks, _ = _run_step(sched)
    assert [c.seq.seq_id for c in chunks] == [2, 3]
    reused = {p for c in chunks for p in sched.allocator.table(c.seq.seq_id)}
    assert reused == {p for t in tables.values() for p in t}  # the same pages, handed out again
    while sched.has_unfinished():
        _run_step(sched)
    assert sched.allocator.num_free == 4


def test_eos_finishes_a_sequence_early():
    sched = _scheduler()
    seq = Sequence(0, [1, 2], max_new_tokens=10, eos_token_id=5)
    sched.add(seq)
    tokens = iter([3, 5, 6])
    while sched.has_unfinished():
        _run_step(sched, sample=lambda s: next(tokens))
    assert seq.output == [3, 5] and seq.finish_reason == "eos"


def test_a_step_scheduled_ahead_takes_the_pending_token_as_a_placeholder():
    """Async scheduling: step 1 is scheduled before step 0's tokens are known."""
    sched = _scheduler(budget=16)
    a, b = Sequence(0, [1, 2, 3], max_new_tokens=4), Sequence(1, [4, 5], max_new_tokens=4)
    sched.add(a)
    sched.add(b)
    step0 = sched.schedule()
    assert [(c.seq.seq_id, c.token_ids, c.samples) for c in step0] == [
        (0, [1, 2, 3], True), (1, [4, 5], True)]
    step1 = sched.schedule()  # each sequence's token 0 is row 0 or 1 of step 0: -1 - row
    assert [(c.seq.seq_id, c.start, c.token_ids) for c in step1] == [(0, 3, [-1]), (1, 2, [-2])]
    assert a.num_tokens == 5 and list(a.pending_rows) == [0, 0]
    sched.update(step0, [7, 8])
    assert a.output == [7] and b.output == [8] and list(b.pending_rows) == [1]
    step2 = sched.schedule()  # step 1's tokens are still in flight
    assert [(c.start, c.token_ids) for c in step2] == [(4, [-1]), (3, [-2])]
    sched.update(step1, [9, 10])
    assert a.tokens(0, 6) == [1, 2, 3, 7, 9, -1]


def test_a_sequence_whose_last_token_is_in_flight_is_not_scheduled_again():
    sched = _scheduler()
    one, two = Sequence(0, [1, 2], max_new_tokens=1), Sequence(1, [3], max_new_tokens=2)
    sched.add(one)
    sched.add(two)
    step0 = sched.schedule()
    step1 = sched.schedule()
    assert [c.seq.seq_id for c in step1] == [1]  # one's only token is in flight
    assert sched.update(step0, [5, 6]) == [one] and one.finish_reason == "length"
    assert sched.schedule() == []  # two's last token is in flight in step 1
    assert sched.update(step1, [7]) == [two] and two.output == [6, 7]
    assert not sched.has_unfinished() and sched.allocator.num_free == 64


def test_eos_drops_the_token_of_a_step_already_in_flight():
    sched = _scheduler()
    seq = Sequence(0, [1, 2], max_new_tokens=10, eos_token_id=5)
    sched.add(seq)
    step0, step1 = sched.schedule(), sched.schedule()
    assert sched.update(step0, [5]) == [seq]  # EOS: finished, pages free, step 1 in flight
    assert sched.allocator.num_free == 64 and not sched.has_unfinished()
    assert sched.update(step1, [9]) == [] and seq.output == [5] and seq.finish_reason == "eos"


def test_abort_frees_the_pages_and_drops_tokens_in_flight():
    sched = _scheduler(max_num_seqs=2)
    a, b, c = (Sequence(i, [1, 2, 3], max_new_tokens=5) for i in range(3))
    for seq in (a, b, c):
        sched.add(seq)
    step0 = sched.schedule()
    assert sched.abort(2) is c and c.finish_reason == "abort" and list(sched.waiting) == []
    assert sched.abort(0) is a and sched.allocator.table(0) == []
    assert sched.allocator.num_free == 64 - len(sched.allocator.table(1))
    assert sched.update(step0, [7, 8]) == [] and a.output == [] and b.output == [8]
    assert sched.abort(0) is None and sched.abort(99) is None
    assert [ch.seq.seq_id for ch in sched.schedule()] == [1]


def test_requests_that_can_never_run_are_refused():
    sched = _scheduler(num_blocks=4, page_size=4, max_model_len=64)
    with pytest.raises(TorchXlaExtError, match="argument 'prompt': expected at least one token"):
        sched.add(Sequence(0, [], 3))
    with pytest.raises(TorchXlaExtError, match=r"\(64 tokens\) \+ max_new_tokens \(2\) - 1 = 65 tokens "
                       "exceeds max_model_len = 64"):
        sched.add(Sequence(1, [0] * 64, 2))
    with pytest.raises(TorchXlaExtError, match="needs 5 KV-cache pages at its longest, the "
                       r"cache has 4 in all; give the cache more pages \(num_pages\)"):
        sched.add(Sequence(2, [0] * 17, 3))
    with pytest.raises(TorchXlaExtError, match="argument 'max_new_tokens': expected a positive"):
        sched.add(Sequence(3, [1], 0))


def test_batch_packs_a_ragged_step_for_the_ops():
    """Two chunks (a decode at position 9, a 3-token prefill) in an 8-row bucket."""
    sched = _scheduler(page_size=4)
    a, b = Sequence(0, list(range(10, 20)), 4), Sequence(1, [30, 31, 32], 4)
    sched.add(a)
    _run_step(sched)  # a: prompt of 10 in, token 7 out
    sched.add(b)
    chunks = sched.schedule()
    layout = batch.StepLayout(num_tokens=8, max_num_seqs=4, pages_per_seq=16)
    tables = [sched.allocator.table(c.seq.seq_id) for c in chunks]
    arrays = layout.unpack(batch.build(chunks, tables, layout, page_size=4, num_pages=64))
    assert arrays["token_ids"].tolist() == [7, 30, 31, 32, 0, 0, 0, 0]
    assert arrays["positions"].tolist() == [10, 0, 1, 2, 0, 0, 0, 0]
    slot_a = tables[0][10 // 4] * 4 + 10 % 4
    assert arrays["slot_mapping"].tolist() == [slot_a, *(tables[1][0] * 4 + i for i in range(3)),
                                               -1, -1, -1, -1]
    assert arrays["kv_lens"].tolist() == [11, 3, 0, 0]
    assert arrays["cu_q_lens"].tolist() == [0, 1, 4, 4, 4]
    assert arrays["num_seqs"].tolist() == [2]
    assert arrays["sample_rows"].tolist() == [0, 3, 0, 0]
    assert arrays["page_indices"][0, :3].tolist() == tables[0]


def test_runs_of_decode_steps_start_only_while_every_sequence_decodes_and_none_waits():
    sched = _scheduler(budget=16)
    a, b = Sequence(0, [1, 2, 3], max_new_tokens=6), Sequence(1, list(range(20)), 5)
    assert not sched.runs_decodes(2)  # nothing running
    sched.add(a)
    sched.add(b)
    assert not sched.runs_decodes(2)  # waiting requests
    _run_step(sched)  # a's prompt and 13 of b's
    assert not sched.runs_decodes(2)  # b is still in its prompt
    _run_step(sched)  # a decodes, b's prompt ends
    assert len(a.output) == 2 and len(b.output) == 1
    assert sched.runs_decodes(4) and not sched.runs_decodes(5)  # a has 4 tokens left, b 4
    sched.schedule()  # one step in flight: 3 left each
    assert sched.runs_decodes(3) and not sched.runs_decodes(4)
    sched.add(Sequence(2, [5], 4))
    assert not sched.runs_decodes(2)


def test_a_run_of_decode_steps_is_packed_once_and_advanced_on_the_device():
    """The batch the device computes for each later step of a run (llama.next_decode_batch):
    each sequence's row as the host would pack it while the sequence has steps left in the run,
    then idle, writing nothing; each step's chunks keep the rows of the first."""
    import numpy as np
    import torch

    from torch_xla_ext.serving import llama

    sched = _scheduler(page_size=4)
    for seq_id, (prompt_len, new_tokens) in enumerate([(6, 9), (3, 3), (8, 5)]):
        sched.add(Sequence(seq_id, list(range(1, prompt_len + 1)), new_tokens))
    _run_step(sched)  # the budget leaves sequence 2 one prompt token: a run may start with it
    assert sched.running[2].num_computed == 7 and sched.runs_decodes(6)
    steps, row_steps = sched.schedule_decodes(6)
    assert row_steps == [6, 2, 5]  # tokens each has left, at most the run's
    assert [[c.row for c in chunks] for chunks in steps] == \
        [[0, 1, 2]] * 2 + [[0, 2]] * 3 + [[0]]
    layout = batch.StepLayout(num_tokens=8, max_num_seqs=4, pages_per_seq=5)
    tables = [sched.allocator.table(i) for i in range(3)]
    packed = torch.from_numpy(batch.build(steps[0], tables, layout, page_size=4, num_pages=64))
    steps_left = torch.tensor(row_steps + [0], dtype=torch.int32)
    first = layout.unpack(packed.numpy().copy())
    for chunks in steps[1:]:
        packed, steps_left = llama.next_decode_batch(layout, 4, packed, steps_left)
        got = layout.unpack(packed.numpy())
        host = layout.unpack(batch.build(chunks, [tables[c.row] for c in chunks], layout,
                                         page_size=4, num_pages=64))
        for i, chunk in enumerate(chunks):  # chunk i of the host's batch is row chunk.row
            r = chunk.row
            assert got["token_ids"][r] == host["token_ids"][i] == -1 - r
            for name in ("positions", "slot_mapping", "kv_lens"):
                assert got[name][r] == host[name][i], (name, r)
        idle = sorted({0, 1, 2} - {c.row for c in chunks})
        assert all(got["slot_mapping"][r] == -1 for r in idle)
        assert (got["kv_lens"][idle] == first["kv_lens"][idle] + np.array(row_steps)[idle]
                - 1).all()
        for name in ("page_indices", "cu_q_lens", "num_seqs", "sample_rows"):
            np.testing.assert_array_equal(got[name], first[name])
        np.testing.assert_array_equal(got["slot_mapping"][3:], -1)  # padding writes nothing


def test_token_buckets():
    assert batch.token_buckets(256) == [16, 32, 64, 128, 256]
    assert batch.token_buckets(100, smallest=8) == [8, 16, 32, 64, 100]
    assert batch.pick_bucket([16, 32, 64], 17) == 32
    with pytest.raises(TorchXlaExtError, match="exceeds the largest token bucket 64"):
        batch.pick_bucket([16, 32, 64], 65)
