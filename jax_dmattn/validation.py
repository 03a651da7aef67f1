"""Trace-time checks shared by both front ends: bad input never reaches a kernel.

Every error names the argument, what was received and what would be accepted.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dmattn._primitives import _ffi
from jax_dmattn.params import IMPLEMENTATIONS, MIN_PAGE_SIZE

KERNEL_DTYPES = {
    None: ("float16", "bfloat16", "float32"),
    "cpu": ("float16", "bfloat16", "float32"),
    "cuda": ("float16", "bfloat16"),
    "xla": ("float16", "bfloat16", "float32", "float64"),
}


class Dims(NamedTuple):
    """Sizes of a normalised call: q ``[B, Lq, H, D]``, k/v ``[B, Lk, Hk, D]``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int


def as_array(x, name: str) -> jax.Array:
    """`x` as a JAX array; a TypeError naming `name` when it is not array-like."""
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def concrete_ints(x) -> np.ndarray | None:
    """The values of a concrete integer array as given (int64, or uint64 beyond its range),
    read before JAX converts it: without x64, ``jnp.asarray`` wraps int64 values into int32,
    which could turn an out-of-range entry into a valid one. None for a traced array."""
    if isinstance(x, jax.core.Tracer):
        return None
    values = np.asarray(x)
    return values if values.dtype == np.uint64 else values.astype(np.int64)


def _bound(value: int, limit: int) -> int:
    """A window bound (< 0: unbounded) with those reaching `limit` (no key is that far from the
    diagonal) unbounded too, so that no kernel adds an int64 near its limit to a position."""
    return -1 if value < 0 or value >= limit else value


def check_implementation(implementation: str | None) -> None:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "cuda" and not _ffi.has_cuda_kernels():
        raise ValueError(
            "implementation='cuda' needs the CUDA kernels, but this build of jax_dmattn has "
            "none (reinstall with JAX_DMATTN_CUDA_WHEELS=13 pip install ., or where nvcc is "
            "found: README, Building the CUDA kernels)")


def check_qkv(query, key, value, implementation: str | None) -> tuple[jax.Array, ...]:
    """q ``[B, Lq, H, D]``, k and v ``[B, Lk, Hk, D]`` of one supported floating dtype."""
    q, k, v = (as_array(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    for x, name, layout in ((q, "query", "[B, Lq, H, D]"), (k, "key", "[B, Lk, Hk, D]"),
                            (v, "value", "[B, Lk, Hk, D]")):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D {layout}, got shape {x.shape}")
    _check_dtype(q, implementation)
    _check_keys_against_query(q, k, v, ("key", "value"))
    batch, seqlen_q, _, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"key shape {k.shape} does not match query shape {q.shape}: expected "
            f"[{batch}, Lk, Hk, {head_dim}]")
    if seqlen_q < 1 or k.shape[1] < 1:
        raise ValueError(f"sequence lengths must be >= 1, got query {q.shape}, key {k.shape}")
    return q, k, v


def _check_keys_against_query(q: jax.Array, k: jax.Array, v: jax.Array,
                              names: tuple[str, str]) -> None:
    """k and v (4-D, heads on dim 2) of q's dtype and one shape, their heads dividing q's."""
    for x, name in zip((k, v), names, strict=True):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} dtype {x.dtype.name} differs from query dtype {q.dtype.name}")
    if k.shape != v.shape:
        raise ValueError(f"{names[0]} and {names[1]} shapes differ: {k.shape} vs {v.shape}")
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"query heads H={heads} must be a multiple of key/value heads Hk={kv_heads}")


def _check_dtype(q: jax.Array, implementation: str | None) -> None:
    accepted = KERNEL_DTYPES[implementation]
    if q.dtype.name not in accepted:
        raise TypeError(
            f"query dtype {q.dtype.name} is not supported by implementation={implementation!r}; "
            f"accepted: {', '.join(accepted)}")
    if implementation == "cuda" and q.shape[-1] not in _ffi.cuda_head_dims():
        raise ValueError(f"head dim {q.shape[-1]} has no CUDA kernel; compiled head dims: "
                         f"{_ffi.cuda_head_dims()}")


def check_paged_cache(query, key_pages, value_pages, page_table, kv_lens,
                      implementation: str | None) -> tuple[tuple[jax.Array, ...], Dims]:
    """q ``[B, Lq, H, D]``, pools ``[P, page_size, Hk, D]`` of q's dtype (page_size a power of
    two, at least ``MIN_PAGE_SIZE``), page_table int32 ``[B, max_pages]`` and kv_lens int32
    ``[B]``; the call's dims have ``Lk = max_pages * page_size``. Concrete tables and lengths
    are checked too: lengths in ``[0, Lk]``, and every page a length reaches names a page of the
    pool."""
    q, k, v = (as_array(x, n) for x, n in ((query, "query"), (key_pages, "key_pages"),
                                            (value_pages, "value_pages")))
    if q.ndim != 4:
        raise ValueError(f"query must be 4-D [B, Lq, H, D], got shape {q.shape}")
    _check_dtype(q, implementation)
    batch, seqlen_q, heads, head_dim = q.shape
    for x, name in ((k, "key_pages"), (v, "value_pages")):
        if x.ndim != 4 or x.shape[0] < 1 or x.shape[3] != head_dim:
            raise ValueError(f"{name} must be [num_pages, page_size, Hk, {head_dim}], got shape "
                             f"{x.shape}")
    _check_keys_against_query(q, k, v, ("key_pages", "value_pages"))
    num_pages, page_size, kv_heads, _ = k.shape
    if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
        raise ValueError(f"page_size (key_pages.shape[1]) must be a power of two, at least "
                         f"{MIN_PAGE_SIZE}, got {page_size}")
    if seqlen_q < 1:
        raise ValueError(f"query must have at least one row, got shape {q.shape}")
    table = as_array(page_table, "page_table")
    if table.dtype != jnp.int32 or table.ndim != 2 or table.shape[0] != batch or \
            table.shape[1] < 1:
        raise ValueError(f"page_table must be int32 [{batch}, max_pages >= 1], got "
                         f"{table.dtype.name} {table.shape}")
    lengths = check_seq_lengths(kv_lens, "kv_lens", batch)
    seqlen_k = table.shape[1] * page_size
    _check_concrete_pages(page_table, kv_lens, num_pages, page_size, seqlen_k)
    return (q, k, v, table, lengths), Dims(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim)


def _check_concrete_pages(page_table, kv_lens, num_pages: int, page_size: int,
                          seqlen_k: int) -> None:
    lengths, table = concrete_ints(kv_lens), concrete_ints(page_table)
    if lengths is None:
        return
    if (lengths < 0).any() or (lengths > seqlen_k).any():
        raise ValueError(f"kv_lens must lie in [0, max_pages * page_size = {seqlen_k}], got "
                         f"{lengths.tolist()}")
    if table is None:
        return
    used = np.arange(table.shape[1]) * page_size < lengths[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, slot = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(f"page_table[{b}, {slot}] = {table[b, slot]} names no page of the pool "
                         f"(num_pages {num_pages}), and kv_lens[{b}] = {lengths[b]} reaches it")


def dims_of(q: jax.Array, k: jax.Array) -> Dims:
    return Dims(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3])


def check_broadcast_operand(x, name: str, dims: Dims) -> jax.Array:
    """A mask or bias: 4-D ``[B|1, H|Hk|1, Lq|1, Lk|1]``."""
    x = as_array(x, name)
    accepted = (f"[{dims.batch}|1, {dims.heads}|{dims.kv_heads}|1, {dims.seqlen_q}|1, "
                f"{dims.seqlen_k}|1]")
    ok = (x.ndim == 4 and x.shape[0] in (1, dims.batch)
          and x.shape[1] in (1, dims.kv_heads, dims.heads)
          and x.shape[2] in (1, dims.seqlen_q) and x.shape[3] in (1, dims.seqlen_k))
    if not ok:
        raise ValueError(f"{name} shape {x.shape} is not accepted; expected {accepted}")
    return x


def check_mask(mask, dims: Dims) -> jax.Array | None:
    if mask is None:
        return None
    mask = check_broadcast_operand(mask, "mask", dims)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"mask must be bool (True = attend), got dtype {mask.dtype.name}")
    return mask


def check_bias(bias, dims: Dims, dtype) -> jax.Array | None:
    """The bias, cast to the query's dtype (its gradient comes back in the bias's own dtype)."""
    if bias is None:
        return None
    bias = check_broadcast_operand(bias, "bias", dims)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must be a floating array, got dtype {bias.dtype.name}")
    return bias.astype(dtype)


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer) or not np.isscalar(scale) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite Python float, got {scale!r}")
    return float(scale)


def check_softcap(softcap) -> float:
    """0.0 for no softcap."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, jax.core.Tracer) or not np.isscalar(softcap) or not softcap > 0:
        raise ValueError(f"softcap must be None or a float > 0, got {softcap!r}")
    return float(softcap)


def check_seq_lengths(lengths, name: str, batch: int) -> jax.Array | None:
    if lengths is None:
        return None
    lengths = as_array(lengths, name)
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(
            f"{name} must be int32 of shape ({batch},), got {lengths.dtype.name} {lengths.shape}")
    return lengths


def check_key_ranges(start, end, dims: Dims) -> tuple[jax.Array, jax.Array]:
    """Key ranges (``masks.KeyRanges``): integer ``[B|1, H|Hk|1, Lk]`` each (``[B|1, H|Hk|1, 1,
    Lk]``, the form :func:`jax_dmattn.masks.topk_key_ranges` returns for a bias ``[B, Hk, 1,
    Lk]``, is accepted too).

    Returns both as int32 ``[B|1, H|Hk|1, 1, Lk]`` of one shape (the smaller broadcast to the
    other, O(B·H·Lk)): the kernels read them as a mask broadcast over query rows, through one
    layout. Values are not bounded: the rule ``start <= i < end`` holds for any integers (a value
    outside ``[0, Lq]`` acts as its nearest bound); where the arrays are concrete, values outside
    ``[0, Lq]`` are rejected as a likely mistake."""
    start, end = _check_ranges(start, end, dims, "KeyRanges", dims.seqlen_k, "Lk",
                               dims.seqlen_q, "Lq", "query rows", unit_axis=2)
    return start[:, :, None, :], end[:, :, None, :]


def check_row_ranges(start, end, dims: Dims) -> tuple[jax.Array, jax.Array]:
    """Row ranges (``masks.RowRanges``): integer ``[B|1, H|Hk|1, Lq]`` each (the normalised
    ``[B|1, H|Hk|1, Lq, 1]`` is accepted too).

    Returns both as int32 ``[B|1, H|Hk|1, Lq, 1]`` of one shape (the smaller broadcast to the
    other, O(B·H·Lq)): the kernels read them as a mask broadcast over key columns, through one
    layout. As for key ranges, traced values are not bounded (a value outside ``[0, Lk]`` acts as
    its nearest bound); concrete values outside ``[0, Lk]`` are rejected."""
    start, end = _check_ranges(start, end, dims, "RowRanges", dims.seqlen_q, "Lq",
                               dims.seqlen_k, "Lk", "key columns", unit_axis=3)
    return start[..., None], end[..., None]


def _check_int_array(x, name: str, batch: int, heads, tail: tuple, expected: str) -> None:
    """`x` is an integer array ``[batch|1, one of heads, *tail]`` (a None in `tail`: any size);
    else a ValueError (shape) or TypeError (dtype) naming `name` and the `expected` shape."""
    if (x.ndim != 2 + len(tail) or x.shape[0] not in (1, batch) or x.shape[1] not in heads
            or any(t is not None and n != t for n, t in zip(x.shape[2:], tail, strict=True))):
        raise ValueError(f"{name} shape {x.shape} is not accepted; expected an integer array "
                         f"of shape {expected}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array of shape {expected}, got dtype "
                        f"{x.dtype.name}")


def _check_ranges(start, end, dims: Dims, kind: str, length: int, length_name: str, bound: int,
                  bound_name: str, bound_what: str,
                  unit_axis: int) -> tuple[jax.Array, jax.Array]:
    """The checks key and row ranges share: ``start`` and ``end`` integer ``[B|1, H|Hk|1,
    length]`` (or 4-D with a size-1 dim at `unit_axis`), concrete values in ``[0, bound]``;
    returns both int32 ``[B|1, H|Hk|1, length]`` broadcast to one shape."""
    heads = sorted({1, dims.kv_heads, dims.heads})
    four_d = ["B|1", "H|Hk|1", length_name]
    four_d.insert(unit_axis, "1")
    expected = (f"[{dims.batch}|1, {'|'.join(map(str, reversed(heads)))}, {length}] "
                f"([B|1, H|Hk|1, {length_name}], or [{', '.join(four_d)}])")
    arrays = []
    for raw, name in ((start, f"{kind}.start"), (end, f"{kind}.end")):
        x = as_array(raw, name)
        if x.ndim == 4 and x.shape[unit_axis] == 1:
            x = jnp.squeeze(x, unit_axis)
        _check_int_array(x, name, dims.batch, heads, (length,), expected)
        values = concrete_ints(raw)
        if values is not None:
            if values.size and (values.min() < 0 or values.max() > bound):
                raise ValueError(
                    f"{name} values must lie in [0, {bound_name}] = [0, {bound}] ({bound_what}), "
                    f"got values in [{values.min()}, {values.max()}]")
        arrays.append(x.astype(jnp.int32))
    try:
        shape = jnp.broadcast_shapes(arrays[0].shape, arrays[1].shape)
    except ValueError as e:
        raise ValueError(f"{kind}.start and {kind}.end shapes {arrays[0].shape} and "
                         f"{arrays[1].shape} do not broadcast together") from e
    return tuple(jnp.broadcast_to(x, shape) for x in arrays)


def check_block_indices(indices, block_q, block_k,
                        dims: Dims) -> tuple[jax.Array, int, int]:
    """Block indices (``masks.BlockIndices``): ``indices`` integer ``[B|1, H|Hk|1,
    ceil(Lq / block_q), K]``, ``block_q`` and ``block_k`` static Python ints ``>= 1``.

    Returns ``(indices, block_q, block_k)``, indices int32 of the same shape with every entry
    that names no key block (``-1``, and traced values outside ``[0, ceil(Lk / block_k))``) set
    to -1, so that no cast can wrap a wide value onto a real block; ``K = 0`` becomes one unused
    slot. Concrete entries other than -1 outside that range are rejected as a likely mistake."""
    sizes = []
    for value, name in ((block_q, "BlockIndices.block_q"), (block_k, "BlockIndices.block_k")):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be a Python int (static under jit), got "
                            f"{type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
        sizes.append(int(value))
    # A block longer than its sequence is the whole sequence: the same mask, and no block size
    # past int32 reaches the kernels or the reference's index arithmetic.
    block_q, block_k = min(sizes[0], max(dims.seqlen_q, 1)), min(sizes[1], max(dims.seqlen_k, 1))
    num_q_blocks, num_key_blocks = -(-dims.seqlen_q // block_q), -(-dims.seqlen_k // block_k)
    heads = sorted({1, dims.kv_heads, dims.heads})
    expected = (f"[{dims.batch}|1, {'|'.join(map(str, reversed(heads)))}, {num_q_blocks}, K] "
                f"([B|1, H|Hk|1, ceil(Lq / block_q), K] with Lq = {dims.seqlen_q}, block_q = "
                f"{block_q})")
    x = as_array(indices, "BlockIndices.indices")
    _check_int_array(x, "BlockIndices.indices", dims.batch, heads, (num_q_blocks, None), expected)
    values = concrete_ints(indices)
    if values is not None:
        bad = (values < -1) | (values >= num_key_blocks)
        if bad.any():
            raise ValueError(
                f"BlockIndices.indices entries must be -1 (unused) or key block numbers in "
                f"[0, ceil(Lk / block_k)) = [0, {num_key_blocks}) (Lk = {dims.seqlen_k}, "
                f"block_k = {block_k}), got {values[bad].min()} .. {values[bad].max()} "
                f"outside it")
    if x.shape[3] == 0:
        x = jnp.full((*x.shape[:3], 1), -1, jnp.int32)
    if jnp.iinfo(x.dtype).bits < 32:  # compared in its own dtype, a block number would wrap
        x = x.astype(jnp.int32)
    # Selected after the cast: a listed block number fits int32, anything else becomes -1.
    listed = (x >= 0) & (x < num_key_blocks)
    return jnp.where(listed, x.astype(jnp.int32), -1), block_q, block_k


def check_segment_ids(q_segment_ids, kv_segment_ids,
                      dims: Dims) -> tuple[jax.Array | None, ...]:
    """Sequence-packing segment ids: integer ``[B|1, Lq]`` and ``[B|1, Lk]``, both or neither.

    Returns them as int32 with one batch pattern (an id array of batch 1 is broadcast to the
    other's batch B, O(B·L)), as the kernels read both through one set of batch strides; or
    ``(None, None)``."""
    if q_segment_ids is None and kv_segment_ids is None:
        return None, None
    if q_segment_ids is None or kv_segment_ids is None:
        given, missing = (("q_segment_ids", "kv_segment_ids") if kv_segment_ids is None
                          else ("kv_segment_ids", "q_segment_ids"))
        raise ValueError(
            f"q_segment_ids and kv_segment_ids must be given together: got {given} without "
            f"{missing}")
    ids = []
    for x, name, length, label in ((q_segment_ids, "q_segment_ids", dims.seqlen_q, "Lq"),
                                   (kv_segment_ids, "kv_segment_ids", dims.seqlen_k, "Lk")):
        x = as_array(x, name)
        expected = f"[{dims.batch}|1, {length}] ([B|1, {label}])"
        if x.ndim != 2 or x.shape[0] not in (1, dims.batch) or x.shape[1] != length:
            raise ValueError(
                f"{name} shape {x.shape} is not accepted; expected an integer array of shape "
                f"{expected}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"{name} must be an integer array of shape {expected}, got dtype {x.dtype.name}")
        ids.append(x.astype(jnp.int32))
    batch = max(x.shape[0] for x in ids)
    return tuple(jnp.broadcast_to(x, (batch, x.shape[1])) for x in ids)


def check_window(local_window_size, dims: Dims) -> tuple[int, int]:
    """``(left, right)``, -1 for unbounded (also a bound no key is that far from)."""
    if local_window_size is None:
        return -1, -1
    if isinstance(local_window_size, int | np.integer):
        local_window_size = (local_window_size, local_window_size)
    try:
        left, right = (int(w) for w in local_window_size)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"local_window_size must be an int or (left, right), got {local_window_size!r}") from e
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be >= 0, got {local_window_size!r}")
    limit = dims.seqlen_q + dims.seqlen_k
    return _bound(left, limit), _bound(right, limit)


def check_window_sizes(window_sizes, dims: Dims) -> tuple[tuple[int, int, int], ...] | None:
    """Per-kv-head windows with sinks as ``Hk`` rows ``(sink, left, right)``, or None.

    `window_sizes`: None, or concrete integers of shape ``[3]`` (one window for every kv head) or
    ``[Hk, 3]``: ``sink >= 0`` keys always visible (subject to the other rules), ``left`` /
    ``right`` keys either side of the aligned diagonal, < 0 for unbounded (returned as -1, as is
    a bound no key is that far from; a sink past Lk is Lk). A row bounded on neither side gets
    sink 0, since its band holds every key anyway.
    """
    if window_sizes is None:
        return None
    num_kv_heads = dims.kv_heads
    accepted = (f"concrete integers of shape [3] or [{num_kv_heads}, 3] ([Hk, 3]): rows "
                "(sink >= 0, left, right), a negative left or right for unbounded")
    if isinstance(window_sizes, jax.core.Tracer):
        raise TypeError(f"window_sizes must be {accepted}; got a traced array (its values "
                        "decide which tiles the kernels skip, so they are static)")
    try:
        table = np.asarray(window_sizes)
    except (TypeError, ValueError) as e:
        raise TypeError(f"window_sizes must be {accepted}, got {window_sizes!r}") from e
    if table.dtype == bool or not np.issubdtype(table.dtype, np.integer):
        raise TypeError(f"window_sizes must be {accepted}, got dtype {table.dtype.name}")
    if table.shape == (3,):
        table = np.broadcast_to(table, (num_kv_heads, 3))
    if table.shape != (num_kv_heads, 3):
        raise ValueError(f"window_sizes shape {table.shape} is not accepted; expected {accepted}")
    if (table[:, 0] < 0).any():
        raise ValueError(f"window_sizes sinks must be >= 0, got {table[:, 0].tolist()}")
    rows = []
    limit = dims.seqlen_q + dims.seqlen_k
    for sink, left, right in table.tolist():
        left, right = _bound(left, limit), _bound(right, limit)
        rows.append((min(sink, dims.seqlen_k) if left >= 0 or right >= 0 else 0, left, right))
    return tuple(rows)


def check_softmax_threshold(softmax_threshold) -> float | None:
    """``softmax_threshold``: None or a concrete finite float ``>= 0`` (static: it decides which
    blocks the kernels skip). 0 drops nothing and is returned as None (exact attention)."""
    if softmax_threshold is None:
        return None
    if (isinstance(softmax_threshold, jax.core.Tracer) or isinstance(softmax_threshold, bool)
            or not np.isscalar(softmax_threshold)
            or not np.issubdtype(np.asarray(softmax_threshold).dtype, np.number)
            or np.iscomplexobj(softmax_threshold)):
        raise TypeError(f"softmax_threshold must be None or a concrete Python float >= 0 (it "
                        f"decides which blocks the kernels skip, so it is static), got "
                        f"{softmax_threshold!r}")
    threshold = float(softmax_threshold)
    if not threshold >= 0 or not math.isfinite(threshold):
        raise ValueError(f"softmax_threshold must be a finite float >= 0 (a multiple of the "
                         f"uniform probability 1 / n_i; 0 or None: exact), got "
                         f"{softmax_threshold!r}")
    return threshold if threshold > 0 else None


def check_gate(gate, gate_threshold, dims: Dims,
               dtype) -> tuple[jax.Array | None, jax.Array | None, float | None]:
    """The gate of gated attention: ``gate=(alpha, delta)``, floating alpha ``[B, Lq, H]`` (one
    value per query row and head) and delta ``[B, Lk, Hk]`` (per key and kv head), or None; and
    its threshold, None or a concrete float ``< 0`` (logsigmoid is negative everywhere, so a
    threshold ``>= 0`` would drop every block), only with a gate.

    Returns ``(alpha, delta, threshold)``, alpha and delta cast to float32 (float64 for a
    float64 query; their gradients come back in their own dtypes), or ``(None, None, None)``."""
    if gate is None:
        if gate_threshold is not None:
            raise ValueError(f"gate_threshold={gate_threshold!r} needs a gate: pass "
                             "gate=(alpha, delta)")
        return None, None, None
    accepted = (f"gate must be a pair (alpha, delta) of floating arrays, alpha [B, Lq, H] = "
                f"[{dims.batch}, {dims.seqlen_q}, {dims.heads}] and delta [B, Lk, Hk] = "
                f"[{dims.batch}, {dims.seqlen_k}, {dims.kv_heads}]")
    if not isinstance(gate, (tuple, list)) or len(gate) != 2:
        raise TypeError(f"{accepted}, got {type(gate).__name__}"
                        + (f" of length {len(gate)}" if isinstance(gate, (tuple, list)) else ""))
    arrays = []
    for x, name, shape in ((gate[0], "alpha", (dims.batch, dims.seqlen_q, dims.heads)),
                           (gate[1], "delta", (dims.batch, dims.seqlen_k, dims.kv_heads))):
        if x is None:
            raise TypeError(f"{accepted}; gate {name} is None")
        x = as_array(x, f"gate {name}")
        if x.shape != shape:
            raise ValueError(f"gate {name} shape {x.shape} is not accepted; {accepted}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"gate {name} must be floating, got dtype {x.dtype.name}; {accepted}")
        arrays.append(x.astype(jnp.float64 if dtype == jnp.float64 else jnp.float32))
    threshold = None
    if gate_threshold is not None:
        if (isinstance(gate_threshold, jax.core.Tracer) or isinstance(gate_threshold, bool)
                or not np.isscalar(gate_threshold)
                or not np.issubdtype(np.asarray(gate_threshold).dtype, np.number)):
            raise TypeError(f"gate_threshold must be None or a concrete Python float < 0 (it "
                            f"decides which blocks the kernels skip, so it is static), got "
                            f"{gate_threshold!r}")
        threshold = float(gate_threshold)
        if not threshold < 0 or not math.isfinite(threshold):
            raise ValueError(f"gate_threshold must be a finite float < 0 (logsigmoid is "
                             f"negative everywhere: a threshold >= 0 drops every block), got "
                             f"{gate_threshold!r}")
    return arrays[0], arrays[1], threshold
