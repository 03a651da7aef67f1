"""Framework-independent pieces of the Dynamic Mask Attention layers.

The Flax NNX, Flax Linen and Equinox layers (``jax_dmattn.flax``, ``jax_dmattn.equinox``) differ
only in how they hold their parameters; everything else is written once here, with the
projections passed in as callables ``[..., in] -> [..., out]``.

The layer (the paper's "Dynamic Mask Attention", as in the Doge models of flash-dmattn):

* ``q = x Wq``, ``k = x Wk``, ``v = x Wv`` split into ``H`` query heads and ``Hk`` kv heads
  (GQA), with rotary position embeddings on ``q`` and ``k``;
* a per-key importance score from the values: ``dt = dt_proj(v)`` (``Hk·D -> Hk``) and
  ``bias = A · softplus(dt)`` per kv head, broadcast over queries as ``[B, Hk, 1, Lk]``;
* a mask keeping, for every query row, the top-``window`` visible keys of that score under
  causality (``masks.topk_mask`` of the score with its gradient stopped);
* ``flash_dmattn(q, k, v, mask, bias, is_causal=True)``: the bias gets its gradient from the
  kernel's dbias, then the output projection.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_dmattn import masks
from jax_dmattn.attention import flash_dmattn
from jax_dmattn.dynamic import dynamic_attention

Projection = Callable[[jax.Array], jax.Array]


def check_config(hidden_size: int, num_heads: int, num_kv_heads: int | None,
                 head_dim: int | None, window: int, rope: bool) -> tuple[int, int]:
    """Validates a layer's sizes; returns ``(num_kv_heads, head_dim)`` with defaults filled in
    (``num_kv_heads = num_heads``, ``head_dim = hidden_size // num_heads``)."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = hidden_size // num_heads if head_dim is None else head_dim
    if min(hidden_size, num_heads, num_kv_heads, head_dim) < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"need positive sizes and num_heads % num_kv_heads == 0; got hidden_size="
            f"{hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}, "
            f"head_dim={head_dim}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if rope and head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, got {head_dim}")
    return num_kv_heads, head_dim


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half convention, as in Llama and Doge).

    Args:
      x: ``[B, L, N, D]``, ``D`` even.
      positions: int ``[B, L]`` or ``[L]``, the position of each token.
      theta: the base of the rotation frequencies ``theta ** (-2i / D)``.

    Returns:
      ``x`` rotated, in its own dtype (computed in float32).
    """
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * inv_freq  # [B|, L, D/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dynamic_bias(dt: jax.Array, a: jax.Array) -> jax.Array:
    """The per-key score ``A · softplus(dt)``, float32.

    Args:
      dt: ``[B, L, Hk]``, ``dt_proj`` of the values of each position.
      a: ``[Hk]``, the trainable per-head gain ``A``.

    Returns:
      ``bias [B, Hk, 1, L]``: one score per key and kv head, broadcast over queries.
    """
    score = a.astype(jnp.float32) * jax.nn.softplus(dt.astype(jnp.float32))
    return jnp.swapaxes(score, -1, -2)[..., None, :]


def project(x: jax.Array, positions: jax.Array | None, *, q_proj: Projection,
            k_proj: Projection, v_proj: Projection, dt_proj: Projection, a: jax.Array,
            num_heads: int, num_kv_heads: int, head_dim: int,
            rope_theta: float | None, offset: jax.Array | int = 0,
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Queries, keys, values and the dynamic bias of the tokens ``x``.

    Args:
      x: ``[B, L, hidden]``.
      positions: int ``[B, L]`` or ``[L]`` for RoPE; None: ``offset + arange(L)``.
      q_proj, k_proj, v_proj: ``hidden -> H·D``, ``hidden -> Hk·D``, ``hidden -> Hk·D``.
      dt_proj: ``Hk·D -> Hk``, applied to the values.
      a: ``[Hk]``.
      rope_theta: RoPE base, or None for no RoPE.
      offset: the position of the first token when ``positions`` is None.

    Returns:
      ``q [B, L, H, D]``, ``k, v [B, L, Hk, D]`` and ``bias [B, Hk, 1, L]`` (float32).
    """
    batch, length, _ = x.shape
    q = q_proj(x).reshape(batch, length, num_heads, head_dim)
    k = k_proj(x).reshape(batch, length, num_kv_heads, head_dim)
    v_flat = v_proj(x)
    v = v_flat.reshape(batch, length, num_kv_heads, head_dim)
    bias = dynamic_bias(dt_proj(v_flat), a)
    if rope_theta is not None:
        if positions is None:
            positions = offset + jnp.arange(length, dtype=jnp.int32)
        q, k = apply_rope(q, positions, rope_theta), apply_rope(k, positions, rope_theta)
    return q, k, v, bias


def attend(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, window: int,
           implementation: str | None = None) -> jax.Array:
    """Causal dynamic-mask attention over a whole sequence.

    Args:
      q: ``[B, L, H, D]``; k, v: ``[B, L, Hk, D]``; bias: ``[B, Hk, 1, L]``.
      window: keys kept per query row; attention runs over each query block's compacted keys
        (:func:`jax_dmattn.dynamic.dynamic_attention`).
      implementation: passed to :func:`dynamic_attention`.

    Returns:
      ``[B, L, H·D]`` in q's dtype.
    """
    batch, length, heads, head_dim = q.shape
    out = dynamic_attention(q, k, v, bias, window, implementation=implementation)
    return out.reshape(batch, length, heads * head_dim)


def attend_cached(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, bias_cache: jax.Array,
                  end: jax.Array, window: int, implementation: str | None = None) -> jax.Array:
    """Dynamic-mask attention of ``Lq`` new tokens over a KV cache whose slots ``[0, end)`` are
    filled (the new tokens being the last ``Lq`` of them).

    The new token ``i`` (at position ``end - Lq + i``) attends to the top-``window`` keys among
    ``0 .. end - Lq + i``: exactly the row of a full-sequence call. The mask is built by
    :func:`masks.topk_mask` on the scores rolled so that the filled prefix ends at the last slot
    (its bottom-right causality then matches), with the unfilled slots marked invalid, and rolled
    back; it hides the unfilled slots, so the kernel runs with the cache length as kv length.

    Args:
      q: ``[B, Lq, H, D]``.
      k_cache, v_cache: ``[B, S, Hk, D]``; bias_cache: ``[B, Hk, 1, S]``.
      end: int32 scalar, ``Lq <= end <= S``.
      window: keys kept per query row.
      implementation: passed to :func:`flash_dmattn`.

    Returns:
      ``[B, Lq, H·D]`` in q's dtype.
    """
    batch, length, heads, head_dim = q.shape
    slots = k_cache.shape[1]
    shift = slots - end
    scores = jnp.roll(jax.lax.stop_gradient(bias_cache), shift, axis=-1)
    filled = jnp.arange(slots) >= shift  # [S], in rolled coordinates
    mask = masks.topk_mask(scores, window, is_causal=True, valid=filled, seqlen_q=length)
    mask = jnp.roll(mask, -shift, axis=-1)
    out = flash_dmattn(q, k_cache, v_cache, mask, bias_cache, implementation=implementation)
    return out.reshape(batch, length, heads * head_dim)
