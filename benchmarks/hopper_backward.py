"""GPU: forward + backward of jax_dmattn side by side with cuDNN and Pallas Mosaic GPU (issue 23).

Each implementation is timed in this one process on the same inputs and cotangent (bf16; fp16
for the Pallas Mosaic-GPU kernel, whose backward is non-causal only): ``jit`` of the gradients
with respect to q, k, v (and the bias where there is one), back to back, 20 calls then one
``block_until_ready``, best of 3 after warm-up. jax_dmattn runs three times: the dispatcher's
choice with the default (atomic) dQ, the same with the FlashAttention-2-class backward forced,
and with ``deterministic=True``. Every gradient is checked against cuDNN's before it
is timed.

Workloads: DESIGN.md §5's dense suite (B·L = 16k tokens, H·D = 2048, D ∈ {64, 128, 256},
L ∈ {4k, 16k}, causal and not); the full [B, H, L, L] bias + 50 % random mask with dbias,
causal, D128 L4k B4 H16, against cuDNN given the same bias and mask; a 10 % block-density mask
[1, 1, L, L] (128 × 128 blocks), L16k H16 D128, against the same call without a mask;
``dynamic_attention`` (L16k, W1024, D128, B1 H2 Hk1).

    python benchmarks/hopper_backward.py [--quick] [--only dense|masked] [--head-dims 64 128]
                                         [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from gpu_suites import block_mask
from hopper_forward import (
    back_to_back_ms,
    dense_cases,
    environment,
    ratio_cells,
    relative_error,
)

import jax_dmattn
from jax_dmattn import _ffi
from jax_dmattn._timing import attention_flops
from jax_dmattn.dynamic import dynamic_attention

CALLS, REPEATS = 20, 3
IMPLS = ("ours", "ours_flash2", "ours_det", "cudnn", "pallas_mgpu")
NAMES = {"ours": "jax_dmattn", "ours_flash2": "jax_dmattn (FA2-class bwd)",
         "ours_det": "jax_dmattn deterministic", "cudnn": "cuDNN",
         "pallas_mgpu": "Pallas Mosaic GPU (fp16)"}
BACKWARD_FLOPS = 3.5  # forward + backward, in units of the forward's (DESIGN.md §5)


def gradients(attention: Callable, argnums: tuple[int, ...]) -> Callable:
    """jit of the gradients of <attention(*args), cotangent> with respect to args[argnums]."""

    def loss(*args):
        *inputs, cotangent = args
        out = attention(*inputs)
        return jnp.vdot(out.astype(jnp.float32), cotangent.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=argnums))


def max_error(grads, reference) -> float:
    return max(relative_error(g, r) for g, r in zip(grads, reference, strict=True))


def pallas_gradients(head_dim: int, q, k, v, cotangent) -> tuple[Callable, str] | None:
    """The fastest Pallas Mosaic-GPU forward + backward among a few block sizes, or None."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

    best = None
    for block_kv, block_bwd, wgs in ((128, 64, 1), (128, 64, 2), (128, 128, 1)):
        config = mgpu.TuningConfig(
            block_q=64, block_kv=block_kv if head_dim <= 128 else 64, max_concurrent_steps=2,
            compute_wgs_bwd=wgs, block_q_dkv=block_bwd, block_kv_dkv=block_bwd,
            block_q_dq=block_bwd, block_kv_dq=block_bwd)
        fn = gradients(lambda q, k, v, c=config: mgpu.attention(q, k, v, c), (0, 1, 2))
        try:
            ms = back_to_back_ms(fn, q, k, v, cotangent)
        except Exception as e:  # a configuration the kernel cannot take
            print(f"    pallas {config}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if best is None or ms < best[0]:
            best = (ms, fn, f"block_kv={config.block_kv} bwd blocks {block_bwd} wgs {wgs}")
    return None if best is None else (best[1], best[2])


def dense_row(case: dict) -> dict:
    b, length, h, d, causal = (case[k] for k in ("batch", "length", "heads", "head_dim", "causal"))
    keys = jax.random.split(jax.random.PRNGKey(b * length + h * d + causal), 4)
    q, k, v, cotangent = (jax.random.normal(key, (b, length, h, d), jnp.bfloat16) for key in keys)
    args = (q, k, v, cotangent)
    cudnn = gradients(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"), (0, 1, 2))
    reference = cudnn(*args)
    row = dict(case, cudnn_ms=back_to_back_ms(cudnn, *args))
    for name, deterministic, kernel in (("ours", False, "auto"), ("ours_flash2", False, "flash2"),
                                        ("ours_det", True, "auto")):
        # each compiled afresh: an executable's CUDA graph cannot change kernels between calls
        _ffi.cuda_set_backward_kernel(kernel)
        jax.clear_caches()
        try:
            ours = gradients(lambda q, k, v, det=deterministic: jax_dmattn.flash_dmattn(
                q, k, v, is_causal=causal, deterministic=det, implementation="cuda"), (0, 1, 2))
            row[f"{name}_err"] = max_error(ours(*args), reference)
            row[f"{name}_ms"] = back_to_back_ms(ours, *args)
        finally:
            _ffi.cuda_set_backward_kernel("auto")
    if not causal:  # the Pallas backward takes no causal mask; q comes scaled by 1/sqrt(D)
        q16, k16, v16, c16 = (x.astype(jnp.float16) for x in (q * d**-0.5, k, v, cotangent))
        pallas = pallas_gradients(d, q16, k16, v16, c16)
        if pallas is not None:
            fn, row["pallas_config"] = pallas
            dq, dk, dv = fn(q16, k16, v16, c16)
            row["pallas_mgpu_err"] = max_error((dq * d**-0.5, dk, dv), reference)
            row["pallas_mgpu_ms"] = back_to_back_ms(fn, q16, k16, v16, c16)
    flops = BACKWARD_FLOPS * attention_flops(b, h, length, length, d, causal)
    for impl in IMPLS:
        if f"{impl}_ms" in row:
            row[f"{impl}_tflops"] = flops / row[f"{impl}_ms"] / 1e9
    return row


def masked_rows(quick: bool) -> list[dict]:
    """bias + 50 % mask with dbias vs cuDNN; 10 % block density vs our dense call;
    dynamic_attention (with the gradient of its per-key bias)."""
    rows = []
    b, length, h, d = (1, 1024, 4, 128) if quick else (4, 4096, 16, 128)
    keys = jax.random.split(jax.random.PRNGKey(7), 6)
    q, k, v, cotangent = (jax.random.normal(key, (b, length, h, d), jnp.bfloat16)
                          for key in keys[:4])
    shape = (b, h, length, length)
    bias = jax.random.normal(keys[4], shape, jnp.bfloat16)
    mask = jax.random.bernoulli(keys[5], 0.5, shape) | jnp.eye(length, dtype=bool)
    args = (q, k, v, bias, mask, cotangent)
    cudnn = gradients(lambda q, k, v, bias, m: jax.nn.dot_product_attention(
        q, k, v, bias, m, is_causal=True, implementation="cudnn"), (0, 1, 2, 3))
    ours = gradients(lambda q, k, v, bias, m: jax_dmattn.flash_dmattn(
        q, k, v, m, bias, is_causal=True, implementation="cuda"), (0, 1, 2, 3))
    reference = cudnn(*args)
    rows.append(dict(workload=f"bias + 50 % mask [B,H,L,L] causal, dbias, D{d} "
                              f"L{length // 1024}k B{b} H{h}",
                     ours_err=max_error(ours(*args), reference),
                     ours_ms=back_to_back_ms(ours, *args), cudnn_ms=back_to_back_ms(cudnn, *args)))
    del bias, mask, args, reference
    jax.clear_caches()

    length, h = (4096, 4) if quick else (16384, 16)
    keys = jax.random.split(jax.random.PRNGKey(8), 4)
    q, k, v, cotangent = (jax.random.normal(key, (1, length, h, d), jnp.bfloat16) for key in keys)
    sparse_mask = block_mask(length, 0.1, 128, seed=3)
    dense = gradients(lambda q, k, v: jax_dmattn.flash_dmattn(q, k, v, implementation="cuda"),
                      (0, 1, 2))
    sparse = gradients(lambda q, k, v, m: jax_dmattn.flash_dmattn(q, k, v, m,
                                                                    implementation="cuda"),
                       (0, 1, 2))
    rows.append(dict(workload=f"10 % block mask [1,1,L,L] D{d} L{length // 1024}k B1 H{h}",
                     ours_ms=back_to_back_ms(sparse, q, k, v, sparse_mask, cotangent),
                     dense_ms=back_to_back_ms(dense, q, k, v, cotangent)))
    del sparse_mask
    jax.clear_caches()

    keys = jax.random.split(jax.random.PRNGKey(9), 5)
    q, cotangent = (jax.random.normal(key, (1, length, 2, d), jnp.bfloat16) for key in keys[:2])
    k, v = (jax.random.normal(key, (1, length, 1, d), jnp.bfloat16) for key in keys[2:4])
    key_bias = jax.random.normal(keys[4], (1, 1, 1, length), jnp.bfloat16)
    dynamic = gradients(lambda q, k, v, bias: dynamic_attention(
        q, k, v, bias, 1024, is_causal=True, implementation="cuda"), (0, 1, 2, 3))
    rows.append(dict(workload=f"dynamic_attention W1024 D{d} L{length // 1024}k B1 H2 Hk1",
                     ours_ms=back_to_back_ms(dynamic, q, k, v, key_bias, cotangent)))
    for row in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
    return rows


def dense_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        "## Dense forward + backward",
        "",
        "TF/s: 3.5 × the forward's 4·B·H·L²·D (causal halved); × = cuDNN time / time. Relative "
        "errors: the worst of dq, dk, dv against cuDNN's.",
        "",
        "| D | L | B | H | causal | " + " | ".join(
            f"{NAMES[i]} ms (TF/s, ×cuDNN)" for i in IMPLS) + " | max rel. err |",
        "|---|---|---|---|---|" + "---|" * len(IMPLS) + "---|",
    ]
    for r in rows:
        err = max(r.get(f"{i}_err", 0.0) for i in IMPLS)
        lines.append(f"| {r['head_dim']} | {r['length'] // 1024}k | {r['batch']} | {r['heads']} | "
                     f"{'yes' if r['causal'] else 'no'} | " + " | ".join(ratio_cells(r, IMPLS))
                     + f" | {err:.1e} |")
    return "\n".join(lines) + "\n"


def masked_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        "## Masked forward + backward",
        "",
        "| workload | jax_dmattn ms | cuDNN ms (×) | dense jax_dmattn ms (fraction) | "
        "max rel. err |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["ours_ms"]
        cudnn = f"{r['cudnn_ms']:.3f} ({r['cudnn_ms'] / ms:.2f}×)" if "cudnn_ms" in r else "—"
        dense = f"{r['dense_ms']:.3f} ({ms / r['dense_ms']:.3f}×)" if "dense_ms" in r else "—"
        err = f"{r['ours_err']:.1e}" if "ours_err" in r else "—"
        lines.append(f"| {r['workload']} | {ms:.3f} | {cudnn} | {dense} | {err} |")
    return "\n".join(lines) + "\n"


def header(env: dict) -> str:
    return "\n".join([
        "# Forward + backward: jax_dmattn, cuDNN and Pallas Mosaic GPU side by side",
        "",
        f"GPU: {env['gpu']}; JAX {env['jax']}; Python {env['python']}; {env['date']}.",
        f"Command: `{env['command']}`.",
        "",
        f"bf16 (Pallas: fp16); back to back, {CALLS} calls then one block, best of {REPEATS}.",
    ]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short sequences only")
    parser.add_argument("--only", choices=("dense", "masked"), help="one section")
    parser.add_argument("--head-dims", type=int, nargs="+", default=(64, 128, 256),
                        help="the dense suite's head dims (those the build holds)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    env = environment()
    rows = []
    for case in dense_cases(args.quick) if args.only in (None, "dense") else ():
        if case["head_dim"] not in args.head_dims:
            continue
        row = dense_row(case)
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
        jax.clear_caches()
    masked = masked_rows(args.quick) if args.only in (None, "masked") else []
    text = (header(env) + (dense_markdown(rows) if rows else "")
            + (masked_markdown(masked) if masked else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hopper_backward.md").write_text(text)
    (args.out / "hopper_backward.json").write_text(
        json.dumps(dict(env, rows=rows, masked=masked), indent=1))


if __name__ == "__main__":
    main()
