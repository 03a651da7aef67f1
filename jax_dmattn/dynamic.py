"""Dynamic-mask attention over compacted keys: the paper's workload without an ``[Lq, Lk]`` pass.

The dynamic mask (:func:`masks.topk_mask`: each query row keeps the ``window`` keys of largest
per-key score) keeps every key over one contiguous run of rows, so a block of ``Bq`` consecutive
query rows needs at most ``U = window + Bq - 1`` distinct keys (:func:`masks.topk_block_keys`).
:func:`dynamic_attention` gathers, per query block, those keys, their values and bias into a
compact key axis and runs :func:`flash_dmattn` on the ``B · ceil(Lq / Bq)`` small problems with
the exact mask rebuilt from the key ranges. The result is that of ``flash_dmattn`` with the
dynamic mask, for ``Lq · U`` (query, key) pairs instead of the ``Lq · Lk / 2`` a causal kernel
visits (the dynamic mask hides no whole tile: every tile holds a few kept keys). Gradients flow
back through the gathers (:func:`ops.sum_listed_keys` sums dk, dv and dbias onto their keys in
float32); the keys' selection itself has no gradient, as with a precomputed mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dmattn import masks, validation
from jax_dmattn._primitives import ops
from jax_dmattn.attention import flash_dmattn
from jax_dmattn.validation import Dims


def dynamic_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array,
    window: int,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    query_block: int | None = None,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``flash_dmattn(q, k, v, topk_mask(bias, window), bias)``, computed over compacted keys.

    Args:
      query: ``[B, Lq, H, D]``; key, value: ``[B, Lk, Hk, D]`` (as :func:`flash_dmattn`).
      bias: per-key bias ``[B|1, Hk|1, 1, Lk]``, floating: added to the logits (differentiable)
        and, through ``stop_gradient``, the scores that choose each row's keys.
      window: static int ``>= 1``, keys kept per query row (every visible key when fewer).
      is_causal: bottom-right aligned causality, as in :func:`flash_dmattn`.
      scale, softcap, deterministic, return_lse, implementation: as in :func:`flash_dmattn`.
      query_block: static int, query rows sharing one compact key list (default
        :func:`default_query_block`); causal only. Larger blocks gather less but compute more
        (``window + query_block - 1`` keys per row).

    Returns:
      ``out [B, Lq, H, D]`` in query's dtype, and ``lse [B, H, Lq]`` when asked: those of
      ``flash_dmattn(query, key, value, masks.topk_mask(stop_gradient(bias), window,
      is_causal=is_causal, seqlen_q=Lq), bias, is_causal=is_causal)``, gradients included.
    """
    validation.check_implementation(implementation)
    q, k, v = validation.check_qkv(query, key, value, implementation)
    dims = validation.dims_of(q, k)
    bias = _check_bias(bias, dims)
    window = masks._check_int(window, "window", 1)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
    block = _query_block(query_block, window, dims.seqlen_q, is_causal)
    options = dict(scale=scale, softcap=softcap, deterministic=deterministic,
                   implementation=implementation)
    listed = min(window + block - 1 if is_causal else window, dims.seqlen_k)
    compact = -(-listed // _KEY_ALIGN) * _KEY_ALIGN
    if compact >= dims.seqlen_k:  # (about) every key is needed somewhere: nothing to compact
        mask = None
        if window < dims.seqlen_k:
            mask = masks.topk_mask(jax.lax.stop_gradient(bias), window, is_causal=is_causal,
                                   seqlen_q=dims.seqlen_q)
        return flash_dmattn(q, k, v, mask, bias, is_causal=is_causal, return_lse=return_lse,
                            **options)

    scores = jax.lax.stop_gradient(bias[:, :, 0, :])
    first, end = masks.key_ranges(scores, window=window, is_causal=is_causal,
                                  seqlen_q=dims.seqlen_q)  # [B|1, Hk|1, Lk]
    keys, first_row, end_row, slots = masks.list_block_keys_and_slots(
        first, end, block=block, size=listed, seqlen_q=dims.seqlen_q)  # [B|1, Hk|1, nb, listed]
    pad = [(0, 0)] * 3 + [(0, compact - listed)]  # slots that no row keeps
    keys = jnp.pad(keys, pad, mode="edge")  # still sorted
    first_row, end_row = (jnp.pad(x, pad, constant_values=dims.seqlen_q)
                          for x in (first_row, end_row))
    num_blocks = keys.shape[2]
    # The blocks that list each key: those its rows [first, end) overlap.
    start = first // block
    spans = jnp.stack([start, jnp.where(first < end, (end - 1) // block + 1, start)], axis=2)
    mask = masks.block_range_mask(first_row, end_row, block)  # [B|1, Hk|1, nb, Bq, U]
    listing = (keys, slots, spans)
    kv_listing = tuple(jnp.broadcast_to(x, (dims.batch, *x.shape[1:])) for x in listing)
    out, lse = flash_dmattn(
        _blocks_of_queries(q, block, num_blocks), _take_listed(k, *kv_listing),
        _take_listed(v, *kv_listing), _per_block(mask, dims.batch),
        _per_block(_take_listed_bias(bias, *listing), dims.batch),
        return_lse=True, **options)
    out = out.reshape(dims.batch, num_blocks * block, dims.heads, dims.head_dim)
    out = out[:, :dims.seqlen_q]
    if not return_lse:
        return out
    lse = lse.reshape(dims.batch, num_blocks, dims.heads, block).transpose(0, 2, 1, 3)
    return out, lse.reshape(dims.batch, dims.heads, num_blocks * block)[..., :dims.seqlen_q]


# The compact key axis is padded to a multiple of this: whole key tiles, and mask rows aligned for
# the kernels' 16-byte loads.
_KEY_ALIGN = 64


def _check_bias(bias, dims: Dims) -> jax.Array:
    b = validation.as_array(bias, "bias")
    if not jnp.issubdtype(b.dtype, jnp.floating):
        raise TypeError(f"bias must be a floating array, got dtype {b.dtype.name}")
    ok = (b.ndim == 4 and b.shape[0] in (1, dims.batch) and b.shape[1] in (1, dims.kv_heads)
          and b.shape[2] == 1 and b.shape[3] == dims.seqlen_k)
    if not ok:
        raise ValueError(f"bias must be a per-key bias [{dims.batch}|1, {dims.kv_heads}|1, 1, "
                         f"{dims.seqlen_k}], got shape {b.shape}")
    return b


def default_query_block(window: int) -> int:
    """Query rows per compact key list by default: a multiple of 64 near ``window / 2``, at most
    512. Larger blocks mean fewer, longer small problems (the kernels' loops over a block's keys
    and rows get longer, the gathered copies and their gradient sums fewer) but more keys per row
    (``window + block - 1``); on the H200, 512 rows for window 1024 were never far from the
    best of 256, 512 and 1024 (benchmarks/results/logs/dynamic_blocks.md)."""
    return min(512, 64 * max(1, round(window / 128)))


def _query_block(query_block: int | None, window: int, seqlen_q: int, is_causal: bool) -> int:
    if not is_causal:
        return seqlen_q  # every row keeps the same keys: one block
    if query_block is None:
        query_block = default_query_block(window)
    return min(masks._check_int(query_block, "query_block", 1), seqlen_q)


def _blocks_of_queries(q: jax.Array, block: int, num_blocks: int) -> jax.Array:
    """``[B, Lq, H, D]`` → ``[B · nb, Bq, H, D]`` (zero rows pad the last block when partial)."""
    batch, seqlen_q, heads, head_dim = q.shape
    q = jnp.pad(q, ((0, 0), (0, num_blocks * block - seqlen_q), (0, 0), (0, 0)))
    return q.reshape(batch * num_blocks, block, heads, head_dim)


@jax.custom_vjp
def _take_listed(x: jax.Array, keys: jax.Array, slots: jax.Array, spans: jax.Array) -> jax.Array:
    """``x [B, Lk, C, D]``, keys ``[B, C|1, nb, U]`` -> ``[B · nb, U, C, D]``: block n's keys.

    slots ``[B, C|1, nb, Lk]`` (each key's slot in each block that lists it) and spans
    ``[B, C|1, 2, Lk]`` (those blocks) are for the gradient, which :func:`ops.sum_listed_keys`
    sums back onto the keys in float32 (half precision would round at each of a key's blocks;
    XLA's float32 scatter-add took twice as long on the H200)."""
    batch, _, channels, dim = x.shape
    _, key_channels, num_blocks, size = keys.shape
    index = keys.transpose(0, 2, 3, 1).reshape(batch, num_blocks * size, key_channels, 1)
    taken = jnp.take_along_axis(x, index, axis=1, mode="promise_in_bounds")
    return taken.reshape(batch * num_blocks, size, channels, dim)


def _take_listed_fwd(x, keys, slots, spans):
    return _take_listed(x, keys, slots, spans), (slots, spans)


def _take_listed_bwd(residuals, grad):
    slots, spans = residuals
    batch, _, num_blocks, _ = slots.shape
    grad = grad.reshape(batch, num_blocks, *grad.shape[1:])
    return ops.sum_listed_keys(grad, slots, spans), None, None, None


_take_listed.defvjp(_take_listed_fwd, _take_listed_bwd)


def _take_listed_bias(bias: jax.Array, keys: jax.Array, slots: jax.Array,
                      spans: jax.Array) -> jax.Array:
    """``bias [B|1, Hk|1, 1, Lk]``, keys ``[B|1, Hk|1, nb, U]`` -> ``[B|1, Hk|1, nb, 1, U]``."""
    batch, key_heads, _, seqlen_k = bias.shape
    per_key = bias.reshape(batch, key_heads, seqlen_k).transpose(0, 2, 1)[..., None]
    taken = _take_listed(per_key, keys, slots, spans)  # [B|1 · nb, U, Hk|1, 1]
    num_blocks, size = keys.shape[2:]
    taken = taken.reshape(batch, num_blocks, size, key_heads).transpose(0, 3, 1, 2)
    return taken[:, :, :, None, :]


def _per_block(x: jax.Array, batch: int) -> jax.Array:
    """``[B|1, h, nb, rows, U]`` → ``[B · nb, h, rows, U]``: one small problem per query block."""
    x = jnp.broadcast_to(x, (batch, *x.shape[1:])).transpose(0, 2, 1, 3, 4)
    return x.reshape(batch * x.shape[1], *x.shape[2:])
