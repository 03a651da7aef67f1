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
  skip them.
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

from jax_dmattn.params import GATE_BLOCK_K, GATE_BLOCK_Q, AttentionParams, gate_cut


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
    gate_threshold`` at each of its pairs. Computed in the inputs' dtype (float64 with x64: the
    products of float32 values exact, as in the kernels, which use double)."""
    alpha, delta = jax.lax.stop_gradient(alpha), jax.lax.stop_gradient(delta)
    a_lo, a_hi = _block_min_max(alpha, GATE_BLOCK_Q)  # [*B, Hk, G, nQB]
    d_lo, d_hi = _block_min_max(delta, GATE_BLOCK_K)  # [*B, Hk, nKB]
    a_lo, a_hi = a_lo[..., :, None], a_hi[..., :, None]
    d_lo, d_hi = d_lo[..., None, None, :], d_hi[..., None, None, :]
    bound = jnp.maximum(jnp.maximum(a_lo * d_lo, a_lo * d_hi),
                        jnp.maximum(a_hi * d_lo, a_hi * d_hi))
    return bound >= gate_cut(params.gate_threshold)


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
) -> tuple[jax.Array, jax.Array]:
    """Attention output ``[*B, Lq, H, D]`` and its log-sum-exp ``[*B, H, Lq]``."""
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
    return out, lse.astype(dtype)
