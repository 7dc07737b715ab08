"""Where the host time of a torch_xla serving step goes: the 1B-class Llama in bf16 through
Engine(backend="torch_xla"), B=1 decode at a 2k context, STEPS steps under cProfile (top
functions by own time and by cumulative time) beside torch_xla's metrics for those steps.

    PJRT_DEVICE=GPU python bench/torch_xla_step_profile.py    (tools/device/torch_xla_gpu.sh env)

`tools/device/torch_xla_gpu.sh run bench` keeps its output in
bench/results/h100-torch-xla-step-profile.txt.
"""

import cProfile
import io
import pstats
import sys
import time

import torch

from torch_xla_ext.serving import Engine, hf

STEPS, CONTEXT = 20, 2048


def profile_steps(step, steps, top=25):
    """`step()` called `steps` times under cProfile: (ms per call, {"tottime": the `top`
    functions by own time, "cumulative": by cumulative time}, each as pstats prints it)."""
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    ms_per_step = (time.perf_counter() - start) * 1e3 / steps
    tables = {}
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(top)
        tables[order] = text.getvalue()
    return ms_per_step, tables


def main():
    import torch_xla.debug.metrics as met

    model = hf.random_model(hf.LLAMA_1B, 0, torch.bfloat16, "cpu")
    engine = Engine(model, backend="torch_xla", dtype=torch.bfloat16, page_size=16,
                    max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=CONTEXT + 200)
    engine.add_request(list(range(1, CONTEXT + 1)), max_new_tokens=150)
    while engine.scheduler.waiting or engine.scheduler.running[0].num_computed < CONTEXT:
        engine.step()
    for _ in range(5):
        engine.step()
    met.clear_all()
    ms_per_step, tables = profile_steps(engine.step, STEPS)
    print(f"{ms_per_step:.2f} ms per step (under cProfile)")
    for table in tables.values():
        print(table)
    print(met.short_metrics_report())
    for name in ("TraceTime", "CompileTime", "ExecuteTime", "TransferToDeviceTime",
                 "TransferFromDeviceTime", "IrValueTensorToXlaData"):
        print(name, met.metric_data(name))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
