"""Async scheduling, alone and with runs of decode steps, against the synchronous loop, through
torchax on JAX's CPU with a tiny float32 Llama: randomized workloads of arrivals, aborts, EOS
and max-token finishes give the same tokens, token for token. After every step the pages in use
are exactly those the running sequences hold, and no token is reported for a request after it
finished or was aborted; at the end every page is free."""

import collections

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from tests.serving.common import ENGINE_ARGS, prompts
from torch_xla_ext import TorchXlaExtError
from torch_xla_ext.serving import Engine, hf


@pytest.fixture(scope="module")
def engines():
    """A synchronous and an async engine over one tiny model (reused: each compiles once)."""
    model = hf.random_model(hf.TINY, seed=0)
    return {"sync": Engine(model, backend="torchax", async_scheduling=False, **ENGINE_ARGS),
            "async": Engine(model, backend="torchax", async_scheduling=True, **ENGINE_ARGS),
            "runs": Engine(model, backend="torchax", async_scheduling=True, max_decode_steps=3,
                           **ENGINE_ARGS)}


def _check_pages(engine, ended_ids):
    running = engine.scheduler.running
    held = sum(len(engine.allocator.table(s.seq_id)) for s in running)
    assert engine.num_pages - engine.allocator.num_free == held
    for seq in running:  # each holds the pages for the tokens scheduled so far, no more
        assert len(engine.allocator.table(seq.seq_id)) == \
            engine.allocator.blocks_for(seq.num_computed)
    assert all(engine.allocator.table(i) == [] for i in ended_ids)


def _drive(engine, requests):
    """Runs the requests (dicts: prompt, max_new_tokens, eos, arrival, abort_after); returns
    each request's reported tokens, checking the invariants after every step."""
    order = sorted(range(len(requests)), key=lambda r: requests[r]["arrival"])
    ids, tokens, ended = {}, collections.defaultdict(list), set()

    def abort_due():
        for r, seq_id in ids.items():
            after = requests[r]["abort_after"]
            if r not in ended and after is not None and len(tokens[r]) >= after:
                assert engine.abort_request(seq_id)
                hypothesis.event("a request aborted" + (" with a step in flight"
                                                        if engine.has_unfinished() else ""))
                ended.add(r)

    step = 0
    while order or engine.has_unfinished():
        while order and requests[order[0]]["arrival"] <= step:
            r = order.pop(0)
            ids[r] = engine.add_request(requests[r]["prompt"], requests[r]["max_new_tokens"],
                                        requests[r]["eos"])
        abort_due()
        step += 1
        if not engine.has_unfinished():
            continue
        out = engine.step()
        request_of = {seq_id: r for r, seq_id in ids.items()}
        for seq_id, token in out.new_tokens.items():
            assert request_of[seq_id] not in ended, "a token after the request ended"
            tokens[request_of[seq_id]].append(token)
        for seq_id, generated in out.finished.items():
            ended.add(request_of[seq_id])
            if generated[-1] == requests[request_of[seq_id]]["eos"]:
                hypothesis.event("a request ended on its EOS token")
            assert generated == tokens[request_of[seq_id]]
        abort_due()
        _check_pages(engine, [ids[r] for r in ended])
    assert engine.allocator.num_free == engine.num_pages
    for r, request in enumerate(requests):  # nothing lost: every request ran to its end
        want = request["max_new_tokens"] if request["abort_after"] is None else \
            min(request["abort_after"], request["max_new_tokens"])
        eos = request["eos"]
        assert len(tokens[r]) == want or (eos in tokens[r] and tokens[r].index(eos) ==
                                           len(tokens[r]) - 1)
    return [tokens[r] for r in range(len(requests))]


_REQUEST = st.fixed_dictionaries({
    "prompt_len": st.integers(1, 40), "max_new_tokens": st.integers(1, 12),
    "arrival": st.integers(0, 6), "eos_index": st.one_of(st.none(), st.integers(0, 11)),
    "abort_after": st.one_of(st.none(), st.integers(0, 8))})


@hypothesis.settings(max_examples=30, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(workload=st.lists(_REQUEST, min_size=1, max_size=6),
                  seed=st.integers(0, 2 ** 16))
def test_async_gives_the_synchronous_tokens(engines, workload, seed):
    g = torch.Generator().manual_seed(seed)
    requests = [dict(prompt=torch.randint(0, 512, (w["prompt_len"],), generator=g).tolist(),
                     max_new_tokens=w["max_new_tokens"], arrival=w["arrival"], eos=None,
                     abort_after=None) for w in workload]
    full = _drive(engines["sync"], requests)  # to max_new_tokens: what EOS ids to pick from
    for request, w, tokens in zip(requests, workload, full):
        if w["eos_index"] is not None:  # a token the request generates: it ends there
            request["eos"] = tokens[min(w["eos_index"], len(tokens) - 1)]
        request["abort_after"] = w["abort_after"]
    got = _drive(engines["async"], requests)
    assert got == _drive(engines["sync"], requests)
    assert _drive(engines["runs"], requests) == got
    for tokens, reference in zip(got, full):
        assert tokens == reference[:len(tokens)]


def test_abort_request_of_an_unknown_id_names_the_argument(engines):
    engine = engines["async"]
    with pytest.raises(TorchXlaExtError, match=r"abort_request: argument 'seq_id': expected the "
                       r"id of a request added to this engine"):
        engine.abort_request(10 ** 6)
    seq_id = engine.add_request([1, 2, 3], 2)
    assert engine.abort_request(seq_id) and not engine.abort_request(seq_id)
    assert not engine.has_unfinished()
