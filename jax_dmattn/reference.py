"""Pure-JAX attention with the exact semantics of the kernels: the ``xla`` implementation and the
oracle of every test.

Shapes (leading batch dims ``*B`` may be several; other operands broadcast over them):
  q ``[*B, Lq, H, D]``, k and v ``[*B|1, Lk, Hk, D]``, mask and bias ``[*B|1, H|Hk|1, Lq|1, Lk|1]``,
  q_lens and kv_lens ``[*B|1]`` int32, q_segments ``[*B|1, Lq]`` and kv_segments ``[*B|1, Lk]``
  int32 (query ``i`` sees key ``j`` only where their ids are equal), key_start and key_end
  ``[*B|1, H|Hk|1, 1, Lk]`` int32 (query ``i`` sees key ``j`` only where
  ``key_start[j] <= i < key_end[j]``; expanded here to a mask, which the kernels never build),
  row_start and row_end ``[*B|1, H|Hk|1, Lq, 1]`` int32 (query ``i`` sees key ``j`` only where
  ``row_start[i] <= j < row_end[i]``; likewise expanded), block_indices
  ``[*B|1, H|Hk|1, ceil(Lq / block_q), K]`` int32 (query ``i`` sees key ``j`` only where
  ``j // block_k`` is among ``block_indices[i // block_q, :]``, the block sizes in params;
  expanded likewise). ``params.window_sizes`` (per-kv-head windows with sinks) is expanded to
  a ``[Hk, Lq, Lk]`` mask likewise. The gate, alpha ``[*B, Lq, H]`` and delta ``[*B, Lk, Hk]``
  (floating), adds ``logsigmoid(alpha[i, h] * delta[j, h // (H // Hk)])`` to the logits (with
  the bias, before the softcap); ``params.gate_threshold`` hides the pairs of the blocks of the
  fixed ``GATE_BLOCK_Q × GATE_BLOCK_K`` grid it drops (:func:`gate_kept_blocks`), as the kernels
  skip them. ``params.softmax_threshold`` hides the pairs of the blocks of the same grid that
  softmax-threshold skipping drops (:func:`softmax_skip_blocks`), or those of a given drop map.
  Returns
  out ``[*B, Lq, H, D]`` in q's dtype and lse ``[*B, H, Lq]`` (float32, or float64 for float64
  inputs).

Logits and softmax are computed in float32 (float64 for float64 inputs); probabilities are rounded
to the input dtype before the product with V, as in the kernels and in ``jax.nn``'s own XLA path.
A row with no visible key gives zeros and lse = -inf, and its gradients are zero, never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dmattn.params import (
    GATE_BLOCK_K,
    GATE_BLOCK_Q,
    SKIP_BLOCK_K,
    SKIP_BLOCK_Q,
    AttentionParams,
    gate_cut,
)


def _compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _split_heads(x: jax.Array, num_kv_heads: int, group: int) -> jax.Array:
    """``[*B, Hx, Lq, Lk]`` with Hx in {1, Hk, H} -> ``[*B, Hk|1, group|1, Lq, Lk]``."""
    heads = x.shape[-3]
    if heads == num_kv_heads * group and group > 1:
        return x.reshape(*x.shape[:-3], num_kv_heads, group, *x.shape[-2:])
    return jnp.expand_dims(x, -3)


def visibility(
    params: AttentionParams,
    seqlen_q: int,
    seqlen_k: int,
    q_lens: jax.Array | None = None,
    kv_lens: jax.Array | None = None,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
) -> jax.Array:
    """Bool ``[*B|1, Lq, Lk]`` (``[Lq, Lk]`` without lengths and segments): the diagonal /
    window / length / segment rule."""
    i = jnp.arange(seqlen_q)[:, None]
    j = jnp.arange(seqlen_k)[None, :]
    diagonal = i + params.diagonal_offset
    visible = jnp.ones((seqlen_q, seqlen_k), bool)
    if params.window_left >= 0:
        visible &= j >= diagonal - params.window_left
    if params.window_right >= 0:
        visible &= j <= diagonal + params.window_right
    if q_lens is not None:
        visible = visible & (i < q_lens[..., None, None]) & (j < kv_lens[..., None, None])
    if q_segments is not None:
        visible = visible & (q_segments[..., :, None] == kv_segments[..., None, :])
    return visible


def head_windows(params: AttentionParams, seqlen_q: int, seqlen_k: int) -> jax.Array:
    """Bool ``[Hk, Lq, Lk]``: the per-kv-head window rule of ``params.window_sizes`` (rows
    ``(sink, left, right)``): key ``j < sink`` or within ``left`` / ``right`` of the aligned
    diagonal (< 0: unbounded). The other rules are and-ed on by the caller."""
    # Bounds past Lq + Lk act like Lq + Lk: clipped, they fit int32 whatever the x64 mode.
    table = np.clip(np.asarray(params.window_sizes, np.int64), -1, seqlen_q + seqlen_k)
    table = jnp.asarray(table.astype(np.int32))[:, :, None, None]  # [Hk, 3, 1, 1]
    sink, left, right = table[:, 0], table[:, 1], table[:, 2]
    i = jnp.arange(seqlen_q)[:, None]
    j = jnp.arange(seqlen_k)[None, :]
    diagonal = i + params.diagonal_offset
    band = (((left < 0) | (j >= diagonal - left)) & ((right < 0) | (j <= diagonal + right)))
    return (j < sink) | band


def _listed_blocks(block_indices: jax.Array, block_q: int, block_k: int, seqlen_q: int,
                   seqlen_k: int) -> jax.Array:
    """Bool ``[..., Lq, Lk]``: whether key ``j``'s block is listed for query ``i``'s block in
    ``block_indices [..., nQB, K]`` (entries naming no key block list nothing)."""
    key_blocks = jnp.arange(-(-seqlen_k // block_k))
    listed = jnp.any(block_indices[..., None] == key_blocks, axis=-2)  # [..., nQB, nKB]
    rows = jnp.take(listed, jnp.arange(seqlen_q) // block_q, axis=-2)
    return jnp.take(rows, jnp.arange(seqlen_k) // block_k, axis=-1)


def _block_min_max(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Min and max of ``x [..., L]`` over blocks of `block` from position 0 (the last one
    partial): ``[..., ceil(L / block)]`` each."""
    length = x.shape[-1]
    pad = -length % block
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], mode="edge")
    blocks = padded.reshape(*x.shape[:-1], -1, block)
    return blocks.min(-1), blocks.max(-1)


def gate_kept_blocks(params: AttentionParams, alpha: jax.Array, delta: jax.Array) -> jax.Array:
    """Bool ``[*B, Hk, G, ceil(Lq / GATE_BLOCK_Q), ceil(Lk / GATE_BLOCK_K)]``: the blocks of the
    gate threshold's grid that are kept, alpha ``[*B, Hk, G, Lq]`` and delta ``[*B, Hk, Lk]``. A
    block is dropped when ``max(alpha_i * delta_j)`` over its rows and keys (all of them below Lq
    and Lk), the largest of the four products of alpha's and delta's min and max there, is below
    ``gate_cut(params.gate_threshold)``: exactly when ``logsigmoid(alpha_i * delta_j) <
    gate_threshold`` at each of its pairs. With x64 the bound is computed in float64 whatever
    the inputs' dtype (the products of float32 values exact, as in the kernels, which use
    double), so the same blocks are dropped. Without x64 it is computed in float32 and compared
    with float32(gate_cut): rounding is monotone, so every block the kernels keep is kept, and a
    block they drop is kept too only where its float32 bound rounds up to float32(gate_cut)."""
    wide = jnp.promote_types(alpha.dtype, jax.dtypes.canonicalize_dtype(jnp.float64))
    alpha, delta = (jax.lax.stop_gradient(x).astype(wide) for x in (alpha, delta))
    a_lo, a_hi = _block_min_max(alpha, GATE_BLOCK_Q)  # [*B, Hk, G, nQB]
    d_lo, d_hi = _block_min_max(delta, GATE_BLOCK_K)  # [*B, Hk, nKB]
    a_lo, a_hi = a_lo[..., :, None], a_hi[..., :, None]
    d_lo, d_hi = d_lo[..., None, None, :], d_hi[..., None, None, :]
    bound = jnp.maximum(jnp.maximum(a_lo * d_lo, a_lo * d_hi),
                        jnp.maximum(a_hi * d_lo, a_hi * d_hi))
    # A NaN bound (a NaN alpha or delta in the block) keeps it: those pairs are not below.
    return ~(bound < gate_cut(params.gate_threshold))


def softmax_skip_blocks(threshold: float, s: jax.Array, visible: jax.Array,
                        counts: jax.Array) -> jax.Array:
    """Bool ``[..., ceil(Lq / SKIP_BLOCK_Q), ceil(Lk / SKIP_BLOCK_K)]``: the blocks that
    softmax-threshold skipping drops, for scores ``s [..., Lq, Lk]`` (the final logits),
    ``visible`` (bool, broadcastable to s) and ``counts [..., Lq]`` (``n_i``: the keys each row
    may see by position alone; broadcastable).

    For each block of rows, key blocks ``kb = 0, 1, ...`` in increasing order: block ``kb`` is
    dropped when it holds a visible pair (a score above -inf) and, for every row ``i`` of it,
    every visible ``s_ij`` there is below ``lse_i + log(threshold / n_i)``, ``lse_i`` the
    log-sum-exp of the row's visible scores in the blocks before ``kb`` that were kept (``-inf``
    before the first, so the first block holding a visible key of some row is kept). Computed
    in s's dtype."""
    s = jax.lax.stop_gradient(s)
    *lead, seqlen_q, seqlen_k = s.shape
    nqb, nkb = -(-seqlen_q // SKIP_BLOCK_Q), -(-seqlen_k // SKIP_BLOCK_K)
    scores = jnp.where(jnp.broadcast_to(visible, s.shape), s, -jnp.inf)
    scores = jnp.pad(scores, [(0, 0)] * len(lead) + [(0, nqb * SKIP_BLOCK_Q - seqlen_q),
                                                     (0, nkb * SKIP_BLOCK_K - seqlen_k)],
                     constant_values=-jnp.inf)
    blocks = scores.reshape(*lead, nqb, SKIP_BLOCK_Q, nkb, SKIP_BLOCK_K)
    blocks = jnp.moveaxis(blocks, -2, 0)  # [nKB, ..., nQB, BQ, BK]
    counts = jnp.broadcast_to(counts, (*lead, seqlen_q)).astype(s.dtype)
    counts = jnp.pad(counts, [(0, 0)] * len(lead) + [(0, nqb * SKIP_BLOCK_Q - seqlen_q)])
    counts = counts.reshape(*lead, nqb, SKIP_BLOCK_Q)
    log_ratio = jnp.where(counts > 0, jnp.log(threshold / jnp.maximum(counts, 1)), 0)

    def step(carry, block):
        row_max, row_sum = carry  # [..., nQB, BQ]: the kept blocks so far
        block_max = block.max(-1)
        seen = block_max > -jnp.inf
        has_sum = row_sum > 0
        cut = jnp.where(has_sum, row_max + jnp.log(jnp.where(has_sum, row_sum, 1)) + log_ratio,
                        -jnp.inf)
        keep = (seen & (block_max >= cut)).any(-1)  # [..., nQB]
        dropped = seen.any(-1) & ~keep
        rows = keep[..., None] & seen
        new_max = jnp.where(rows, jnp.maximum(row_max, block_max), row_max)
        shift = jnp.where(new_max > -jnp.inf, new_max, 0)
        added = jnp.exp(block - shift[..., None]).sum(-1)
        new_sum = jnp.where(rows, row_sum * jnp.exp(row_max - shift) + added, row_sum)
        return (new_max, new_sum), dropped

    init = (jnp.full((*lead, nqb, SKIP_BLOCK_Q), -jnp.inf, s.dtype),
            jnp.zeros((*lead, nqb, SKIP_BLOCK_Q), s.dtype))
    _, dropped = jax.lax.scan(step, init, blocks)  # [nKB, ..., nQB]
    return jnp.moveaxis(dropped, 0, -1)


def attention(
    params: AttentionParams,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    q_lens: jax.Array | None = None,
    kv_lens: jax.Array | None = None,
    q_segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
    key_start: jax.Array | None = None,
    key_end: jax.Array | None = None,
    row_start: jax.Array | None = None,
    row_end: jax.Array | None = None,
    block_indices: jax.Array | None = None,
    alpha: jax.Array | None = None,
    delta: jax.Array | None = None,
    *,
    drop_map: jax.Array | None = None,
    return_drop_map: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Attention output ``[*B, Lq, H, D]`` and its log-sum-exp ``[*B, H, Lq]``; with
    ``return_drop_map`` (and ``params.softmax_threshold``) also the drop map, uint8 ``[*B, H,
    ceil(Lq / SKIP_BLOCK_Q), ceil(Lk / SKIP_BLOCK_K)]``. A given ``drop_map`` (the forward's)
    is applied in place of the rule (the backward of the kernels' reference fallback)."""
    *_, seqlen_q, num_heads, _ = q.shape
    seqlen_k, num_kv_heads = k.shape[-3], k.shape[-2]
    group = num_heads // num_kv_heads
    dtype = _compute_dtype(q.dtype)

    # [*B, Hk, G, Lq, D] and [*B, Hk, Lk, D]
    qg = jnp.moveaxis(q.reshape(*q.shape[:-2], num_kv_heads, group, q.shape[-1]), -4, -2)
    kt = jnp.moveaxis(k, -3, -2)
    vt = jnp.moveaxis(v, -3, -2)
    s = jnp.einsum("...hgqd,...hkd->...hgqk", qg, kt, preferred_element_type=dtype)
    s = s.astype(dtype) * params.scale
    if bias is not None:
        s = s + _split_heads(bias.astype(dtype), num_kv_heads, group)
    if alpha is not None:
        # [*B, Lq, H] -> [*B, Hk, G, Lq]; [*B, Lk, Hk] -> [*B, Hk, Lk]
        a = jnp.moveaxis(alpha.astype(dtype), -1, -2)
        a = a.reshape(*a.shape[:-2], num_kv_heads, group, seqlen_q)
        d = jnp.moveaxis(delta.astype(dtype), -1, -2)
        s = s + jax.nn.log_sigmoid(a[..., :, None] * d[..., None, None, :])
    if params.softcap > 0:
        s = params.softcap * jnp.tanh(s / params.softcap)

    visible = visibility(params, seqlen_q, seqlen_k, q_lens, kv_lens, q_segments,
                         kv_segments)
    visible = jnp.expand_dims(visible, (-4, -3))  # [*B|1, 1, 1, Lq, Lk]
    if params.window_sizes is not None:
        visible = visible & head_windows(params, seqlen_q, seqlen_k)[:, None]
    if mask is not None:
        visible = visible & _split_heads(mask, num_kv_heads, group)
    if key_start is not None:
        rows = jnp.arange(seqlen_q)[:, None]
        in_range = (key_start <= rows) & (rows < key_end)  # [*B|1, Hr, Lq, Lk]
        visible = visible & _split_heads(in_range, num_kv_heads, group)
    if row_start is not None:
        cols = jnp.arange(seqlen_k)
        in_range = (row_start <= cols) & (cols < row_end)  # [*B|1, Hr, Lq, Lk]
        visible = visible & _split_heads(in_range, num_kv_heads, group)
    if block_indices is not None:
        listed = _listed_blocks(block_indices, params.block_q, params.block_k, seqlen_q,
                                seqlen_k)  # [*B|1, Hr, Lq, Lk]
        visible = visible & _split_heads(listed, num_kv_heads, group)

    if alpha is not None and params.gate_threshold is not None:
        kept = gate_kept_blocks(params, a, d)  # [*B, Hk, G, nQB, nKB]
        kept = jnp.repeat(jnp.repeat(kept, GATE_BLOCK_Q, axis=-2)[..., :seqlen_q, :],
                          GATE_BLOCK_K, axis=-1)[..., :seqlen_k]
        visible = visible & kept

    dropped = None
    if drop_map is not None:
        dropped = drop_map.astype(bool)
        dropped = dropped.reshape(*dropped.shape[:-3], num_kv_heads, group, *dropped.shape[-2:])
    elif params.softmax_threshold is not None:
        positional = jnp.expand_dims(visibility(params, seqlen_q, seqlen_k, q_lens, kv_lens),
                                     (-4, -3))
        if params.window_sizes is not None:
            positional = positional & head_windows(params, seqlen_q, seqlen_k)[:, None]
        counts = positional.sum(-1)  # n_i: [*B|1, Hk|1, 1, Lq]
        dropped = softmax_skip_blocks(params.softmax_threshold, s, visible, counts)
    if dropped is not None:
        hidden = jnp.repeat(jnp.repeat(dropped, SKIP_BLOCK_Q, axis=-2)[..., :seqlen_q, :],
                            SKIP_BLOCK_K, axis=-1)[..., :seqlen_k]
        visible = visible & ~hidden

    row_max = jnp.max(jnp.where(visible, s, -jnp.inf), axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    # exp(-inf) = 0 with a zero derivative: masked logits never feed NaN into gradients.
    p = jnp.exp(jnp.where(visible, s - row_max, -jnp.inf))
    row_sum = jnp.sum(p, axis=-1, keepdims=True)
    has_keys = row_sum > 0
    safe_sum = jnp.where(has_keys, row_sum, 1)
    probs = (p / safe_sum).astype(v.dtype)
    out = jnp.einsum("...hgqk,...hkd->...hgqd", probs, vt, preferred_element_type=dtype)
    out = jnp.moveaxis(out, -2, -4).reshape(q.shape).astype(q.dtype)

    lse = jnp.where(has_keys, row_max + jnp.log(safe_sum), -jnp.inf)[..., 0]  # [*B, Hk, G, Lq]
    lse = lse.reshape(*lse.shape[:-3], num_heads, seqlen_q)
    lse = jnp.broadcast_to(lse, (*q.shape[:-3], num_heads, seqlen_q))
    if return_drop_map:
        if dropped is None:
            raise ValueError("return_drop_map needs params.softmax_threshold")
        dropped = jnp.broadcast_to(dropped, (*q.shape[:-3], *dropped.shape[-4:]))
        drops = dropped.reshape(*q.shape[:-3], num_heads, *dropped.shape[-2:])
        return out, lse.astype(dtype), drops.astype(jnp.uint8)
    return out, lse.astype(dtype)
