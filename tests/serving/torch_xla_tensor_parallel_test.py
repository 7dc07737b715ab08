"""Engine(tensor_parallel_size=N) through torch_xla SPMD on CPU devices (PJRT_DEVICE=CPU,
CPU_NUM_DEVICES 2 or 4, one Bazel target each; SPMD is on for the whole process): a tiny
float32 Llama with 4 kv heads, split over every N > 1 that divides the devices (replicated over
devices / N groups where N is fewer), gives the tokens of the unsplit model on the serving
workload (arrivals, pages reused, async scheduling, runs of decode steps). XLA's optimised HLO
of each step (dumped by this process) runs our ops on each device's heads with 2 all-reduces
per layer within each group of N devices, one more for a tied embedding, gathers nothing but
each device's best token, and donates the caches, which stay split by kv heads."""

import os
import re
import tempfile

_DUMP = tempfile.mkdtemp(prefix="tp_hlo_")
# Read when torch_xla starts its client, i.e. at the first device use below.
os.environ["XLA_FLAGS"] = f"--xla_dump_to={_DUMP} --xla_dump_hlo_as_text"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()

from tests.serving.common import (  # noqa: E402
    ARRIVALS, ENGINE_ARGS, MAX_NEW_TOKENS, TP_CONFIG, count_runs, prompts, workload_tokens)
from torch_xla_ext import TorchXlaExtError  # noqa: E402
from torch_xla_ext.serving import Engine, hf  # noqa: E402

DEVICES = xr.global_runtime_device_count()
assert DEVICES > 1, "run with CPU_NUM_DEVICES=2 or 4 (the Bazel targets set it)"
SIZES = [n for n in range(2, DEVICES + 1) if DEVICES % n == 0]
COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                        r"collective-permute)(?:-start)?\(.*replica_groups=(\{[{}\d,]*\}|"
                        r"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")


def _device_groups(text):
    """HLO replica_groups, listed ({{0,1},{2,3}}) or as an iota ([2,2]<=[4], [2,2]<=[2,2]T(1,0):
    the devices arange'd into the dims after <=, transposed, then reshaped to the groups)."""
    def numbers(listed):
        return [int(d) for d in listed.split(",")]

    if text.startswith("{"):
        return tuple(tuple(numbers(g)) for g in re.findall(r"\{([\d,]+)\}", text))
    shape, dims, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                                     text).groups()
    devices = np.arange(np.prod(numbers(dims))).reshape(numbers(dims))
    if perm:
        devices = devices.transpose(numbers(perm))
    return tuple(map(tuple, devices.reshape(numbers(shape)).tolist()))


@pytest.fixture(scope="module")
def model():
    return hf.random_model(TP_CONFIG, seed=0)


@pytest.fixture(scope="module")
def unsplit(model):
    """The workload's tokens through the unsplit model (every device computes all of it)."""
    return workload_tokens(model, "torch_xla")


def _split_spec(tensor_parallel_size, rank, dim):
    """torch_xla's text of a tensor of `rank` dimensions split over the engine's mesh
    (replica, tp) at `dim`: device r * tp + i holds piece i."""
    tiles = [1] * rank
    tiles[dim] = tensor_parallel_size
    replicas = DEVICES // tensor_parallel_size
    if replicas == 1:
        return f"{{devices=[{','.join(map(str, tiles))}]{','.join(map(str, range(DEVICES)))}}}"
    devices = [r * tensor_parallel_size + i for i in range(tensor_parallel_size)
               for r in range(replicas)]
    return (f"{{devices=[{','.join(map(str, tiles + [replicas]))}]"
            f"{','.join(map(str, devices))} last_tile_dim_replicate}}")


@pytest.mark.parametrize("tensor_parallel_size", SIZES)
@pytest.mark.parametrize("max_decode_steps", [1, 3])
def test_tokens_equal_the_unsplit_model(model, unsplit, tensor_parallel_size, max_decode_steps):
    requests, want = unsplit
    engine = Engine(model, backend="torch_xla", tensor_parallel_size=tensor_parallel_size,
                    max_decode_steps=max_decode_steps, **ENGINE_ARGS)
    runs = count_runs(engine)
    assert engine.generate(requests, MAX_NEW_TOKENS, ARRIVALS) == want
    assert (max(runs) == max_decode_steps) if max_decode_steps > 1 else not runs
    assert engine.allocator.num_free == engine.num_pages
    # The sampled tokens, fed to the next step, come out whole on every device.
    assert torch_xla._XLAC._get_xla_sharding_spec(engine._previous_tokens) == "{replicated}"
    for cache in engine.caches:
        assert torch_xla._XLAC._get_xla_sharding_spec(cache) == _split_spec(
            tensor_parallel_size, 4, 2)


def _step_modules(since):
    """The optimised HLO of the steps compiled since the dump held the files `since`."""
    names = sorted(set(os.listdir(_DUMP)) - since)
    modules = [open(os.path.join(_DUMP, n)).read() for n in names
               if n.endswith("after_optimizations.txt")]
    return [m for m in modules if 'custom_call_target="xla_ext.ragged_paged_attention"' in m]


@pytest.mark.parametrize("tensor_parallel_size", SIZES)
@pytest.mark.parametrize("tied", [False, True])
def test_a_step_all_reduces_twice_per_layer_and_gathers_only_the_argmax(tensor_parallel_size,
                                                                        tied):
    """The layers' two all-reduces of [tokens, hidden]; the head split by vocabulary, whose
    argmax gathers each device's best value and index per sequence ([max_num_seqs, N]); a
    tied head's embedding split too: one more all-reduce, of the embedded tokens. Each within
    a group of N devices; the caches donated, not copied."""
    model = hf.random_model(dict(TP_CONFIG, tie_word_embeddings=tied), seed=0)
    before = set(os.listdir(_DUMP))
    # 3 sequences, not the other tests' 4: graphs of their own, compiled (and dumped) here,
    # where torch_xla would reuse the executable of an equal graph compiled before.
    engine = Engine(model, backend="torch_xla", tensor_parallel_size=tensor_parallel_size,
                    **dict(ENGINE_ARGS, max_num_seqs=3))
    requests = prompts(model.config.vocab_size)[:2]
    want = [hf.reference_generate(model, p, 3)[0] for p in requests]
    assert engine.generate(requests, 3) == want
    head = engine.weights["embed" if tied else "lm_head"]
    assert torch_xla._XLAC._get_xla_sharding_spec(head) == _split_spec(tensor_parallel_size, 2, 0)

    n, hidden, seqs = tensor_parallel_size, TP_CONFIG["hidden_size"], engine.max_num_seqs
    layers = TP_CONFIG["num_hidden_layers"]
    groups = tuple(tuple(range(g * n, g * n + n)) for g in range(DEVICES // n))
    modules = _step_modules(before)
    rows_of_steps = set()
    for module in modules:
        collectives = [(shape, kind, _device_groups(text))
                       for shape, kind, text in COLLECTIVE.findall(module)]
        rows = int(re.search(r"= f32\[(\d+),\d+\]\{1,0\} all-reduce", module).group(1))
        rows_of_steps.add(rows)
        assert sorted(collectives) == sorted(
            [(f"f32[{rows},{hidden}]{{1,0}}", "all-reduce", groups)] * (2 * layers + tied)
            + [(f"f32[{seqs},{n}]{{0,1}}", "all-gather", groups),
               (f"s32[{seqs},{n}]{{0,1}}", "all-gather", groups)])
        assert module.splitlines()[0].count("may-alias") == layers
        assert not re.search(r"= f32\[\d+,\d+,\d+,\d+\]\S* copy\(", module)
    assert rows_of_steps == engine.buckets_used  # one graph per bucket, each checked


def test_sizes_it_cannot_split_name_the_argument(model):
    for size in (3, 2 * DEVICES, 0):
        with pytest.raises(TorchXlaExtError, match=rf"argument 'tensor_parallel_size': expected "
                           rf"a divisor of the {DEVICES} CPU devices torch_xla sees .*, "
                           rf"got {size}$"):
            Engine(model, backend="torch_xla", tensor_parallel_size=size, **ENGINE_ARGS)
    one_kv_head = hf.random_model(dict(TP_CONFIG, num_key_value_heads=1), seed=0)
    with pytest.raises(TorchXlaExtError, match=r"tensor_parallel_size: expected a divisor of the "
                       r"model's num_key_value_heads = 1, got 2"):
        Engine(one_kv_head, backend="torch_xla", tensor_parallel_size=2, **ENGINE_ARGS)
