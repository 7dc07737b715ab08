"""What a graph that failed when it ran leaves behind, op by op and failure by failure, through
torch_xla (PJRT_DEVICE=CPU). The call asks its handler to defer the failure
(kernels/registry/registry.h), so the graph runs on without it; the first next use raises
TorchXlaExtError naming the failure. Then:
- a cache our in-place op was to update keeps its values from before the graph (a write by a
  call that ran before the failed one stays) and stays usable: read, compared, used in a new
  graph, by another custom call, updated in place, synced over pending work;
- what the graph computed (the op's result; a cache the caller copied the result into, as
  vLLM's Pallas backend does) holds no value, and every use of it raises TorchXlaExtError
  naming the failure, until it is made again;
- tensors the graph only read keep their values; nothing crashes; the next graph runs.
The issue's repro is one case.

The bad values are computed on the device (`+ 0` in the graph), as a serving step computes its
metadata, so only the handler sees them, when the graph runs. Each case runs in a process of
its own, so that a crash fails that case instead of ending the run; the case prints a line per
use, so a crash names the use it reached.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

_CASE = textwrap.dedent('''
    import sys
    import torch, torch_xla, torch_xla_ext
    import torch_xla.core.xla_model as xm
    from torch_xla_ext import TorchXlaExtError, sample_inputs

    dev = torch_xla.device()


    def in_graph(t):  # int32 data computed on the device: only the handler sees its values
        return t.to(dev) + 0


    def paged_inputs():
        return sample_inputs.paged_attention([5, 30], 8, 2, 64, 16, torch.float32)


    def ragged_inputs():
        return sample_inputs.ragged_paged_attention(**sample_inputs.MIXED_BATCH, num_q_heads=8,
                                                    num_kv_heads=2, head_dim=64, page_size=16,
                                                    dtype=torch.float32)


    def paged(**change):
        on = {k: v.to(dev) for k, v in paged_inputs().items()}
        return on, lambda: torch.ops.xla_ext.paged_attention(
            **{**on, **{k: in_graph(v) for k, v in change.items()}}, scale=0.1)


    def ragged(fused=False, **change):
        on = {k: v.to(dev) for k, v in ragged_inputs().items()}
        rows = on["q"].shape[0]
        key = torch.randn(rows, 2, 64).to(dev)
        slots = torch.full((rows,), -1, dtype=torch.int32)
        slots[:2] = torch.tensor([0, 1])

        def run():
            if fused:  # a serving step: the K/V write, then attention over the cache
                torch.ops.xla_ext.kv_cache_update(key, key, on["kv_pages"], in_graph(slots))
            return torch.ops.xla_ext.ragged_paged_attention(
                **{**on, **{k: in_graph(v) for k, v in change.items()}}, sm_scale=0.125)
        return on, run, (key, slots.to(dev))


    def case(name):
        """(run, [(name, tensor) the graph writes in place], [(name, tensor) it only reads],
        what the error names, what the first written tensor holds afterwards: None (no value),
        or its values on the CPU (None as the second: its values from before)."""
        rows = torch.randn(2, 2, 64).to(dev)
        if name == "kv_cache_update, a slot past the cache":
            cache = torch.randn(4, 16, 4, 64).to(dev)
            return (lambda: torch.ops.xla_ext.kv_cache_update(
                rows, rows, cache, in_graph(torch.tensor([1, 99], dtype=torch.int32))),
                [("kv_cache", cache)], [("key", rows)], r"slot_mapping\\[1\\] = 99", "before")
        if name == "kv_cache_update, a slot past the cache, after torch.compile work":
            # A process that ran our ops under torch.compile first (whose trace leaves results
            # that never run), and keeps that work's results: they stay intact too.
            def compiled_step(k, cache, slots):
                torch.ops.xla_ext.kv_cache_update(k, k, cache, slots)
                return torch.ops.xla_ext.simple_add(cache, cache).sum()

            earlier_cache = torch.randn(4, 16, 4, 64).to(dev)
            total = torch.compile(compiled_step, backend="openxla")(
                rows, earlier_cache, torch.tensor([3, 4], dtype=torch.int32).to(dev))
            total.cpu()
            cache = torch.randn(4, 16, 4, 64).to(dev)
            return (lambda: torch.ops.xla_ext.kv_cache_update(
                rows, rows, cache, in_graph(torch.tensor([1, 99], dtype=torch.int32))),
                [("kv_cache", cache)], [("key", rows), ("compiled result", total),
                                        ("compiled cache", earlier_cache)],
                r"slot_mapping\\[1\\] = 99", "before")
        if name == "reshape_and_cache, a slot past the cache":
            key_cache, value_cache = torch.randn(4, 16, 2, 64).to(dev), torch.randn(4, 16, 2, 64).to(dev)
            return (lambda: torch.ops.xla_ext.reshape_and_cache(
                rows, rows, key_cache, value_cache, in_graph(torch.tensor([1, 64]))),
                [("key_cache", key_cache), ("value_cache", value_cache)], [("key", rows)],
                r"slot_mapping\\[1\\] = 64", "before")
        if name == "kv_cache_update_slices, a slice past the cache":
            cache = torch.randn(4, 16, 4, 64).to(dev)
            slices = torch.tensor([[0, 0, 1], [63, 1, 2]], dtype=torch.int32).T.contiguous()
            new = torch.randn(3, 4, 64).to(dev)

            def write():  # as vLLM's Pallas backend: the op's result copied into the cache
                flat = cache.view(64, 4, 64)
                flat.copy_(torch.ops.xla_ext.kv_cache_update_slices(
                    new, in_graph(slices), flat, in_graph(torch.tensor([2], dtype=torch.int32)),
                    16, 8))
            return (write, [("kv_cache", cache)], [("new_kv", new)], r"cache_start\\[1\\] = 63",
                    None)
        if name == "paged_attention, a block id past the cache":
            on, run = paged(block_tables=paged_inputs()["block_tables"].index_fill(
                1, torch.tensor([1]), 99))
            return (run, [], [("key_cache", on["key_cache"]), ("query", on["query"])],
                    r"block_tables", None)
        if name == "paged_attention, a length past the table":
            on, run = paged(seq_lens=torch.tensor([5, 300], dtype=torch.int32))
            return run, [], [("key_cache", on["key_cache"])], r"seq_lens", None
        if name == "ragged_paged_attention, a page id past the cache":
            on, run, _ = ragged(page_indices=on_cpu_pages(999))
            return run, [], [("kv_pages", on["kv_pages"]), ("q", on["q"])], r"page_indices", None
        if name == "ragged_paged_attention, num_seqs past the batch":
            on, run, _ = ragged(num_seqs=torch.tensor([99], dtype=torch.int32))
            return run, [], [("kv_pages", on["kv_pages"])], r"num_seqs", None
        if name == "ragged_paged_attention, a length past its pages":
            lens = ragged_inputs()["kv_lens"].clone()
            lens[2] = 10_000
            on, run, _ = ragged(kv_lens=lens)
            return run, [], [("kv_pages", on["kv_pages"])], r"kv_lens", None
        if name == "a step: the K/V write, then attention with a page id past the cache":
            on, run, (key, slots) = ragged(fused=True, page_indices=on_cpu_pages(999))
            # The cache after the K/V write, which ran before the failed call.
            written = on["kv_pages"].cpu().to(dev)
            torch.ops.xla_ext.kv_cache_update(key, key, written, slots)
            return (run, [("kv_pages", on["kv_pages"])], [("q", on["q"])], r"page_indices",
                    written.cpu())
        if name == "the issue's repro: kv_cache_update, a slot computed on the device":
            base = torch.randn(4, 16, 4, 64)
            cache = base.clone().to(dev)
            k = torch.randn(2, 2, 64).to(dev)
            return (lambda: torch.ops.xla_ext.kv_cache_update(
                k, k, cache, torch.tensor([0, 98], dtype=torch.int32).to(dev) + 1),
                    [("kv_cache", cache)], [("k", k)], r"slot_mapping\\[1\\] = 99", base)
        raise KeyError(name)


    def on_cpu_pages(bad):
        pages = ragged_inputs()["page_indices"].clone()
        pages[1, 0] = bad
        return pages


    def report(use, call):
        try:
            got = call()
            print(f"{use}: value {got}", flush=True)
        except TorchXlaExtError as e:
            print(f"{use}: TorchXlaExtError {e}", flush=True)
        except Exception as e:
            print(f"{use}: {type(e).__name__} {e}", flush=True)


    run, written, read_only, named, after = case(sys.argv[1])
    assert named
    before = {n: t.cpu().clone() for n, t in written + read_only}
    torch_xla.sync()
    xm.wait_device_ops()  # its inputs ready, the CPU client runs the graph at once
    out = run()
    torch_xla.sync()  # launched as a serving step is: every pending tensor in one graph
    name, tensor = written[0] if written else ("output", out)
    want = before[name] if isinstance(after, str) else after  # None: no value
    print(f"expect: {'no value' if want is None else 'values'}", flush=True)
    report("first", lambda: tensor.cpu() is None)
    if want is None:
        want = torch.zeros(tensor.shape)  # never compared: each use raises first
    pending = None


    def sync_over_pending():
        global pending
        pending = tensor * 2
        torch_xla.sync()
        return torch.allclose(pending.cpu(), (want + 1) * 2)  # after add_


    def add_():
        tensor.add_(1)
        return torch.allclose(tensor.cpu(), want + 1)


    def custom_call():
        return torch.allclose(torch.ops.xla_ext.simple_add(tensor, tensor).cpu(), want * 2)


    report("read", lambda: torch.equal(tensor.cpu(), want))
    report("new graph", lambda: torch.allclose((tensor * 2 + 1).cpu(), want * 2 + 1))
    report("another custom call", custom_call)
    report("in-place add_", add_)
    report("sync over pending work", sync_over_pending)
    pending = None
    for n, t in read_only:
        report(f"read-only input {n} intact", lambda: torch.equal(t.cpu(), before[n]))
    remade = torch.randn(tensor.shape)
    report("made again by copy_", lambda: (tensor.copy_(remade.to(dev)), torch.equal(tensor.cpu(), remade))[1])
    report("used after", lambda: torch.equal((tensor * 2).cpu(), remade * 2))
    report("sync", lambda: torch_xla.sync())
    print("next:", (torch.ones(3, device=dev) * 2).cpu().tolist(), flush=True)
''')

CASES = [
    "kv_cache_update, a slot past the cache",
    "kv_cache_update, a slot past the cache, after torch.compile work",
    "reshape_and_cache, a slot past the cache",
    "kv_cache_update_slices, a slice past the cache",
    "paged_attention, a block id past the cache",
    "paged_attention, a length past the table",
    "ragged_paged_attention, a page id past the cache",
    "ragged_paged_attention, num_seqs past the batch",
    "ragged_paged_attention, a length past its pages",
    "a step: the K/V write, then attention with a page id past the cache",
    "the issue's repro: kv_cache_update, a slot computed on the device",
]
# The uses after the first, which raise for a tensor that holds no value.
USES = ("read", "new graph", "another custom call", "in-place add_", "sync over pending work")


@pytest.mark.parametrize("case", CASES)
def test_a_failed_graph_leaves_caches_intact_and_its_results_clearly_dead(case):
    result = subprocess.run([sys.executable, "-c", _CASE, case], capture_output=True, text=True,
                            timeout=300,
                            env=dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU")))
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    context = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, context
    kind, _, failure = lines.get("first", "").partition(" ")
    assert kind == "TorchXlaExtError" and re.search(r"argument '", failure), context
    assert "the caches our ops were to update in place, which keep their values" in failure, \
        context
    for use in USES:
        got = lines.get(use, "")
        if lines["expect"] == "no value":
            assert got.startswith("TorchXlaExtError") and "holds no value" in got, (use, context)
            assert failure in got, (use, context)
        else:
            assert got == "value True", (use, context)
    for use, got in lines.items():
        if use.startswith("read-only input"):
            assert got == "value True", (use, context)
    assert lines.get("made again by copy_") == "value True", context
    assert lines.get("used after") == "value True", context
    assert lines.get("next") == "[2.0, 2.0, 2.0]", context
