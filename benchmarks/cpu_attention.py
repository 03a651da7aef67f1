"""CPU: C++ kernels vs jax.nn.dot_product_attention(implementation="xla"), side by side.

The foundation's acceptance question: forward+backward at B=1, H=4, L=2048, D=64, float32, causal,
dense and with an [1, 1, L, L] mask of 10 % block density. Writes benchmarks/results/cpu.{md,json}.

    python benchmarks/cpu_attention.py [--length 2048] [--iters 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _command import recorded_command

import jax_dmattn
from jax_dmattn._timing import median_ms

RESULTS = Path(__file__).parent / "results"


def block_mask(seqlen: int, density: float, block: int, seed: int) -> jax.Array:
    """[1, 1, L, L] bool: whole block×block tiles kept with probability `density`."""
    blocks = -(-seqlen // block)
    keep = np.random.default_rng(seed).random((blocks, blocks)) < density
    np.fill_diagonal(keep, True)  # every query row keeps some keys
    full = np.kron(keep, np.ones((block, block), bool))[:seqlen, :seqlen]
    return jnp.asarray(full)[None, None]


def fwd_bwd(attention):
    def loss(q, k, v):
        return jnp.sum(attention(q, k, v) * jnp.float32(0.5))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def run(length: int, iters: int) -> list[dict]:
    batch, heads, head_dim = 1, 4, 64
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (batch, length, heads, head_dim), jnp.float32)
               for kk in keys)
    cases = {"dense causal": None, "10% block mask, causal": block_mask(length, 0.10, 64, 0)}
    rows = []
    for name, mask in cases.items():
        visible = jnp.tril(jnp.ones((length, length), bool))
        if mask is not None:
            visible &= mask[0, 0]
        density = float(jnp.mean(visible))
        ours = fwd_bwd(lambda q, k, v, m=mask: jax_dmattn.flash_dmattn(
            q, k, v, m, is_causal=True, implementation="cpu"))
        xla = fwd_bwd(lambda q, k, v, m=mask: jax.nn.dot_product_attention(
            q, k, v, mask=m, is_causal=True, implementation="xla"))
        row = {"case": name, "visible_fraction": round(density, 4)}
        for label, fn in (("jax_dmattn_cpu_ms", ours), ("jax_nn_xla_ms", xla)):
            row[label] = round(median_ms(fn, q, k, v, warmup=2, iters=iters), 2)
            print(f"  {name:28s} {label:18s} {row[label]:9.2f} ms", flush=True)
        row["xla_over_ours"] = round(row["jax_nn_xla_ms"] / row["jax_dmattn_cpu_ms"], 2)
        rows.append(row)
    return rows


def write(rows: list[dict], length: int, command: str) -> None:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = cpu
    meta = {"command": command, "jax": jax.__version__, "cpu": model, "cores": os.cpu_count(),
            "shape": f"B=1 H=4 L={length} D=64 float32 causal", "metric": "median ms, fwd+bwd"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# CPU: jax_dmattn C++ kernels vs jax.nn.dot_product_attention (xla)", "",
        f"- command: `{command}`",
        f"- machine: {model}, {os.cpu_count()} cores; jax {jax.__version__}",
        f"- shape: {meta['shape']}; forward+backward (value_and_grad wrt q, k, v), "
        "median of timed calls after warm-up", "",
        "| case | visible (query, key) pairs / L² | jax_dmattn cpu (ms) | jax.nn xla (ms) | "
        "xla / ours |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['visible_fraction']} | {r['jax_dmattn_cpu_ms']} | "
              f"{r['jax_nn_xla_ms']} | {r['xla_over_ours']}× |" for r in rows]
    (RESULTS / "cpu.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    rows = run(args.length, args.iters)
    write(rows, args.length, recorded_command())


if __name__ == "__main__":
    main()
