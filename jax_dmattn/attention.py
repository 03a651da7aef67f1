"""The public front ends: ``flash_dmattn`` and the ``jax.nn.dot_product_attention`` drop-in.

Both validate their arguments at trace time, normalise them to the one operation of ``core`` and
differ only in conventions (causal alignment, windows, lengths, layouts of optional outputs). Both
take sequence-packing segment ids: query ``i`` of batch entry ``b`` sees key ``j`` only where
``q_segment_ids[b, i] == kv_segment_ids[b, j]``, on top of every other rule. Both take, beside the
bool mask, a mask in O(Lk) form, :class:`jax_dmattn.masks.KeyRanges`, in O(Lq) form,
:class:`jax_dmattn.masks.RowRanges`, or in block-sparse form,
:class:`jax_dmattn.masks.BlockIndices`, or a tuple of them meaning their and (at most one bool
mask and one of each form): each form has its own operand, so the kernels read them side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from jax_dmattn import masks, validation
from jax_dmattn._primitives import core
from jax_dmattn.params import AttentionParams

# One mask: a bool array or one of the O(L) forms.
OneMask: TypeAlias = jax.Array | masks.KeyRanges | masks.RowRanges | masks.BlockIndices
# The ``mask`` argument: one mask, a tuple of them (their and) or None.
Mask: TypeAlias = OneMask | tuple[OneMask, ...] | None
# ``window_sizes``: concrete integers [Hk, 3] or [3], rows (sink, left, right).
WindowSizes: TypeAlias = np.ndarray | Sequence[int] | Sequence[Sequence[int]] | None
# ``gate``: (alpha [B, Lq, H], delta [B, Lk, Hk]) or None.
Gate: TypeAlias = tuple[jax.Array, jax.Array] | None

# The O(L) forms. They are NamedTuples, so they are told apart from a tuple of masks by type.
_FORMS = (masks.KeyRanges, masks.RowRanges, masks.BlockIndices)


def flash_dmattn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: Mask = None,
    bias: jax.Array | None = None,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    implementation: str | None = None,
    window_sizes: WindowSizes = None,
    gate: Gate = None,
    gate_threshold: float | None = None,
    softmax_threshold: float | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Flash Dynamic Mask Attention: ``softmax(scale · Q Kᵀ + bias, masked) V``.

    Args:
      query: ``[B, Lq, H, D]``, float16 or bfloat16 (float32 too on ``cpu`` and ``xla``).
      key, value: ``[B, Lk, Hk, D]`` of query's dtype, ``H % Hk == 0``; query head ``h`` reads
        kv head ``h // (H // Hk)``.
      mask: optional bool ``[B|1, H|Hk|1, Lq|1, Lk|1]``, True = attend; size-1 dims broadcast
        without copies. Tiles where it is all False are skipped. Or a
        :class:`~jax_dmattn.masks.KeyRanges` (start, end int ``[B|1, H|Hk|1, Lk]``): key ``j``
        visible to rows ``start[..., j] <= i < end[..., j]``, never expanded to ``[Lq, Lk]`` by
        the CPU and CUDA kernels (the CUDA kernels skip tiles from per-block summaries of the
        ranges, in the FlashAttention-2-class forward and the backward). Or a
        :class:`~jax_dmattn.masks.RowRanges` (start, end int ``[B|1, H|Hk|1, Lq]``): row ``i``
        sees keys ``start[..., i] <= j < end[..., i]``, likewise. Or a
        :class:`~jax_dmattn.masks.BlockIndices` (indices int ``[B|1, H|Hk|1, ceil(Lq / block_q),
        K]``, static block sizes): rows of query block ``i // block_q`` see the keys of the key
        blocks it lists (``-1``: an unused slot), likewise. Or a tuple of these, meaning all of
        them (their and): at most one bool mask and at most one of each form, e.g.
        ``(mask, KeyRanges(...))`` or ``(KeyRanges(...), RowRanges(...), BlockIndices(...))``;
        ``(m,)`` is ``m``, and an empty tuple or two of one kind raise at trace time. The CPU
        and CUDA kernels read every member side by side, beside every other rule.
      bias: optional floating array of the mask's shape rule, added to the logits; differentiable
        (its gradient has its own shape, summed over its broadcast dims). Cast to query's dtype.
      q_segment_ids, kv_segment_ids: optional integer ``[B|1, Lq]`` and ``[B|1, Lk]`` (cast to
        int32; both or neither), for sequence packing: query ``i`` sees key ``j`` only where
        ``q_segment_ids[b, i] == kv_segment_ids[b, j]``, and-ed with every other rule (causality,
        mask, bias, GQA, softcap). No gradient. The kernels skip the tiles whose ids cannot
        meet.
      scale: logit scale, default ``1 / sqrt(D)``; any finite float (on a GPU, a scale
        ``<= 0`` runs the pure-JAX reference: the CUDA kernels take scale > 0).
      is_causal: bottom-right aligned: key ``j`` is visible to query ``i`` iff
        ``j <= i + (Lk - Lq)``.
      softcap: ``None`` or ``> 0``: logits become ``softcap · tanh(logits / softcap)``.
      deterministic: bitwise reproducible gradients.
      return_lse: also return ``lse [B, H, Lq]`` float32 (natural log; ``-inf`` for a row with no
        visible key).
      implementation: ``None`` (best for the platform), ``"cuda"``, ``"cpu"`` or ``"xla"``.
      window_sizes: optional per-kv-head local windows with attention sinks: concrete integers
        ``[Hk, 3]`` or ``[3]`` (the same for every kv head), rows ``(sink, left, right)``. Query
        ``i`` of kv head ``g`` sees key ``j`` only where ``j < sink[g]`` or
        ``i + Lk - Lq - left[g] <= j <= i + Lk - Lq + right[g]`` (bottom-right aligned like
        ``is_causal``; a negative bound is unbounded), and-ed with every other rule: causality,
        lengths, segment ids and masks hide sink keys too. Tiles outside every window and sink
        are skipped. A table that is one window without sink for all heads runs the plain
        window. The CPU and CUDA kernels read the table (CUDA: up to 64 kv heads; a larger one
        runs the reference on a GPU, with a warning, and implementation='cuda' raises).
      gate: optional ``(alpha, delta)`` of gated attention, floating alpha ``[B, Lq, H]`` (one
        value per query row and head) and delta ``[B, Lk, Hk]`` (per key and kv head): the
        logits gain ``logsigmoid(alpha[b, i, h] * delta[b, j, h // (H // Hk)])``, so the logit
        is ``scale · q·k + bias + logsigmoid(alpha · delta)``, softcapped as a whole (the gate
        enters before the softcap, with the bias). O(L) memory: no ``[Lq, Lk]`` array. Read in
        float32; differentiable in both (their gradients have their shapes and dtypes:
        ``dalpha[b, i, h] = sum_j dS_ij · sigmoid(-alpha_i delta_j) · delta_j``, ``ddelta``
        likewise summed over rows and the kv head's query heads, dS the logit's cotangent).
        Combines with every mask form, bias, causality, windows, segment ids, lengths and
        softcap. The CPU kernels and the CUDA kernels take it; without a softcap the Hopper
        kernels use ``exp(s + logsigmoid(x)) = exp(s + min(x, 0)) · sigmoid(|x|)`` with
        ``sigmoid(|x|)`` from the hardware tanh (relative error below 2^-11, under the 16-bit
        rounding of the probabilities).
      gate_threshold: ``None`` (exact) or a concrete float ``< 0``, only with a gate. Each query
        head's score matrix is cut into a fixed grid of blocks of ``GATE_BLOCK_Q = 128`` query
        rows × ``GATE_BLOCK_K = 128`` keys from position 0 (the last ones partial; all rows and
        keys below Lq and Lk, whatever the lengths or masks). A block is dropped, its pairs
        hidden like masked ones and never computed (tiles skipped whole, no Q·Kᵀ, forward and
        backward), when ``logsigmoid(alpha_i · delta_j) < gate_threshold`` at every pair of it,
        i.e. when the bound ``max(alpha_i · delta_j)`` over the block, the largest of the
        products of alpha's min / max over its rows and delta's min / max over its keys, is
        below ``gate_threshold - log(1 - exp(gate_threshold))``; kernels of any tile shape drop
        the same pairs (the bound in double), and so does the reference (``'xla'``) with x64;
        without x64 it rounds the bound to float32 and also keeps a block whose bound rounds up
        to the cut. Error: a row whose exact (threshold None) softmax
        gives its dropped pairs total probability ``m`` changes by at most ``2m / (1 - m) ·
        max_j |v_j|``, and each dropped pair's weight ``exp(logit)`` is below
        ``exp(gate_threshold)`` times its weight without the gate (without softcap; not its
        probability, which the gate's lowering of the row's other weights can raise back
        towards the ungated one); a row with every pair dropped gives zeros and lse ``-inf``,
        like a masked row. Dropped pairs get no gradient.
      softmax_threshold: ``None`` or ``0`` (exact attention) or a concrete float ``> 0``: tile
        skipping as upstream's, on a fixed grid. Each query head's scores are cut into blocks of
        ``SKIP_BLOCK_Q = 64`` rows × ``SKIP_BLOCK_K = 128`` keys from position 0. For each block of
        rows, the key blocks are visited in increasing key order; block ``(qb, kb)`` is dropped
        when, for every row ``i`` of it, every visible score ``s_ij`` there (the final logit, after
        bias, gate and softcap) is below ``lse_i + log(softmax_threshold / n_i)``, where ``lse_i``
        is the log-sum-exp of row ``i``'s visible scores in the blocks ``(qb, kb' < kb)`` that were
        kept (``-inf`` before the first), and ``n_i`` is the number of keys row ``i`` may see by
        position alone (the key length, causality, the window and its kv head's window with sink;
        not the mask, segment ids or other mask forms; a score of ``-inf``, from a ``-inf`` bias,
        counts as hidden, so a block of such scores alone is never dropped). A dropped block's pairs
        are hidden like masked ones (no V read and no P·V in the forward, no dO / dP work in the
        backward; Q·Kᵀ still runs on it), so a row's first block with a visible key is never dropped
        and no row loses every key. The forward records the dropped blocks and the backward skips
        exactly those: the gradients are exact for the function computed. Kernels of any tile shape
        or walk order drop the same pairs. Error against exact attention (threshold ``None``): each
        dropped pair has exact probability below ``softmax_threshold / n_i``, the dropped pairs of a
        row hold exact probability ``m < t / (1 + t)`` (``t = softmax_threshold · d_i / n_i``,
        ``d_i`` its dropped visible keys), lse is lower by ``-log(1 - m) < log(1 + t)`` and each
        output coordinate moves by at most ``m · (max_j v_jd - min_j v_jd)`` over the row's visible
        keys. The CPU kernels take it, and the CUDA kernels at head dims 64 and 128 without a
        gate threshold (the Hopper forward where it takes the call, else the
        FlashAttention-2-class one, which also takes segment ids, key ranges, row ranges, block
        indices, a window table and the gate); other GPU calls run the reference (with a warning;
        implementation='cuda' raises).

    Returns:
      ``out [B, Lq, H, D]`` in query's dtype, and ``lse`` when asked. A row with no visible key
      gives zeros and zero gradients.
    """
    validation.check_implementation(implementation)
    q, k, v = validation.check_qkv(query, key, value, implementation)
    dims = validation.dims_of(q, k)
    q_segments, kv_segments = validation.check_segment_ids(q_segment_ids, kv_segment_ids, dims)
    m = _mask_operands(_members(mask), dims)
    window = _window(validation.check_window_sizes(window_sizes, dims), -1,
                     0 if is_causal else -1)
    alpha, delta, threshold = validation.check_gate(gate, gate_threshold, dims, q.dtype)
    aligned = is_causal or window != (-1, -1, None)
    params = AttentionParams(
        scale=validation.check_scale(scale, dims.head_dim),
        softcap=validation.check_softcap(softcap),
        diagonal_offset=dims.seqlen_k - dims.seqlen_q if aligned else 0,
        window_left=window.left,
        window_right=window.right,
        window_sizes=window.table,
        deterministic=bool(deterministic),
        implementation=implementation,
        block_q=m.block_q,
        block_k=m.block_k,
        gate_threshold=threshold,
        softmax_threshold=validation.check_softmax_threshold(softmax_threshold),
    )
    out, lse = core.attention(params, q, k, v, m.mask, validation.check_bias(bias, dims, q.dtype),
                              None, None, q_segments, kv_segments, m.key_start, m.key_end,
                              m.row_start, m.row_end, m.block_indices, alpha, delta)
    return (out, lse) if return_lse else out


class _Window(NamedTuple):
    """A call's window: the shared bounds (-1 unbounded) and the per-kv-head table, or None."""

    left: int
    right: int
    table: tuple[tuple[int, int, int], ...] | None


def _tighter(a: int, b: int) -> int:
    """The and of two window bounds on one side (< 0: unbounded)."""
    return max(a, b) if min(a, b) < 0 else min(a, b)


def _window(table: tuple[tuple[int, int, int], ...] | None, left: int, right: int) -> _Window:
    """The window of a call whose shared bounds (causality, ``local_window_size``) are
    `left`/`right` and whose per-kv-head table (from ``validation.check_window_sizes``) is
    `table`. A table of one row repeated without sink is a shared window: it joins the bounds
    and runs the plain window path (the CUDA kernels included); any other table is kept."""
    if table is None:
        return _Window(left, right, None)
    sink, head_left, head_right = table[0]
    if sink == 0 and all(row == table[0] for row in table):
        return _Window(_tighter(left, head_left), _tighter(right, head_right), None)
    return _Window(left, right, table)


class _MaskOperands(NamedTuple):
    """The ``mask`` argument as the operation's operands: each form in its own slot (None where
    the call has none of it); the block sizes are those of the block indices (0 without them)."""

    mask: jax.Array | None = None
    key_start: jax.Array | None = None
    key_end: jax.Array | None = None
    row_start: jax.Array | None = None
    row_end: jax.Array | None = None
    block_indices: jax.Array | None = None
    block_q: int = 0
    block_k: int = 0


def _kind(mask: OneMask) -> str:
    return next((form.__name__ for form in _FORMS if isinstance(mask, form)), "bool mask")


# What an and of two masks of one kind is, for the error that refuses them.
_COMBINE_HINT = {
    "bool mask": "pass their and (m0 & m1) as one bool mask",
    "KeyRanges": "two key ranges intersect to one: KeyRanges(maximum(start0, start1), "
                 "minimum(end0, end1))",
    "RowRanges": "two row ranges intersect to one: RowRanges(maximum(start0, start1), "
                 "minimum(end0, end1))",
    "BlockIndices": "pass the and of their to_mask forms as a bool mask",
}


def _members(mask: Mask) -> tuple[OneMask, ...]:
    """The masks a ``mask`` argument ands: none for None, a tuple's elements, or the one mask.

    A tuple takes at most one bool mask and at most one of each O(L) form (each has one operand
    slot); an empty tuple, a None or nested tuple in it, or two of one kind raise here."""
    if mask is None:
        return ()
    if not isinstance(mask, tuple) or isinstance(mask, _FORMS):
        return (mask,)
    accepted = ("a tuple of masks takes at most one bool mask and at most one each of "
                "masks.KeyRanges, masks.RowRanges and masks.BlockIndices")
    if not mask:
        raise ValueError(f"mask=() holds no mask; pass None for no mask ({accepted})")
    seen: dict[str, int] = {}
    for i, m in enumerate(mask):
        if m is None or (isinstance(m, tuple) and not isinstance(m, _FORMS)):
            raise TypeError(f"mask tuple element {i} is {type(m).__name__}, not a mask "
                            f"({accepted})")
        kind = _kind(m)
        if kind in seen:
            raise ValueError(f"mask tuple holds more than one {kind} (elements {seen[kind]} and "
                             f"{i}); {accepted}: {_COMBINE_HINT[kind]}")
        seen[kind] = i
    return mask


def _mask_operands(members: tuple[OneMask, ...], dims: validation.Dims) -> _MaskOperands:
    """`members` (from :func:`_members`) checked and normalised, each into its own slots: a bool
    mask by ``validation.check_mask``, key or row ranges or block indices by
    ``validation.check_key_ranges`` / ``check_row_ranges`` / ``check_block_indices``."""
    operands = _MaskOperands()
    for m in members:
        if isinstance(m, masks.KeyRanges):
            start, end = validation.check_key_ranges(m.start, m.end, dims)
            operands = operands._replace(key_start=start, key_end=end)
        elif isinstance(m, masks.RowRanges):
            start, end = validation.check_row_ranges(m.start, m.end, dims)
            operands = operands._replace(row_start=start, row_end=end)
        elif isinstance(m, masks.BlockIndices):
            indices, block_q, block_k = validation.check_block_indices(*m, dims)
            operands = operands._replace(block_indices=indices, block_q=block_q,
                                         block_k=block_k)
        else:
            operands = operands._replace(mask=validation.check_mask(m, dims))
    return operands


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: Mask = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    window_sizes: WindowSizes = None,
    gate: Gate = None,
    gate_threshold: float | None = None,
    softmax_threshold: float | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Drop-in for ``jax.nn.dot_product_attention`` with the same signature and semantics (plus
    keywords of its own at the end: the segment ids, ``window_sizes`` and the gate).

    Shapes: query ``[B, T, N, H]`` or ``[T, N, H]``, key/value ``[B, S, K, H]`` or ``[S, K, H]``;
    bias and mask broadcastable to ``[B, N, T, S]`` (each dim full or 1); sequence lengths int32
    ``[B]``; segment ids (an addition to ``jax.nn``'s signature) integer ``[B|1, T]`` and
    ``[B|1, S]`` (``[T]`` and ``[S]`` for 3-D inputs), both or neither: query ``i`` sees key
    ``j`` only where ``q_segment_ids[b, i] == kv_segment_ids[b, j]`` (sequence packing), and-ed
    with the other rules. ``mask`` may also be a :class:`jax_dmattn.masks.KeyRanges` (an
    addition: start, end ``[B|1, N|K|1, S]``, ``[N|K|1, S]`` for 3-D inputs; key ``j`` visible
    to queries ``start[..., j] <= i < end[..., j]``) or a :class:`jax_dmattn.masks.RowRanges`
    (start, end ``[B|1, N|K|1, T]``, ``[N|K|1, T]`` for 3-D inputs; query ``i`` sees keys
    ``start[..., i] <= j < end[..., i]``) or a :class:`jax_dmattn.masks.BlockIndices` (indices
    ``[B|1, N|K|1, ceil(T / block_q), K]``, ``[N|K|1, ceil(T / block_q), K]`` for 3-D inputs;
    query ``i`` sees keys ``j`` whose block ``j // block_k`` its block ``i // block_q`` lists),
    or a tuple of these meaning their and (at most one bool mask and one of each form; ``(m,)``
    is ``m``). ``is_causal`` is top-left aligned (query ``i`` sees keys ``j <= i``);
    ``local_window_size=(left, right)`` lets query ``i`` see keys ``i - left .. i + right``.
    ``window_sizes`` (an addition; not with ``local_window_size``): concrete integers ``[K, 3]``
    or ``[3]``, per kv head ``(sink, left, right)``: query ``i`` of kv head ``g`` sees key ``j``
    only where ``j < sink[g]`` or ``i - left[g] <= j <= i + right[g]`` (top-left aligned like
    ``local_window_size``; a negative bound is unbounded), and-ed with every other rule
    (causality hides sink keys after ``i`` too); see :func:`flash_dmattn`.
    ``gate=(alpha, delta)`` and ``gate_threshold`` (additions): gated attention as in
    :func:`flash_dmattn`, alpha ``[B, T, N]`` and delta ``[B, S, K]`` (``[T, N]`` and ``[S, K]``
    for 3-D inputs); the threshold's block grid starts at position 0 as there.
    ``softmax_threshold`` (an addition): tile skipping as in :func:`flash_dmattn` (the grid
    from position 0; ``n_i`` counts the keys that ``is_causal``, the window and the key length
    leave row ``i``).
    ``implementation``: ``None``, ``"cuda"``, ``"cpu"`` or ``"xla"`` (``"cudnn"`` is
    ``jax.nn``'s own). Differs from ``jax.nn`` only where it is better: a query row with no
    visible key gives zeros (and residual ``-inf``), and masked tiles are skipped.

    Returns:
      the output of query's shape, and with ``return_residual`` the log-sum-exp ``[B, T, N]``
      (``[T, N]`` for 3-D inputs).
    """
    validation.check_implementation(implementation)
    unbatched = jnp.ndim(query) == 3
    if unbatched:
        query, key, value = (jnp.expand_dims(jnp.asarray(x), 0) for x in (query, key, value))
    q, k, v = validation.check_qkv(query, key, value, implementation)
    dims = validation.dims_of(q, k)

    def as_4d(x):
        return None if x is None else jnp.reshape(x, (1,) * (4 - jnp.ndim(x)) + jnp.shape(x))

    def mask_as_4d(m: OneMask) -> OneMask:
        if isinstance(m, (masks.KeyRanges, masks.RowRanges)):
            # [N|K|1, S|T] -> [1, N|K|1, S|T]
            return type(m)(*(jnp.expand_dims(jnp.asarray(x), 0) for x in m)) if unbatched else m
        if isinstance(m, masks.BlockIndices):
            # [N|K|1, nQB, K] -> [1, N|K|1, nQB, K]
            return (m._replace(indices=jnp.expand_dims(jnp.asarray(m.indices), 0)) if unbatched
                    else m)
        return as_4d(m)

    m = _mask_operands(tuple(map(mask_as_4d, _members(mask))), dims)
    bias = validation.check_bias(as_4d(bias), dims, q.dtype)
    q_lens = validation.check_seq_lengths(query_seq_lengths, "query_seq_lengths", dims.batch)
    kv_lens = validation.check_seq_lengths(key_value_seq_lengths, "key_value_seq_lengths",
                                           dims.batch)
    if (q_lens is None) != (kv_lens is None):
        q_lens = jnp.full((dims.batch,), dims.seqlen_q, jnp.int32) if q_lens is None else q_lens
        kv_lens = jnp.full((dims.batch,), dims.seqlen_k, jnp.int32) if kv_lens is None else kv_lens
    if unbatched:
        q_segment_ids, kv_segment_ids = (
            x if x is None or jnp.ndim(x) != 1 else jnp.expand_dims(jnp.asarray(x), 0)
            for x in (q_segment_ids, kv_segment_ids))
    q_segments, kv_segments = validation.check_segment_ids(q_segment_ids, kv_segment_ids, dims)
    if window_sizes is not None and local_window_size is not None:
        raise ValueError("window_sizes and local_window_size cannot be combined: pass the "
                         "window as window_sizes=(0, left, right), or per kv head [K, 3]")
    left, right = validation.check_window(local_window_size, dims)
    if is_causal:
        right = 0
    window = _window(validation.check_window_sizes(window_sizes, dims), left, right)
    if unbatched and isinstance(gate, (tuple, list)) and len(gate) == 2:
        # 3-D inputs take alpha [T, N] and delta [S, K]: their shapes are checked as given,
        # before the batch dim is added.
        wanted = ((dims.seqlen_q, dims.heads), (dims.seqlen_k, dims.kv_heads))
        for x, name, shape in zip(gate, ("alpha", "delta"), wanted, strict=True):
            if x is not None and np.shape(x) != shape:
                raise ValueError(
                    f"gate {name} shape {np.shape(x)} is not accepted; with 3-D inputs gate "
                    f"must be a pair (alpha, delta) of floating arrays, alpha [T, N] = "
                    f"[{dims.seqlen_q}, {dims.heads}] and delta [S, K] = "
                    f"[{dims.seqlen_k}, {dims.kv_heads}]")
        gate = tuple(None if x is None else jnp.expand_dims(jnp.asarray(x), 0) for x in gate)
    alpha, delta, threshold = validation.check_gate(gate, gate_threshold, dims, q.dtype)
    params = AttentionParams(
        scale=validation.check_scale(scale, dims.head_dim),
        window_left=window.left,
        window_right=window.right,
        window_sizes=window.table,
        implementation=implementation,
        block_q=m.block_q,
        block_k=m.block_k,
        gate_threshold=threshold,
        softmax_threshold=validation.check_softmax_threshold(softmax_threshold),
    )
    out, lse = core.attention(params, q, k, v, m.mask, bias, q_lens, kv_lens, q_segments,
                              kv_segments, m.key_start, m.key_end, m.row_start, m.row_end,
                              m.block_indices, alpha, delta)
    if unbatched:
        out, lse = out[0], lse[0]
    if not return_residual:
        return out
    return out, jnp.swapaxes(lse, -1, -2)
