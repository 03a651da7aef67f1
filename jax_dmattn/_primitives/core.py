"""The differentiable attention operation behind both front ends.

``attention`` takes validated, normalised operands (see ``attention.py``) and returns
``(out, lse)``. The ``xla`` implementation is the pure-JAX reference, differentiated by JAX; every
other choice runs the kernels through a ``custom_vjp`` whose forward saves q, k, v, mask, bias,
the gate, out (in float32) and lse, and whose backward returns dq, dk, dv, dbias and the gate's
dalpha and ddelta (the mask, the lengths, the segment ids, the key and row ranges and the block
indices get none).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dmattn import reference
from jax_dmattn._primitives import batching, ops  # noqa: F401  (batching registers vmap rules)
from jax_dmattn.params import AttentionParams


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
    """``(out [B, Lq, H, D], lse [B, H, Lq] float32)`` for normalised operands (segment ids int32
    ``[B|1, Lq]`` and ``[B|1, Lk]`` of one batch pattern, or both None; key ranges int32
    ``[B|1, H|Hk|1, 1, Lk]`` of one shape, or both None; row ranges int32 ``[B|1, H|Hk|1, Lq,
    1]`` of one shape, or both None; block indices int32 ``[B|1, H|Hk|1, ceil(Lq / block_q),
    K]`` with ``params.block_q`` and ``params.block_k`` set, or None; the gate alpha ``[B, Lq,
    H]`` and delta ``[B, Lk, Hk]``, float32 (float64 for float64 q), or both None)."""
    if params.implementation == "xla":
        return reference.attention(params, q, k, v, mask, bias, q_lens, kv_lens, q_segments,
                                   kv_segments, key_start, key_end, row_start, row_end,
                                   block_indices, alpha, delta)
    return _attention(params, *vary_alike(q, k, v, mask, bias, q_lens, kv_lens, q_segments,
                                          kv_segments, key_start, key_end, row_start, row_end,
                                          block_indices, alpha, delta))


def _varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside shard_map (empty elsewhere)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_alike(*operands):
    """Inside shard_map, makes every operand vary over the same manual axes, as the kernels'
    outputs do; the transpose of that cast then sums an invariant input's gradient (a replicated
    bias's dbias) over those axes, as it must."""
    axes = frozenset().union(*(_varying_axes(x) for x in operands if x is not None))
    if not axes:
        return operands
    return tuple(x if x is None or _varying_axes(x) == axes
                 else jax.lax.pcast(x, tuple(sorted(axes - _varying_axes(x))), to="varying")
                 for x in operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(params, q, k, v, mask, bias, q_lens, kv_lens, q_segments, kv_segments, key_start,
               key_end, row_start, row_end, block_indices, alpha, delta):
    out, lse = ops.forward(params, q, k, v, mask, bias, q_lens, kv_lens, q_segments, kv_segments,
                           key_start, key_end, row_start, row_end, block_indices, alpha,
                           delta)[:2]
    return out, lse


def _attention_fwd(params, q, k, v, mask, bias, q_lens, kv_lens, q_segments, kv_segments,
                   key_start, key_end, row_start, row_end, block_indices, alpha, delta):
    # The residual out is float32 (see ops.Optionals); the caller gets q's dtype.
    # With a softmax threshold the forward also returns its drop map, a residual that the
    # backward reads (no gradient), so that both skip exactly the same blocks.
    out, lse, *drop_map = ops.forward(params, q, k, v, mask, bias, q_lens, kv_lens, q_segments,
                                      kv_segments, key_start, key_end, row_start, row_end,
                                      block_indices, alpha, delta, float32_out=True)
    drop_map = drop_map[0] if drop_map else None
    residuals = (q, k, v, mask, bias, q_lens, kv_lens, q_segments, kv_segments, key_start,
                 key_end, row_start, row_end, block_indices, alpha, delta, drop_map, out, lse)
    return (out.astype(q.dtype), lse), residuals


def _attention_bwd(params, residuals, cotangents):
    (q, k, v, mask, bias, q_lens, kv_lens, q_segments, kv_segments, key_start, key_end, row_start,
     row_end, block_indices, alpha, delta, drop_map, out, lse) = residuals
    dout, dlse = cotangents
    # the lengths, segment ids, key and row ranges and block indices: integer inputs
    no_grads = (None,) * 9
    if bias is not None and _bias_shifts_rows(params, bias):
        dq, dk, dv, _, dalpha, ddelta = ops.backward(
            params, q, k, v, out, dout, _unshifted_lse(lse, bias), dlse, mask, None, q_lens,
            kv_lens, q_segments, kv_segments, key_start, key_end, row_start, row_end,
            block_indices, alpha, delta, drop_map)
        return (dq, dk, dv, None, _row_shift_gradient(lse, dlse, bias), *no_grads, dalpha,
                ddelta)
    dq, dk, dv, dbias, dalpha, ddelta = ops.backward(
        params, q, k, v, out, dout, lse, dlse, mask, bias, q_lens, kv_lens, q_segments,
        kv_segments, key_start, key_end, row_start, row_end, block_indices, alpha, delta,
        drop_map)
    return dq, dk, dv, None, dbias, *no_grads, dalpha, ddelta


# A bias constant over keys ([.., Lq|1, 1]) adds one value b_i to every logit of row i: without a
# softcap the softmax ignores it and lse_i moves by b_i, so d loss / d b_i = dlse_i exactly (rows
# with a visible key). The kernels' sum over keys of dS_ij = P_ij (dP_ij - D_i + dlse_i) gives the
# same value in exact arithmetic, but in half precision its sum over j of P_ij dP_ij - D_i cancels
# to the rounding error of the stored output (D_i = dO_i . O_i), which dwarfs the true dlse_i. So
# the backward runs without the bias (P recomputed from lse - b_i) and dbias comes from dlse.


def _bias_shifts_rows(params: AttentionParams, bias: jax.Array) -> bool:
    return bias.shape[-1] == 1 and params.softcap == 0.0


def _heads_to_bias(x: jax.Array, bias_heads: int) -> jax.Array:
    """Sums ``x [B, H, Lq]`` over the query heads that share one head of the bias."""
    batch, heads, seqlen_q = x.shape
    return x.reshape(batch, bias_heads, heads // bias_heads, seqlen_q).sum(2)


def _bias_rows(bias: jax.Array, lse: jax.Array) -> jax.Array:
    """The row shifts ``b [B, H, Lq]`` (float32) of a bias ``[B|1, H|Hk|1, Lq|1, 1]``."""
    rows = bias[..., 0].astype(jnp.float32)
    rows = jnp.repeat(rows, lse.shape[1] // rows.shape[1], axis=1)
    return jnp.broadcast_to(rows, lse.shape)


def _unshifted_lse(lse: jax.Array, bias: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(lse), lse - _bias_rows(bias, lse), lse)


def _row_shift_gradient(lse: jax.Array, dlse: jax.Array, bias: jax.Array) -> jax.Array:
    """dbias of the bias's shape: dlse on rows with a visible key, summed over broadcast dims."""
    grad = _heads_to_bias(jnp.where(jnp.isfinite(lse), dlse, 0.0), bias.shape[1])
    reduced = tuple(d for d in (0, 2) if bias.shape[d] == 1 and grad.shape[d] > 1)
    grad = grad.sum(reduced, keepdims=True) if reduced else grad
    return grad[..., None].astype(bias.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)
