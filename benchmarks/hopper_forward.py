"""GPU: the dense forward of jax_dmattn side by side with cuDNN and Pallas Mosaic GPU.

DESIGN.md §5's dense suite (B·L = 16k tokens, H·D = 2048, D ∈ {64, 128, 256}, L ∈ {4k, 16k},
causal and not), forward only, each implementation timed in this one process on the same inputs
(bf16; fp16 for the Pallas Mosaic-GPU kernel, which its authors tune for fp16): back to back,
20 calls then one ``block_until_ready``, best of 3 after warm-up. Columns: jax_dmattn with the
dispatcher's choice (the warp-specialised Hopper kernel where it takes the call), jax_dmattn with
the FlashAttention-2-class kernel forced, cuDNN (``jax.nn.dot_product_attention``) and
``jax.experimental.pallas.ops.gpu.attention_mgpu`` (its best of a few block sizes). Every output
is checked against cuDNN's before it is timed.

    python benchmarks/hopper_forward.py [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

import jax_dmattn
from jax_dmattn import _ffi
from jax_dmattn._timing import attention_flops

CALLS, REPEATS = 20, 3
IMPLS = ("ours", "ours_flash2", "cudnn", "pallas_mgpu")
NAMES = {"ours": "jax_dmattn", "ours_flash2": "jax_dmattn (FA2-class fwd)", "cudnn": "cuDNN",
         "pallas_mgpu": "Pallas Mosaic GPU (fp16)"}


def back_to_back_ms(fn: Callable, *args) -> float:
    """Milliseconds per call: CALLS calls then one block, best of REPEATS (after warm-up)."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(CALLS):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) * 1e3 / CALLS)
    return best


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
    row = dict(case, kernel=_ffi.cuda_forward_kernel(q.shape, k.shape, False, False))
    reference = cudnn(q, k, v)
    for name, fn, args in (("ours", ours, (q, k, v)), ("cudnn", cudnn, (q, k, v))):
        row[f"{name}_err"] = relative_error(fn(*args), reference) if name != "cudnn" else 0.0
        row[f"{name}_ms"] = back_to_back_ms(fn, *args)
    _ffi.cuda_set_forward_kernel("flash2")
    try:
        row["ours_flash2_err"] = relative_error(ours(q, k, v), reference)
        row["ours_flash2_ms"] = back_to_back_ms(ours, q, k, v)
    finally:
        _ffi.cuda_set_forward_kernel("auto")
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


def environment() -> dict:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    return dict(gpu=smi, jax=jax.__version__, python=platform.python_version(),
                date=datetime.date.today().isoformat(),
                command="python " + shlex.join(["benchmarks/hopper_forward.py", *sys.argv[1:]]))


def markdown(rows: list[dict], env: dict) -> str:
    lines = [
        "# Dense forward: jax_dmattn, cuDNN and Pallas Mosaic GPU side by side",
        "",
        f"GPU: {env['gpu']}; JAX {env['jax']}; Python {env['python']}; {env['date']}.",
        f"Command: `{env['command']}`.",
        "",
        f"bf16 (Pallas: fp16); back to back, {CALLS} calls then one block, best of {REPEATS}; "
        "TF/s by DESIGN.md §5 (causal halved); ratio = cuDNN time / time. `kernel`: what the "
        "dispatcher ran for jax_dmattn. Relative errors are against cuDNN's output.",
        "",
        "| D | L | B | H | causal | kernel | " + " | ".join(
            f"{NAMES[i]} ms (TF/s, ×cuDNN)" for i in IMPLS) + " | max rel. err |",
        "|---|---|---|---|---|---|" + "---|" * len(IMPLS) + "---|",
    ]
    for r in rows:
        cells = []
        for impl in IMPLS:
            if f"{impl}_ms" not in r:
                cells.append("n/a")
                continue
            ratio = r["cudnn_ms"] / r[f"{impl}_ms"]
            cells.append(f"{r[f'{impl}_ms']:.3f} ({r[f'{impl}_tflops']:.0f}, {ratio:.2f}×)")
        err = max(r.get(f"{i}_err", 0.0) for i in IMPLS)
        lines.append(f"| {r['head_dim']} | {r['length'] // 1024}k | {r['batch']} | {r['heads']} | "
                     f"{'yes' if r['causal'] else 'no'} | {r['kernel']} | " + " | ".join(cells)
                     + f" | {err:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 4k only")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    env = environment()
    rows = []
    for case in dense_cases(args.quick):
        row = run_case(case)
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
        jax.clear_caches()
    text = markdown(rows, env)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hopper_forward.md").write_text(text)
    (args.out / "hopper_forward.json").write_text(json.dumps(dict(env, rows=rows), indent=1))
    print(text)


if __name__ == "__main__":
    main()
