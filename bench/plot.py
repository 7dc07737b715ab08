"""Plots a results file of bench/decode_bench.py: paged-attention time per implementation and
shape, and XlaGpuSimpleAdd against XLA's add.

    python bench/plot.py bench/results/h100.json bench/results/h100.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMPLS = [("xla_ext", "ours (XLA custom call)"), ("sdpa_cudnn", "torch SDPA cuDNN (contiguous)"),
         ("sdpa_flash", "torch SDPA flash (contiguous)"), ("xla_gather", "XLA gather + einsum")]


def main(results_path, png_path):
    with open(results_path) as f:
        results = json.load(f)
    rows = [r for r in results["rows"] if "time_us" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in rows if r["op"] == "paged_attention"))
    fig, (attention, add) = plt.subplots(1, 2, figsize=(15, 5.5),
                                         gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(IMPLS)
    for i, (impl, label) in enumerate(IMPLS):
        times = [next((r["time_us"] for r in rows if r["op"] == "paged_attention"
                       and r["shape"] == s and r["impl"] == impl), 0) for s in shapes]
        bars = attention.bar([x + i * width for x in range(len(shapes))], times, width,
                             label=label)
        if impl == "xla_ext":
            for bar, shape in zip(bars, shapes):
                pct = next(r["pct_of_copy"] for r in rows if r["shape"] == shape
                           and r["impl"] == impl and r["op"] == "paged_attention")
                attention.annotate(f"{pct:.0f}%", (bar.get_x() + bar.get_width() / 2,
                                                   bar.get_height()),
                                   ha="center", va="bottom", fontsize=8)
    attention.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))])
    attention.set_xticklabels([s.replace(",block", "\nblock") for s in shapes], fontsize=8)
    attention.set_ylabel("µs per decode step (lower is better)")
    attention.set_title(f"paged_attention decode, bf16, H=32, KVH=8, D=128 — {results['device']}\n"
                        f"(labels: ours as % of the {results['copy_gbps']:.0f} GB/s copy bandwidth)",
                        fontsize=10)
    attention.legend(fontsize=8)

    adds = [r for r in rows if r["op"] in ("simple_add", "dispatch")]
    labels = [f"{r['op']}\n{r['shape']}\n{r['impl']}" for r in adds]
    add.bar(range(len(adds)), [r["time_us"] for r in adds],
            color=["C0" if r["impl"] == "xla_ext" else "C4" for r in adds])
    add.set_yscale("log")
    add.set_xticks(range(len(adds)))
    add.set_xticklabels(labels, fontsize=7)
    add.set_ylabel("µs per call (log)")
    add.set_title("XlaGpuSimpleAdd vs XLA's add", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
