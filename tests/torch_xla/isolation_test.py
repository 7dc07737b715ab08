"""One bad request must not fail the next step: data the ops can see on the host is checked at
the call (nothing is built or run, every cache keeps its contents), and a step that fails when
it runs leaves no stale error behind when run through torch_xla_ext.sync()."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torch_xla_ext import sample_inputs


def _bad_calls(dev):
    """(op call with bad data, argument the error must name, caches the call would write)."""
    attention = {k: v.to(dev) for k, v in sample_inputs.paged_attention(
        [5, 30], 8, 2, 64, 16, torch.float32).items()}
    bad_table = attention["block_tables"].cpu()
    bad_table[1, 1] = 99
    key_cache, value_cache = torch.randn(4, 16, 2, 64).to(dev), torch.randn(4, 16, 2, 64).to(dev)
    kv_cache = torch.randn(4, 16, 4, 64).to(dev)
    rows = torch.randn(2, 2, 64).to(dev)
    slices = torch.tensor([[0, 0, 1], [63, 1, 2]], dtype=torch.int32).T.contiguous()  # 63 + 2 > 64
    return [
        (lambda: torch.ops.xla_ext.paged_attention(**{**attention, "block_tables":
                                                      bad_table.to(dev)}, scale=0.1),
         r"argument 'block_tables'.*block_tables\[1\]\[1\] = 99", []),
        (lambda: torch.ops.xla_ext.paged_attention(**{**attention, "seq_lens": torch.tensor(
            [5, 300], dtype=torch.int32).to(dev)}, scale=0.1), r"argument 'seq_lens'", []),
        (lambda: torch.ops.xla_ext.reshape_and_cache(rows, rows, key_cache, value_cache,
                                                     torch.tensor([1, 64]).to(dev)),
         r"argument 'slot_mapping'.*slot_mapping\[1\] = 64", [key_cache, value_cache]),
        (lambda: torch.ops.xla_ext.kv_cache_update(rows, rows, kv_cache, torch.tensor(
            [64, 1], dtype=torch.int32).to(dev)), r"slot_mapping\[0\] = 64", [kv_cache]),
        (lambda: torch.ops.xla.kv_cache_update_op(
            torch.randn(3, 4, 64).to(dev), slices.to(dev), kv_cache.view(64, 4, 64),
            torch.tensor([2], dtype=torch.int32).to(dev), 16, 8),
         r"argument 'slot_mapping'.*cache_start\[1\] = 63", [kv_cache]),
    ]


def test_bad_data_fails_at_the_call_and_the_next_step_runs(xla_device):
    import torch_xla

    from torch_xla_ext import TorchXlaExtError

    calls = _bad_calls(xla_device)
    torch_xla.sync()
    for call, message, caches in calls:
        before = [c.cpu().clone() for c in caches]
        with pytest.raises(TorchXlaExtError, match=message):
            call()
        torch_xla.sync()
        assert all(torch.equal(c.cpu(), b) for c, b in zip(caches, before))
        a, b = torch.randn(3), torch.randn(3)
        out = torch.ops.xla_ext.simple_add(a.to(xla_device), b.to(xla_device))
        assert torch.equal(out.cpu(), a + b)


_FAILING_STEP = textwrap.dedent("""
    import torch, torch_xla, torch_xla_ext
    from torch_xla_ext import TorchXlaExtError
    dev = torch_xla.device()
    rows = torch.ones(2, 2, 64, device=dev)

    def step(slots):
        cache = torch.zeros(4, 16, 4, 64, device=dev)
        torch_xla.sync()
        # Slots computed in the step itself: only the handler sees their values, when it runs.
        slots = torch.tensor(slots, dtype=torch.int32, device=dev) + 0
        torch.ops.xla_ext.kv_cache_update(rows, rows, cache, slots)
        torch_xla_ext.sync()

    for attempt in range(2):  # a bad step fails each time: its error is never swallowed
        try:
            step([1, 99])
            print("no error")
        except TorchXlaExtError as e:
            print("failed:", "slot_mapping[1] = 99" in str(e))
    a, b = torch.randn(5), torch.randn(5)
    out = torch.ops.xla_ext.simple_add(a.to(dev), b.to(dev))
    torch_xla_ext.sync()
    print("next step:", torch.equal(out.cpu(), a + b))
    fresh = torch.zeros(4, 16, 4, 64, device=dev)  # the failed steps' cache holds no value now
    torch_xla.sync()
    torch.ops.xla_ext.kv_cache_update(rows, rows, fresh, torch.tensor([1, 2], dtype=torch.int32, device=dev))
    torch_xla_ext.sync()
    print("cache step:", float(fresh.sum()))
""")


def test_a_step_failing_when_it_runs_leaves_no_stale_error():
    result = subprocess.run([sys.executable, "-c", _FAILING_STEP], capture_output=True, text=True,
                            env=dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU")))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["failed: True", "failed: True", "next step: True",
                                          f"cache step: {2 * 2 * 2 * 64:.1f}"]
