"""GPU: jax_dmattn vs jax.nn.dot_product_attention (cudnn, xla), side by side (DESIGN.md §5).

The four suites of the performance protocol, each timed in one run on the same bf16 inputs:
forward (jit) and forward+backward (jit of value_and_grad wrt q, k, v and the bias when there is
one), median of timed calls after warm-up. A cell that fails (unsupported config, OOM) is recorded
as "n/a (reason)" and the run goes on. Each suite writes gpu_<suite>.md and gpu_<suite>.json.

A fifth suite, `packed` (issue 24: sequence packing with segment ids), times 8 documents of 2k
tokens packed in one L16k row (D128 H16 causal) with ids, the same documents as a batch [8, 2k],
and cuDNN / xla on the packed row with the equivalent dense mask; a sixth, `sinks` (issue 27),
a per-kv-head table of sink 64 + window 1024 (L16k D128 H16 causal) against the same window
without sinks and cuDNN with the equivalent dense mask; a seventh, `blocks` (issues 22-24), block
indices (top-16 of the 64-key blocks for each 64-row query block, and top-13 of the 128-key blocks
for each 128-row one: 10 % density; L16k D128 H16) against the same problem without a mask and
with the equivalent dense bool mask; an eighth, `gate` (issue
27), gated attention (L16k D128 H16 causal) exact and with a gate threshold that drops three of
every four grid key blocks, against the same call without a gate; a ninth, `threshold` (issue
27), softmax-threshold skipping on a trained-like input (a sharp key every 1024, L16k D128 H16
causal) against the exact call and cuDNN. Their calls are timed
back to back (DESIGN.md §5: `--iters` calls, one block_until_ready, best of 3), since the gaps
they report are within the per-call latency of a block after every call.

    python benchmarks/gpu_suites.py --suite {dense,bias_mask,dynamic,density,packed,sinks,blocks,
                                             gate,threshold,all}
        [--quick] [--iters 20] [--out benchmarks/results]

Without a GPU, `--quick --allow-cpu --out /tmp/...` smoke-tests the script on the CPU
(jax_dmattn with implementation=None, cuDNN skipped); such results never go to benchmarks/results.
Plots: python benchmarks/plot_results.py benchmarks/results/gpu_<suite>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _command import recorded_command

import jax_dmattn
from jax_dmattn._timing import attention_flops, back_to_back_ms, median_ms
from jax_dmattn.dynamic import default_query_block, dynamic_attention

RESULTS = Path(__file__).resolve().parent / "results"
SUITES = ("dense", "bias_mask", "dynamic", "density", "packed", "sinks", "blocks", "gate",
          "threshold")
# Suites timed back to back (DESIGN.md §5); the others keep the median of synchronised calls that
# their recorded results were measured with.
BACK_TO_BACK = ("packed", "sinks", "blocks", "gate", "threshold")
BACK_TO_BACK_REPEATS = 3
IMPLS = ("jax_dmattn", "jax_dmattn_mask", "jax_dmattn_batch", "jax_dmattn_window",
         "jax_dmattn_dense", "jax_dmattn_cut", "jax_dmattn_nogate", "jax_dmattn_skip", "cudnn",
         "xla")
NAMES = {"jax_dmattn": "jax_dmattn", "jax_dmattn_mask": "jax_dmattn (dense mask)",
         "jax_dmattn_batch": "jax_dmattn (as a batch)",
         "jax_dmattn_window": "jax_dmattn (window, no sinks)",
         "jax_dmattn_dense": "jax_dmattn (no mask)",
         "jax_dmattn_cut": "jax_dmattn (gate threshold)",
         "jax_dmattn_nogate": "jax_dmattn (no gate)",
         "jax_dmattn_skip": "jax_dmattn (softmax threshold)",
         "cudnn": "cuDNN", "xla": "xla"}
BWD_FACTOR = 3.5  # forward + backward FLOPs, backward counted as 2.5× forward (DESIGN.md §5)
DTYPE = jnp.bfloat16
JAX_NN_MASK = ("jax.nn.dot_product_attention turns a bool mask into an additive bias inside the "
               "timed call (cuDNN takes no bool mask); that cost is part of its time")


@dataclasses.dataclass
class Bench:
    """How to run every cell: platform, our implementation, timing counts, problem sizes."""

    on_gpu: bool
    quick: bool
    iters: int
    warmup: int
    warmup_s: float

    @property
    def ours(self) -> str | None:
        return "cuda" if self.on_gpu else None


def say(message: str) -> None:
    print(message, flush=True)


def kilo(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# ---- inputs ---------------------------------------------------------------------------------

def normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape, DTYPE)


def qkv(batch: int, length: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """Random q, k, v and the output cotangent dout, all [B, L, heads, D] bf16."""
    return dict(q=normal(1, (batch, length, heads, head_dim)),
                k=normal(2, (batch, length, kv_heads, head_dim)),
                v=normal(3, (batch, length, kv_heads, head_dim)),
                dout=normal(4, (batch, length, heads, head_dim)))


def free(*trees) -> None:
    """Deletes the device buffers of the arrays in `trees` and drops compiled executables."""
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()
    jax.clear_caches()


def topk_mask_reference(bias: jax.Array, window: int) -> jax.Array:
    """Causal top-`window` mask of a per-key bias: [B, Hk, 1, L] → bool [B, Hk, L, L].

    Key j is kept for query row i iff j <= i and bias_j is among the `window` largest biases of the
    keys visible to row i (every visible key when fewer than `window`). The plain `lax.top_k` over
    the causally masked broadcast [L, L] scores; a faster generator from `jax_dmattn.masks` can
    replace it (same signature).
    """
    batch, kv_heads, _, length = bias.shape
    window = min(window, length)
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal, bias, -jnp.inf)  # [B, Hk, L, L]
    _, index = jax.lax.top_k(scores, window)  # [B, Hk, L, W]; exactly W per row, even with ties
    b = jnp.arange(batch)[:, None, None, None]
    h = jnp.arange(kv_heads)[None, :, None, None]
    row = jnp.arange(length)[None, None, :, None]
    mask = jnp.zeros(scores.shape, bool).at[b, h, row, index].set(True)
    return mask & causal  # rows with fewer than W visible keys picked some hidden ones: drop them


def kept_pairs_topk(length: int, window: int) -> int:
    """Visible (query, key) pairs of the causal top-`window` mask: Σ_i min(i + 1, window)."""
    window = min(window, length)
    return window * (window + 1) // 2 + (length - window) * window


def block_mask(length: int, density: float, block: int, seed: int) -> jax.Array:
    """[1, 1, L, L] bool of block×block tiles, the diagonal ones and others at random.

    Exactly round(density · blocks²) tiles are kept (at least the diagonal), so no row is empty.
    """
    blocks = -(-length // block)
    keep = np.eye(blocks, dtype=bool)
    off = np.flatnonzero(~keep)
    extra = max(round(density * blocks * blocks) - blocks, 0)
    keep.flat[np.random.default_rng(seed).permutation(off)[:extra]] = True
    full = np.kron(keep, np.ones((block, block), bool))[:length, :length]
    return jnp.asarray(full)[None, None]


# ---- timing cells ---------------------------------------------------------------------------

def attention_fn(impl: str, causal: bool, ours: str | None, window: int | None,
                 window_sizes=None, gate_threshold: float | None = None,
                 softmax_threshold: float | None = None) -> Callable:
    """(q, k, v, mask, bias, gate, segment_ids) → out for one implementation. With a `window`
    (the dynamic suite), jax_dmattn is ``dynamic_attention``, which makes its own key lists from
    the bias and ignores the mask; jax_dmattn_mask, jax_dmattn_batch (the packed suite's
    documents as a batch) and jax_dmattn_window (the sinks suite's window alone) are always
    ``flash_dmattn``. ``segment_ids`` [B, L] or None (the packed suite) go to ``flash_dmattn`` as
    both the query and the key ids, `window_sizes` (the sinks suite's table) as its window
    table, ``gate`` (alpha, delta) or () (the gate suite) and `gate_threshold` as its gate,
    `softmax_threshold` as its softmax threshold (the threshold suite)."""
    if impl == "jax_dmattn" and window is not None:
        def attend(q, k, v, mask, bias, gate, segment_ids):
            return dynamic_attention(q, k, v, bias, window, is_causal=causal,
                                     implementation=ours)
    elif impl.startswith("jax_dmattn"):
        def attend(q, k, v, mask, bias, gate, segment_ids):
            return jax_dmattn.flash_dmattn(q, k, v, mask, bias, q_segment_ids=segment_ids,
                                           kv_segment_ids=segment_ids, is_causal=causal,
                                           window_sizes=window_sizes, gate=gate or None,
                                           gate_threshold=gate_threshold if gate else None,
                                           softmax_threshold=softmax_threshold,
                                           implementation=ours)
    else:
        def attend(q, k, v, mask, bias, gate, segment_ids):
            return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=causal,
                                                implementation=impl)
    return attend


def reason(error: Exception) -> str:
    text = f"{type(error).__name__}: {error}"
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "OOM"
    return " ".join(text.split())[:300]


def time_impl(bench: Bench, impl: str, inputs: dict, causal: bool,
              back_to_back: bool = False) -> dict[str, dict]:
    """{"fwd": cell, "fwd+bwd": cell}; a cell is {"ms": …} or {"error": …}, never raises.

    ``inputs["gate"]`` (optional (alpha, delta), differentiated like the bias) and
    ``inputs["segment_ids"]`` (optional, [B, L] int32) are passed after the other arguments, as
    jit arguments like the mask (not constants folded into the program)."""
    if impl == "cudnn" and not bench.on_gpu:
        return {p: {"error": "skipped: no GPU"} for p in ("fwd", "fwd+bwd")}
    attend = attention_fn(impl, causal, bench.ours, inputs.get("window"),
                          inputs.get("window_sizes"), inputs.get("gate_threshold"),
                          inputs.get("softmax_threshold"))
    gate = tuple(inputs.get("gate") or ())
    ids = inputs.get("segment_ids")

    def loss(q, k, v, mask, bias, gate, segment_ids, dout):
        return jnp.sum(attend(q, k, v, mask, bias, gate, segment_ids).astype(jnp.float32) * dout)

    args = [*(inputs[n] for n in ("q", "k", "v", "mask", "bias")), gate, ids]
    argnums = (0, 1, 2) + ((4,) if inputs["bias"] is not None else ()) + ((5,) if gate else ())
    passes = {
        "fwd": (jax.jit(attend), args),
        "fwd+bwd": (jax.jit(jax.value_and_grad(loss, argnums=argnums)), [*args, inputs["dout"]]),
    }
    cells = {name: time_cell(bench, fn, *fn_args, back_to_back=back_to_back)
             for name, (fn, fn_args) in passes.items()}
    jax.clear_caches()
    return cells


def time_cell(bench: Bench, fn: Callable, *args, back_to_back: bool = False) -> dict:
    """{"ms": ms of ``fn(*args)``} or {"error": why}: one failing cell must not stop the run.

    By default the median of `bench.iters` calls, each waited on; with `back_to_back`, per call of
    `bench.iters` calls issued without waiting and then one block, the best of
    BACK_TO_BACK_REPEATS such batches (DESIGN.md §5). Both after at least `bench.warmup_s` of
    warm-up calls, so that a GPU idle during compilation is back at its clocks."""
    try:
        if not back_to_back:
            return {"ms": round(median_ms(fn, *args, warmup=bench.warmup, iters=bench.iters,
                                          warmup_s=bench.warmup_s), 4)}
        start = time.perf_counter()
        while time.perf_counter() - start < bench.warmup_s:
            jax.block_until_ready(fn(*args))
        return {"ms": round(back_to_back_ms(fn, *args, calls=bench.iters,
                                            repeats=BACK_TO_BACK_REPEATS,
                                            warmup=bench.warmup), 4)}
    except Exception as error:
        return {"error": reason(error)}


def measure(bench: Bench, suite: str, label: str, config: dict, inputs: dict, causal: bool,
            flops: float, impls=("jax_dmattn", "cudnn", "xla"),
            overrides: dict | None = None) -> list[dict]:
    """Times every implementation on `inputs` (or its entry of `overrides`): one row per pass,
    back to back in the suites of BACK_TO_BACK.

    A row: {"label", "config", "pass", "flops" (of the pass), "results": {impl: cell}}, where a
    cell holds "ms" and "tflops", or "error".
    """
    rows = {p: {"label": label, "config": config, "pass": p,
                "flops": flops * (BWD_FACTOR if p == "fwd+bwd" else 1.0), "results": {}}
            for p in ("fwd", "fwd+bwd")}
    for impl in impls:
        cells = time_impl(bench, impl, {**inputs, **(overrides or {}).get(impl, {})}, causal,
                          back_to_back=suite in BACK_TO_BACK)
        for name, cell in cells.items():
            if "ms" in cell:
                cell = {"ms": round(cell["ms"], 4),
                        "tflops": float(f"{rows[name]['flops'] / cell['ms'] / 1e9:.4g}")}
            rows[name]["results"][impl] = cell
            say(f"[{suite}] {label:34s} {impl:10s} {name:8s} {fmt_cell(cell, tflops=True)}")
    return list(rows.values())


def add_speedups(rows: list[dict]) -> list[dict]:
    """speedup vs cuDNN = cuDNN ms / jax_dmattn ms, where both ran (not for the shared mask gen)."""
    for row in rows:
        ours, cudnn = (row["results"].get(i, {}).get("ms") for i in ("jax_dmattn", "cudnn"))
        useful = ours and cudnn and row["pass"] != "mask gen"
        row["speedup_vs_cudnn"] = round(cudnn / ours, 3) if useful else None
    return rows


# ---- suites ---------------------------------------------------------------------------------

def suite_dense(bench: Bench) -> tuple[list[dict], list[str]]:
    """B·L = 16k tokens, H·D = 2048, D ∈ {64, 128}, L ∈ {1k, 4k, 16k}, causal and not."""
    tokens, width, lengths = (512, 256, (128, 512)) if bench.quick else \
        (16384, 2048, (1024, 4096, 16384))
    rows = []
    for head_dim in (64, 128):
        for length in lengths:
            batch, heads = tokens // length, width // head_dim
            inputs = {**qkv(batch, length, heads, heads, head_dim), "mask": None, "bias": None}
            for causal in (False, True):
                label = (f"D={head_dim} L={kilo(length)} B={batch} H={heads}"
                         + (" causal" if causal else ""))
                config = dict(B=batch, L=length, H=heads, Hk=heads, D=head_dim, causal=causal)
                flops = attention_flops(batch, heads, length, length, head_dim, causal)
                rows += measure(bench, "dense", label, config, inputs, causal, flops)
            free(inputs)
    return rows, ["no mask, no bias; TF/s counts 4·B·H·L²·D (halved for causal) forward, "
                  "3.5× that forward+backward"]


def suite_bias_mask(bench: Bench) -> tuple[list[dict], list[str]]:
    """Full bias + mask [B, H, L, L]: B·L = 16k, H = 16, D = 128, causal, L ∈ {4k, 2k}."""
    heads, head_dim = (2, 128) if bench.quick else (16, 128)
    shapes = ((2, 256),) if bench.quick else ((4, 4096), (8, 2048))  # (B, L)
    rows = []
    for batch, length in shapes:
        shape = (batch, heads, length, length)
        keep = jax.random.bernoulli(jax.random.PRNGKey(5), 0.5, shape)
        inputs = {**qkv(batch, length, heads, heads, head_dim), "bias": normal(6, shape),
                  "mask": keep | jnp.eye(length, dtype=bool)}
        del keep
        label = f"D={head_dim} L={kilo(length)} B={batch} H={heads} causal"
        config = dict(B=batch, L=length, H=heads, Hk=heads, D=head_dim, causal=True)
        flops = attention_flops(batch, heads, length, length, head_dim, True)
        rows += measure(bench, "bias_mask", label, config, inputs, True, flops)
        free(inputs)
    return rows, ["every implementation gets the same bias (bf16, random normal) and mask "
                  "(bool, each element kept with p = 0.5, diagonal always kept), both "
                  "[B, H, L, L]; gradients wrt q, k, v and the bias",
                  "TF/s counts the dense causal FLOPs (the mask is elementwise, no tile is empty)",
                  JAX_NN_MASK]


def suite_dynamic(bench: Bench) -> tuple[list[dict], list[str]]:
    """B=1, H=2, Hk=1, per-key bias [B, Hk, 1, L], mask = causal top-W (W = 1024) of it."""
    batch, heads, kv_heads = 1, 2, 1
    window = 64 if bench.quick else 1024
    lengths = (256, 512) if bench.quick else (4096, 8192, 16384, 32768)
    generate = jax.jit(lambda bias, window: jax_dmattn.masks.topk_mask(bias, window),
                       static_argnums=1)
    # dynamic_attention's own mask generation (part of its timed fwd), timed alone for the record
    key_lists = jax.jit(lambda bias, window: jax_dmattn.masks.topk_block_keys(
        bias[:, :, 0, :], window, default_query_block(window)), static_argnums=1)
    baseline = jax.jit(topk_mask_reference, static_argnums=1)
    rows = []
    for head_dim in (64, 128):
        for length in lengths:
            label = f"D={head_dim} L={kilo(length)} W={window}"
            config = dict(B=batch, L=length, H=heads, Hk=kv_heads, D=head_dim, causal=True,
                          window=window)
            bias = normal(7, (batch, kv_heads, 1, length))
            mask_cell = time_cell(bench, generate, bias, window)
            mask_ms = mask_cell.get("ms")
            mask = generate(bias, window) if mask_ms is not None else None
            base_cell = time_cell(bench, baseline, bias, window)
            lists_cell = time_cell(bench, key_lists, bias, window)
            if "ms" in lists_cell:
                lists_cell["in_fwd"] = True
            say(f"[dynamic] {label:34s} {'mask gen':10s} {'':8s} {fmt_cell(mask_cell)}; "
                f"lax.top_k baseline {fmt_cell(base_cell)}")
            rows.append({"label": label, "config": config, "pass": "mask gen (lax.top_k)",
                         "flops": 0.0, "results": {impl: base_cell for impl in IMPLS}})
            if mask is None:
                rows.append({"label": label, "config": config, "pass": "mask gen", "flops": 0.0,
                             "results": {impl: mask_cell for impl in IMPLS}})
                free(bias)
                continue
            inputs = {**qkv(batch, length, heads, kv_heads, head_dim), "mask": mask, "bias": bias,
                      "window": window}
            # cuDNN needs a bias with full query and key dims: materialised here, outside timing.
            cudnn = {"bias": jnp.broadcast_to(bias, (batch, 1, length, length)).copy()}
            flops = 4.0 * batch * heads * head_dim * kept_pairs_topk(length, window)
            timed = measure(bench, "dynamic", label, config, inputs, True, flops,
                            impls=IMPLS, overrides={"cudnn": cudnn})
            mask_row = {"label": label, "config": config, "pass": "mask gen", "flops": 0.0,
                        "results": {}}
            total = {"label": label, "config": config, "pass": "total", "flops": 0.0,
                     "results": {}}
            for impl, cell in timed[1]["results"].items():  # the fwd+bwd cells
                ran = "skipped" not in cell.get("error", "")
                mask_row["results"][impl] = (lists_cell if impl == "jax_dmattn" else mask_cell
                                             ) if ran else cell
                before = 0.0 if impl == "jax_dmattn" else mask_ms  # its fwd made its key lists
                total["results"][impl] = ({"ms": round(before + cell["ms"], 4)} if "ms" in cell
                                          else cell)
            rows += [mask_row, *timed, total]
            free(inputs, cudnn)
    return rows, [
        "jax_dmattn is `jax_dmattn.dynamic.dynamic_attention(q, k, v, bias, W)`: its timed fwd "
        "and fwd+bwd include making its own mask (the key lists of each query block, "
        "`masks.topk_block_keys`, whose time alone is its 'mask gen' cell); total = fwd+bwd",
        "the others get the mask of `jax_dmattn.masks.topk_mask` (jitted; 'mask gen', timed "
        "alone, not part of their fwd); total = mask gen + fwd+bwd; jax_dmattn (dense mask) is "
        "`flash_dmattn` with that mask; 'mask gen (lax.top_k)' is the baseline "
        "`topk_mask_reference` (jitted `lax.top_k` over the causally masked broadcast [L, L] "
        "scores, then a scatter)",
        "jax_dmattn (dense mask) and xla take the per-key bias [B, Hk, 1, L] and the mask "
        "[B, Hk, L, L]; "
        "† cuDNN takes the bias materialised to [B, 1, L, L] outside the timed region (its dbias "
        "is then [B, 1, L, L]) and the same mask; all run with is_causal=True",
        "TF/s counts only the kept (query, key) pairs: 4·B·H·D·Σᵢ min(i+1, W) forward, "
        "3.5× that forward+backward", JAX_NN_MASK]


# Heads of the density sweep: the dynamic-mask suite's (H=2, Hk=1) and those of DESIGN.md's
# density anchor (L16k H16 D128).
DENSITY_HEADS = ((2, 1), (16, 16))


def suite_density(bench: Bench) -> tuple[list[dict], list[str]]:
    """B=1, D=128, L=16k, H/Hk = 2/1 and 16/16, 128×128 block masks at 100…5 % density,
    non-causal."""
    batch, head_dim = 1, 128
    length, block = (512, 64) if bench.quick else (16384, 128)
    rows = []
    for heads, kv_heads in DENSITY_HEADS:
        base = qkv(batch, length, heads, kv_heads, head_dim)
        for percent in (100, 50, 25, 10, 5):
            mask = block_mask(length, percent / 100, block, seed=percent)
            kept = int(jnp.sum(mask))
            label = f"H={heads} density {percent}% (actual {kept / length**2:.3f})"
            config = dict(B=batch, L=length, H=heads, Hk=kv_heads, D=head_dim, causal=False,
                          density=percent / 100, actual_density=kept / length**2)
            flops = 4.0 * batch * heads * head_dim * kept
            rows += measure(bench, "density", label, config,
                            {**base, "mask": mask, "bias": None}, False, flops,
                            impls=("jax_dmattn", "cudnn"))
            free(mask)
        free(base)
    for row in rows:  # time / time at 100 % density of the same heads, per implementation, pass
        dense = next(r for r in rows if r["pass"] == row["pass"]
                     and r["config"]["H"] == row["config"]["H"])
        row["vs_dense"] = {impl: round(cell["ms"] / dense["results"][impl]["ms"], 3)
                           if "ms" in cell and "ms" in dense["results"][impl] else None
                           for impl, cell in row["results"].items()}
    heads = ", ".join(f"H={h} Hk={hk}" for h, hk in DENSITY_HEADS)
    return rows, [f"mask [1, 1, L, L] of {block}×{block} blocks (diagonal blocks always kept), "
                  f"the same for both; no bias; B={batch} D={head_dim} L={kilo(length)}; "
                  f"{heads}",
                  "TF/s counts only the kept (query, key) pairs; '/ 100 %' = time over the time "
                  "at 100 % density", JAX_NN_MASK]


# Issue 24's acceptance bounds for the forward+backward pass of the packed suite.
PACKED_MAX_VS_BATCH = 1.15
PACKED_MIN_VS_CUDNN = 5.0


def packed_notes(rows: list[dict]) -> list[str]:
    """Adds "packed_vs_batch" = jax_dmattn ms (packed, ids) / jax_dmattn_batch ms (the same
    documents as a batch) to each row (None unless both ran); returns one note a pass with it and
    cuDNN ms (dense mask) / jax_dmattn ms (the table's "speedup vs cuDNN"), against issue 24's
    bounds for forward+backward."""
    notes = []
    for row in rows:
        ms = {impl: cell.get("ms") for impl, cell in row["results"].items()}
        ours, batch, cudnn = ms.get("jax_dmattn"), ms.get("jax_dmattn_batch"), ms.get("cudnn")
        row["packed_vs_batch"] = round(ours / batch, 3) if ours and batch else None
        bounds = row["pass"] == "fwd+bwd"
        words = []
        if row["packed_vs_batch"] is not None:
            words.append(f"packed / batch = {row['packed_vs_batch']:.3f}×"
                         + (f" (issue 24: ≤ {PACKED_MAX_VS_BATCH}×)" if bounds else ""))
        if ours and cudnn:
            words.append(f"cuDNN / packed = {cudnn / ours:.2f}×"
                         + (f" (issue 24: ≥ {PACKED_MIN_VS_CUDNN:g}×)" if bounds else ""))
        if words:
            notes.append(f"{row['pass']}: " + "; ".join(words))
    return notes


def suite_packed(bench: Bench) -> tuple[list[dict], list[str]]:
    """Sequence packing (issue 24): D=128, H=16, causal, 8 documents of 2k tokens (ids 0..7, in
    order) packed in one row [1, 16k] with segment ids, against the same documents as a batch
    [8, 2k] and against cuDNN and xla on the packed row with the equivalent dense mask."""
    heads, head_dim = (2, 128) if bench.quick else (16, 128)
    documents, doc_len = (4, 128) if bench.quick else (8, 2048)
    length = documents * doc_len
    packed = qkv(1, length, heads, heads, head_dim)
    ids = jnp.repeat(jnp.arange(documents, dtype=jnp.int32), doc_len)[None]  # [1, L]
    # the documents are contiguous, so the batch is a free reshape of the same data
    batch = {name: x.reshape(documents, doc_len, *x.shape[2:]) for name, x in packed.items()}
    # block-diagonal & causal [1, 1, L, L]; is_causal=True too, so that cuDNN skips the tiles
    # above the diagonal as it would for a causal call
    dense = ((ids[0][:, None] == ids[0][None, :])
             & jnp.tril(jnp.ones((length, length), bool)))[None, None]
    label = f"D={head_dim} L={kilo(length)} H={heads} causal {documents}x{kilo(doc_len)} docs"
    config = dict(B=1, L=length, H=heads, Hk=heads, D=head_dim, causal=True,
                  documents=documents, doc_len=doc_len)
    flops = attention_flops(documents, heads, doc_len, doc_len, head_dim, True)
    rows = measure(bench, "packed", label, config,
                   {**packed, "mask": None, "bias": None, "segment_ids": ids}, True, flops,
                   impls=("jax_dmattn", "jax_dmattn_batch", "cudnn", "xla"),
                   overrides={"jax_dmattn_batch": {**batch, "segment_ids": None},
                              "cudnn": {"mask": dense, "segment_ids": None},
                              "xla": {"mask": dense, "segment_ids": None}})
    free(packed, batch, ids, dense)
    notes = [f"jax_dmattn: `flash_dmattn` on the packed row [1, {kilo(length)}] with "
             f"q_segment_ids = kv_segment_ids = [1, {kilo(length)}] (ids 0..{documents - 1}, "
             f"{kilo(doc_len)} tokens each); jax_dmattn (as a batch): `flash_dmattn` on the same "
             f"documents as [{documents}, {kilo(doc_len)}] (no ids); cuDNN and xla: "
             f"`jax.nn.dot_product_attention` on the packed row with the equivalent bool mask "
             f"[1, 1, {kilo(length)}, {kilo(length)}] (same document & causal); all with "
             "is_causal=True, no bias; gradients wrt q, k, v",
             "TF/s counts the documents' causal FLOPs alone (4·documents·H·doc_len²·D / 2 "
             "forward, 3.5× that forward+backward), the same for every implementation",
             JAX_NN_MASK, *packed_notes(rows)]
    return rows, notes


SINK, SINK_WINDOW = 64, 1024
SINKS_MAX_VS_WINDOW = 1.2  # issue 27: sink + window fwd+bwd within 1.2x of the window alone
SINKS_MIN_VS_CUDNN = 5.0  # and at least 5x faster than cuDNN given the equivalent dense mask


def suite_sinks(bench: Bench) -> tuple[list[dict], list[str]]:
    """Attention sinks (issue 27): D=128, H=16, causal, a per-kv-head window table of sink 64 +
    window 1024 keys, against the same table without sinks and against cuDNN with the
    equivalent dense mask [1, 1, L, L]."""
    heads, head_dim, length = (2, 128, 1024) if bench.quick else (16, 128, 16384)
    sink, window = (16, 128) if bench.quick else (SINK, SINK_WINDOW)
    inputs = qkv(1, length, heads, heads, head_dim)
    rows_i = jnp.arange(length)[:, None]
    cols = jnp.arange(length)[None, :]
    dense = (((cols < sink) | (cols >= rows_i - window)) & (cols <= rows_i))[None, None]
    label = f"D={head_dim} L={kilo(length)} H={heads} causal sink {sink} + window {window}"
    config = dict(B=1, L=length, H=heads, Hk=heads, D=head_dim, causal=True, sink=sink,
                  window=window)
    pairs = sum(min(i + 1, window + 1 + min(sink, max(i - window, 0))) for i in range(length))
    flops = 4.0 * heads * pairs * head_dim
    table = ((sink, window, 0),) * heads
    rows = measure(bench, "sinks", label, config,
                   {**inputs, "mask": None, "bias": None, "window_sizes": table}, True, flops,
                   impls=("jax_dmattn", "jax_dmattn_window", "cudnn"),
                   overrides={"jax_dmattn_window": {"window_sizes": ((0, window, 0),) * heads},
                              "cudnn": {"mask": dense, "window_sizes": None}})
    free(inputs, dense)
    notes = [f"jax_dmattn: `flash_dmattn(..., is_causal=True, window_sizes=[[{sink}, {window}, "
             f"0]] * {heads})` (a row per kv head: the first {sink} keys and the {window} keys "
             f"before each query); jax_dmattn (window, no sinks): the table [[0, {window}, 0]] * "
             f"{heads}; cuDNN: `jax.nn.dot_product_attention` with the equivalent bool mask "
             f"[1, 1, {kilo(length)}, {kilo(length)}] and is_causal=True; no bias; gradients "
             "wrt q, k, v",
             "TF/s counts the visible pairs' FLOPs (4·H·pairs·D forward, 3.5× that "
             "forward+backward), the same for every implementation", JAX_NN_MASK]
    for row in rows:
        ms = {impl: cell.get("ms") for impl, cell in row["results"].items()}
        ours, alone, cudnn = ms.get("jax_dmattn"), ms.get("jax_dmattn_window"), ms.get("cudnn")
        words = []
        if ours and alone:
            words.append(f"sinks / window alone = {ours / alone:.3f}× (issue 27: ≤ "
                         f"{SINKS_MAX_VS_WINDOW}× forward+backward)")
        if ours and cudnn:
            words.append(f"cuDNN / sinks = {cudnn / ours:.2f}× (issue 27: ≥ "
                         f"{SINKS_MIN_VS_CUDNN:g}× forward+backward)")
        if words:
            notes.append(f"{row['pass']}: " + "; ".join(words))
    return rows, notes


# The blocks suite's configurations (block size, listed key blocks per query block) and the
# acceptance bounds over the same problem without a mask: issue 24's 64-blocks (top 16 of 256),
# and issues 22 / 23's 10 % block density as 128-blocks (top 13 of 128). On sm_90a the Hopper
# forward walks both (csrc/cuda/README.md: the O(L) mask forms), the Hopper backward the 128-blocks.
BLOCKS_CONFIGS = ((64, 16, "issue 24: ≤ 0.1×"), (128, 13, "issues 22 / 23: ≤ 0.12×"))


def suite_blocks(bench: Bench) -> tuple[list[dict], list[str]]:
    """Block indices (issues 22-24): each query block attends its `top` of the key blocks of its
    size, drawn at random (one list for all heads), D=128 H=16 L=16k non-causal, against the
    same problem without a mask and with the equivalent dense bool mask [1, 1, L, L], for each of
    BLOCKS_CONFIGS."""
    heads, head_dim, length = (2, 128, 1024) if bench.quick else (16, 128, 16384)
    inputs = qkv(1, length, heads, heads, head_dim)
    rows, notes = [], []
    for block, top, bound in BLOCKS_CONFIGS:
        top = 4 if bench.quick else top
        blocks = length // block
        order = jax.random.uniform(jax.random.PRNGKey(5), (blocks, blocks)).argsort(axis=1)
        indices = order[:, :top].astype(jnp.int32)[None, None]  # [1, 1, nQB, top]
        listed = jnp.zeros((blocks, blocks), bool).at[
            jnp.arange(blocks)[:, None], order[:, :top]].set(True)
        dense = jnp.repeat(jnp.repeat(listed, block, axis=0), block, axis=1)[None, None]
        label = f"D={head_dim} L={kilo(length)} H={heads} top {top} of {blocks} blocks of {block}"
        config = dict(B=1, L=length, H=heads, Hk=heads, D=head_dim, causal=False, block=block,
                      top=top)
        flops = 4.0 * heads * length * top * block * head_dim
        mask = jax_dmattn.masks.BlockIndices(indices, block, block)
        block_rows = measure(bench, "blocks", label, config,
                             {**inputs, "mask": mask, "bias": None}, False, flops,
                             impls=("jax_dmattn", "jax_dmattn_dense", "jax_dmattn_mask"),
                             overrides={"jax_dmattn_dense": {"mask": None},
                                        "jax_dmattn_mask": {"mask": dense}})
        free(dense)
        notes.append(f"{label}: `flash_dmattn(..., mask=masks.BlockIndices(indices [1, 1, "
                     f"{blocks}, {top}], {block}, {block}))`")
        for row in block_rows:
            ms = {impl: cell.get("ms") for impl, cell in row["results"].items()}
            ours, dense_ms = ms.get("jax_dmattn"), ms.get("jax_dmattn_dense")
            if ours and dense_ms:
                notes.append(f"{label}, {row['pass']}: block indices / no mask = "
                             f"{ours / dense_ms:.3f}× ({bound})")
        rows += block_rows
    free(inputs)
    notes.insert(0, "jax_dmattn (no mask): the same call without a mask; jax_dmattn (dense "
                 f"mask): the equivalent bool mask [1, 1, {kilo(length)}, {kilo(length)}]; no "
                 "bias, non-causal; gradients wrt q, k, v; TF/s counts the listed pairs' FLOPs "
                 "(4·H·pairs·D forward, 3.5× that forward+backward), the same for every "
                 "implementation")
    return rows, notes


# Issue 27's acceptance bounds for the gate suite: the threshold's calls against the exact gated
# ones (forward and forward+backward, with >= GATE_MIN_DROPPED of the tiles dropped), the exact
# gated forward+backward against the same call without a gate.
GATE_MAX_CUT_VS_EXACT = 0.4
GATE_MIN_DROPPED = 0.7
GATE_MAX_EXACT_VS_NONE = 1.1
GATE_BLOCK, GATE_KEEP_EVERY, GATE_THRESHOLD = 128, 4, -2.0


def suite_gate(bench: Bench) -> tuple[list[dict], list[str]]:
    """Gated attention (issue 27): D=128, H=16, causal, alpha [1, L, H] = 0.5 + |N(0, 1)| and
    delta [1, L, H] = N(0, 1/4) lowered by 8 in all but every GATE_KEEP_EVERY-th grid block of
    GATE_BLOCK keys, so that `gate_threshold` = GATE_THRESHOLD drops those blocks whole (their
    bound alpha · delta <= -3, the cut -1.85) and keeps the others; exact (no threshold), with the
    threshold, and without the gate."""
    heads, head_dim, length = (2, 128, 1024) if bench.quick else (16, 128, 16384)
    inputs = qkv(1, length, heads, heads, head_dim)
    gaussian = [jax.random.normal(jax.random.PRNGKey(seed), (1, length, heads), jnp.float32)
                for seed in (7, 8)]
    lowered = (jnp.arange(length) // GATE_BLOCK) % GATE_KEEP_EVERY != 0
    alpha = 0.5 + jnp.abs(gaussian[0])
    delta = 0.5 * gaussian[1] - 8.0 * lowered[None, :, None]
    blocks = -(-length // GATE_BLOCK)
    visible = [(i, j) for i in range(blocks) for j in range(i + 1)]
    dropped = sum(j % GATE_KEEP_EVERY != 0 for _, j in visible) / len(visible)
    label = f"D={head_dim} L={kilo(length)} H={heads} causal gate"
    config = dict(B=1, L=length, H=heads, Hk=heads, D=head_dim, causal=True,
                  gate_threshold=GATE_THRESHOLD, dropped_blocks=round(dropped, 4))
    flops = attention_flops(1, heads, length, length, head_dim, causal=True)
    rows = measure(bench, "gate", label, config,
                   {**inputs, "mask": None, "bias": None, "gate": (alpha, delta)}, True, flops,
                   impls=("jax_dmattn", "jax_dmattn_cut", "jax_dmattn_nogate"),
                   overrides={"jax_dmattn_cut": {"gate_threshold": GATE_THRESHOLD},
                              "jax_dmattn_nogate": {"gate": None}})
    free(inputs, alpha, delta)
    notes = [f"jax_dmattn: `flash_dmattn(..., is_causal=True, gate=(alpha, delta))` (exact); "
             f"jax_dmattn (gate threshold): the same with `gate_threshold={GATE_THRESHOLD}`, "
             f"which drops {100 * dropped:.1f} % of the causal grid's {GATE_BLOCK} x "
             f"{GATE_BLOCK} blocks (all but every {GATE_KEEP_EVERY}th key block); jax_dmattn (no "
             "gate): the same call without the gate; no mask, no bias; gradients wrt q, k, v "
             "(and alpha, delta)",
             "TF/s counts the causal call's FLOPs for every implementation"]
    for row in rows:
        ms = {impl: cell.get("ms") for impl, cell in row["results"].items()}
        exact, cut, none = (ms.get(i) for i in ("jax_dmattn", "jax_dmattn_cut",
                                                "jax_dmattn_nogate"))
        words = []
        if exact and cut:
            words.append(f"threshold / exact = {cut / exact:.3f}× (issue 27: ≤ "
                         f"{GATE_MAX_CUT_VS_EXACT}×, ≥ {100 * GATE_MIN_DROPPED:.0f} % dropped)")
        if exact and none:
            words.append(f"exact / no gate = {exact / none:.3f}× (issue 27: ≤ "
                         f"{GATE_MAX_EXACT_VS_NONE}× forward+backward)")
        if words:
            notes.append(f"{row['pass']}: " + "; ".join(words))
    return rows, notes


# Issue 27's acceptance bounds for the threshold suite: the threshold's call against the exact one
# (forward, forward+backward), with >= SKIP_MIN_DROPPED of the visible grid blocks dropped.
SKIP_MAX_FWD, SKIP_MAX_FWD_BWD, SKIP_MIN_DROPPED = 0.75, 0.6, 0.7
SKIP_THRESHOLD, SKIP_SHARP_EVERY, SKIP_SHARPNESS = 0.5, 1024, 60.0


def sharp_qkv(batch: int, length: int, heads: int, head_dim: int) -> dict:
    """Trained-like q, k, v, dout [B, L, H, D] bf16: each head's queries share a direction u
    (4 u + N(0, 1/4)), and every SKIP_SHARP_EVERY-th key points along it (+ SKIP_SHARPNESS u), so
    each row's softmax is dominated by a few keys."""
    shape = (batch, length, heads, head_dim)
    keys = jax.random.split(jax.random.PRNGKey(11), 5)
    u = jax.random.normal(keys[0], (heads, head_dim), jnp.float32)
    u = u / jnp.linalg.norm(u, axis=-1, keepdims=True)
    sharp = (jnp.arange(length) % SKIP_SHARP_EVERY == 0)[None, :, None, None]
    q = 0.5 * jax.random.normal(keys[1], shape, jnp.float32) + 4.0 * u
    k = jax.random.normal(keys[2], shape, jnp.float32) + SKIP_SHARPNESS * sharp * u
    return dict(q=q.astype(DTYPE), k=k.astype(DTYPE),
                v=jax.random.normal(keys[3], shape, DTYPE),
                dout=jax.random.normal(keys[4], shape, DTYPE))


def drop_map(inputs: dict, causal: bool, threshold: float) -> np.ndarray:
    """The forward's drop map [B, H, Lq / 64, Lk / 128] of `threshold` (from the kernels that
    run the timed calls)."""
    from jax_dmattn import ops
    from jax_dmattn.params import AttentionParams

    q, k, v = (inputs[n] for n in "qkv")
    params = AttentionParams(scale=q.shape[-1] ** -0.5, window_right=0 if causal else -1,
                             softmax_threshold=threshold)
    return np.asarray(jax.jit(lambda q, k, v: ops.forward(params, q, k, v, None, None)[2])(
        q, k, v)).astype(bool)


def dropped_fraction(drops: np.ndarray, causal: bool) -> float:
    """The share of the grid's visible blocks that a drop map drops."""
    from jax_dmattn.params import SKIP_BLOCK_K, SKIP_BLOCK_Q

    rows, cols = drops.shape[-2:]
    last_row = np.arange(rows)[:, None] * SKIP_BLOCK_Q + SKIP_BLOCK_Q - 1
    visible = np.arange(cols)[None] * SKIP_BLOCK_K <= last_row if causal else True
    visible = np.broadcast_to(visible, drops.shape)
    return float(drops[visible].mean())


def threshold_error(inputs: dict, drops: np.ndarray, threshold: float,
                    implementation: str, rows: int = 96) -> str:
    """The threshold's output against exact attention (causal, float64 on the host) on `rows`
    sampled query rows of every head. The documented bound: row i moves by at most m_i ·
    (max_j v_jd - min_j v_jd) over its visible keys j, m_i (< t / (1 + t)) the probability of
    its dropped blocks (`drops`, the forward's drop map [H, Lq / 64, Lk / 128] of batch entry
    0); on top of it the kernel's own bf16 error, which the exact call's shows."""
    from jax_dmattn.params import SKIP_BLOCK_K, SKIP_BLOCK_Q

    q, k, v = (inputs[n] for n in "qkv")
    length, head_dim = q.shape[1], q.shape[-1]

    def attend(t):
        return jax.jit(lambda q, k, v: jax_dmattn.flash_dmattn(
            q, k, v, is_causal=True, softmax_threshold=t, implementation=implementation))(q, k, v)

    picks = np.unique(np.linspace(0, length - 1, rows).astype(int))
    out, exact = (np.asarray(attend(t)[0, picks], np.float64) for t in (threshold, None))
    q64, k64, v64 = (np.asarray(x[0], np.float64) for x in (q, k, v))  # [L, H, D]
    worst = dict(dropped=0.0, excess=0.0, ours=0.0, exact=0.0)
    for n, i in enumerate(picks):
        scores = np.einsum("hd,jhd->hj", q64[i], k64[:i + 1]) * head_dim ** -0.5
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        kept = weights * ~drops[:, i // SKIP_BLOCK_Q, np.arange(i + 1) // SKIP_BLOCK_K]
        dropped = 1.0 - kept.sum(-1) / weights.sum(-1)  # [H]
        want = np.einsum("hj,jhd->hd", weights / weights.sum(-1, keepdims=True), v64[:i + 1])
        rule = np.einsum("hj,jhd->hd", kept / kept.sum(-1, keepdims=True), v64[:i + 1])
        bound = dropped[:, None] * (v64[:i + 1].max(0) - v64[:i + 1].min(0))  # [H, D]
        worst["dropped"] = max(worst["dropped"], float(dropped.max()))
        worst["excess"] = max(worst["excess"], float((np.abs(out[n] - want) - bound).max()))
        worst["ours"] = max(worst["ours"], float(np.abs(out[n] - rule).max()))
        worst["exact"] = max(worst["exact"], float(np.abs(exact[n] - want).max()))
    holds = worst["dropped"] < threshold / (1 + threshold) and worst["excess"] <= 2 * worst["exact"]
    return (f"output vs exact attention (float64) on {len(picks)} rows x {q.shape[2]} heads: "
            f"dropped probability m <= {worst['dropped']:.3g} (documented bound t / (1 + t) = "
            f"{threshold / (1 + threshold):.3g}); |out - exact| - m · spread(v) <= "
            f"{worst['excess']:.3g}, the bf16 error of the kernels: the threshold call's against "
            f"the same rule in float64 {worst['ours']:.3g}, the exact call's against exact "
            f"{worst['exact']:.3g}; within the documented bound up to the exact call's own error "
            f"(the excess at most twice it): {'yes' if holds else 'NO'}")


def suite_threshold(bench: Bench) -> tuple[list[dict], list[str]]:
    """Softmax-threshold skipping (issue 27): D=128, H=16, causal, sharp_qkv inputs; exact (no
    threshold), `softmax_threshold` = SKIP_THRESHOLD, and cuDNN."""
    heads, head_dim, length = (2, 128, 2048) if bench.quick else (16, 128, 16384)
    inputs = sharp_qkv(1, length, heads, head_dim)
    drops = drop_map(inputs, True, SKIP_THRESHOLD)
    dropped = dropped_fraction(drops, True)
    error = threshold_error(inputs, drops[0], SKIP_THRESHOLD, bench.ours)
    label = f"D={head_dim} L={kilo(length)} H={heads} causal sharp"
    config = dict(B=1, L=length, H=heads, Hk=heads, D=head_dim, causal=True,
                  softmax_threshold=SKIP_THRESHOLD, dropped_blocks=round(dropped, 4))
    flops = attention_flops(1, heads, length, length, head_dim, causal=True)
    rows = measure(bench, "threshold", label, config, {**inputs, "mask": None, "bias": None},
                   True, flops, impls=("jax_dmattn", "jax_dmattn_skip", "cudnn"),
                   overrides={"jax_dmattn_skip": {"softmax_threshold": SKIP_THRESHOLD}})
    free(inputs)
    notes = [f"inputs: each head's queries 4 u + N(0, 1/4), keys N(0, 1) + {SKIP_SHARPNESS} u at "
             f"every {SKIP_SHARP_EVERY}th key, v N(0, 1); jax_dmattn: `flash_dmattn(..., "
             f"is_causal=True)` (exact); jax_dmattn (softmax threshold): the same with "
             f"`softmax_threshold={SKIP_THRESHOLD}`, which drops {100 * dropped:.1f} % of the "
             "causal grid's visible 64 x 128 blocks; gradients wrt q, k, v",
             "TF/s counts the causal call's FLOPs for every implementation", error]
    bounds = {"fwd": SKIP_MAX_FWD, "fwd+bwd": SKIP_MAX_FWD_BWD}
    for row in rows:
        exact, skip = (row["results"].get(i, {}).get("ms") for i in ("jax_dmattn",
                                                                      "jax_dmattn_skip"))
        if exact and skip:
            notes.append(f"{row['pass']}: threshold / exact = {skip / exact:.3f}× (issue 27: ≤ "
                         f"{bounds[row['pass']]}×, ≥ {100 * SKIP_MIN_DROPPED:.0f} % dropped)")
    return rows, notes


# ---- output ---------------------------------------------------------------------------------

def fmt_ms(ms: float) -> str:
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 1000 else f"{ms:.0f}"


def fmt_tflops(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


def fmt_cell(cell: dict, tflops: bool = False, width: int = 300, unit: str = " ms") -> str:
    if "error" in cell:
        return f"n/a ({cell['error'][:width]})"
    text = fmt_ms(cell["ms"]) + unit
    return text + (f"  {fmt_tflops(cell['tflops'])} TF/s" if tflops and "tflops" in cell else "")


def machine_info(on_gpu: bool) -> dict:
    info = {"jax": jax.__version__, "jax_dmattn": jax_dmattn.__version__,
            "python": platform.python_version(), "backend": jax.default_backend()}
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
        info["git"] = commit or "unknown"
    except (OSError, subprocess.SubprocessError):
        info["git"] = "unknown"
    if not on_gpu:
        try:
            info["device"] = next(line.split(":", 1)[1].strip() for line in
                                  Path("/proc/cpuinfo").read_text().splitlines()
                                  if line.startswith("model name"))
        except (OSError, StopIteration):
            info["device"] = platform.processor() or platform.machine()
        info["driver"] = "n/a (CPU)"
        return info
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.splitlines()[0]
        info["device"], info["driver"] = (s.strip() for s in line.split(",", 1))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        info["device"], info["driver"] = jax.devices()[0].device_kind, "unknown"
    try:
        from jax._src.lib import cuda_versions  # private: best effort only
        info["cudnn"] = str(cuda_versions.cudnn_get_version())
    except Exception:
        pass
    return info


def table(rows: list[dict], suite: str) -> list[str]:
    """One markdown table: ms, TF/s, speedup vs cuDNN (and time / time at 100 %, or packed /
    batch, if present)."""
    impls = [i for i in IMPLS if any(i in r["results"] for r in rows)]
    mark = {i: "†" if suite == "dynamic" and i == "cudnn" else "" for i in impls}
    head = ["config", "pass"] + [f"{NAMES[i]}{mark[i]} ms" for i in impls]
    head += [f"{NAMES[i]} TF/s" for i in impls] + ["speedup vs cuDNN"]
    dense = any("vs_dense" in r for r in rows)
    if dense:
        head += [f"{NAMES[i]} / 100 %" for i in impls]
    packed = any("packed_vs_batch" in r for r in rows)
    if packed:
        head += ["packed / batch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"], r["pass"]]
        cells += [fmt_cell(r["results"].get(i, {"error": "not run"}), width=60, unit="")
                  for i in impls]
        cells += [fmt_tflops(r["results"][i]["tflops"]) if "tflops" in r["results"].get(i, {})
                  else "—" for i in impls]
        cells.append(f"{r['speedup_vs_cudnn']:.2f}×" if r.get("speedup_vs_cudnn") else "n/a")
        if dense:
            cells += [f"{r['vs_dense'][i]:.3f}" if r["vs_dense"].get(i) is not None else "n/a"
                      for i in impls]
        if packed:
            cells.append(f"{r['packed_vs_batch']:.3f}×" if r.get("packed_vs_batch") else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write(out: Path, suite: str, rows: list[dict], notes: list[str], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    timing = "back_to_back" if suite in BACK_TO_BACK else "median_per_call"
    meta = {**meta, "suite": suite, "timing": timing, "notes": notes}
    (out / f"gpu_{suite}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2)
                                           + "\n")
    smoke = meta["smoke_test"]
    title = f"# GPU suite `{suite}`: jax_dmattn vs jax.nn.dot_product_attention (cuDNN, xla)"
    lines = [title + (" — SMOKE TEST, NOT A PERFORMANCE RESULT" if smoke else ""), ""]
    if smoke:
        lines += [f"> **{smoke}** Numbers only show that the script runs.", ""]
    lines += [f"- command: `{meta['command']}`",
              f"- device: {meta['device']}; driver {meta['driver']}"
              + (f"; cuDNN {meta['cudnn']}" if "cudnn" in meta else ""),
              f"- jax {meta['jax']} ({meta['backend']}); jax_dmattn {meta['jax_dmattn']} "
              f"(git {meta['git']}, implementation={meta['ours_implementation']!r}); "
              f"python {meta['python']}",
              f"- date: {meta['date']}",
              "- bf16, random normal inputs; "
              + (f"per call of {meta['iters']} calls issued back to back and one "
                 f"block_until_ready, best of {BACK_TO_BACK_REPEATS}, after "
                 if timing == "back_to_back" else f"median of {meta['iters']} timed calls after ")
              + f"{meta['warmup']} warm-up call(s) and at least {meta.get('warmup_s', 0)} s of "
              "warm-up calls, each waited on with block_until_ready; fwd = jit "
              "forward, fwd+bwd = jit of value_and_grad wrt q, k, v (and the bias when there is "
              "one); speedup vs cuDNN = cuDNN ms / jax_dmattn ms"]
    lines += [f"- {note}" for note in notes] + [""] + table(rows, suite)
    (out / f"gpu_{suite}.md").write_text("\n".join(lines) + "\n")
    say(f"wrote {out / f'gpu_{suite}.md'} and .json")


def summary(results: dict[str, list[dict]]) -> None:
    say("\nsummary (ms; speedup = cuDNN / jax_dmattn)")
    say(f"{'suite':10s} {'config':34s} {'pass':9s} "
        + " ".join(f"{i:>16s}" for i in IMPLS) + f" {'speedup':>8s}")
    for suite, rows in results.items():
        for r in rows:
            ms = [r["results"].get(i, {}).get("ms") for i in IMPLS]
            text = " ".join(f"{fmt_ms(m) if m is not None else 'n/a':>16s}" for m in ms)
            speedup = f"{r['speedup_vs_cudnn']:.2f}×" if r.get("speedup_vs_cudnn") else "n/a"
            say(f"{suite:10s} {r['label']:34s} {r['pass']:9s} {text} {speedup:>8s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=(*SUITES, "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed calls (default 30; 3 with --quick on a GPU; 1 on the CPU)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default benchmarks/results; smoke tests need one "
                             "outside it, e.g. /tmp/bench_smoke)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without a GPU, run on the CPU (implementation=None, no cuDNN)")
    args = parser.parse_args()

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.allow_cpu:
        sys.exit(f"no GPU (jax backend {jax.default_backend()!r}); for a CPU smoke test pass "
                 "--quick --allow-cpu --out /tmp/bench_smoke")
    smoke = None
    if not on_gpu:
        smoke = "CPU smoke test (no GPU): jax_dmattn ran with implementation=None, cuDNN skipped."
    elif args.quick:
        smoke = "GPU smoke test (--quick): tiny shapes, few iterations."
    out = args.out if args.out is not None else (RESULTS if smoke is None else None)
    if out is None or (smoke and out.resolve().is_relative_to(RESULTS)):
        sys.exit("smoke tests (--quick or CPU) must write elsewhere than benchmarks/results: "
                 "pass --out, e.g. --out /tmp/bench_smoke")
    try:
        has_cuda = "cuda" in jax_dmattn.available_implementations()
    except Exception as error:  # e.g. the extension is not built for this Python
        has_cuda = False
        say(f"warning: jax_dmattn's extension does not load ({reason(error)})")
    if on_gpu and not has_cuda:
        say("warning: this jax_dmattn build has no CUDA kernels; its cells will read n/a")

    iters = args.iters or (30 if on_gpu and not args.quick else 3 if on_gpu else 1)
    warmup_s = 0.3 if on_gpu and not args.quick else 0.0
    bench = Bench(on_gpu=on_gpu, quick=args.quick, iters=iters, warmup=1 if args.quick else 3,
                  warmup_s=warmup_s)
    meta = {"command": recorded_command(), "smoke_test": smoke or False,
            "quick": args.quick, "iters": iters, "warmup": bench.warmup, "warmup_s": warmup_s,
            "dtype": "bfloat16",
            "ours_implementation": bench.ours,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            **machine_info(on_gpu)}
    say(f"device: {meta['device']} (driver {meta['driver']}); jax {meta['jax']}; "
        f"iters {iters}; out {out}" + (f"; {smoke}" if smoke else ""))
    runners = {"dense": suite_dense, "bias_mask": suite_bias_mask, "dynamic": suite_dynamic,
               "density": suite_density, "packed": suite_packed, "sinks": suite_sinks,
               "blocks": suite_blocks, "gate": suite_gate, "threshold": suite_threshold}
    results = {}
    for suite in SUITES if args.suite == "all" else (args.suite,):
        rows, notes = runners[suite](bench)
        results[suite] = add_speedups(rows)
        write(out, suite, rows, notes, meta)
    summary(results)


if __name__ == "__main__":
    main()
