"""GPU: the forward of jax_dmattn side by side with cuDNN and Pallas Mosaic GPU (issue 22).

Each implementation is timed in this one process on the same inputs (bf16; fp16 for the Pallas
Mosaic-GPU kernel, which its authors tune for fp16): back to back, 20 calls then one
``block_until_ready``, best of 3 after warm-up. Columns: jax_dmattn with the dispatcher's choice
(the warp-specialised Hopper kernel where it takes the call), jax_dmattn with the
FlashAttention-2-class kernel forced, cuDNN (``jax.nn.dot_product_attention``) and
``jax.experimental.pallas.ops.gpu.attention_mgpu`` (its best of a few block sizes; dense only).
Every output is checked against cuDNN's (or, where cuDNN has no such call, the FA2-class
kernel's) before it is timed.

Workloads: DESIGN.md §5's dense suite (B·L = 16k tokens, H·D = 2048, D ∈ {64, 128, 256},
L ∈ {4k, 16k}, causal and not); the full [B, H, L, L] bias + 50 % random mask, causal, D128 L4k
B4 H16; a 10 % block-density mask [1, 1, L, L] (128 × 128 blocks), L16k H16 D128, against the
same call without a mask; ``dynamic_attention`` (L16k, W1024, D128, B1 H2 Hk1); and for the
dispatcher's rule, the two forward generations where a tile has little work (key lengths 512 to
4096 at equal total work, dense and masked, and dynamic_attention's 512 x 1536 block calls).

    python benchmarks/hopper_forward.py [--quick] [--only dense|masked|dispatch]
                                        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from _command import recorded_command
from gpu_suites import block_mask

import jax_dmattn
from jax_dmattn import _ffi
from jax_dmattn import _timing as timing
from jax_dmattn._timing import attention_flops
from jax_dmattn.dynamic import dynamic_attention

CALLS, REPEATS = 20, 3
IMPLS = ("ours", "ours_flash2", "cudnn", "pallas_mgpu")
NAMES = {"ours": "jax_dmattn", "ours_flash2": "jax_dmattn (FA2-class fwd)", "cudnn": "cuDNN",
         "pallas_mgpu": "Pallas Mosaic GPU (fp16)"}


def back_to_back_ms(fn: Callable, *args) -> float:
    return timing.back_to_back_ms(fn, *args, calls=CALLS, repeats=REPEATS)


def relative_error(x: jax.Array, ref: jax.Array) -> float:
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def pallas_forward(causal: bool, head_dim: int, q, k, v) -> tuple[Callable, str] | None:
    """The fastest Pallas Mosaic-GPU forward among a few block sizes, or None where none runs."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    best = None
    for block_kv in ((128, 256) if head_dim <= 128 else (64, 128)):
        config = mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2,
                                   causal=causal)
        fn = jax.jit(lambda q, k, v, c=config: mgpu.attention(q, k, v, c))
        try:
            ms = back_to_back_ms(fn, q, k, v)
        except Exception as e:  # a block size the kernel cannot take
            print(f"    pallas block_kv={block_kv}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if best is None or ms < best[0]:
            best = (ms, fn, f"block_q=64 block_kv={block_kv}")
    return None if best is None else (best[1], best[2])


def dense_cases(quick: bool) -> list[dict]:
    cases = []
    for head_dim in (64, 128, 256):
        for length in ((4096,) if quick else (4096, 16384)):
            for causal in (False, True):
                cases.append(dict(batch=16384 // length, length=length, heads=2048 // head_dim,
                                  head_dim=head_dim, causal=causal))
    return cases


def run_case(case: dict) -> dict:
    b, length, h, d, causal = (case[k] for k in ("batch", "length", "heads", "head_dim", "causal"))
    keys = jax.random.split(jax.random.PRNGKey(b * length + h * d + causal), 3)
    q, k, v = (jax.random.normal(key, (b, length, h, d), jnp.bfloat16) for key in keys)
    flops = attention_flops(b, h, length, length, d, causal)
    ours = jax.jit(lambda q, k, v: jax_dmattn.flash_dmattn(q, k, v, is_causal=causal,
                                                           implementation="cuda"))
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                 implementation="cudnn"))
    reference = cudnn(q, k, v)
    row = dict(case, kernel=_ffi.cuda_forward_kernel(q.shape, k.shape),
               cudnn_err=0.0, cudnn_ms=back_to_back_ms(cudnn, q, k, v),
               **timed_pair(ours, (q, k, v), reference))
    # the Pallas kernel applies no softmax scale: q comes scaled by 1/sqrt(D)
    q16, k16, v16 = (x.astype(jnp.float16) for x in (q * d**-0.5, k, v))
    pallas = pallas_forward(causal, d, q16, k16, v16)
    if pallas is not None:
        fn, row["pallas_config"] = pallas
        row["pallas_mgpu_err"] = relative_error(fn(q16, k16, v16), reference)
        row["pallas_mgpu_ms"] = back_to_back_ms(fn, q16, k16, v16)
    for impl in IMPLS:
        if f"{impl}_ms" in row:
            row[f"{impl}_tflops"] = flops / row[f"{impl}_ms"] / 1e9
    return row


def timed_pair(fn: Callable, args: tuple, reference: jax.Array | None) -> dict:
    """fn's time and error with the dispatcher's choice and with the FA2-class forward forced,
    each compiled afresh (an executable's CUDA graph cannot change kernels between calls)."""
    row = {}
    for kernel, name in (("auto", "ours"), ("flash2", "ours_flash2")):
        _ffi.cuda_set_forward_kernel(kernel)
        jax.clear_caches()
        try:
            out = fn(*args)
            if reference is None:
                reference = out
            row[f"{name}_err"] = relative_error(out, reference)
            row[f"{name}_ms"] = back_to_back_ms(fn, *args)
        finally:
            _ffi.cuda_set_forward_kernel("auto")
    return row


def mask_map_ms(mask: jax.Array, causal: bool) -> float:
    """The time of the mask's summaries pass (block map and bits), part of every masked call."""
    params = jax_dmattn.AttentionParams(scale=1.0, window_right=0 if causal else -1)
    return back_to_back_ms(jax.jit(lambda m: _ffi.call_mask_map(m, params)), mask)


def masked_rows(quick: bool) -> list[dict]:
    """The masked workloads: bias + 50 % mask vs cuDNN, 10 % block density vs our dense forward,
    dynamic_attention."""
    rows = []
    b, length, h, d = (1, 1024, 4, 128) if quick else (4, 4096, 16, 128)
    keys = jax.random.split(jax.random.PRNGKey(7), 5)
    q, k, v = (jax.random.normal(key, (b, length, h, d), jnp.bfloat16) for key in keys[:3])
    shape = (b, h, length, length)
    bias = jax.random.normal(keys[3], shape, jnp.bfloat16)
    mask = jax.random.bernoulli(keys[4], 0.5, shape) | jnp.eye(length, dtype=bool)
    ours = jax.jit(lambda q, k, v, m, bias: jax_dmattn.flash_dmattn(
        q, k, v, m, bias, is_causal=True, implementation="cuda"))
    cudnn = jax.jit(lambda q, k, v, m, bias: jax.nn.dot_product_attention(
        q, k, v, bias, m, is_causal=True, implementation="cudnn"))
    args = (q, k, v, mask, bias)
    reference = cudnn(*args)
    row = dict(workload=f"bias + 50 % mask [B,H,L,L] causal D{d} L{length // 1024}k B{b} H{h}",
               kernel=_ffi.cuda_forward_kernel(q.shape, k.shape, mask.shape, bias.shape),
               cudnn_ms=back_to_back_ms(cudnn, *args), map_ms=mask_map_ms(mask, True),
               **timed_pair(ours, args, reference))
    rows.append(row)
    del bias, mask, args
    jax.clear_caches()

    length, h = (4096, 4) if quick else (16384, 16)
    keys = jax.random.split(jax.random.PRNGKey(8), 3)
    q, k, v = (jax.random.normal(key, (1, length, h, d), jnp.bfloat16) for key in keys)
    dense = jax.jit(lambda q, k, v: jax_dmattn.flash_dmattn(q, k, v, implementation="cuda"))
    dense_ms = back_to_back_ms(dense, q, k, v)
    sparse_mask = block_mask(length, 0.1, 128, seed=3)
    sparse = jax.jit(lambda q, k, v, m: jax_dmattn.flash_dmattn(q, k, v, m,
                                                                  implementation="cuda"))
    row = dict(workload=f"10 % block mask [1,1,L,L] D{d} L{length // 1024}k B1 H{h}",
               kernel=_ffi.cuda_forward_kernel(q.shape, k.shape, sparse_mask.shape),
               dense_ms=dense_ms, map_ms=mask_map_ms(sparse_mask, False),
               **timed_pair(sparse, (q, k, v, sparse_mask), None))
    rows.append(row)
    del sparse_mask
    jax.clear_caches()

    length = 4096 if quick else 16384
    keys = jax.random.split(jax.random.PRNGKey(9), 4)
    q = jax.random.normal(keys[0], (1, length, 2, d), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, length, 1, d), jnp.bfloat16) for key in keys[1:3])
    key_bias = jax.random.normal(keys[3], (1, 1, 1, length), jnp.bfloat16)
    dynamic = jax.jit(lambda q, k, v, bias: dynamic_attention(q, k, v, bias, 1024,
                                                              is_causal=True,
                                                              implementation="cuda"))
    rows.append(dict(workload=f"dynamic_attention W1024 D{d} L{length // 1024}k B1 H2 Hk1",
                     kernel="(its own calls)",
                     **timed_pair(dynamic, (q, k, v, key_bias), None)))
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
    return rows


def dispatch_rows(quick: bool) -> list[dict]:
    """The two forward generations side by side where the work per tile is small: equal total
    work (B·H·Lq·Lk) at key lengths from 512 to 4096, dense and with a 50 % mask [B,1,Lq,Lk], and
    dynamic_attention's block calls (512 queries against 1536 keys): where the Hopper kernel's
    per-tile costs outweigh its faster main loop, for the dispatcher's rule."""
    d, heads = 128, 16
    lengths = (512, 1024, 2048) if quick else (512, 768, 1024, 1536, 2048, 3072, 4096)
    shapes = [(max(1, (4 if quick else 16) * 4096**2 // (heads * length**2)), heads, length,
               length) for length in lengths]
    shapes.append((16 if quick else 128, 2, 512, 1536))
    rows = []
    for batch, h, q_len, k_len in shapes:
        keys = jax.random.split(jax.random.PRNGKey(q_len + k_len), 4)
        q = jax.random.normal(keys[0], (batch, q_len, h, d), jnp.bfloat16)
        k, v = (jax.random.normal(key, (batch, k_len, h, d), jnp.bfloat16) for key in keys[1:3])
        mask = jax.random.bernoulli(keys[3], 0.5, (batch, 1, q_len, k_len))
        for masked in (False, True):
            args = (q, k, v, mask) if masked else (q, k, v)
            fn = jax.jit(lambda q, k, v, m=None: jax_dmattn.flash_dmattn(
                q, k, v, m, implementation="cuda"))
            row = dict(batch=batch, heads=h, q_len=q_len, k_len=k_len, masked=masked,
                       tiles=batch * h * -(-q_len // 128), key_blocks=-(-k_len // 128),
                       kernel=_ffi.cuda_forward_kernel(q.shape, k.shape,
                                                       mask.shape if masked else None),
                       **timed_pair(fn, args, None))
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
        jax.clear_caches()
    return rows


def dispatch_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        "## Small work per tile: the two forward generations side by side",
        "",
        "D128 bf16; equal work B·H·Lq·Lk per length; mask: 50 % random `[B,1,Lq,Lk]`. `kernel`: "
        "the dispatcher's choice; `×`: FA2-class time / the dispatcher's choice's time.",
        "",
        "| B | H | Lq | Lk | key blocks | tiles | mask | kernel | jax_dmattn ms | "
        "FA2-class fwd ms (×) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms, fa2 = r["ours_ms"], r["ours_flash2_ms"]
        lines.append(f"| {r['batch']} | {r['heads']} | {r['q_len']} | {r['k_len']} | "
                     f"{r['key_blocks']} | {r['tiles']} | {'yes' if r['masked'] else 'no'} | "
                     f"{r['kernel']} | {ms:.3f} | {fa2:.3f} ({fa2 / ms:.2f}×) |")
    return "\n".join(lines) + "\n"


def environment() -> dict:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return dict(gpu=smi, jax=jax.__version__, python=platform.python_version(),
                date=datetime.date.today().isoformat(),
                command=recorded_command())


def masked_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        "## Masked workloads",
        "",
        "ms back to back; `×` = the other column's time / jax_dmattn's (dispatcher's choice); "
        "mask pass: the mask's block map and bits alone, part of jax_dmattn's time.",
        "",
        "| workload | kernel | jax_dmattn ms | mask pass ms | FA2-class fwd ms (×) | "
        "cuDNN ms (×) | dense jax_dmattn ms (fraction) | max rel. err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ours_ms"]
        cudnn = f"{r['cudnn_ms']:.3f} ({r['cudnn_ms'] / ms:.2f}×)" if "cudnn_ms" in r else "—"
        dense = f"{r['dense_ms']:.3f} ({ms / r['dense_ms']:.3f}×)" if "dense_ms" in r else "—"
        err = max(r.get("ours_err", 0.0), r.get("ours_flash2_err", 0.0))
        mask_pass = f"{r['map_ms']:.3f}" if "map_ms" in r else "—"
        lines.append(f"| {r['workload']} | {r['kernel']} | {ms:.3f} | {mask_pass} | "
                     f"{r['ours_flash2_ms']:.3f} ({r['ours_flash2_ms'] / ms:.2f}×) | {cudnn} | "
                     f"{dense} | {err:.1e} |")
    return "\n".join(lines) + "\n"


def header(env: dict) -> str:
    return "\n".join([
        "# Forward: jax_dmattn, cuDNN and Pallas Mosaic GPU side by side",
        "",
        f"GPU: {env['gpu']}; JAX {env['jax']}; Python {env['python']}; {env['date']}.",
        f"Command: `{env['command']}`.",
        "",
        f"bf16 (Pallas: fp16); back to back, {CALLS} calls then one block, best of {REPEATS}.",
    ]) + "\n"


def ratio_cells(row: dict, impls: tuple[str, ...]) -> list[str]:
    """`ms (TF/s, ×cuDNN)` of each implementation in `row`, `n/a` where it did not run."""
    cells = []
    for impl in impls:
        if f"{impl}_ms" not in row:
            cells.append("n/a")
            continue
        ratio = row["cudnn_ms"] / row[f"{impl}_ms"]
        cells.append(f"{row[f'{impl}_ms']:.3f} ({row[f'{impl}_tflops']:.0f}, {ratio:.2f}×)")
    return cells


def dense_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        "## Dense workloads",
        "",
        "TF/s by DESIGN.md §5 (causal halved); ratio = cuDNN time / time. `kernel`: what the "
        "dispatcher ran for jax_dmattn. Relative errors are against cuDNN's output.",
        "",
        "| D | L | B | H | causal | kernel | " + " | ".join(
            f"{NAMES[i]} ms (TF/s, ×cuDNN)" for i in IMPLS) + " | max rel. err |",
        "|---|---|---|---|---|---|" + "---|" * len(IMPLS) + "---|",
    ]
    for r in rows:
        err = max(r.get(f"{i}_err", 0.0) for i in IMPLS)
        lines.append(f"| {r['head_dim']} | {r['length'] // 1024}k | {r['batch']} | {r['heads']} | "
                     f"{'yes' if r['causal'] else 'no'} | {r['kernel']} | "
                     + " | ".join(ratio_cells(r, IMPLS)) + f" | {err:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short sequences only")
    parser.add_argument("--only", choices=("dense", "masked", "dispatch"),
                        help="one section of the workloads")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    env = environment()
    rows = []
    for case in dense_cases(args.quick) if args.only in (None, "dense") else ():
        row = run_case(case)
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
        jax.clear_caches()
    masked = masked_rows(args.quick) if args.only in (None, "masked") else []
    dispatch = dispatch_rows(args.quick) if args.only in (None, "dispatch") else []
    text = (header(env) + (dense_markdown(rows) if rows else "")
            + (masked_markdown(masked) if masked else "")
            + (dispatch_markdown(dispatch) if dispatch else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hopper_forward.md").write_text(text)
    (args.out / "hopper_forward.json").write_text(
        json.dumps(dict(env, rows=rows, masked=masked, dispatch=dispatch), indent=1))
    print(text)


if __name__ == "__main__":
    main()
