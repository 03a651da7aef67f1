"""Boolean masks for :func:`jax_dmattn.flash_dmattn`: the dynamic top-``window`` mask of the
paper, and causal, local-window, padding and block helpers.

Every function returns a bool array (True = attend) that broadcasts to flash_dmattn's mask
``[B|1, H|Hk|1, Lq|1, Lk|1]``; all are pure JAX, usable under ``jit`` (sizes and ``window`` are
static Python ints) and ``vmap``.

The dynamic mask (:func:`topk_mask`) keeps, for every query row, the ``window`` keys with the
largest score among the keys that row may see. With a per-key score (the paper's bias
``[B, Hk, 1, Lk]``, computed from the values) and causality, a key that leaves the top-``window``
of a row never comes back in a later row: later rows see a superset of keys, and newcomers can
only push it further down. So each key ``j`` is selected over one contiguous run of rows, and the
whole ``[Lq, Lk]`` mask is described by O(Lk) numbers (:func:`topk_key_ranges`): where each key
leaves (the position of its `window`-th better key). On GPUs a CUDA kernel finds them (one warp
per key scans the row up to that better key, ``csrc/cuda/dynamic.cu``); elsewhere a ranking sort and
prefix order-statistic queries on a radix-16 wavelet matrix do (O(Lk log Lk) work in a handful of
vectorised steps, no loop over the sequence). The only O(Lq·Lk) work is the final elementwise
comparison that writes the mask. The slow baseline, ``lax.top_k`` over the masked
``[Lq, Lk]`` scores, is kept for the general case (per-(query, key) scores, or a ``valid`` mask
whose key pattern differs between rows).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_dmattn import reference
from jax_dmattn._primitives import _ffi
from jax_dmattn.params import AttentionParams
from jax_dmattn.validation import as_array

__all__ = [
    "BlockIndices",
    "KeyRanges",
    "RowRanges",
    "block_mask",
    "causal_mask",
    "padding_mask",
    "topk_block_keys",
    "topk_key_ranges",
    "topk_mask",
    "window_mask",
]

# Bits of the rank resolved per wavelet-matrix level: 16-way levels, so 4 levels up to 65536 keys.
_RADIX_BITS = 4


class KeyRanges(NamedTuple):
    """A mask in O(Lk) form, for flash_dmattn's and dot_product_attention's ``mask``: key ``j``
    is visible to exactly the query rows ``start[..., j] <= i < end[..., j]`` (and-ed with every
    other rule), so ``start >= end`` hides the key from every row.

    ``start`` and ``end``: integer arrays ``[B|1, H|Hk|1, Lk]`` (``[B|1, H|Hk|1, 1, Lk]`` too, as
    :func:`topk_key_ranges` returns them for a bias ``[B, Hk, 1, Lk]``), values in ``[0, Lq]``;
    size-1 dims broadcast. A pytree (a NamedTuple), so it passes through ``jit`` and ``vmap``.
    It is given as ``mask`` alone or in a tuple of masks meaning their and, with at most one bool
    mask, one :class:`RowRanges` and one :class:`BlockIndices` (e.g. ``mask=(bool_mask,
    key_ranges)``). The CPU and CUDA kernels skip a tile when no key of it has a range meeting
    the tile's rows; it is equivalent to the bool mask
    ``(start[..., None, :] <= i) & (i < end[..., None, :])`` for ``i = arange(Lq)[:, None]``
    (:meth:`to_mask`).
    """

    start: jax.Array
    end: jax.Array

    def to_mask(self, seqlen_q: int) -> jax.Array:
        """The equivalent dense bool mask ``[..., Lq, Lk]`` (O(Lq·Lk); for tests and for code
        that takes only a bool mask: the kernels read the ranges themselves)."""
        start, end = (jnp.asarray(x) for x in (self.start, self.end))
        if start.ndim == 4:
            start, end = start[..., 0, :], end[..., 0, :]
        i = jnp.arange(_check_int(seqlen_q, "seqlen_q", 1))[:, None]
        return (start[..., None, :] <= i) & (i < end[..., None, :])


class RowRanges(NamedTuple):
    """A mask in O(Lq) form, the mirror of :class:`KeyRanges`, for flash_dmattn's and
    dot_product_attention's ``mask``: query row ``i`` sees exactly the keys
    ``start[..., i] <= j < end[..., i]`` (and-ed with every other rule), so ``start >= end``
    leaves the row no key (its output is 0 and its lse -inf, as for any row with no visible key).

    ``start`` and ``end``: integer arrays ``[B|1, H|Hk|1, Lq]``, values in ``[0, Lk]``; size-1
    dims broadcast. A pytree (a NamedTuple), so it passes through ``jit`` and ``vmap``. It is
    given as ``mask`` alone or in a tuple of masks meaning their and, with at most one bool mask,
    one :class:`KeyRanges` and one :class:`BlockIndices` (e.g. ``mask=(key_ranges,
    row_ranges)``). The CPU and CUDA kernels skip a tile when no row of it has a range meeting
    the tile's key columns; it is equivalent to the bool mask
    ``(start[..., :, None] <= j) & (j < end[..., :, None])`` for ``j = arange(Lk)``
    (:meth:`to_mask`).
    """

    start: jax.Array
    end: jax.Array

    def to_mask(self, seqlen_k: int) -> jax.Array:
        """The equivalent dense bool mask ``[..., Lq, Lk]`` (O(Lq·Lk); for tests and for code
        that takes only a bool mask: the kernels read the ranges themselves)."""
        start, end = (jnp.asarray(x) for x in (self.start, self.end))
        j = jnp.arange(_check_int(seqlen_k, "seqlen_k", 1))
        return (start[..., :, None] <= j) & (j < end[..., :, None])


class BlockIndices(NamedTuple):
    """A block-sparse mask in O(Lq / block_q · K) form, for flash_dmattn's and
    dot_product_attention's ``mask``: each block of ``block_q`` query rows sees exactly the key
    blocks (of ``block_k`` keys) it lists. Element ``(i, j)`` is visible iff ``j // block_k`` is
    among ``indices[..., i // block_q, :]`` (and-ed with every other rule); a block that lists
    none leaves its rows no key (output 0, lse -inf, as for any row with no visible key).

    ``indices``: integer ``[B|1, H|Hk|1, ceil(Lq / block_q), K]``, size-1 dims broadcast; entries
    are key block numbers in ``[0, ceil(Lk / block_k))``, ``-1`` marks an unused slot, and a
    block listed twice counts once. Where ``indices`` is concrete, other values are rejected at
    trace time; traced values outside that range are ignored like ``-1`` (they name no key
    block). ``block_q`` and ``block_k``: static Python ints ``>= 1`` (the last blocks may be
    partial); they are pytree metadata, so a BlockIndices passes through ``jit`` and ``vmap``
    with only ``indices`` as a leaf. It is given as ``mask`` alone or in a tuple of masks meaning
    their and, with at most one bool mask, one :class:`KeyRanges` and one :class:`RowRanges`
    (e.g. ``mask=(bool_mask, key_ranges, row_ranges, block_indices)``). The CPU and CUDA kernels
    skip a tile when none of its query blocks lists a key block meeting its keys (O(K) per query
    block); it is equivalent to the bool mask :meth:`to_mask`.
    """

    indices: jax.Array
    block_q: int
    block_k: int

    def to_mask(self, seqlen_q: int, seqlen_k: int) -> jax.Array:
        """The equivalent dense bool mask ``[..., Lq, Lk]`` (O(Lq·Lk); for tests and for code
        that takes only a bool mask: the kernels read the indices themselves)."""
        lk = _check_int(seqlen_k, "seqlen_k", 1)
        num_key_blocks = -(-lk // _check_int(self.block_k, "block_k", 1))
        listed = jnp.asarray(self.indices)[..., None] == jnp.arange(num_key_blocks)
        return block_mask(jnp.any(listed, axis=-2), self.block_q, self.block_k, seqlen_q, lk)


# block_q and block_k are static: the treedef carries them, so jit retraces for new sizes and
# vmap maps only the indices.
jax.tree_util.register_pytree_node(
    BlockIndices, lambda b: ((b.indices,), (b.block_q, b.block_k)),
    lambda sizes, leaves: BlockIndices(leaves[0], *sizes))


# ---- argument checks --------------------------------------------------------------------------


def _check_int(value, name: str, minimum: int) -> int:
    """A static Python int (not a bool, not a tracer) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int (static under jit), got "
                        f"{type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_scores(scores) -> jax.Array:
    s = as_array(scores, "scores")
    if not (jnp.issubdtype(s.dtype, jnp.floating) or jnp.issubdtype(s.dtype, jnp.integer)):
        raise TypeError(f"scores must be a floating (or integer) array, got dtype {s.dtype.name}")
    if s.ndim < 1:
        raise ValueError(f"scores must have at least one dim [..., Lk], got shape {s.shape}")
    if s.shape[-1] < 1:
        raise ValueError(f"scores must have at least one key (Lk >= 1), got shape {s.shape}")
    return s


def _check_valid(valid, shape: tuple[int, ...]) -> jax.Array | None:
    """None, or a bool array that broadcasts to `shape` without enlarging it."""
    if valid is None:
        return None
    v = as_array(valid, "valid")
    if v.dtype != jnp.bool_:
        raise TypeError(f"valid must be a bool array (True = may be selected), got dtype "
                        f"{v.dtype.name}")
    try:
        ok = v.ndim <= len(shape) and np.broadcast_shapes(v.shape, shape) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"valid of shape {v.shape} does not broadcast to {tuple(shape)}")
    return v


def _check_lengths(lengths, name: str) -> jax.Array | None:
    if lengths is None:
        return None
    x = as_array(lengths, name)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array [B], got dtype {x.dtype.name}")
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {x.shape}")
    return x


# ---- ordering keys ----------------------------------------------------------------------------


def _order_key(s: jax.Array) -> jax.Array:
    """An integer key with the order of the scores (larger = better): NaN counts as -inf, -0.0 as
    +0.0, and every key is strictly greater than ``iinfo(key.dtype).min`` (the "never" sentinel).
    Integer scores are compared as float32, half precision ones exactly as float32."""
    if not jnp.issubdtype(s.dtype, jnp.floating) or jnp.finfo(s.dtype).bits < 32:
        s = s.astype(jnp.float32)
    s = jnp.where(jnp.isnan(s), -jnp.inf, s)
    s = jnp.where(s == 0, jnp.zeros_like(s), s)
    int_type = jnp.int64 if s.dtype == jnp.float64 else jnp.int32
    bits = lax.bitcast_convert_type(s, int_type)
    # Negative floats: flip the magnitude bits so that a larger magnitude sorts lower.
    return jnp.where(bits < 0, bits ^ jnp.array(jnp.iinfo(int_type).max, int_type), bits)


def _sentinel(key: jax.Array) -> jax.Array:
    return jnp.array(jnp.iinfo(key.dtype).min, key.dtype)


def _ranks(key: jax.Array) -> jax.Array:
    """Rank of each entry of `key` ``[n, L]`` along its row: 0 for the largest key, ties broken by
    lower index. int32 ``[n, L]``, a permutation of ``0..L-1`` per row."""
    iota = lax.broadcasted_iota(jnp.int32, key.shape, 1)
    _, order = lax.sort((lax.bitwise_not(key), iota), dimension=1, num_keys=1, is_stable=True)
    return _scatter_rows(iota, order)  # the inverse permutation


def _scatter_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """``out[:, index[:, i]] = x[:, i]`` for ``[n, L]`` arrays, `index` a permutation per row
    (a scatter: much cheaper than a sort on accelerators)."""
    rows = lax.broadcasted_iota(jnp.int32, index.shape, 0)
    return jnp.zeros_like(x).at[rows, index].set(x, unique_indices=True)


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    """``out[..., i] = sum(x[..., :i])`` for ``i`` in ``0..L``, int32 ``[..., L+1]``."""
    inclusive = jnp.cumsum(x.astype(jnp.int32), axis=-1, dtype=jnp.int32)
    return jnp.concatenate([jnp.zeros((*x.shape[:-1], 1), jnp.int32), inclusive], axis=-1)


def _select(x: jax.Array, index: jax.Array, iota: jax.Array) -> jax.Array:
    """``x[:, index, :]`` column by column: x ``[n, R, L]``, index ``[n, L]``; 0 where the index
    is out of ``0..R-1``."""
    return jnp.sum(jnp.where(iota == index[:, None, :], x, 0), axis=1, dtype=jnp.int32)


def _prefix_kth(values: jax.Array, k: int) -> jax.Array:
    """``out[:, t]`` = the k-th smallest (0-based) of ``values[:, :t+1]``, or L where ``t < k``.

    `values` ``[n, L]`` int32 holds a permutation of ``0..L-1`` per row. A wavelet matrix with
    ``R = 2**_RADIX_BITS``-way levels answers all L prefix quantile queries at once; each of the
    ``ceil(log2(L) / _RADIX_BITS)`` levels costs a digit count (a cumsum), a stable partition by
    digit (one scatter, placed by that count) and O(n·L·R) elementwise work and gathers."""
    n, length = values.shape
    bits = max(1, (length - 1).bit_length())
    num_levels = -(-bits // _RADIX_BITS)
    radix = 1 << _RADIX_BITS
    digits = lax.broadcasted_iota(jnp.int32, (1, radix, 1), 1)

    tables = []
    cur = values
    for level in range(num_levels):  # a static handful of levels, never a loop over L
        shift = (num_levels - 1 - level) * _RADIX_BITS
        d = (cur >> shift) & (radix - 1)  # [n, L]
        # table[:, r, i]: how many of cur[:, :i] have a digit <= r  ([n, R, L+1])
        table = _exclusive_cumsum((d[:, None, :] <= digits).astype(jnp.int32))
        tables.append((shift, table))
        if level + 1 < num_levels:  # stable partition by digit: the next level's order
            # entry i goes after every entry of a smaller digit and the earlier ones of its own
            before, totals = table[:, :, :length], jnp.broadcast_to(table[:, :, length:],
                                                                    (n, radix, length))
            position = (_select(totals, d - 1, digits) + _select(before, d, digits)
                        - _select(before, d - 1, digits))
            cur = _scatter_rows(cur, position)

    # Query [lo, hi) = [0, t+1) for every t at once, descending one digit per level.
    lo = jnp.zeros((n, length), jnp.int32)
    hi = jnp.broadcast_to(jnp.arange(1, length + 1, dtype=jnp.int32), (n, length))
    kk = jnp.full((n, length), k, jnp.int32)
    out = jnp.zeros((n, length), jnp.int32)
    for shift, table in tables:
        c_lo = jnp.take_along_axis(table, jnp.broadcast_to(lo[:, None, :], (n, radix, length)),
                                   axis=2)
        c_hi = jnp.take_along_axis(table, jnp.broadcast_to(hi[:, None, :], (n, radix, length)),
                                   axis=2)
        inside = c_hi - c_lo  # [n, R, L]: entries of [lo, hi) with a digit <= r
        digit = jnp.sum(inside <= kk[:, None, :], axis=1, dtype=jnp.int32)  # holds the k-th
        prev = digit - 1
        kk = kk - _select(inside, prev, digits)
        start = _select(jnp.broadcast_to(table[:, :, length:], (n, radix, length)), prev, digits)
        lo = start + _select(c_lo, digit, digits) - _select(c_lo, prev, digits)
        hi = start + _select(c_hi, digit, digits) - _select(c_hi, prev, digits)
        out = out + (digit << shift)
    t = lax.broadcasted_iota(jnp.int32, (n, length), 1)
    return jnp.where(t >= k, out, length)


def _per_key(s: jax.Array, lead: tuple[int, ...], valid: jax.Array | None):
    """Per-key order keys ``[n, Lk]`` (invalid keys set to the sentinel) and valid ``[n, Lk]``."""
    lk = s.shape[-1]
    n = math.prod(lead)
    key = _order_key(s).reshape(n, lk)
    if valid is None:
        return key, None
    v = valid if valid.ndim < 2 else valid[..., 0, :]
    v = jnp.broadcast_to(v, (*lead, lk)).reshape(n, lk)
    return jnp.where(v, key, _sentinel(key)), v


def _leave_positions(key: jax.Array, window: int) -> jax.Array:
    """``leave[:, j]`` for order keys ``[n, Lk]``: the index of the `window`-th key that beats key
    j (a larger key, or an equal one at a lower index), Lk when fewer do. Key j is among the
    `window` best of keys ``0..t`` exactly for ``j <= t < leave[:, j]``. int32 ``[n, Lk]``."""
    n, lk = key.shape
    if window >= lk:
        return jnp.full((n, lk), lk, jnp.int32)
    return _leave_p.bind(key, window=window)


def _leave_positions_xla(key: jax.Array, *, window: int) -> jax.Array:
    rank = _ranks(key)
    n, lk = rank.shape
    theta = _prefix_kth(rank, window - 1)  # non-increasing in t, values in [0, Lk]
    rows = lax.broadcasted_iota(jnp.int32, (n, lk), 0)
    hist = jnp.zeros((n, lk + 1), jnp.int32).at[rows, theta].add(1)
    at_least = jnp.flip(jnp.cumsum(jnp.flip(hist, axis=1), axis=1, dtype=jnp.int32), axis=1)
    return jnp.take_along_axis(at_least, rank, axis=1)  # #{t : theta[t] >= rank[j]}


# The leave positions are a primitive so that GPUs run the CUDA kernel instead of the ~60 small
# XLA kernels of the wavelet matrix.
_leave_p = Primitive("dmattn_topk_leave")
_leave_p.def_impl(partial(dispatch.apply_primitive, _leave_p))
_leave_p.def_abstract_eval(lambda key, *, window: key.update(dtype=jnp.int32, weak_type=False))


def _no_tangent(primitive: Primitive):
    """The jvp of a primitive with an integer or boolean result: a zero tangent."""
    def jvp(primals, tangents, **params):
        result = primitive.bind(*primals, **params)
        return result, ad.Zero.from_primal_value(result)

    return jvp


def _leave_batch(args, dims, *, window):
    key = jnp.moveaxis(args[0], dims[0], 0)
    size, n, lk = key.shape
    return _leave_p.bind(key.reshape(size * n, lk), window=window).reshape(size, n, lk), 0


def _leave_cuda_lowering(ctx, key, *, window):
    if ctx.avals_in[0].dtype == jnp.int32 and _ffi.has_cuda_kernels():
        fn = partial(_ffi.call_topk_leave, window=window)
    else:  # int64 keys (float64 scores), or a build without CUDA kernels
        fn = partial(_leave_positions_xla, window=window)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, key)


ad.primitive_jvps[_leave_p] = _no_tangent(_leave_p)
batching.primitive_batchers[_leave_p] = _leave_batch
mlir.register_lowering(_leave_p, mlir.lower_fun(_leave_positions_xla, multiple_results=False))
mlir.register_lowering(_leave_p, _leave_cuda_lowering, platform="cuda")


# ---- the dynamic mask -------------------------------------------------------------------------


def topk_mask(
    scores: jax.Array,
    window: int,
    *,
    is_causal: bool = True,
    valid: jax.Array | None = None,
    seqlen_q: int | None = None,
) -> jax.Array:
    """The dynamic mask: each query row keeps the `window` visible keys of largest score.

    Args:
      scores: per-key scores ``[..., 1, Lk]`` (e.g. the paper's bias ``[B, Hk, 1, Lk]``, the
        same for every query) or ``[Lk]``; or per-(query, key) scores ``[..., Lq, Lk]`` with
        ``Lq > 1`` (so per-key scores ``[B, Lk]`` must become ``[B, 1, Lk]``). Floating, or
        integer (compared as float32). NaN counts as ``-inf``: such a key
        is still selectable, after every key with a real score. ``-0.0`` equals ``+0.0``.
      window: static int ``>= 1``, keys kept per row. Rows that see at most `window` keys keep
        all of them.
      is_causal: key ``j`` is visible to query ``i`` only if ``j <= i + (Lk - Lq)`` (bottom-right
        aligned, like flash_dmattn); rows that see no key are all False.
      valid: optional bool mask broadcastable to the output ``[..., Lq, Lk]`` that further
        restricts which keys a row may see (e.g. key padding). A key outside it is never
        selected and never takes a slot.
      seqlen_q: Lq for per-key scores (default ``Lk``); for per-(query, key) scores it must be
        None or equal ``scores.shape[-2]``.

    Returns:
      bool ``[..., Lq, Lk]`` (``[Lq, Lk]`` for 1-D scores), True = attend; pass it (4-D) as
      flash_dmattn's mask, with the same `is_causal`.

    Ties are broken by the lower key index: among equal scores the earlier key wins.

    Per-key scores take the fast path when `valid` is absent, per-key (query dim 1, e.g. key
    padding ``[B, 1, 1, Lk]``) or per-row (key dim 1, e.g. query padding ``[B, 1, Lq, 1]``):
    causal rows are computed in O(Lk log Lk) (see :func:`topk_key_ranges`) and written with one
    elementwise comparison; without causality every row is the same and is computed once. For
    key and query padding together, pass the key part as `valid` and AND the query part
    afterwards (a row with no visible key selects nothing, so the result is the same).
    Per-(query, key) scores, or a `valid` that varies along both Lq and Lk, fall back to
    ``lax.top_k`` over each row: O(Lq·Lk·log(window)) and much slower for long sequences.
    """
    s = _check_scores(scores)
    window = _check_int(window, "window", 1)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
    lk = s.shape[-1]
    per_key = s.ndim == 1 or s.shape[-2] == 1
    lead = s.shape[:-2] if s.ndim >= 2 else ()
    if per_key:
        lq = lk if seqlen_q is None else _check_int(seqlen_q, "seqlen_q", 1)
    else:
        lq = s.shape[-2]
        if seqlen_q is not None and _check_int(seqlen_q, "seqlen_q", 1) != lq:
            raise ValueError(f"seqlen_q={seqlen_q} does not match the query dim of scores of "
                             f"shape {s.shape} (per-(query, key) scores [..., Lq, Lk]); pass "
                             f"per-key scores as [..., 1, Lk] to choose Lq")
    v = _check_valid(valid, (*lead, lq, lk))
    return _topk_mask(s, v, window=window, is_causal=bool(is_causal), seqlen_q=lq)


@partial(jax.jit, static_argnames=("window", "is_causal", "seqlen_q"))
def _topk_mask(s: jax.Array, v: jax.Array | None, *, window: int, is_causal: bool,
               seqlen_q: int) -> jax.Array:
    lq, lk = seqlen_q, s.shape[-1]
    per_key = s.ndim == 1 or s.shape[-2] == 1
    lead = s.shape[:-2] if s.ndim >= 2 else ()
    out_shape = (*lead, lq, lk)
    offset = lk - lq
    cols = lax.broadcasted_iota(jnp.int32, (lq, lk), 1)
    rows = lax.broadcasted_iota(jnp.int32, (lq, lk), 0)

    rows_only = v is not None and v.ndim >= 2 and v.shape[-2] != 1 and v.shape[-1] == 1
    key_valid = None if rows_only else v  # a valid [..., Lq, 1] only empties whole rows
    if per_key and (key_valid is None or key_valid.ndim < 2 or key_valid.shape[-2] == 1):
        key, kv = _per_key(s, lead, key_valid)
        n = key.shape[0]
        if window >= lk:
            keep = jnp.ones((n, 1, lk), jnp.bool_)
        elif is_causal:
            t = jnp.clip(jnp.arange(lq, dtype=jnp.int32) + offset, 0, lk - 1)  # prefix ends
            keep = t[:, None] < _leave_positions(key, window)[:, None, :]  # [n, Lq, Lk]
        else:
            keep = (_ranks(key) < window)[:, None, :]
        if is_causal:
            keep = keep & (cols <= rows + offset)
        if kv is not None:
            keep = keep & kv[:, None, :]
        keep = jnp.broadcast_to(keep, (n, lq, lk)).reshape(out_shape)
        return keep & v if rows_only else keep

    # General path: lax.top_k over each row of order keys, hidden keys set to the sentinel.
    key = _order_key(s)
    sentinel = _sentinel(key)
    visible = cols <= rows + offset if is_causal else jnp.ones((lq, lk), jnp.bool_)
    if v is not None:
        visible = visible & v
    key = jnp.where(visible, key, sentinel)
    key = jnp.broadcast_to(key, out_shape)
    if window >= lk:
        return key > sentinel
    values, index = lax.top_k(key, window)
    last = values[..., -1:]  # the window-th best key of each row
    # top_k breaks ties by lower index: of the keys equal to `last`, those up to the highest
    # selected index are in.
    last_index = jnp.max(jnp.where(values == last, index, -1), axis=-1, keepdims=True)
    j = lax.broadcasted_iota(index.dtype, out_shape, len(out_shape) - 1)
    return (key > sentinel) & ((key > last) | ((key == last) & (j <= last_index)))


def topk_key_ranges(
    scores: jax.Array,
    window: int,
    *,
    seqlen_q: int | None = None,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The causal dynamic mask of per-key scores in O(Lk) form: the rows that keep each key.

    Args:
      scores: per-key scores ``[..., Lk]`` (every leading dim is a batch dim, e.g. the bias
        ``[B, Hk, 1, Lk]``); same rules as :func:`topk_mask` (ties to the lower index, NaN as
        ``-inf``).
      window: static int ``>= 1``.
      seqlen_q: Lq (default Lk); causality is bottom-right aligned, key ``j`` visible to query
        ``i`` iff ``j <= i + (Lk - Lq)``.
      valid: optional bool per-key mask broadcastable to ``scores.shape``; keys outside it are
        never selected.

    Returns:
      ``(first_row, end_row)``, int32 of ``scores.shape``: key ``j`` is kept by exactly the
      query rows ``first_row[j] <= i < end_row[j]``, i.e. ``topk_mask(scores[..., None, :],
      window, seqlen_q=Lq, valid=valid)`` equals ``(first_row[..., None, :] <= i) & (i <
      end_row[..., None, :])`` for ``i = arange(Lq)[:, None]``. A key kept by no row has
      ``end_row == first_row``. Both lie in ``[0, Lq]``.
    """
    s = _check_scores(scores)
    window = _check_int(window, "window", 1)
    lk = s.shape[-1]
    lq = lk if seqlen_q is None else _check_int(seqlen_q, "seqlen_q", 1)
    v = _check_valid(valid, s.shape)
    return _topk_key_ranges(s, v, window=window, seqlen_q=lq)


@partial(jax.jit, static_argnames=("window", "seqlen_q"))
def _topk_key_ranges(s: jax.Array, v: jax.Array | None, *, window: int,
                     seqlen_q: int) -> tuple[jax.Array, jax.Array]:
    lq, lk = seqlen_q, s.shape[-1]
    key = _order_key(s).reshape(-1, lk)
    if v is not None:
        v = jnp.broadcast_to(v, s.shape).reshape(-1, lk)
        key = jnp.where(v, key, _sentinel(key))
    offset = lk - lq
    j = lax.broadcasted_iota(jnp.int32, key.shape, 1)
    first = jnp.clip(j - offset, 0, lq)
    leave = _leave_positions(key, window)
    end = jnp.clip(leave - offset, first, lq)
    if v is not None:
        end = jnp.where(v, end, first)
    return first.reshape(s.shape), end.reshape(s.shape)


def topk_block_keys(
    scores: jax.Array,
    window: int,
    block: int,
    *,
    is_causal: bool = True,
    seqlen_q: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The keys each block of query rows needs under the dynamic mask of per-key scores.

    Every key is kept over one contiguous run of rows (:func:`topk_key_ranges`), so a block of
    `block` consecutive rows sees at most ``window + block - 1`` distinct keys with causality (the
    `window` of its first row and one newcomer per later row) and at most `window` without. This
    lists them, so that attention can run over a compact key axis (``jax_dmattn.dynamic``).

    Args:
      scores: per-key scores ``[..., Lk]`` (every leading dim is a batch dim); the rules of
        :func:`topk_mask` (ties to the lower index, NaN as ``-inf``).
      window: static int ``>= 1``, keys kept per row.
      block: static int ``>= 1``, rows per query block; the last block may be partial.
      is_causal: bottom-right aligned causality, as in :func:`topk_mask`.
      seqlen_q: Lq (default Lk).

    Returns:
      ``(keys, first_row, end_row)``, int32 ``[..., nb, U]`` with ``nb = ceil(Lq / block)`` and
      ``U = min(window + block - 1, Lk)`` (``min(window, Lk)`` without causality): block ``n``
      needs keys ``keys[..., n, :]`` (ascending), and row ``i`` keeps the listed key ``u`` iff
      ``first_row[..., n, u] <= i < end_row[..., n, u]``. Unused slots come last, repeat the
      last listed key (0 when none) and have ``first_row == end_row`` (kept by no row).
    """
    s = _check_scores(scores)
    window = _check_int(window, "window", 1)
    block = _check_int(block, "block", 1)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__}")
    lq = s.shape[-1] if seqlen_q is None else _check_int(seqlen_q, "seqlen_q", 1)
    return _topk_block_keys(s, window=window, block=block, is_causal=bool(is_causal),
                            seqlen_q=lq)


@partial(jax.jit, static_argnames=("window", "block", "is_causal", "seqlen_q"))
def _topk_block_keys(s: jax.Array, *, window: int, block: int, is_causal: bool,
                     seqlen_q: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    first, end = key_ranges(s, window=window, is_causal=is_causal, seqlen_q=seqlen_q)
    size = min(window + block - 1 if is_causal else window, s.shape[-1])
    return list_block_keys(first, end, block=block, size=size, seqlen_q=seqlen_q)


def key_ranges(s: jax.Array, *, window: int, is_causal: bool,
               seqlen_q: int) -> tuple[jax.Array, jax.Array]:
    """:func:`topk_key_ranges` of checked per-key scores ``[..., Lk]``, causal or not (then every
    row keeps the same keys: ``first == 0`` and ``end`` is Lq or 0)."""
    if is_causal:
        return _topk_key_ranges(s, None, window=window, seqlen_q=seqlen_q)
    lk = s.shape[-1]
    kept = _ranks(_order_key(s).reshape(-1, lk)).reshape(s.shape) < window
    return jnp.zeros(s.shape, jnp.int32), jnp.where(kept, seqlen_q, 0).astype(jnp.int32)


def list_block_keys(first: jax.Array, end: jax.Array, *, block: int, size: int,
                    seqlen_q: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Key ranges ``[..., Lk]`` -> :func:`topk_block_keys`' ``(keys, first_row, end_row)``
    ``[..., nb, size]``; `size` must hold every block's keys."""
    return list_block_keys_and_slots(first, end, block=block, size=size, seqlen_q=seqlen_q)[:3]


def list_block_keys_and_slots(
        first: jax.Array, end: jax.Array, *, block: int, size: int,
        seqlen_q: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`list_block_keys` and ``slots [..., nb, Lk]``: ``keys[..., n, slots[..., n, j]]
    == j`` wherever block ``n`` lists key ``j`` (elsewhere, the number of keys before ``j`` that
    block ``n`` lists)."""
    lq, lk = seqlen_q, first.shape[-1]
    lead = first.shape[:-1]
    num_blocks = -(-lq // block)
    first = first.reshape(-1, 1, lk)
    end = end.reshape(-1, 1, lk)
    start = lax.broadcasted_iota(jnp.int32, (1, num_blocks, 1), 1) * block
    seen = (first < start + block) & (end > start) & (first < end)  # [n, nb, Lk]
    slots = _exclusive_cumsum(seen)[..., :lk]
    slot = jnp.where(seen, slots, size)  # `size`: dropped below
    n = seen.shape[0]
    batch = lax.broadcasted_iota(jnp.int32, seen.shape, 0)
    row = lax.broadcasted_iota(jnp.int32, seen.shape, 1)
    col = lax.broadcasted_iota(jnp.int32, seen.shape, 2)
    keys = jnp.full((n, num_blocks, size), -1, jnp.int32).at[batch, row, slot].set(
        col, mode="drop")
    used = keys >= 0
    # Unused (tail) slots repeat the last listed key: every list stays sorted.
    keys = jnp.maximum(lax.cummax(keys, axis=2), 0)
    first_row = jnp.where(used, jnp.take_along_axis(first, keys, axis=2), lq)
    end_row = jnp.where(used, jnp.take_along_axis(end, keys, axis=2), lq)
    out_shape = (*lead, num_blocks, size)
    return (keys.reshape(out_shape), first_row.reshape(out_shape), end_row.reshape(out_shape),
            slots.reshape(*lead, num_blocks, lk))


def block_range_mask(first_row: jax.Array, end_row: jax.Array, block: int) -> jax.Array:
    """The masks of :func:`topk_block_keys`' lists: int32 ``[..., nb, U]`` row ranges -> bool
    ``[..., nb, block, U]``, true where row ``n · block + r`` keeps slot ``u`` of block ``n``
    (``first_row[..., n, u] <= n · block + r < end_row[..., n, u]``). One CUDA kernel on GPUs
    (14 us for the 25 MB of the dynamic suite's L16k, where XLA's fusion took 31 us)."""
    return _range_mask_p.bind(first_row, end_row, block=block)


def _range_mask_xla(first_row: jax.Array, end_row: jax.Array, *, block: int) -> jax.Array:
    shape = (first_row.shape[-2], block, 1)
    rows = lax.broadcasted_iota(jnp.int32, shape, 0) * block + lax.broadcasted_iota(
        jnp.int32, shape, 1)
    return (first_row[..., None, :] <= rows) & (rows < end_row[..., None, :])


_range_mask_p = Primitive("dmattn_range_mask")
_range_mask_p.def_impl(partial(dispatch.apply_primitive, _range_mask_p))
_range_mask_p.def_abstract_eval(lambda first, end, *, block: first.update(
    shape=(*first.shape[:-1], block, first.shape[-1]), dtype=jnp.bool_, weak_type=False))


def _range_mask_cuda_lowering(ctx, first, end, *, block):
    kernel = _ffi.has_cuda_kernels()
    fn = partial(_ffi.call_range_mask if kernel else _range_mask_xla, block=block)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, first, end)


ad.primitive_jvps[_range_mask_p] = _no_tangent(_range_mask_p)  # (vmap: _primitives/batching.py)
mlir.register_lowering(_range_mask_p, mlir.lower_fun(_range_mask_xla, multiple_results=False))
mlir.register_lowering(_range_mask_p, _range_mask_cuda_lowering, platform="cuda")


# ---- static masks -----------------------------------------------------------------------------


def _diagonal_offset(seqlen_q: int, seqlen_k: int, bottom_right: bool) -> tuple[int, int, int]:
    """Checked ``(Lq, Lk, offset)`` with the diagonal at key ``i + offset`` for query ``i``."""
    lq = _check_int(seqlen_q, "seqlen_q", 1)
    lk = _check_int(seqlen_k, "seqlen_k", 1)
    if not isinstance(bottom_right, (bool, np.bool_)):
        raise TypeError(f"bottom_right must be a Python bool, got {type(bottom_right).__name__}")
    return lq, lk, (lk - lq if bottom_right else 0)


def causal_mask(seqlen_q: int, seqlen_k: int, *, bottom_right: bool = True) -> jax.Array:
    """bool ``[1, 1, Lq, Lk]``: key ``j`` visible to query ``i`` iff ``j <= i + (Lk - Lq)``
    (bottom-right aligned, flash_dmattn's ``is_causal``) or ``j <= i`` with
    ``bottom_right=False`` (top-left, ``jax.nn.dot_product_attention``'s)."""
    return window_mask(seqlen_q, seqlen_k, None, 0, bottom_right=bottom_right)


def window_mask(
    seqlen_q: int,
    seqlen_k: int,
    left: int | None,
    right: int | None,
    *,
    bottom_right: bool = True,
) -> jax.Array:
    """bool ``[1, 1, Lq, Lk]``: a local window around the (aligned) diagonal.

    Key ``j`` is visible to query ``i`` iff ``d - left <= j <= d + right`` with
    ``d = i + (Lk - Lq)`` (``bottom_right``) or ``d = i``. `left`/`right`: ints ``>= 0``, or None
    for no bound on that side; ``(left, 0)`` is a causal sliding window of ``left + 1`` keys.
    """
    lq, lk, offset = _diagonal_offset(seqlen_q, seqlen_k, bottom_right)
    params = AttentionParams(
        scale=1.0, diagonal_offset=offset,
        window_left=-1 if left is None else _check_int(left, "left", 0),
        window_right=-1 if right is None else _check_int(right, "right", 0))
    return reference.visibility(params, lq, lk)[None, None]


def padding_mask(
    q_lens: jax.Array | None,
    kv_lens: jax.Array | None,
    seqlen_q: int,
    seqlen_k: int,
) -> jax.Array:
    """bool ``[B, 1, Lq, Lk]``: query ``i`` of batch ``b`` may see key ``j`` iff
    ``i < q_lens[b]`` and ``j < kv_lens[b]``.

    `q_lens`, `kv_lens`: integer ``[B]`` (traced values are fine), or None for "all"; at least one
    must be given. Rows of padded queries are all False (flash_dmattn gives them zeros).
    """
    lq = _check_int(seqlen_q, "seqlen_q", 1)
    lk = _check_int(seqlen_k, "seqlen_k", 1)
    q = _check_lengths(q_lens, "q_lens")
    k = _check_lengths(kv_lens, "kv_lens")
    if q is None and k is None:
        raise ValueError("padding_mask needs q_lens or kv_lens (integer arrays [B]), got neither")
    if q is not None and k is not None and q.shape != k.shape:
        raise ValueError(f"q_lens {q.shape} and kv_lens {k.shape} must both be [B]")
    batch = (q if q is not None else k).shape[0]
    keep = jnp.ones((batch, 1, lq, lk), jnp.bool_)
    if q is not None:
        rows = lax.broadcasted_iota(jnp.int32, (1, 1, lq, 1), 2)
        keep = keep & (rows < q[:, None, None, None])
    if k is not None:
        cols = lax.broadcasted_iota(jnp.int32, (1, 1, 1, lk), 3)
        keep = keep & (cols < k[:, None, None, None])
    return keep


def block_mask(
    block_keep: jax.Array,
    block_q: int,
    block_k: int,
    seqlen_q: int,
    seqlen_k: int,
) -> jax.Array:
    """A block map ``[..., nQ, nK]`` bool expanded to elements ``[..., Lq, Lk]``.

    Entry ``(i, j)`` is ``block_keep[..., i // block_q, j // block_k]``; ``nQ`` must equal
    ``ceil(Lq / block_q)`` and ``nK`` ``ceil(Lk / block_k)`` (the last blocks may be partial).
    """
    bq = _check_int(block_q, "block_q", 1)
    bk = _check_int(block_k, "block_k", 1)
    lq = _check_int(seqlen_q, "seqlen_q", 1)
    lk = _check_int(seqlen_k, "seqlen_k", 1)
    b = as_array(block_keep, "block_keep")
    if b.dtype != jnp.bool_:
        raise TypeError(f"block_keep must be bool, got dtype {b.dtype.name}")
    expected = (-(-lq // bq), -(-lk // bk))
    if b.ndim < 2 or b.shape[-2:] != expected:
        raise ValueError(f"block_keep must be [..., nQ, nK] = [..., {expected[0]}, {expected[1]}] "
                         f"for Lq={lq}, Lk={lk} with blocks {bq}x{bk}, got shape {b.shape}")
    row_block = jnp.arange(lq, dtype=jnp.int32) // bq
    col_block = jnp.arange(lk, dtype=jnp.int32) // bk
    return jnp.take(jnp.take(b, row_block, axis=-2), col_block, axis=-1)
