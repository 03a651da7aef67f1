"""The README's example: dynamic-mask attention with a per-key bias, forward and gradients.

    python examples/quickstart.py
"""

import jax
import jax.numpy as jnp

from jax_dmattn import flash_dmattn


def main() -> None:
    batch, length, heads, kv_heads, head_dim = 2, 256, 8, 2, 64
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), dtype)
    # A per-key importance score, broadcast over queries, and the causal top-64 keys of each row.
    bias = jax.random.normal(keys[3], (batch, kv_heads, 1, length), dtype)
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal, bias.astype(jnp.float32), -jnp.inf)  # [B, Hk, L, L]
    threshold = jax.lax.top_k(scores, 64)[0][..., -1:]
    mask = causal & (scores >= threshold)

    out = flash_dmattn(q, k, v, mask, bias, is_causal=True)

    def loss(q, bias):
        out = flash_dmattn(q, k, v, mask, bias, is_causal=True)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    dq, dbias = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, bias)
    print(f"out {out.shape} {out.dtype}, dq {dq.shape}, dbias {dbias.shape}; "
          f"finite: {bool(jnp.isfinite(out).all() & jnp.isfinite(dq).all())}")


if __name__ == "__main__":
    main()
