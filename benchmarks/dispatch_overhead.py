"""How much of a per-call time is dispatch and wake-up latency rather than GPU work.

DESIGN.md §5 times each call with ``block_until_ready``; this script times the same jitted
forward both ways, per call (median) and back to back (mean of calls issued without waiting),
for jax_dmattn and cuDNN, side by side:

    python benchmarks/dispatch_overhead.py [--shape B L H D] [--kv-heads Hk]
        [--block-density P] [--iters 20]

``--block-density`` adds the density suite's [1, 1, L, L] mask of 128x128 blocks.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from gpu_suites import block_mask

import jax_dmattn
from jax_dmattn._timing import back_to_back_ms, median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=(4, 4096, 16, 128),
                        metavar=("B", "L", "H", "D"))
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--block-density", type=float, default=None)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    batch, length, heads, head_dim = args.shape
    kv_heads = args.kv_heads or heads
    rng = np.random.default_rng(0)

    def normal(h):
        return jnp.asarray(rng.standard_normal((batch, length, h, head_dim)), jnp.bfloat16)

    q, k, v = normal(heads), normal(kv_heads), normal(kv_heads)
    mask = (None if args.block_density is None
            else block_mask(length, args.block_density, 128, seed=0))
    calls = {
        "jax_dmattn": jax.jit(lambda q, k, v, mask: jax_dmattn.flash_dmattn(q, k, v, mask)),
        "cuDNN": jax.jit(lambda q, k, v, mask: jax.nn.dot_product_attention(
            q, k, v, mask=mask, implementation="cudnn")),
    }
    if jax.default_backend() != "gpu":
        del calls["cuDNN"]
    masked = "" if mask is None else f", block mask {args.block_density:.0%}"
    print(f"forward, bf16, B={batch} L={length} H={heads} Hk={kv_heads} D={head_dim}{masked}, "
          f"{jax.devices()[0]}")
    print(f"{'implementation':<12} {'per call ms':>12} {'back to back ms':>16} {'latency ms':>11}")
    for name, fn in calls.items():
        per_call = median_ms(fn, q, k, v, mask, warmup=3, iters=args.iters)
        back_to_back = back_to_back_ms(fn, q, k, v, mask, calls=args.iters, repeats=1,
                                       warmup=1)
        latency = per_call - back_to_back
        print(f"{name:<12} {per_call:>12.3f} {back_to_back:>16.3f} {latency:>11.3f}")


if __name__ == "__main__":
    main()
