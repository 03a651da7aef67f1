"""GPU: decoding at memory speed (issue 26): the forward of a few query rows against a long cache.

Each implementation is timed in this one process on the same bf16 inputs (random normal, D128,
forward only): back to back, 20 calls then one ``block_until_ready``, best of 3, after warm-up
(DESIGN.md §5). Columns: jax_dmattn with the dispatcher's choice (its kernel named by
``_ffi.cuda_forward_kernel``), jax_dmattn with the FlashAttention-2-class forward forced (the path
before the decode kernel), jax_dmattn's ``paged_attention`` over the same keys in a paged cache
(64-key pages scattered in a pool, the full lengths), cuDNN and XLA
(``jax.nn.dot_product_attention``).

A decode call reads the whole cache once, so each time is also given as the rate of K/V bytes
read, ``2·B·Lk·Hk·D·2`` bytes / time, beside the device-to-device copy bandwidth measured in the
same run (a jitted ``x + 1`` of a 1 GiB bf16 array: (read + write) bytes / time, as CUDA's
bandwidthTest counts it).

Workloads: B8 Lq1 Lk32k, B1 Lq1 Lk128k and B8 Lq16 Lk32k, H32 Hk8, each without and with a
per-key bias ``[B, H, 1, Lk]``, and B8 Lq1 Lk32k with a bool mask ``[B, 1, 1, Lk]`` (~90 % True).
Issue 26's targets: B8 Lq1 Lk32k >= 1.0x cuDNN with K/V read >= 85 % of the copy bandwidth,
B1 Lq1 Lk128k and B8 Lq16 >= 1.0x cuDNN, a per-key bias <= 10 % over no bias, a paged cache
(page size 64 or more) <= 5 % over the contiguous one.

    python benchmarks/decode.py [--smoke] [--out benchmarks/results]

``--smoke`` runs tiny shapes (on a machine without a GPU: the CPU kernels) to check the script;
its numbers are no result.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from _command import recorded_command
from gpu_suites import machine_info, reason

import jax_dmattn
from jax_dmattn import _ffi
from jax_dmattn import _timing as timing

CALLS, REPEATS, WARMUP_S = 20, 3, 0.3
DTYPE = jnp.bfloat16
COPY_BYTES = 1 << 30
IMPLS = ("ours", "ours_paged", "ours_flash2", "cudnn", "xla")
NAMES = {"ours": "jax_dmattn", "ours_paged": "jax_dmattn paged",
         "ours_flash2": "jax_dmattn (FA2-class fwd)", "cudnn": "cuDNN", "xla": "XLA"}
PAGE_SIZE = 64
EXTRAS = {"none": "", "bias": " + per-key bias [B,H,1,Lk]", "mask": " + mask [B,1,1,Lk] 90 %"}


@dataclasses.dataclass(frozen=True)
class Workload:
    """q ``[B, Lq, H, D]``, k and v ``[B, Lk, Hk, D]``; `extra`: "none", "bias" (per key,
    ``[B, H, 1, Lk]``) or "mask" (bool ``[B, 1, 1, Lk]``, ~90 % True)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    extra: str = "none"

    @property
    def config(self) -> str:
        """The shapes without the extra operand: a bias row's no-bias partner has the same."""
        lk = self.seqlen_k
        keys = f"{lk // 1024}k" if lk % 1024 == 0 else str(lk)
        return (f"B{self.batch} Lq{self.seqlen_q} Lk{keys} H{self.heads} Hk{self.kv_heads} "
                f"D{self.head_dim}")

    @property
    def label(self) -> str:
        return self.config + EXTRAS[self.extra]

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V, which a decode call reads once."""
        return 2 * self.batch * self.seqlen_k * self.kv_heads * self.head_dim * DTYPE.dtype.itemsize


def workloads(smoke: bool) -> list[Workload]:
    if smoke:  # the same structure at shapes a CPU runs in seconds
        shapes = [(2, 1, 2048, 8, 2, 64), (1, 1, 4100, 8, 2, 64), (2, 16, 2048, 8, 2, 64)]
    else:
        shapes = [(8, 1, 32768, 32, 8, 128), (1, 1, 131072, 32, 8, 128),
                  (8, 16, 32768, 32, 8, 128)]
    rows = []
    for i, shape in enumerate(shapes):
        rows += [Workload(*shape), Workload(*shape, extra="bias")]
        if i == 0:
            rows.append(Workload(*shape, extra="mask"))
    return rows


def make_inputs(w: Workload) -> dict[str, jax.Array | None]:
    """Random normal q, k, v (and bias) in bf16; the mask ~90 % True; k and v also as a paged
    cache (pools of PAGE_SIZE-key pages in random order, their table, the full lengths)."""
    keys = jax.random.split(jax.random.PRNGKey(w.batch * 131 + w.seqlen_q * 7 + w.seqlen_k), 5)
    q = jax.random.normal(keys[0], (w.batch, w.seqlen_q, w.heads, w.head_dim), DTYPE)
    k, v = (jax.random.normal(key, (w.batch, w.seqlen_k, w.kv_heads, w.head_dim), DTYPE)
            for key in keys[1:3])
    bias = mask = None
    if w.extra == "bias":
        bias = jax.random.normal(keys[3], (w.batch, w.heads, 1, w.seqlen_k), DTYPE)
    elif w.extra == "mask":
        mask = jax.random.bernoulli(keys[4], 0.9, (w.batch, 1, 1, w.seqlen_k))
    paged = {}
    if w.seqlen_k % PAGE_SIZE == 0:
        pages = w.batch * w.seqlen_k // PAGE_SIZE
        order = jax.random.permutation(keys[0], pages).astype(jnp.int32)
        k_pages, v_pages = (jnp.zeros((pages, PAGE_SIZE, w.kv_heads, w.head_dim), DTYPE)
                            .at[order].set(x.reshape(pages, PAGE_SIZE, w.kv_heads, w.head_dim))
                            for x in (k, v))
        paged = dict(k_pages=k_pages, v_pages=v_pages, page_table=order.reshape(w.batch, -1),
                     kv_lens=jnp.full((w.batch,), w.seqlen_k, jnp.int32))
    return dict(q=q, k=k, v=v, mask=mask, bias=bias, paged=paged)


def back_to_back_ms(fn: Callable, *args) -> float:
    """DESIGN.md §5's time, after at least WARMUP_S of warm-up calls (a GPU idle while the cell
    compiled runs at low clocks until they ramp up)."""
    start = time.perf_counter()
    while time.perf_counter() - start < WARMUP_S:
        jax.block_until_ready(fn(*args))
    return timing.back_to_back_ms(fn, *args, calls=CALLS, repeats=REPEATS)


def relative_error(x: jax.Array, ref: jax.Array) -> float:
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def time_cell(fn: Callable, args: tuple, reference: jax.Array | None, kv_bytes: int) -> dict:
    """{"ms", "kv_tb_s", "err" (against `reference`, where given), "out"} or {"error": why}: one
    failing cell must not stop the run."""
    try:
        out = jax.block_until_ready(fn(*args))
        cell = {"out": out}
        if reference is not None:
            cell["err"] = relative_error(out, reference)
        cell["ms"] = back_to_back_ms(fn, *args)
        cell["kv_tb_s"] = kv_bytes / cell["ms"] / 1e9
        return cell
    except Exception as error:
        return {"error": reason(error)}


def set_forward_kernel(name: str) -> None:
    """The CUDA forward for executables compiled after this ("auto" or "flash2"); the caches are
    cleared since an executable may hold its kernels in a CUDA graph."""
    _ffi.cuda_set_forward_kernel(name)
    jax.clear_caches()


def kernel_name(w: Workload, inputs: dict) -> str:
    """The CUDA forward the dispatcher runs for the call (with "auto"), or why none is named."""
    def shape(x):
        return None if x is None else x.shape
    try:
        return _ffi.cuda_forward_kernel(inputs["q"].shape, inputs["k"].shape,
                                        shape(inputs["mask"]), shape(inputs["bias"]))
    except Exception as error:
        return f"n/a ({type(error).__name__})"


def run_workload(w: Workload, implementation: str, on_gpu: bool) -> dict:
    """One row: every implementation's cell on the same inputs, errors against XLA's output."""
    x = make_inputs(w)
    args = (x["q"], x["k"], x["v"], x["mask"], x["bias"])
    ours = jax.jit(lambda q, k, v, m, b: jax_dmattn.flash_dmattn(
        q, k, v, m, b, implementation=implementation))
    row = dict(workload=dataclasses.asdict(w), label=w.label, config=w.config,
               kv_bytes=w.kv_bytes, kernel=kernel_name(w, x), notes=[])

    def nn(impl: str):
        return jax.jit(lambda q, k, v, m, b: jax.nn.dot_product_attention(
            q, k, v, b, m, implementation=impl))

    cells = {"xla": time_cell(nn("xla"), args, None, w.kv_bytes)}
    reference = cells["xla"].get("out")
    cells["ours"] = time_cell(ours, args, reference, w.kv_bytes)
    if reference is None:
        reference = cells["ours"].get("out")
    if x["paged"]:
        p = x["paged"]
        paged = jax.jit(lambda q, kp, vp, t, n, m, b: jax_dmattn.paged_attention(
            q, kp, vp, t, n, m, b, implementation=implementation))
        cells["ours_paged"] = time_cell(paged, (x["q"], p["k_pages"], p["v_pages"],
                                                p["page_table"], p["kv_lens"], x["mask"],
                                                x["bias"]), reference, w.kv_bytes)
    else:
        cells["ours_paged"] = {"error": f"Lk is no multiple of the page size {PAGE_SIZE}"}
    if on_gpu:
        set_forward_kernel("flash2")
        try:
            cells["ours_flash2"] = time_cell(ours, args, reference, w.kv_bytes)
        finally:
            set_forward_kernel("auto")
    else:
        cells["ours_flash2"] = {"error": "no CUDA kernels on this machine"}
    cudnn_args = args
    if x["bias"] is not None and w.seqlen_q > 1:
        # cuDNN wants the bias's query rows in full (jax.nn's check: bias T == Lq): it reads a
        # materialised [B, H, Lq, Lk] copy, made outside the timed call.
        full = (w.batch, w.heads, w.seqlen_q, w.seqlen_k)
        cudnn_args = (*args[:4], jnp.array(jnp.broadcast_to(x["bias"], full)))
        row["notes"].append("cuDNN reads the bias materialised as [B,H,Lq,Lk]")
    if x["mask"] is not None:
        row["notes"].append("jax.nn turns the bool mask into an additive bias inside the "
                            "timed call for cuDNN")
    cells["cudnn"] = time_cell(nn("cudnn"), cudnn_args, reference, w.kv_bytes)
    for cell in cells.values():
        cell.pop("out", None)
    row["cells"] = {impl: cells[impl] for impl in IMPLS}
    ms = {impl: c.get("ms") for impl, c in row["cells"].items()}
    row["speedup_vs_cudnn"] = ms["cudnn"] / ms["ours"] if ms["cudnn"] and ms["ours"] else None
    row["speedup_vs_flash2"] = (ms["ours_flash2"] / ms["ours"] if ms["ours_flash2"] and ms["ours"]
                                else None)
    del x, args, cudnn_args
    jax.clear_caches()
    return row


def copy_bandwidth(nbytes: int) -> dict:
    """A jitted ``x + 1`` of an `nbytes` bf16 array (no donation: a fresh output each call, which
    XLA cannot elide): ms and (read + write) bytes per second in TB/s."""
    try:
        x = jax.random.normal(jax.random.PRNGKey(0), (nbytes // 2 // 1024, 1024), DTYPE)
        ms = back_to_back_ms(jax.jit(lambda x: x + 1), x)
        return dict(bytes=x.nbytes, ms=ms, tb_s=2 * x.nbytes / ms / 1e9)
    except Exception as error:
        return dict(bytes=nbytes, error=reason(error))


def add_derived(rows: list[dict], copy: dict) -> None:
    """Per row: the bias cost (ours with bias / ours without, same config), the paged cache's
    cost (paged / contiguous, same row) and our K/V read rate over the copy bandwidth."""
    plain = {r["config"]: r["cells"]["ours"].get("ms") for r in rows
             if r["workload"]["extra"] == "none"}
    for r in rows:
        ms = r["cells"]["ours"].get("ms")
        base = plain.get(r["config"])
        r["extra_cost"] = ms / base if ms and base and r["workload"]["extra"] != "none" else None
        paged = r["cells"]["ours_paged"].get("ms")
        r["paged_cost"] = paged / ms if paged and ms else None
        rate = r["cells"]["ours"].get("kv_tb_s")
        r["kv_of_copy"] = rate / copy["tb_s"] if rate and copy.get("tb_s") else None


def acceptance(rows: list[dict], smoke: bool) -> list[dict]:
    """Issue 26's criteria, each with its value and whether it is met (None: not measured)."""
    if smoke:  # tiny shapes: the configs are not the issue's
        return []
    by_label = {r["label"]: r for r in rows}
    checks = []

    def check(what: str, label: str, key: str, target: float, at_least: bool) -> None:
        value = by_label.get(label, {}).get(key)
        met = None if value is None else (value >= target if at_least else value <= target)
        checks.append(dict(criterion=what, workload=label, value=value, target=target, met=met))

    b8, b1, b8q16 = "B8 Lq1 Lk32k H32 Hk8 D128", "B1 Lq1 Lk128k H32 Hk8 D128", \
        "B8 Lq16 Lk32k H32 Hk8 D128"
    check("speedup vs cuDNN >= 1.0", b8, "speedup_vs_cudnn", 1.0, True)
    check("K/V read / copy bandwidth >= 0.85", b8, "kv_of_copy", 0.85, True)
    check("speedup vs cuDNN >= 1.0", b1, "speedup_vs_cudnn", 1.0, True)
    check("speedup vs cuDNN >= 1.0", b8q16, "speedup_vs_cudnn", 1.0, True)
    for config in (b8, b1, b8q16):
        check("per-key bias / no bias <= 1.10", config + EXTRAS["bias"], "extra_cost", 1.10,
              False)
    for config in (b8, b1, b8q16):
        check(f"paged ({PAGE_SIZE}-key pages) / contiguous <= 1.05", config, "paged_cost",
              1.05, False)
    return checks


def fmt_cell(cell: dict) -> str:
    if "error" in cell:
        return f"n/a ({cell['error'][:60]})"
    return f"{cell['ms']:.4f} ({cell['kv_tb_s']:.3g})"


def fmt(x: float | None, spec: str, suffix: str = "") -> str:
    """`x` in `spec` with `suffix`, or a dash as wide (`spec`'s width) where it is None."""
    if x is None:
        width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
        return f"{'—':>{width + len(suffix)}}"
    return f"{x:{spec}}{suffix}"


def markdown(meta: dict, rows: list[dict], copy: dict, checks: list[dict]) -> str:
    smoke = meta["smoke"]
    copy_text = (f"{copy['tb_s']:.3f} TB/s ({copy['ms']:.3f} ms for {copy['bytes'] / 2**30:.3g} "
                 "GiB)" if "tb_s" in copy else f"n/a ({copy.get('error')})")
    lines = [
        "# Decode forward: jax_dmattn, cuDNN and XLA side by side (issue 26)"
        + (" — SMOKE TEST, NOT A PERFORMANCE RESULT" if smoke else ""),
        "",
        f"- command: `{meta['command']}`",
        f"- device: {meta['device']}; driver {meta['driver']}"
        + (f"; cuDNN {meta['cudnn']}" if "cudnn" in meta else ""),
        f"- jax {meta['jax']} ({meta['backend']}); jax_dmattn {meta['jax_dmattn']} "
        f"(git {meta['git']}, implementation={meta['implementation']!r}); "
        f"python {meta['python']}; {meta['date']}",
        f"- bf16, random normal inputs, forward only; back to back, {CALLS} calls then one "
        f"block_until_ready, best of {REPEATS}, after at least {WARMUP_S} s of warm-up calls",
        "- each cell: ms (K/V read rate in TB/s: 2·B·Lk·Hk·D·2 bytes of K and V / time); "
        "×cuDNN = cuDNN ms / jax_dmattn ms; ×FA2 = the FA2-class forward's ms / jax_dmattn ms "
        "(before / after the decode kernel); bias cost = jax_dmattn with / without the bias or "
        f"mask; paged cost = jax_dmattn over a paged cache ({PAGE_SIZE}-key pages in random "
        "order, every sequence's full length) / over the contiguous one; relative errors "
        "against XLA's output",
        f"- device-to-device copy bandwidth, same run: {copy_text}, a jitted `x + 1` of a bf16 "
        "array, (read + write) bytes / time as CUDA's bandwidthTest counts; "
        "K/V / copy = jax_dmattn's K/V read rate over it",
        "",
        "| workload | kernel | " + " | ".join(f"{NAMES[i]} ms (TB/s)" for i in IMPLS)
        + " | ×cuDNN | ×FA2 | K/V / copy | bias cost | paged cost | max rel. err |",
        "|---|---|" + "---|" * len(IMPLS) + "---|---|---|---|---|---|",
    ]
    for r in rows:
        errs = [c["err"] for c in r["cells"].values() if "err" in c]
        lines.append(
            f"| {r['label']} | {r['kernel']} | "
            + " | ".join(fmt_cell(r["cells"][i]) for i in IMPLS)
            + f" | {fmt(r['speedup_vs_cudnn'], '.2f', '×')} | "
            f"{fmt(r['speedup_vs_flash2'], '.2f', '×')} | {fmt(r['kv_of_copy'], '.0%')} | "
            f"{fmt(r['extra_cost'], '.3f', '×')} | {fmt(r['paged_cost'], '.3f', '×')} | "
            f"{fmt(max(errs) if errs else None, '.1e')} |")
    notes = sorted({n for r in rows for n in r["notes"]})
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    if checks:
        lines += ["", "## Issue 26's targets", "", "| workload | criterion | value | met |",
                  "|---|---|---|---|"]
        for c in checks:
            met = "—" if c["met"] is None else ("yes" if c["met"] else "**no**")
            lines.append(f"| {c['workload']} | {c['criterion']} | {fmt(c['value'], '.3f')} | "
                         f"{met} |")
    return "\n".join(lines) + "\n"


def short_table(rows: list[dict]) -> str:
    head = (f"{'workload':52s} {'kernel':13s} {'ours ms':>8s} {'FA2 ms':>8s} {'cuDNN ms':>8s} "
            f"{'xcuDNN':>7s} {'K/V TB/s':>8s} {'of copy':>7s} {'extra':>6s} {'paged':>6s}")
    lines = [head]
    for r in rows:
        c = r["cells"]
        lines.append(
            f"{r['label']:52s} {r['kernel'][:13]:13s} {fmt(c['ours'].get('ms'), '8.4f')} "
            f"{fmt(c['ours_flash2'].get('ms'), '8.4f')} {fmt(c['cudnn'].get('ms'), '8.4f')} "
            f"{fmt(r['speedup_vs_cudnn'], '6.2f', 'x')} {fmt(c['ours'].get('kv_tb_s'), '8.3f')} "
            f"{fmt(r['kv_of_copy'], '7.1%')} {fmt(r['extra_cost'], '5.3f', 'x')} "
            f"{fmt(r['paged_cost'], '5.3f', 'x')}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (the CPU kernels without a GPU): checks the script only")
    parser.add_argument("--out", type=Path, default=None,
                        help="where gpu_decode.md/json go (default benchmarks/results; with "
                        "--smoke a temporary folder, so that a smoke test never replaces results)")
    args = parser.parse_args()
    if args.out is None:
        args.out = (Path(tempfile.gettempdir()) / "decode_smoke" if args.smoke
                    else Path(__file__).parent / "results")
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        parser.error("no GPU backend: pass --smoke to check the script on the CPU")
    implementation = "cuda" if on_gpu else "cpu"
    meta = dict(machine_info(on_gpu), command=recorded_command(), smoke=args.smoke,
                implementation=implementation,
                date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"))
    rows = []
    for w in workloads(args.smoke):
        row = run_workload(w, implementation, on_gpu)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "workload"}), flush=True)
    copy = copy_bandwidth(COPY_BYTES >> 6 if args.smoke else COPY_BYTES)
    print("copy:", json.dumps(copy), flush=True)
    add_derived(rows, copy)
    checks = acceptance(rows, args.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_decode.md").write_text(markdown(meta, rows, copy, checks))
    (args.out / "gpu_decode.json").write_text(
        json.dumps(dict(meta=meta, copy=copy, rows=rows, acceptance=checks), indent=1) + "\n")
    print(f"wrote {args.out / 'gpu_decode.md'} and .json\n")
    print(short_table(rows))


if __name__ == "__main__":
    main()
