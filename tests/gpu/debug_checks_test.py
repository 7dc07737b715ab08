"""XLA_EXT_DEBUG_CHECKS on the GPU: bad block ids, lengths, slots and slices given to the CUDA
handlers, through the torch CUDA op and through JAX (jit, where the data is traced and only the
handler sees it).

The kernels read the variable once per process, so tools/device/run.sh runs this file twice:
- with XLA_EXT_DEBUG_CHECKS=1, each bad call raises exactly the message the Host handler gives
  for the same inputs (run here on CPU copies), every cache is unchanged, and the next valid
  call gives the Host handler's results; a bad call captured into a CUDA graph is reported by
  the next call that is not captured;
- without it, the same calls raise nothing (the handlers skip or clamp such entries, as each
  op's header in kernels/ says).
"""

import dataclasses
import os
import subprocess
import sys
import textwrap
from typing import Callable

import pytest
import torch

# JAX and torch share the GPU in this process: JAX must not take most of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEBUG_CHECKS = os.environ.get("XLA_EXT_DEBUG_CHECKS", "") not in ("", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class Case:
    """A valid call of `op` (torch CPU tensors and attributes) and the same call with one entry
    made bad, which the Host handler rejects naming `arg`."""
    name: str
    op: str
    valid: Callable[[], dict]
    corrupt: Callable[[dict], None]  # changes the arguments in place
    arg: str

    def __repr__(self):
        return self.name


def _paged_attention():
    from torch_xla_ext import sample_inputs
    args = sample_inputs.paged_attention([5, 40, 17], num_heads=8, num_kv_heads=2, head_size=128,
                                         block_size=16, dtype=torch.bfloat16, seed=3)
    return dict(args, scale=0.1)


def _reshape_and_cache():
    g = torch.Generator().manual_seed(4)
    return dict(key=torch.randn(5, 2, 64, generator=g), value=torch.randn(5, 2, 64, generator=g),
                key_cache=torch.randn(4, 16, 2, 64, generator=g),
                value_cache=torch.randn(4, 16, 2, 64, generator=g),
                slot_mapping=torch.tensor([0, -1, 63, 17, 5]))


def _kv_cache_update():
    g = torch.Generator().manual_seed(5)
    return dict(key=torch.randn(5, 2, 64, generator=g).bfloat16(),
                value=torch.randn(5, 2, 64, generator=g).bfloat16(),
                kv_cache=torch.randn(4, 16, 4, 64, generator=g).bfloat16(),
                slot_mapping=torch.tensor([0, -1, 63, 17, 5], dtype=torch.int32))


def _kv_cache_update_slices():
    g = torch.Generator().manual_seed(6)
    slices = torch.tensor([[3, 0, 5], [16, 5, 1], [40, 6, 3], [1, 1, 1]], dtype=torch.int32)
    return dict(kv=torch.randn(9, 4, 64, generator=g), slot_mapping=slices.T.contiguous(),
                kv_cache=torch.randn(64, 4, 64, generator=g),
                num_kv_update_slices=torch.tensor([3], dtype=torch.int32), page_size=16,
                num_slices_per_block=8)


def _ragged_paged_attention():
    from torch_xla_ext import sample_inputs
    args = sample_inputs.ragged_paged_attention([5, 1, 1, 40], [37, 9, 100, 40], num_q_heads=8,
                                                num_kv_heads=2, head_dim=128, page_size=16,
                                                dtype=torch.bfloat16, max_num_seqs=6,
                                                padding_rows=3, seed=7)
    return dict(args, sm_scale=0.09)


def _set(name, index, value):
    def corrupt(args):
        args[name][index] = value(args) if callable(value) else value
    return corrupt


def _capacity(args):
    return args["block_tables"].shape[1] * args["key_cache"].shape[1]


CASES = [
    Case("paged_block_id", "paged_attention", _paged_attention,
         _set("block_tables", (1, 2), lambda a: a["key_cache"].shape[0]), "block_tables"),
    Case("paged_negative_block_id", "paged_attention", _paged_attention,
         _set("block_tables", (0, 0), -1), "block_tables"),
    Case("paged_seq_len_beyond_table", "paged_attention", _paged_attention,
         _set("seq_lens", 2, lambda a: _capacity(a) + 1), "seq_lens"),
    Case("paged_negative_seq_len", "paged_attention", _paged_attention,
         _set("seq_lens", 1, -5), "seq_lens"),
    Case("reshape_slot", "reshape_and_cache", _reshape_and_cache, _set("slot_mapping", 3, 64),
         "slot_mapping"),
    Case("kv_update_slot", "kv_cache_update", _kv_cache_update,
         _set("slot_mapping", 4, 2 ** 31 - 1), "slot_mapping"),
    Case("slices_slice", "kv_cache_update_slices", _kv_cache_update_slices,
         _set("slot_mapping", (0, 1), 64), "slot_mapping"),
    Case("slices_count", "kv_cache_update_slices", _kv_cache_update_slices,
         _set("num_kv_update_slices", 0, 5), "num_kv_update_slices"),
    Case("ragged_num_seqs", "ragged_paged_attention", _ragged_paged_attention,
         _set("num_seqs", 0, 7), "num_seqs"),
    Case("ragged_cu_q_lens_decreasing", "ragged_paged_attention", _ragged_paged_attention,
         _set("cu_q_lens", 2, 4), "cu_q_lens"),
    Case("ragged_kv_len_below_q_len", "ragged_paged_attention", _ragged_paged_attention,
         _set("kv_lens", 0, 4), "kv_lens"),
    Case("ragged_kv_len_beyond_pages", "ragged_paged_attention", _ragged_paged_attention,
         _set("kv_lens", 3, lambda a: a["page_indices"].shape[1] * 16 + 1), "kv_lens"),
    Case("ragged_page_id", "ragged_paged_attention", _ragged_paged_attention,
         _set("page_indices", (2, 6), lambda a: a["kv_pages"].shape[0]), "page_indices"),
]


def _op(name):
    import torch_xla_ext  # noqa: F401  (registers the ops)
    return getattr(torch.ops.xla_ext, name)


def _catalog(name):
    from torch_xla_ext import op_catalog
    return next(op for op in op_catalog.OPS if op.name == name)


def _copy(args, device):
    return {k: v.to(device, copy=True) if isinstance(v, torch.Tensor) else v
            for k, v in args.items()}


def _run_torch(op_name, args):
    """The op's results: its return value, or for an in-place op the tensors it wrote."""
    out = _op(op_name)(**args)
    if _catalog(op_name).in_place:
        return [args[n] for n in _catalog(op_name).written_args()]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _host_error(case, args):
    """The Host handler's message for `args` (CPU copies)."""
    from torch_xla_ext.errors import TorchXlaExtError
    with pytest.raises(TorchXlaExtError) as info:
        _run_torch(case.op, _copy(args, "cpu"))
    message = str(info.value)
    assert f"argument '{case.arg}'" in message
    return message


def _same_bits(a, b):
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    a, b = a.contiguous(), b.contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(as_int[a.element_size()]), b.view(as_int[b.element_size()]))


def _assert_matches_host(got, args, op_name):
    """CUDA results against the Host handler's on the same (valid) inputs: cache writes bit
    for bit, attention within sample_inputs.TOLERANCES."""
    from torch_xla_ext import sample_inputs
    for g, want in zip(got, _run_torch(op_name, _copy(args, "cpu"))):
        if op_name.endswith("attention"):
            atol, rtol = sample_inputs.TOLERANCES[want.dtype]
            torch.testing.assert_close(g.cpu().double(), want.double(), atol=atol, rtol=rtol)
        else:
            assert _same_bits(g.cpu(), want)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_torch_cuda_op(case):
    from torch_xla_ext.errors import TorchXlaExtError
    valid = case.valid()
    bad = _copy(valid, "cpu")
    case.corrupt(bad)
    on_gpu = _copy(bad, "cuda")
    before = _copy(on_gpu, "cuda")
    if not DEBUG_CHECKS:
        _run_torch(case.op, on_gpu)  # skipped or clamped, not reported
        torch.cuda.synchronize()
        return
    with pytest.raises(TorchXlaExtError) as info:
        _run_torch(case.op, on_gpu)
    assert str(info.value) == _host_error(case, bad)
    for name, value in on_gpu.items():
        if isinstance(value, torch.Tensor):
            assert _same_bits(value, before[name]), f"{name} changed"
    _assert_matches_host(_run_torch(case.op, _copy(valid, "cuda")), valid, case.op)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_jax_jit(case):
    import jax
    from tests.kernels.common import PLATFORM, to_jax, to_torch  # enables x64 (int64 slots)
    from torch_xla_ext import jax_ops
    if PLATFORM != "cuda":
        pytest.skip("set XLA_EXT_TEST_PLATFORM=cuda to run JAX on the GPU")
    op = _catalog(case.op)

    def run(args):
        tensors = [n for n in op.tensor_args() if isinstance(args.get(n), torch.Tensor)]
        static = {k: v for k, v in args.items() if k not in tensors}
        arrays = [to_jax(args[n]) for n in tensors]
        fn = jax.jit(lambda *xs: getattr(jax_ops, case.op)(**static, **dict(zip(tensors, xs))))
        out = jax.block_until_ready(fn(*arrays))
        return [to_torch(x) for x in (out if isinstance(out, (tuple, list)) else [out])]

    valid = case.valid()
    bad = _copy(valid, "cpu")
    case.corrupt(bad)
    if not DEBUG_CHECKS:
        run(bad)
        return
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        run(bad)
    assert _host_error(case, bad) in str(info.value)
    _assert_matches_host(run(valid), valid, case.op)


def _capture(first_call_captured):
    """Runs the capture scenario in a fresh process; returns its printed lines."""
    script = textwrap.dedent(f"""
        import torch
        import torch_xla_ext  # noqa: F401
        from torch_xla_ext.errors import TorchXlaExtError

        key, value = torch.randn(3, 2, 64).cuda(), torch.randn(3, 2, 64).cuda()
        key_cache = torch.zeros(4, 16, 2, 64).cuda()
        value_cache = torch.zeros(4, 16, 2, 64).cuda()
        bad_slots = torch.tensor([0, 64, 5]).cuda()
        stream = torch.cuda.Stream()
        if not {first_call_captured}:  # a valid call first, outside any capture
            with torch.cuda.stream(stream):
                torch.ops.xla_ext.reshape_and_cache(key, value, key_cache, value_cache,
                                                    torch.tensor([0, 1, 2]).cuda())
            stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):  # the checks cannot synchronise here
            torch.ops.xla_ext.reshape_and_cache(key, value, key_cache, value_cache, bad_slots)
        print("captured")
        graph.replay()
        torch.cuda.synchronize()
        print("replayed")
        kv_args = (torch.ones(2, 2, 64).cuda(), torch.ones(2, 2, 64).cuda(),
                   torch.zeros(4, 16, 4, 64).cuda(), torch.tensor([1, 2], dtype=torch.int32).cuda())
        for attempt in range(2):  # the next call not captured reports it; the one after is clean
            try:
                torch.ops.xla_ext.kv_cache_update(*kv_args)
                torch.cuda.synchronize()
                print("ok")
            except TorchXlaExtError as e:
                print("error:", e)
        print("written:", bool(kv_args[2][0, 1].eq(1).all() and kv_args[2][0, 2].eq(1).all()))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()


@pytest.mark.parametrize("first_call_captured", [False, True],
                         ids=["warm", "first_checked_call_captured"])
def test_call_captured_in_a_cuda_graph(first_call_captured):
    lines = _capture(first_call_captured)
    assert lines[:2] == ["captured", "replayed"], lines
    if not DEBUG_CHECKS:
        assert lines[2:] == ["ok", "ok", "written: True"], lines
        return
    host = ("xla_ext.reshape_and_cache: argument 'slot_mapping': expected slots < num_blocks * "
            "block_size = 64 (negative to skip), got slot_mapping[1] = 64")
    assert lines[2].startswith(f"error: {host} (found when a CUDA graph replayed"), lines
    assert "this call of xla_ext.kv_cache_update" in lines[2], lines
    # The reporting call failed before writing; the next one is clean and writes.
    assert lines[3:] == ["ok", "written: True"], lines
