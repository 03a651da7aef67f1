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

Gated layers (``gated=True``): two more projections of the layer input give the gate of gated
attention, ``alpha = x Wa`` (``hidden -> H``, one value per token and query head) and
``delta = x Wd`` (``hidden -> Hk``, per token and kv head), so that the logits gain
``logsigmoid(alpha_i · delta_j)`` (``flash_dmattn``'s ``gate=``; upstream's gated layer also
projects one scalar per token and head). The compact-key path takes no gate, so gated calls give
the top-``window`` mask to ``flash_dmattn`` in its O(L) form (``masks.topk_key_ranges``, key
ranges: no ``[L, L]`` array) beside the gate.

Softmax-threshold skipping (``softmax_threshold=t``): ``flash_dmattn``'s ``softmax_threshold``
on the layer's attention (the top-``window`` mask as key ranges, as for a gated layer); such a
layer has no KV cache (a decoding call would see other positions of the rule's fixed grid).

Packed batches: with ``segment_ids [B, L]`` (one id per token; each maximal run of equal ids is
one document) every document is attended as if it were alone in its row: its queries see only
its own keys (``flash_dmattn``'s segment ids), each query keeps the top-``window`` keys of its
document's causal prefix (not of the whole row's), and RoPE positions restart at each document
by default. The compact-key path (:func:`jax_dmattn.dynamic.dynamic_attention`) lists one key
set per query block, which cannot follow document boundaries, so segmented calls build the
dense top-``window`` mask ``[B, Hk, L, L]`` instead and run the kernels on it (the work of a
causal call; the kernels skip the tiles whose rows and keys lie in different documents).
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


def check_segment_ids(segment_ids: jax.Array | None, batch: int, length: int,
                      name: str = "segment_ids") -> jax.Array | None:
    """Validates a layer's segment ids (trace time); returns them as int32 ``[batch, length]``.

    Args:
      segment_ids: integer ``[batch, length]`` or ``[1, length]`` (broadcast over the batch),
        or None.
      batch, length: the batch size and sequence length of the layer's input.
      name: the argument's name in error messages.

    Returns:
      int32 ``[batch, length]``, or None when `segment_ids` is None.
    """
    if segment_ids is None:
        return None
    ids = jnp.asarray(segment_ids)
    if ids.ndim != 2 or ids.shape[0] not in (1, batch) or ids.shape[1] != length:
        raise ValueError(
            f"{name} must be an integer array of shape [{batch}, {length}] (or [1, {length}]): "
            f"one id per token of the input [B={batch}, L={length}, hidden]; got shape "
            f"{ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array of shape [{batch}, {length}], got "
                        f"dtype {ids.dtype.name}")
    return jnp.broadcast_to(ids.astype(jnp.int32), (batch, length))


def _document_starts(segment_ids: jax.Array) -> jax.Array:
    """bool ``[..., L]``: True where a token starts a document (a run of equal ids)."""
    first = jnp.ones((*segment_ids.shape[:-1], 1), jnp.bool_)
    return jnp.concatenate([first, segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions that restart at every document of a packed row.

    Args:
      segment_ids: integer ``[..., L]``; each maximal run of equal ids is one document.

    Returns:
      int32 ``[..., L]``: each token's index within its run (0 at every run's first token).
    """
    index = jnp.arange(segment_ids.shape[-1], dtype=jnp.int32)
    starts = jnp.where(_document_starts(segment_ids), index, 0)
    return index - jax.lax.cummax(starts, axis=starts.ndim - 1)


def document_scores(scores: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Per-key scores re-expressed so that the causal top-``window`` of any query row is taken
    within the row's own document first.

    The rows of a document see (causally) its own keys and those of the documents before it.
    Ranking every key of a later document above every key of an earlier one, and keys of one
    document by their score (ties to the lower index, as :func:`masks.topk_mask` breaks them),
    makes the top-``window`` of a row the top-``window`` of its document's prefix, padded with
    earlier documents' keys only where that prefix has fewer than ``window`` keys: those are
    then hidden by the segment ids. The result is a strict rank (no ties), exact in float32.

    Args:
      scores: per-key scores ``[B, Hk, 1, L]`` (no gradient flows through this).
      segment_ids: int ``[B, L]``.

    Returns:
      float32 ``[B, Hk, 1, L]``, larger = kept first, every value distinct.
    """
    length = scores.shape[-1]
    s = scores.astype(jnp.float32)
    # masks.topk_mask treats NaN as -inf and -0.0 as +0.0; so must the order here.
    s = jnp.where(jnp.isnan(s), -jnp.inf, s)
    s = jnp.where(s == 0, 0.0, s)
    runs = jnp.cumsum(_document_starts(segment_ids), axis=-1, dtype=jnp.int32)  # [B, L]
    runs = jnp.broadcast_to(runs[:, None, None, :], s.shape)
    iota = jax.lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1)
    # Ascending sort on (-run, -score), stable: the best key first, equal scores by index.
    _, _, order = jax.lax.sort((-runs, -s, iota), dimension=s.ndim - 1, num_keys=2,
                               is_stable=True)
    rank = jnp.put_along_axis(jnp.zeros_like(order), order, iota, axis=-1, inplace=False)
    return (length - rank).astype(jnp.float32)


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
            segment_ids: jax.Array | None = None,
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Queries, keys, values and the dynamic bias of the tokens ``x``.

    Args:
      x: ``[B, L, hidden]``.
      positions: int ``[B, L]`` or ``[L]`` for RoPE; None: ``offset + arange(L)``, or with
        `segment_ids` each token's index within its document (:func:`segment_positions`).
      q_proj, k_proj, v_proj: ``hidden -> H·D``, ``hidden -> Hk·D``, ``hidden -> Hk·D``.
      dt_proj: ``Hk·D -> Hk``, applied to the values.
      a: ``[Hk]``.
      rope_theta: RoPE base, or None for no RoPE.
      offset: the position of the first token when ``positions`` and `segment_ids` are None.
      segment_ids: optional int32 ``[B, L]``, only for the default positions.

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
        if positions is None and segment_ids is not None:
            positions = segment_positions(segment_ids)
        elif positions is None:
            positions = offset + jnp.arange(length, dtype=jnp.int32)
        q, k = apply_rope(q, positions, rope_theta), apply_rope(k, positions, rope_theta)
    return q, k, v, bias


def gate_values(x: jax.Array, a_proj: Projection,
                d_proj: Projection) -> tuple[jax.Array, jax.Array]:
    """The gate of a gated layer: ``alpha = a_proj(x)`` ``[B, L, H]`` and ``delta = d_proj(x)``
    ``[B, L, Hk]`` of the tokens ``x [B, L, hidden]``."""
    return a_proj(x), d_proj(x)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, window: int,
           implementation: str | None = None,
           segment_ids: jax.Array | None = None,
           gate: tuple[jax.Array, jax.Array] | None = None,
           softmax_threshold: float | None = None) -> jax.Array:
    """Causal dynamic-mask attention over a whole sequence.

    Args:
      q: ``[B, L, H, D]``; k, v: ``[B, L, Hk, D]``; bias: ``[B, Hk, 1, L]``.
      window: keys kept per query row; without segment ids attention runs over each query
        block's compacted keys (:func:`jax_dmattn.dynamic.dynamic_attention`).
      implementation: passed to :func:`dynamic_attention` / :func:`flash_dmattn`.
      segment_ids: optional int32 ``[B, L]`` (see :func:`check_segment_ids`): each document
        attends only to itself, with the top-``window`` keys of its own causal prefix; a dense
        ``[B, Hk, L, L]`` mask (see the module docstring).
      gate: optional ``(alpha [B, L, H], delta [B, L, Hk])`` of a gated layer (see the module
        docstring): without segment ids the mask goes to ``flash_dmattn`` as key ranges.
      softmax_threshold: ``flash_dmattn``'s (None: exact); likewise with key ranges.

    Returns:
      ``[B, L, H·D]`` in q's dtype.
    """
    batch, length, heads, head_dim = q.shape
    if segment_ids is None and gate is None and softmax_threshold is None:
        out = dynamic_attention(q, k, v, bias, window, implementation=implementation)
    elif segment_ids is None:
        mask = None
        if window < length:
            mask = masks.KeyRanges(*masks.topk_key_ranges(jax.lax.stop_gradient(bias), window))
        out = flash_dmattn(q, k, v, mask, bias, is_causal=True, gate=gate,
                           softmax_threshold=softmax_threshold, implementation=implementation)
    else:
        mask = None  # every visible key is kept: the segment ids and causality suffice
        if window < length:
            scores = document_scores(jax.lax.stop_gradient(bias), segment_ids)
            mask = masks.topk_mask(scores, window, is_causal=True, seqlen_q=length)
        out = flash_dmattn(q, k, v, mask, bias, q_segment_ids=segment_ids,
                           kv_segment_ids=segment_ids, is_causal=True, gate=gate,
                           softmax_threshold=softmax_threshold, implementation=implementation)
    return out.reshape(batch, length, heads * head_dim)


def attend_cached(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, bias_cache: jax.Array,
                  end: jax.Array, window: int, implementation: str | None = None,
                  q_segment_ids: jax.Array | None = None,
                  kv_segment_ids: jax.Array | None = None) -> jax.Array:
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
      q_segment_ids, kv_segment_ids: optional int32 ``[B, Lq]`` (the new tokens') and ``[B, S]``
        (the cache's, the new tokens' included), both or neither: a new token keeps the
        top-``window`` keys of its own document's prefix and sees no other document.

    Returns:
      ``[B, Lq, H·D]`` in q's dtype.
    """
    batch, length, heads, head_dim = q.shape
    slots = k_cache.shape[1]
    shift = slots - end
    scores = jnp.roll(jax.lax.stop_gradient(bias_cache), shift, axis=-1)
    if kv_segment_ids is not None:
        scores = document_scores(scores, jnp.roll(kv_segment_ids, shift, axis=-1))
    filled = jnp.arange(slots) >= shift  # [S], in rolled coordinates
    mask = masks.topk_mask(scores, window, is_causal=True, valid=filled, seqlen_q=length)
    mask = jnp.roll(mask, -shift, axis=-1)
    out = flash_dmattn(q, k_cache, v_cache, mask, bias_cache, q_segment_ids=q_segment_ids,
                       kv_segment_ids=kv_segment_ids, implementation=implementation)
    return out.reshape(batch, length, heads * head_dim)
