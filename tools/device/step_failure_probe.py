"""Where a serving step's device-side failure goes on the GPU (XLA_EXT_DEBUG_CHECKS=1): runs
tests/serving/step_failure_test.py's corrupted step through the Engine's torch_xla backend
and prints what each layer of the failure path saw: the failures our kernel libraries hold
after the step, each check step.py made, and whether a later lazy call raises a violation a
CUDA graph replay recorded.

    XLA_EXT_DEBUG_CHECKS=1 PJRT_DEVICE=GPU python3 tools/device/step_failure_probe.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.serving.common import ENGINE_ARGS, prompts  # noqa: E402
from tests.serving.step_failure_test import _corrupt_next_pack  # noqa: E402
from torch_xla_ext import binders, step  # noqa: E402
from torch_xla_ext.serving import Engine, hf  # noqa: E402

checks = []
raise_deferred = step._raise_deferred_failure


def traced(waited_for):
    checks.append(waited_for)
    return raise_deferred(waited_for)


step._raise_deferred_failure = traced
model = hf.random_model(hf.TINY, seed=0)
engine = Engine(model, backend="torch_xla", **dict(ENGINE_ARGS, num_pages=16))
requests = prompts(model.config.vocab_size)
running = [engine.add_request(p, 12) for p in requests[:4]]
engine.add_request(requests[5], 6)  # waits, so the engine has work after the failure
for _ in range(3):
    engine.step()
print("checks before the bad step:", len(checks), flush=True)
checks.clear()
_corrupt_next_pack(engine)
for i in range(3):
    out = engine.step()
    print(f"step {i}: failed {sorted(out.failed)}; checks {checks}", flush=True)
    checks.clear()
print("held by the libraries:", [lib.take_deferred_failure() for lib in binders.libraries()],
      flush=True)
import torch_xla  # noqa: E402

dev = torch_xla.device()
cache = torch.zeros(4, 16, 4, 64, device=dev)
rows = torch.ones(2, 2, 64, device=dev)
try:
    torch.ops.xla_ext.kv_cache_update(rows, rows, cache, torch.tensor([1, 2], dtype=torch.int32,
                                                                     device=dev))
    print("a later call:", cache.cpu().sum().item(), flush=True)
except Exception as e:  # a violation recorded by a replayed CUDA graph surfaces here
    print("a later call raised:", str(e)[:300], flush=True)
