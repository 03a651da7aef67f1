"""Plots a results file of benchmarks/gpu_suites.py: one PNG next to the JSON.

    python benchmarks/plot_results.py benchmarks/results/gpu_<suite>.json [more.json ...]

dense, bias_mask, packed: grouped bars of TF/s per config, forward and forward+backward;
dynamic: stacked bars of mask generation + forward + backward (ms) per config and implementation;
density: time / time at 100 % density against the kept fraction, forward and forward+backward.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

IMPLS = ("jax_dmattn", "jax_dmattn_mask", "jax_dmattn_batch", "cudnn", "xla")
NAMES = {"jax_dmattn": "jax_dmattn", "jax_dmattn_mask": "jax_dmattn (dense mask)",
         "jax_dmattn_batch": "jax_dmattn (as a batch)", "cudnn": "cuDNN", "xla": "xla (jax.nn)"}
COLORS = {"jax_dmattn": "tab:blue", "jax_dmattn_mask": "tab:cyan",
          "jax_dmattn_batch": "tab:purple", "cudnn": "tab:green", "xla": "tab:gray"}
PASSES = ("fwd", "fwd+bwd")


def value(row: dict | None, impl: str, key: str = "ms") -> float:
    """The number in one cell, NaN when the cell (or its row) is n/a or absent."""
    return math.nan if row is None else row["results"].get(impl, {}).get(key, math.nan)


def impls_of(rows: list[dict]) -> list[str]:
    return [i for i in IMPLS if any(i in r["results"] for r in rows)]


def configs_of(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in rows))


def row_of(rows: list[dict], label: str, pass_name: str) -> dict | None:
    return next((r for r in rows if r["label"] == label and r["pass"] == pass_name), None)


def grouped_bars(plt, rows: list[dict]):
    """Two panels (fwd, fwd+bwd): TF/s of each implementation, grouped by config."""
    impls, labels = impls_of(rows), configs_of(rows)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.1 * len(labels) + 3), 9), sharex=True)
    width = 0.8 / len(impls)
    for ax, pass_name in zip(axes, PASSES, strict=True):
        for n, impl in enumerate(impls):
            xs = [i + (n - (len(impls) - 1) / 2) * width for i in range(len(labels))]
            ys = [value(row_of(rows, label, pass_name), impl, "tflops") for label in labels]
            ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=NAMES[impl],
                   color=COLORS[impl])
            for x, y in zip(xs, ys, strict=True):
                if math.isnan(y):
                    ax.text(x, 0, "n/a", ha="center", va="bottom", rotation=90, fontsize=7)
        ax.set_ylabel(f"{pass_name} TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1].set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    return fig


def stacked_bars(plt, rows: list[dict]):
    """Per config and implementation: mask generation + forward + backward, stacked (ms)."""
    impls, labels = impls_of(rows), configs_of(rows)
    hatches = {"jax_dmattn": "", "jax_dmattn_mask": "xx", "cudnn": "//", "xla": ".."}
    segments = (("mask gen", "tab:orange"), ("fwd", "tab:blue"), ("bwd", "tab:purple"))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(labels) + 3), 6))
    width = 0.8 / len(impls)
    for n, impl in enumerate(impls):
        for i, label in enumerate(labels):
            mask_row = row_of(rows, label, "mask gen")
            mask_ms = value(mask_row, impl)
            fwd = value(row_of(rows, label, "fwd"), impl)
            if mask_row and mask_row["results"].get(impl, {}).get("in_fwd"):
                # its fwd made its own mask: stack that part once (timed alone, it can exceed
                # the fwd by the run-to-run spread)
                mask_ms = min(mask_ms, fwd)
                fwd -= mask_ms
            bwd = value(row_of(rows, label, "fwd+bwd"), impl) - fwd
            x = i + (n - (len(impls) - 1) / 2) * width
            if any(math.isnan(t) for t in (mask_ms, fwd, bwd)):
                ax.text(x, 0, f"{NAMES[impl]} n/a", ha="center", va="bottom", rotation=90,
                        fontsize=7)
                continue
            bottom = 0.0
            for (_, color), height in zip(segments, (mask_ms, fwd, bwd), strict=True):
                ax.bar(x, height, width, bottom=bottom, color=color, hatch=hatches[impl],
                       edgecolor="black", linewidth=0.4)
                bottom += height
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, label=name) for name, c in segments]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=hatches[i], label=NAMES[i])
                for i in impls]
    ax.legend(handles=handles, fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms (mask gen + fwd + bwd)")
    ax.grid(axis="y", alpha=0.3)
    return fig


def density_lines(plt, rows: list[dict]):
    """Two panels (fwd, fwd+bwd): time / time at 100 % against the kept fraction, one line per
    implementation and head count."""
    impls = impls_of(rows)
    head_counts = sorted({r["config"]["H"] for r in rows})
    markers = dict(zip(head_counts, "os^v", strict=False))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, pass_name in zip(axes, PASSES, strict=True):
        ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="ideal (time ∝ density)")
        for heads in head_counts:
            sweep = sorted((r for r in rows if r["pass"] == pass_name
                            and r["config"]["H"] == heads),
                           key=lambda r: r["config"]["actual_density"])
            xs = [r["config"]["actual_density"] for r in sweep]
            for impl in impls:
                ys = [r.get("vs_dense", {}).get(impl) for r in sweep]
                ax.plot(xs, [math.nan if y is None else y for y in ys], f"{markers[heads]}-",
                        label=f"{NAMES[impl]} H={heads}", color=COLORS[impl],
                        alpha=1.0 if heads == head_counts[-1] else 0.55)
        ax.set_title(pass_name)
        ax.set_xlabel("kept fraction of the [L, L] mask")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("time / time at 100 %")
    return fig


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]
    suite = meta["suite"]
    drawers = {"dense": grouped_bars, "bias_mask": grouped_bars, "dynamic": stacked_bars,
               "density": density_lines, "packed": grouped_bars}
    fig = drawers[suite](plt, rows)
    title = f"{suite}: {meta['device']}, jax {meta['jax']}, bf16"
    if meta.get("smoke_test"):
        title += "\nSMOKE TEST, NOT A PERFORMANCE RESULT"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="gpu_<suite>.json files")
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("plot_results.py needs matplotlib: pip install matplotlib")
    for path in args.results:
        print(f"wrote {plot(path)}", flush=True)


if __name__ == "__main__":
    main()
