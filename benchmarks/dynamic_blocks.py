"""dynamic_attention's query block size: time per call against the block, on the dynamic suite's
shapes (B=1, H=2, Hk=1, per-key bias, causal top-W), median of synchronised calls:

    python benchmarks/dynamic_blocks.py [--dims 128 64] [--lengths 4096 16384 32768]
        [--window 1024] [--blocks 256 512 1024] [--iters 20]

Prints one line per (D, L, block): forward, forward+backward (wrt q, k, v and the bias) and the
key lists alone (``masks.topk_block_keys``, part of both).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jax_dmattn import masks
from jax_dmattn._timing import median_ms
from jax_dmattn.dynamic import default_query_block, dynamic_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--blocks", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    window = args.window
    print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; window {window}; "
          f"default block {default_query_block(window)}")
    print("| D | L | block | fwd ms | fwd+bwd ms | key lists ms |\n|---|---|---|---|---|---|")
    for head_dim in args.dims:
        for length in args.lengths:
            keys = jax.random.split(jax.random.PRNGKey(0), 5)
            q, dout = (jax.random.normal(keys[i], (1, length, 2, head_dim), jnp.bfloat16)
                       for i in (0, 4))
            k, v = (jax.random.normal(keys[i], (1, length, 1, head_dim), jnp.bfloat16)
                    for i in (1, 2))
            bias = jax.random.normal(keys[3], (1, 1, 1, length), jnp.bfloat16)
            for block in args.blocks:
                def attend(q, k, v, bias, block=block):
                    return dynamic_attention(q, k, v, bias, window, query_block=block)

                def loss(q, k, v, bias, dout, block=block):
                    return jnp.sum(attend(q, k, v, bias, block).astype(jnp.float32) * dout)

                fwd = jax.jit(attend)
                fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
                lists = jax.jit(lambda b, block=block: masks.topk_block_keys(
                    b[:, :, 0, :], window, block))
                times = [median_ms(f, *a, warmup=3, iters=args.iters) for f, a in (
                    (fwd, (q, k, v, bias)), (fwd_bwd, (q, k, v, bias, dout)), (lists, (bias,)))]
                print(f"| {head_dim} | {length} | {block} | "
                      + " | ".join(f"{t:.3f}" for t in times) + " |", flush=True)
                jax.clear_caches()


if __name__ == "__main__":
    main()
