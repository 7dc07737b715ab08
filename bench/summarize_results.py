"""Writes bench/results/SUMMARY.md: the key numbers of every file in bench/results, one table
per benchmark, made from the files alone (nothing is typed in by hand).

    python bench/summarize_results.py            # rewrites bench/results/SUMMARY.md
    python bench/summarize_results.py --check    # exit status 1 if SUMMARY.md is out of date

A result file is named <gpu>-<kind>.<ext> (tools/device/run.sh writes them so: `h100`, `h100x2`
for two H100s, `cpu` for the dev machine), or <gpu>.json for the `bench` phase's run of
bench/decode_bench.py. KINDS says which kinds this script reads and what wrote them; a file of
another kind is listed at the end, unread. //tests/build:results_summary_test fails when the
committed SUMMARY.md is not what this script makes of the committed files: after replacing a
result file, run this script and commit both.
"""

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SUMMARY = "SUMMARY.md"
FILE_NAME = re.compile(r"^(?P<gpu>[a-z]+[0-9]*(?:x[0-9]+)?)(?:-(?P<kind>.+?))?\.(?P<ext>[a-z.]+)$")

# kind (the file name between "<gpu>-" and the extension; "" for <gpu>.json) -> what wrote it.
# Kinds given as a pattern match several names (a model, a TP size, a backend, a tool).
KINDS = {
    "serving": "`tools/device/run.sh serving` (one run) or `serving_ab` (a baseline's run, then "
               "the working tree's, in one lease): bench/serving_bench.py, the engine through "
               "torchax",
    "serving-ab": "`tools/device/run.sh serving_ab`: the working tree's GPU tests, its attention "
                  "call against the baseline's, Nsight Compute and compute-sanitizer",
    "serving-flags": "`tools/device/run.sh serving_flags`: serving_bench.py with $SERVING_XLA_FLAGS",
    r"serving-(?P<model>[a-z0-9]+)-tp(?P<tp>[0-9]+)": "`tools/device/run.sh tp` (on several GPUs: "
                                                      "GPU=h100x2, h100x4): serving_bench.py per "
                                                      "model and TP size",
    "serving-torch-xla": "`tools/device/torch_xla_gpu.sh run bench`: serving_bench.py through "
                         "torch_xla, then torchax, one lease",
    "serving-compare": "`tools/device/run.sh serving`: bench/serving_compare.py",
    "serving-tp-timeline": "`tools/device/run.sh tp`: serving_bench.py --timeline per model and "
                           "TP size, the busiest GPU's kernels in order",
    "serving-timeline": "`tools/device/run.sh serving` (or `serving_ab`, each run's): "
                        "bench/serving_bench.py --timeline, each profile's kernels in order on "
                        "the GPU, idle time before each",
    "": "`tools/device/run.sh bench`: bench/decode_bench.py (paged attention, simple_add, dispatch)",
    "decode-uniform": "`tools/device/run.sh decode`: bench/decode_bench.py --skip-add",
    "decode-mixes": "`tools/device/run.sh decode`: bench/decode_mixes_bench.py --flashinfer",
    "ragged": "`tools/device/run.sh ragged`: bench/ragged_bench.py --flashinfer",
    "kernel-times": "`tools/device/run.sh bench`: bench/kernel_times.py, ours and cuDNN SDPA",
    "kv-cache": "bench/kv_cache_bench.py (`tools/device/run.sh kv_cache` on the GPU)",
    "layer-ops": "`tools/device/run.sh layer_ops` (part bench): bench/linear_bench.py, "
                 "small_batch_linear against cuBLAS",
    "layer-ops-tests": "`tools/device/run.sh layer_ops`: the layer ops' GPU tests and "
                       "sanitizers, the benchmark's lines, and the serving step with an op and "
                       "without",
    "eager-overhead": "bench/eager_overhead.py --device cpu|cuda",
    r"tp(?P<tp>[0-9]+)": "`tools/device/run.sh tp1` / `tp2`: bench/tp_bench.py",
    r"engine-soak-(?P<backend>[a-z-]+)": "bench/engine_soak.py --steps 10000 (on the GPU machine: "
                                         "`tools/device/torch_xla_gpu.sh run soak`)",
    "torch-xla-gpu": "`tools/device/torch_xla_gpu.sh run proof`",
    "torch-xla-gpu-tests": "`tools/device/torch_xla_gpu.sh run proof`: the torch_xla and engine tests",
    "torch-xla-failures": "`tools/device/torch_xla_gpu.sh run failures`: a serving step's "
                          "failure path, and the tests of failed graphs, with "
                          "XLA_EXT_DEBUG_CHECKS=1",
    "torch-xla-legacy": "`tools/device/torch_xla_gpu.sh run legacy` (and `proof`): the guides' "
                        "legacy custom-call flow with an nvcc-built kernel, api_version 1-4",
    "tests": "`tools/device/run.sh tests` (and `bench`, `tp1` and `tp2`, which append to it)",
    "decode-tests": "`tools/device/run.sh decode`: tests, sanitizers, benchmark lines",
    "ragged-tests": "`tools/device/run.sh ragged`: tests, sanitizers, benchmark lines",
    r"sanitize(?:-(?P<tools>[a-z-]+))?": "`tools/device/run.sh sanitize [TOOL...]`: compute-sanitizer",
    "plugin": "`tools/device/run.sh tests`: tests/gpu/plugin_registration.py",
    "serving-summary": "`tools/device/run.sh serving`: the phase's summary lines",
    "dispatch-command-buffers": "`tools/device/run.sh bench`: bench/dispatch_command_buffers.py",
    "dispatch-record-probe": "`tools/device/run.sh bench`: bench/record_probe/probe.py --trace",
    "ncu": "`tools/device/run.sh bench`: Nsight Compute on paged attention, B=32, L=4096",
    "decode-latency": "`tools/device/run.sh decode_latency`: bench/decode_latency_probe.cu, the "
                      "decode-only attention call's time and its CTAs' phase stamps",
    "ncu-mixes": "`tools/device/run.sh ncu_mixes`: Nsight Compute on five decode mixes",
    "ncu-ragged": "`tools/device/run.sh ncu_ragged`: Nsight Compute on the ragged kernels",
    r"ncu-ragged-sass-(?P<table>[0-9]+)": "`NCU_SASS=1 tools/device/run.sh ncu_ragged`: SASS table",
    "ragged-clocks": "`tools/device/run.sh clocks_ragged`: SM clock and power per mix",
    "vllm": "`tools/device/torch_xla_gpu.sh run vllm`: tools/device/vllm_gpu.py, vLLM's "
            "`LLM` and `vllm serve` through torch_xla_ext.vllm_platform, its step times beside "
            "our Engine's and transformers' (`run bench`)",
    "torch-xla-step-profile": "`tools/device/torch_xla_gpu.sh run bench`: "
                              "bench/torch_xla_step_profile.py",
}

# Where one kind has files of two extensions that say different things.
BY_EXTENSION = {
    ("serving", "txt"): "`tools/device/run.sh serving` (or `serving_ab`): the benchmark's "
                        "whole log",
    ("torch-xla-gpu", "json"): "`tools/device/torch_xla_gpu.sh run proof`: the proof's record",
    ("torch-xla-gpu", "txt"): "`tools/device/torch_xla_gpu.sh run proof`: its log",
}

HF_IMPLS = {"hf_eager_sdpa_static_cache": "transformers eager (SDPA, static cache)",
            "hf_compile_reduce_overhead": "transformers + torch.compile (reduce-overhead)"}
FLASHINFER = ("flashinfer_cuda_core", "flashinfer_tensor_core")
NOTHING = "–"


class ResultFile:
    """One file of the results folder: its name's parts and, for JSON, its data."""

    def __init__(self, path):
        self.path = path
        self.name = path.name
        match = FILE_NAME.match(self.name)
        self.gpu = match["gpu"] if match else ""
        self.kind = (match["kind"] or "") if match else None
        self.ext = match["ext"] if match else ""
        self.fields = {}
        self.kind_pattern = None
        if self.kind is not None:
            for pattern in KINDS:
                kind_match = re.fullmatch(pattern, self.kind)
                if kind_match:
                    self.kind_pattern, self.fields = pattern, kind_match.groupdict()
                    break
        self._data = None

    @property
    def data(self):
        if self._data is None:
            try:
                self._data = json.loads(self.path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.path}: expected a JSON results file, got invalid JSON "
                                 f"({e})") from e
        return self._data

    def text(self):
        return self.path.read_text(errors="replace")

    def description(self):
        """What wrote the file (KINDS, or BY_EXTENSION where the extension matters)."""
        return BY_EXTENSION.get((self.kind_pattern, self.ext), KINDS[self.kind_pattern])

    def is_kind(self, pattern, ext):
        return self.kind_pattern == pattern and self.ext == ext

    def machine(self):
        """The GPU the file names (its own 'device' field where that is a GPU's name), else
        what its file name says."""
        data = self.data if self.ext == "json" else {}
        device = (data[0] if isinstance(data, list) and data else data).get("device")
        if isinstance(device, str) and device.startswith("NVIDIA"):
            return device
        return gpu_label(self.gpu)


def gpu_label(gpu):
    """'h100' -> 'H100', 'h100x2' -> '2 x H100', 'cpu' -> 'the dev machine's CPU'."""
    if gpu == "cpu":
        return "the dev machine's CPU"
    match = re.fullmatch(r"([a-z]+[0-9]+)x([0-9]+)", gpu)
    return f"{match[2]} x {match[1].upper()}" if match else gpu.upper()


def fmt(value, digits=1):
    if value is None:
        return NOTHING
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.{digits}f}"
    return str(value)


def ratio(a, b, digits=2):
    return f"{a / b:.{digits}f}" if a is not None and b else NOTHING


def table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def source_line(result_file, extra=""):
    """The line under a table's title: file, machine, what wrote it."""
    line = f"`{result_file.name}` ({result_file.machine()}"
    line += f"; {extra})" if extra else ")"
    return line + f": {result_file.description()}."


# --- one renderer per kind: a ResultFile (or the files of a group) -> Markdown lines ---------

KINDS_SHOWN = ("GEMMs", "attention", "collectives", "other")


def kinds_table(labelled_profiles):
    """Lines of a table of each profile's kernel time per step by kind (serving_bench's
    kernel_kinds_us, the busiest GPU), for the (label, profile) pairs that have it; none when
    no profile has (files written before it existed)."""
    rows = [[label] + [fmt(p["kernel_kinds_us"].get(kind, 0.0) / 1000, 2) for kind in KINDS_SHOWN]
            for label, p in labelled_profiles if p.get("kernel_kinds_us")]
    if not rows:
        return []
    return ["", "Kernel time per step on the busiest GPU by kind, ms (kernels that run at once "
                "each counted; other: XLA's elementwise and reduction fusions):", ""] + \
        table(["profile"] + list(KINDS_SHOWN), rows)


def serving(f):
    """One serving_bench run, or (run.sh serving_ab) several of one lease side by side, then
    each."""
    if "runs" not in f.data:
        return serving_run(f, f.data)
    runs = f.data["runs"]
    names = list(runs)
    keyed = {n: {(r["shape"], r.get("scheduling")): r for r in runs[n]["rows"]
                 if r["impl"].startswith("xla_ext_")} for n in names}
    steps = list(dict.fromkeys(k for n in names for k in keyed[n]))
    lines = [source_line(f, f.data.get("note", "")), ""]
    lines += table(["step", "scheduling"] + [f"{n} ms per step" for n in names]
                   + [f"{names[-1]} / {names[0]}"],
                   [[shape, scheduling or NOTHING]
                    + [fmt(keyed[n].get((shape, scheduling), {}).get("time_per_step_ms"), 2)
                       for n in names]
                    + [ratio(keyed[names[-1]].get((shape, scheduling), {}).get("time_per_step_ms"),
                             keyed[names[0]].get((shape, scheduling), {}).get("time_per_step_ms"))]
                    for shape, scheduling in steps])
    for n in names:
        lines += ["", f"Run '{n}':", ""] + serving_run(f, runs[n])[2:]
    return lines


def serving_run(f, d):
    extra = f"{d.get('model')} model, {d.get('dtype')}, {d.get('backend', 'torchax')}, " \
            f"context {d.get('context')}, copy {fmt(d.get('copy_gbps'), 0)} GB/s"
    if d.get("xla_flags"):
        extra += f", XLA_FLAGS={d['xla_flags'].strip()}"
    lines = [source_line(f, extra), ""]
    ours = [r for r in d["rows"] if r["impl"].startswith("xla_ext_")]
    lines += table(["step", "scheduling", "ms per step", "tokens/s", "GPU busy ms per step",
                    "floor ms", "wall / floor"],
                   [[r["shape"], r.get("scheduling", NOTHING), fmt(r["time_per_step_ms"], 2),
                     fmt(r["tokens_per_s"], 0), fmt(r.get("gpu_ms_per_step"), 2),
                     fmt(r.get("floor_ms"), 2), fmt(r.get("wall_over_floor"), 2)] for r in ours])
    lines += kinds_table(sorted(d.get("profiles", {}).items()))
    theirs = [r for r in d["rows"] if not r["impl"].startswith("xla_ext_")]
    if theirs:
        lines += ["", "The same model in transformers, same run (ours: our fastest row of that "
                      "batch):", ""]
        lines += table(["baseline", "step", "ms per step", "tokens/s", "ours faster by"],
                       [[HF_IMPLS.get(r["impl"], r["impl"]), r["shape"],
                         fmt(r["time_per_step_ms"], 2), fmt(r["tokens_per_s"], 0),
                         fmt(r.get("ours_speedup"), 2) + "x"] for r in theirs])
    if d.get("errors"):
        lines += ["", f"Errors recorded in the file: {len(d['errors'])}."]
    return lines


def serving_tensor_parallel(files):
    """All <gpu>-serving-<model>-tp<n>.json of one machine: TP sizes side by side."""
    rows, tp1 = [], {}
    for f in files:
        for r in f.data["rows"]:
            if r["impl"].startswith("xla_ext_"):
                tp1_key = (f.fields["model"], r["shape"], r.get("scheduling"))
                if f.fields["tp"] == "1":
                    tp1[tp1_key] = r["time_per_step_ms"]
                rows.append((f, r, tp1_key))
    out = []
    for f, r, tp1_key in rows:
        profile = f.data.get("profiles", {}).get(f"decode {r['shape']} {r.get('scheduling')}", {})
        devices = profile.get("per_device") or {}
        busy = " / ".join(fmt(v["busy_us"] / 1000, 2) for _, v in sorted(devices.items()))
        collective = " / ".join(fmt(v["collective_us"] / 1000, 2)
                                for _, v in sorted(devices.items()))
        out.append([f.fields["model"], f.fields["tp"], r["shape"], r.get("scheduling", NOTHING),
                    fmt(r["time_per_step_ms"], 2), fmt(r["tokens_per_s"], 0),
                    busy or fmt(r.get("gpu_ms_per_step"), 2), collective or NOTHING,
                    fmt(r.get("floor_ms"), 2),
                    ratio(r["time_per_step_ms"], tp1.get(tp1_key)) if f.fields["tp"] != "1"
                    else NOTHING])
    first = files[0]
    lines = [f"{', '.join(f'`{f.name}`' for f in files)} ({gpu_label(first.gpu)}; "
             f"{first.data.get('dtype')}, context {first.data.get('context')}): "
             f"{first.description()}.", ""]
    lines += table(["model", "TP", "step", "scheduling", "ms per step", "tokens/s",
                    "GPU busy ms (each GPU)", "in all-reduce ms (each GPU)", "floor ms",
                    "ms / TP=1's"], out)
    return lines + kinds_table(
        (f"{f.fields['model']} TP={f.fields['tp']} {label}", profile)
        for f in files for label, profile in sorted(f.data.get("profiles", {}).items()))


def serving_torch_xla(f):
    runs = f.data["runs"]
    backends = sorted(runs)
    # transformers' rows (no scheduling) are keyed by their impl.
    keyed = {b: {(r["shape"], r.get("scheduling") or r["impl"]): r for r in runs[b]["rows"]}
             for b in backends}
    steps = list(dict.fromkeys(k for b in backends for k in keyed[b]))
    lines = [source_line(f, f"{f.data.get('note', '')}; "
                         + ", ".join(f"{b}: {runs[b].get('device')}" for b in backends)), ""]
    return lines + table(["step", "scheduling"] + [f"{b} ms per step" for b in backends],
                         [[shape, scheduling or NOTHING]
                          + [fmt(keyed[b].get((shape, scheduling), {}).get("time_per_step_ms"), 2)
                             for b in backends] for shape, scheduling in steps])


def serving_compare(f):
    rows = []
    for case in f.data["cases"]:
        requests = case["requests"]
        diverged = [r["first_divergence"] for r in requests if r["first_divergence"] is not None]
        rows.append([case["case"], case["dtype"], f"{case['requests_equal']} of {len(requests)}",
                     f"{min(diverged)}-{max(diverged)}" if diverged else NOTHING,
                     fmt(max(r["max_abs_logit_diff_up_to_divergence"] for r in requests), 3)])
    lines = [source_line(f, f"{f.data.get('max_new_tokens')} new tokens per request"), ""]
    return lines + table(["case", "dtype", "requests with transformers' tokens",
                          "first divergence (new token)", "largest logit difference up to it"],
                         rows)


def decode_bench(f):
    d = f.data
    by = {(r["op"], r["shape"], r["impl"]): r for r in d["rows"] if "time_us" in r}
    shapes = list(dict.fromkeys(r["shape"] for r in d["rows"] if r["op"] == "paged_attention"))
    lines = [source_line(f, f"copy {fmt(d.get('copy_gbps'), 0)} GB/s"), ""]

    def time(shape, impl):
        return by.get(("paged_attention", shape, impl), {}).get("time_us")

    lines += table(["shape", "ours µs", "% of copy", "cuDNN SDPA µs", "ours / cuDNN",
                    "flash SDPA µs", "XLA gather µs", "gather / ours"],
                   [[s, fmt(time(s, "xla_ext")),
                     fmt(by.get(("paged_attention", s, "xla_ext"), {}).get("pct_of_copy")),
                     fmt(time(s, "sdpa_cudnn")), ratio(time(s, "xla_ext"), time(s, "sdpa_cudnn")),
                     fmt(time(s, "sdpa_flash")), fmt(time(s, "xla_gather")),
                     ratio(time(s, "xla_gather"), time(s, "xla_ext"))] for s in shapes])
    others = [(op, shape) for op, shape, impl in by if op != "paged_attention" and impl == "xla_ext"]
    if others:
        lines += ["", "Against XLA's own op:", ""]
        lines += table(["op", "shape", "ours µs", "XLA's µs", "ours / XLA's"],
                       [[op, shape, fmt(by[(op, shape, "xla_ext")]["time_us"], 2),
                         fmt(by.get((op, shape, "xla_native"), {}).get("time_us"), 2),
                         ratio(by[(op, shape, "xla_ext")]["time_us"],
                               by.get((op, shape, "xla_native"), {}).get("time_us"))]
                        for op, shape in others])
    return lines


def decode_mixes(f):
    d = f.data
    by = {(r["shape"], r["impl"]): r for r in d["rows"]}
    mixes = list(dict.fromkeys(r["shape"] for r in d["rows"]))
    rows = []
    for mix in mixes:
        ours = by.get((mix, "xla_ext"), {})
        eager = by.get((mix, "torch_eager"), {})
        uniform = by.get((mix, "uniform_xla_ext"), {}).get("time_us")
        flashinfer = [by[(mix, i)]["time_us"] for i in FLASHINFER if (mix, i) in by
                      and "time_us" in by[(mix, i)]]
        rows.append([mix, fmt(ours.get("kv_mb")), fmt(ours.get("time_us")),
                     fmt(ours.get("pct_of_copy")),
                     fmt(by.get((mix, "torch_graph"), {}).get("time_us")),
                     fmt(eager.get("time_us")), fmt(eager.get("host_us")), fmt(uniform),
                     ratio(ours.get("time_us"), uniform),
                     *[fmt(by.get((mix, i), {}).get("time_us")) for i in FLASHINFER],
                     ratio(ours.get("time_us"), min(flashinfer)) if flashinfer else NOTHING])
    lines = [source_line(f, f"{d.get('dtype')}, block {d.get('block_size')}, copy "
                            f"{fmt(d.get('copy_gbps'), 0)} GB/s"), ""]
    return lines + table(["mix", "K/V MB", "ours (XLA) µs", "% of copy", "torch op, graph µs",
                          "torch op, eager µs", "host µs per eager call",
                          "uniform batch, same tokens µs", "ours / uniform",
                          "FlashInfer CUDA-core µs", "FlashInfer tensor-core µs",
                          "ours / faster FlashInfer"], rows)


def ragged(f):
    d = f.data
    by = {(r["shape"], r["impl"]): r for r in d["rows"]}
    mixes = list(dict.fromkeys(r["shape"] for r in d["rows"]))
    impls = [i for i in ("flashinfer_prefill", "xla_native")
             if any(impl == i for _, impl in by)]
    names = {"flashinfer_prefill": "FlashInfer paged prefill", "xla_native": "plain JAX"}
    rows = []
    for mix in mixes:
        ours = by.get((mix, "xla_ext"), {})
        row = [mix, fmt(ours.get("roofline_us")), fmt(ours.get("time_us")),
               fmt(ours.get("x_roofline"), 2)]
        for impl in impls:
            row += [fmt(by.get((mix, impl), {}).get("time_us")),
                    fmt(by.get((mix, impl), {}).get("x_roofline"), 2)]
        rows.append(row)
    headers = ["mix", "roofline µs", "ours µs", "ours / roofline"]
    for impl in impls:
        headers += [f"{names[impl]} µs", "/ roofline"]
    lines = [source_line(f, f"copy {fmt(d.get('copy_gbps'), 0)} GB/s, bf16 matmul "
                            f"{fmt(d.get('matmul_tflops'), 0)} TFLOP/s"), ""]
    return lines + table(headers, rows)


def kernel_times(f):
    rows = []
    for run in f.data:
        for r in run["results"]:
            rows.append([r["impl"], r["shape"], fmt(r["period_us"]),
                         " + ".join(fmt(t) for t in r["kernels_us"].values()),
                         fmt(r["idle_us"])])
    lines = [source_line(f, f"{f.data[0].get('calls_per_chain')} calls per chain"), ""]
    return lines + table(["impl", "shape", "GPU span per call µs", "kernels µs",
                          "idle between kernels µs"], rows)


def kv_cache(f):
    d = f.data
    sizes = list(dict.fromkeys(r["cache_bytes"] for r in d["rows"]))
    impls = list(dict.fromkeys(r["impl"] for r in d["rows"]))
    by = {(r["impl"], r["cache_bytes"]): r for r in d["rows"]}
    rows = [[impl] + [fmt(by.get((impl, s), {}).get("time_us")) for s in sizes] for impl in impls]
    copies = [by.get((impls[0], s), {}).get("cache_copy_us") for s in sizes]
    if any(c is not None for c in copies):
        rows.append(["one copy of the cache (for scale)"] + [fmt(c) for c in copies])
    extra = f"{d.get('new_tokens')} new tokens per step"
    if d.get("copy_gbps"):
        extra += f", copy {fmt(d['copy_gbps'], 0)} GB/s"
    lines = [source_line(f, extra), ""]
    return lines + table(["µs per step"] + [f"{s // 2**20} MiB cache" for s in sizes], rows)


def linear(f):
    d = f.data
    rows = [[r["model"], r["proj"], r["form"], r["tokens"], fmt(r["weight_mb"]),
             fmt(r["ours_us"], 2), fmt(r["cublas_us"], 2), fmt(r["ours_gbps"], 0),
             fmt(r["cublas_gbps"], 0), fmt(r["speedup"], 2)] for r in d["rows"]]
    lines = [source_line(f, f"{d.get('dtype')}, copy {fmt(d.get('copy_gbps'), 0)} GB/s"), ""]
    return lines + table(["model", "projection", "epilogue", "tokens", "weight MB", "ours µs",
                          "cuBLAS (+ torch epilogue) µs", "ours GB/s", "cuBLAS GB/s",
                          "cuBLAS / ours"], rows)


def eager_overhead(files):
    ops = list(dict.fromkeys(op for f in files for op in f.data["host_us_per_call"]))
    lines = [f"{', '.join(f'`{f.name}`' for f in files)}: {files[0].description()}; "
             "host CPU time per call, best of 7 rounds of 2000 calls.", ""]
    return lines + table(["machine", "tensors", "host"] + [f"{op} µs" for op in ops],
                         [[gpu_label(f.gpu), f.data.get("device"), f.data.get("host")]
                          + [fmt(f.data["host_us_per_call"].get(op)) for op in ops]
                          for f in files])


def tp_layer(f):
    d = f.data
    rows = []
    for tp, run in sorted(d["runs"].items()):
        for device, trace in sorted((run.get("trace") or {}).items()):
            rows.append([tp, device, fmt(run["step_us"]), fmt(trace["span_us_per_step"]),
                         fmt(trace["kernel_us_per_step"]),
                         fmt(trace["collective_share_of_span"] * 100),
                         run["hlo_all_reduces"]])
    config = d.get("config", {})
    lines = [source_line(f, f"one decoder layer, {config.get('seqs')} sequences of "
                            f"{config.get('context')} tokens, {config.get('dtype')}")]
    if "tp_vs_1" in d:
        check = d["tp_vs_1"]
        verdict = "within" if check.get("ok") else "OUTSIDE"
        lines[0] += (f" TP={d['tp']} against TP=1: {verdict} the tolerance, "
                     f"{check.get('tolerance')} of each tensor's largest value (layer output: "
                     f"{check.get('layer_output_max_abs_diff')} of "
                     f"{check.get('layer_output_max_abs')}).")
    return lines + [""] + table(["TP", "device", "step µs", "GPU span µs per step",
                                 "kernels µs per step", "% in collectives",
                                 "all-reduces in the HLO"], rows)


def engine_soak(files):
    rows = []
    for f in files:
        d = f.data
        counts, rss, buffers = d["counts"], d["rss_mib"], d["live_buffers"]
        device = d.get("device_mib")
        solo = (f"{len(d['solo_mismatches'])} of {d['solo_checked']}" if "solo_checked" in d
                else "not checked")
        rows.append([d.get("backend"), d.get("device", "CPU"), counts["steps"],
                     fmt(d.get("seconds")), counts["requests"], counts["finished"],
                     counts["aborted"], counts.get("refused", 0), counts["tokens"], solo,
                     f"{fmt(rss['first'])} -> {fmt(rss['last'])} ({rss['change']:+.1f})",
                     f"{buffers['first']} -> {buffers['last']} ({buffers['change']:+d})",
                     f"{fmt(device['first'])} -> {fmt(device['last'])} ({device['change']:+.1f})"
                     if device else "–"])
    lines = [f"{', '.join(f'`{f.name}`' for f in files)}: {files[0].description()}. Memory and "
             "live buffers: first and last sample after the first tenth of the run; device "
             "memory from the GPU allocator's statistics. Solo: finished requests whose tokens "
             "differ from the same request run alone, of those checked.", ""]
    return lines + table(["backend", "device", "steps", "seconds", "requests", "finished",
                          "aborted", "refused", "tokens", "solo: differ", "host RSS MiB",
                          "live device buffers", "device MiB"], rows)


def torch_xla_gpu(f):
    d = f.data
    checks = d.get("checks", {})
    failed = [name for name, check in checks.items() if not check.get("passed")]
    line = (f"{source_line(f, 'torch ' + str(d.get('torch')) + ', torch_xla ' + str(d.get('torch_xla')))} "
            f"{len(checks) - len(failed)} of {len(checks)} checks pass")
    line += f"; failed: {', '.join(failed)}." if failed else "."
    compared = d.get("compared_with", {})
    if compared:
        line += f" Compared with torch {compared.get('torch')} on {compared.get('gpu')}."
    return [line]


def _start_breakdown(record):
    """Where a vLLM start's time went, from its start_log (tools/device/vllm_gpu.py: "+S s"
    and vLLM's line): the platform's first line, weights loaded, the KV cache sized after the
    profile run, each warm-up compile, the first token."""
    marks, compiles, compiling = {}, [], None
    for line in record.get("start_log", []):
        at, _, message = line[1:].partition(" s ")
        if not at.isdigit():
            continue
        if message.startswith("XLA platform: KV page size"):
            marks.setdefault("platform", at)
        elif message.startswith("Loading weights took"):
            marks["weights"] = at
        elif message.startswith("GPU KV cache size"):
            marks["kv"] = at
        elif message.startswith("Compiling "):
            compiling = message.split()[1 if not message.startswith("Compiling the ") else 2]
        elif message.startswith("Compilation finished in") and compiling:
            compiles.append(f"{compiling} {fmt(float(message.split()[3]))}")
    if not marks:
        return None
    return (f"first token at {fmt(record.get('start_to_first_token_s'))} s: the platform's first "
            f"line at {marks.get('platform', NOTHING)} s (imports, the engine's process), weights "
            f"loaded at {marks.get('weights', NOTHING)} s, the KV cache sized after the profile run "
            f"at {marks.get('kv', NOTHING)} s, then warm-up compiles (s): {', '.join(compiles)}.")


def vllm_on_xla(f):
    d = f.data
    lines = [source_line(f, d.get("note", "")), ""]
    checks = []
    for model, m in d.get("check", {}).items():
        v = m.get("vllm", {})
        where = m.get("first_divergence")
        agree = "yes" if m.get("equal") else (
            f"no: prompt {where['prompt']}, token {where['token']}, vLLM's margin there "
            f"{fmt(where.get('vllm_margin'), 3)}" if where else "no")
        checks.append([model, v.get("device", NOTHING), m.get("equal_to"), agree,
                       fmt(v.get("start_to_first_token_s")), v.get("layer_cache_shape", NOTHING),
                       v.get("error", NOTHING)])
    if checks:
        lines += ["`LLM.generate` greedy tokens:", ""] + table(
            ["model", "device", "against", "equal", "start to first token s",
             "cache per layer", "error"], checks) + [""]
    serve = d.get("serve")
    if serve:
        held = ", ".join(f"{k} {'ok' if v.get('ok') else 'FAILED'}" for k, v in serve.items()
                         if isinstance(v, dict) and "ok" in v)
        gone = serve.get("disconnects", {})
        lines += [f"`vllm serve` (tiny): {held}; tokens equal to transformers': "
                  f"{serve.get('equal_to_transformers')}; healthy {fmt(serve.get('start_to_healthy_s'))} s "
                  f"after start; {gone.get('aborted', NOTHING)} of {gone.get('requests', NOTHING)} "
                  f"streams left mid-way aborted, cache empty "
                  f"{fmt(gone.get('seconds_to_idle_and_empty_cache'), 2)} s later.", ""]
    speed = d.get("speed", {})
    if d.get("compared"):
        cold, warm = speed.get("cold", {}), speed.get("warm_start", {})
        lines += [f"Wall time per step, 1B bf16 (vLLM: start to first token "
                  f"{fmt(cold.get('start_to_first_token_s'))} s cold, "
                  f"{fmt(warm.get('start_to_first_token_s'))} s with its compilation cache):", ""]
        lines += table(["step", "vLLM on XLA ms", "Engine torchax ms", "Engine torch_xla ms",
                        "transformers + torch.compile ms", "vLLM / Engine's best"],
                       [[c["shape"], fmt(c["vllm_ms"], 2), fmt(c.get("xla_ext_torchax_ms"), 2),
                         fmt(c.get("xla_ext_torch_xla_ms"), 2),
                         fmt(c.get("hf_compile_reduce_overhead_ms"), 2),
                         fmt(c.get("vllm_over_engine_best"), 2)] for c in d["compared"]])
    for start in ("cold", "warm_start"):
        line = _start_breakdown(d.get("startup", {}).get(start, {}))
        if line:
            lines += ["", f"vLLM's start ({start.replace('_', ' ')}, a lease of its own): " + line]
    for start_kind, r in d.get("start", {}).items():
        if "error" in r:
            continue
        parts = ", ".join(f"{what} {fmt(s)}" for what, s in r.get("cumulative_s", {}).items())
        lines += ["", f"vLLM's start profiled ({start_kind}, the engine in the process): first "
                  f"token at {fmt(r.get('start_to_first_token_s'))} s; torch_xla compiled "
                  f"{r.get('compiles')} graphs in {fmt(r.get('compile_s'))} s; its counters "
                  f"{r.get('counters')}; {r.get('cache_files')} files in the compilation cache; "
                  f"cumulative s: {parts}."]
    profile = d.get("profile")
    if profile and "error" not in profile:
        per_step = profile.get("torch_xla_per_step", {})
        timed, busy = per_step.get("timed", {}), profile.get("gpu_busy_percent")
        costs = profile.get("host_us_per_call", {})
        lines += ["", f"Where vLLM's B=1 decode step goes (1B bf16, {profile.get('num_gpu_blocks')} "
                  f"blocks of {profile.get('block_size')} tokens): {fmt(profile.get('ms_per_step'), 2)} "
                  f"ms per step; the GPU busy {fmt(busy)}% of the time "
                  f"({fmt(busy * profile['ms_per_step'] / 100 if busy else None, 2)} ms per step); "
                  f"per step {fmt(timed.get('ExecuteTime', {}).get('count'))} executions, "
                  f"{fmt(timed.get('TransferToDeviceTime', {}).get('count'))} transfers to the "
                  f"device, {fmt(per_step.get('counters', {}).get('MarkStep'))} syncs; host µs per "
                  "call: " + ", ".join(f"{k.replace('_', ' ')} {fmt(v)}" for k, v in costs.items())
                  + "."]
    return lines


# --- logs --------------------------------------------------------------------------------

LOG_DATE = re.compile(r"^== (\w{3} \w{3} +\d+ [\d:]+ [AP]M UTC \d{4}) (.+?), [\d.]+$", re.M)
PYTEST_LINE = re.compile(r"^(?:(?P<label>[\w -]+ kernel): )?(?P<counts>(?:\d+ (?:passed|failed|"
                         r"skipped|deselected|errors?|warnings?)(?:, )?)+) in [\d.]+s", re.M)
SANITIZER_LINE = re.compile(r"^=+ (?:ERROR SUMMARY: (\d+) errors?|RACECHECK SUMMARY: (\d+) hazards)",
                            re.M)
STATUS_LINE = re.compile(r"^== done, status (\d+)$", re.M)


def log_date(text):
    """'Thu Nov 26 06:33:32 AM UTC 2026' (`date -u`) -> '2026-11-26 06:33 UTC'."""
    return datetime.datetime.strptime(text.replace("  ", " "), "%a %b %d %I:%M:%S %p UTC %Y") \
        .strftime("%Y-%m-%d %H:%M UTC")


def log_row(f):
    """A log's date and GPU (its first '== <date> <GPU>' line), and what it reports."""
    text = f.text()
    date = LOG_DATE.search(text)
    outcomes = []
    for m in PYTEST_LINE.finditer(text):
        counts = re.sub(r",? \d+ (?:deselected|warnings?)", "", m["counts"]).strip(", ")
        outcomes.append(f"{m['label']}: {counts}" if m["label"] else counts)
    sanitizers = SANITIZER_LINE.findall(text)
    if sanitizers:
        found = sum(int(a or b) for a, b in sanitizers)
        runs = f"{len(sanitizers)} run" + ("s" if len(sanitizers) > 1 else "")
        outcomes.append(f"compute-sanitizer: {runs}, {found} errors or hazards")
    passes = re.findall(r"^(PASS|FAIL)\b", text, re.M)
    if passes:
        outcomes.append(f"{passes.count('PASS')} PASS, {passes.count('FAIL')} FAIL")
    status = STATUS_LINE.findall(text)
    if status:
        outcomes.append(f"exit status {status[-1]}")
    return [f"`{f.name}`", f.description(),
            log_date(date[1]) if date else NOTHING, date[2] if date else gpu_label(f.gpu),
            "; ".join(outcomes) or NOTHING]


def dispatch_lines(f):
    """bench/dispatch_command_buffers.py's lines: one per XLA_FLAGS setting."""
    rows = []
    for m in re.finditer(r"^XLA_FLAGS=(.*?): us per call \{'xla_ext': ([\d.]+), "
                         r"'xla_native': ([\d.]+)\}", f.text(), re.M):
        rows.append([m[1], m[2], m[3], ratio(float(m[2]), float(m[3]))])
    return [source_line(f, "one 4 KiB add inside a compiled graph"), ""] + \
        table(["XLA_FLAGS", "ours µs", "XLA's add µs", "ours / XLA's"], rows)


def clocks(f):
    rows = []
    for m in re.finditer(r"^(.+?): (\d+) calls/s \(([\d.]+) us each\).*?SM clock median (\d+) MHz"
                         r" \(min (\d+)\), power median (\d+) W", f.text(), re.M):
        rows.append([m[1], m[3], m[4], m[5], m[6]])
    return [source_line(f), ""] + table(["mix, back to back", "µs per call",
                                         "SM clock median MHz", "min MHz", "power median W"],
                                        rows)


# --- the document ----------------------------------------------------------------------------

def group_by_gpu(files):
    groups = {}
    for f in files:
        groups.setdefault(f.gpu, []).append(f)
    return list(groups.values())


# (title, which files, how: "each" renders every file alone, "group" the files of one machine
# together, "all" every matching file in one table).
SECTIONS = [
    ("Serving engine, one GPU", [("serving", "json"), ("serving-flags", "json")], serving, "each"),
    ("Serving engine, tensor parallel", [(r"serving-(?P<model>[a-z0-9]+)-tp(?P<tp>[0-9]+)", "json")],
     serving_tensor_parallel, "group"),
    ("Serving engine through torch_xla and torchax", [("serving-torch-xla", "json")],
     serving_torch_xla, "each"),
    ("Serving engine against transformers' tokens", [("serving-compare", "json")],
     serving_compare, "each"),
    ("Paged decode attention, uniform batches", [("decode-uniform", "json"), ("", "json")],
     decode_bench, "each"),
    ("Paged decode attention on batch mixes", [("decode-mixes", "json")], decode_mixes, "each"),
    ("Ragged paged attention", [("ragged", "json")], ragged, "each"),
    ("GPU time of a paged-attention call", [("kernel-times", "json")], kernel_times, "each"),
    ("A custom call's cost inside a compiled graph", [("dispatch-command-buffers", "txt")],
     dispatch_lines, "each"),
    ("KV-cache write step against cache size", [("kv-cache", "json")], kv_cache, "each"),
    ("Linear layers of a decode step: small_batch_linear against cuBLAS", [("layer-ops", "json")],
     linear, "each"),
    ("Host time of an eager torch-op call", [("eager-overhead", "json")], eager_overhead, "all"),
    ("One decoder layer split over GPUs", [(r"tp(?P<tp>[0-9]+)", "json")], tp_layer, "each"),
    ("Engine soak", [(r"engine-soak-(?P<backend>[a-z-]+)", "json")], engine_soak, "all"),
    ("torch_xla on the GPU", [("torch-xla-gpu", "json")], torch_xla_gpu, "each"),
    ("vLLM's engine on XLA", [("vllm", "json")], vllm_on_xla, "each"),
    ("SM clock under load", [("ragged-clocks", "txt")], clocks, "each"),
]
LOGS = [("tests", "txt"), ("decode-tests", "txt"), ("ragged-tests", "txt"),
        (r"sanitize(?:-(?P<tools>[a-z-]+))?", "txt"), ("plugin", "txt"),
        ("torch-xla-gpu", "txt"), ("torch-xla-gpu-tests", "txt"), ("torch-xla-legacy", "txt"),
        ("torch-xla-failures", "txt"), ("serving-summary", "txt"), ("serving-ab", "txt"),
        ("layer-ops-tests", "txt")]
PROFILES = [("ncu", "txt"), ("ncu-mixes", "txt"), ("ncu-ragged", "txt"), ("decode-latency", "txt"),
            (r"ncu-ragged-sass-(?P<table>[0-9]+)", "csv"), ("dispatch-record-probe", "txt"),
            ("torch-xla-step-profile", "txt"), ("serving", "txt"), ("serving-timeline", "txt"),
            ("serving-tp-timeline", "txt")]
PLOTS = {"": "bench/plot.py of the same GPU's .json"}


def summarize(results=RESULTS):
    """SUMMARY.md's text for the files in `results` (a folder)."""
    results = Path(results)
    if not results.is_dir():
        raise ValueError(f"results: expected a folder of result files, got {results}")
    files = [ResultFile(p) for p in sorted(results.iterdir()) if p.is_file() and p.name != SUMMARY]
    used = set()

    def take(kinds):
        chosen = [f for f in files if any(f.is_kind(k, e) for k, e in kinds)]
        used.update(f.name for f in chosen)
        return chosen

    out = ["# Benchmark results: summary", "",
           "Generated by `python bench/summarize_results.py` from the files in this folder "
           "(do not edit; rerun it after replacing a file). How each benchmark runs and what its "
           "fields mean: [bench/README.md](../README.md); what was tried on the way: "
           "[docs/performance.md](../../docs/performance.md). Only the logs record when they "
           "ran; for a JSON file, `git log` it.", ""]
    for title, kinds, render, how in SECTIONS:
        chosen = take(kinds)
        if not chosen:
            continue
        out += [f"## {title}", ""]
        if how == "each":
            inputs = [[f] for f in chosen]
        elif how == "group":
            inputs = group_by_gpu(chosen)
        else:
            inputs = [chosen]
        for group in inputs:
            try:
                part = render(group[0] if how == "each" else group)
            except (KeyError, IndexError, TypeError, AttributeError) as e:
                names = ", ".join(str(f.path) for f in group)
                raise ValueError(f"{names}: expected the fields of a '{title}' result file, "
                                 f"got a file without them ({type(e).__name__}: {e})") from e
            out += part + [""]
    logs = take(LOGS)
    if logs:
        out += ["## Test runs and logs", ""]
        out += table(["file", "what", "date", "GPU", "reports"], [log_row(f) for f in logs])
        out.append("")
    profiles = take(PROFILES)
    plots = [f for f in files if f.ext == "png" and f.kind in PLOTS]
    used.update(f.name for f in plots)
    if profiles or plots:
        out += ["## Profiles and plots (not summarized)", ""]
        out += [f"- `{f.name}`: {f.description()}" for f in profiles]
        out += [f"- `{f.name}`: {PLOTS[f.kind]}" for f in plots]
        out.append("")
    unread = [f.name for f in files if f.name not in used]
    if unread:
        out += ["## Other files (no summary for their kind)", ""]
        out += [f"- `{name}`" for name in unread] + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=str(RESULTS), help="the folder of result files")
    parser.add_argument("--check", action="store_true",
                        help="compare with the folder's SUMMARY.md instead of writing it")
    args = parser.parse_args()
    text = summarize(args.results)
    path = Path(args.results) / SUMMARY
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date: run python bench/summarize_results.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
