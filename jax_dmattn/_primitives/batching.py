"""vmap rules: each mapped axis becomes one more leading batch dim of the primitive.

Attention: an unmapped mask, bias, length, segment id, key or row range or block index array
gets a size-1 dim there (a free reshape) and is read with stride 0, so vmap never copies it (the
block indices are one array, in no pair); k and v likewise when
both are unmapped, and so are the two lengths, the two segment id arrays and the two key (or row)
range arrays (each pair is read through one set of batch strides: where only one of a pair is
mapped, the other is broadcast, O(L) int32). The query-shaped operands (q, and out/dout/lse/dlse
in the backward) define the batch: one of them unmapped while another operand is mapped is
broadcast, which copies a query-sized array, and so is k or v when only the other one is mapped
(the kernels read k and v through one layout). The gate's alpha and delta are O(L) and always
get the full batch dims (an unmapped one is broadcast; vmap's custom_vjp rule sums its
per-example gradient). The backward's drop map (softmax-threshold skipping) likewise.
Dynamic attention's key-list helpers (the listed keys' gradient sum, the block range masks)
broadcast any unmapped operand.

The paged forward: its pools have no batch dims. Unmapped pools stay shared by every example; a
mapped pool (each example its own pages) becomes one pool of the examples' pages side by side,
each example's page table offset to its own (the other pool is broadcast if only one is mapped,
a copy of the pool). The page table and the lengths follow the rules above.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.interpreters import batching

from jax_dmattn import masks
from jax_dmattn._primitives import ops, paged


def _leading(x, dim, size: int, broadcast: bool):
    if dim is None:
        x = jnp.expand_dims(x, 0)
        return jnp.broadcast_to(x, (size, *x.shape[1:])) if broadcast else x
    return jnp.moveaxis(x, dim, 0)


def _pairs(opts: ops.Optionals, num_fixed: int) -> list[tuple[int, int]]:
    """Operand positions of the pairs read through one layout: k and v, the two lengths, the two
    segment id arrays, the two key range arrays, the two row range arrays."""
    pairs = [(1, 2)]
    first = num_fixed + int(opts.has_mask) + int(opts.has_bias)
    for present in (opts.has_seqlens, opts.has_segments, opts.has_key_ranges,
                    opts.has_row_ranges):
        if present:
            pairs.append((first, first + 1))
            first += 2
    return pairs


def _gate_operands(opts: ops.Optionals, num_fixed: int) -> set[int]:
    """Operand positions of the gate's alpha and delta (none without a gate): last."""
    if not opts.has_gate:
        return set()
    first = num_fixed + sum((opts.has_mask, opts.has_bias, 2 * opts.has_seqlens,
                             2 * opts.has_segments, 2 * opts.has_key_ranges,
                             2 * opts.has_row_ranges, opts.has_block_indices))
    return {first, first + 1}


def _batch(primitive, query_like: frozenset[int], num_fixed: int):
    """`query_like`: the query-shaped operands; `num_fixed`: how many operands precede the
    optional ones."""

    def rule(args, dims, **params):
        size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
        broadcast = set(query_like) | _gate_operands(params["opts"], num_fixed)
        if params["opts"].drop_map(args) is not None:  # the backward's drop map: full batch
            broadcast.add(len(args) - 1)
        for a, b in _pairs(params["opts"], num_fixed):
            if (dims[a] is None) != (dims[b] is None):
                broadcast.update((a, b))
        moved = [_leading(x, d, size, broadcast=i in broadcast)
                 for i, (x, d) in enumerate(zip(args, dims, strict=True))]
        outs = primitive.bind(*moved, **params)
        return outs, [0] * len(outs)

    return rule


batching.primitive_batchers[ops.forward_p] = _batch(ops.forward_p, frozenset({0}), 3)
# q, out, dout, lse, dlse are query-shaped (operands 0 and 3..6).
batching.primitive_batchers[ops.backward_p] = _batch(ops.backward_p, frozenset({0, 3, 4, 5, 6}),
                                                       7)


def _batch_paged(args, dims, *, params, has_mask, has_bias):
    size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
    q, k, v, table, q_lens, kv_lens, *extras = (
        x if i in (1, 2) else _leading(x, d, size, broadcast=i == 0)
        for i, (x, d) in enumerate(zip(args, dims, strict=True)))
    if dims[1] is not None or dims[2] is not None:
        k, v = (_leading(x, d, size, broadcast=True) for x, d in zip(args[1:3], dims[1:3],
                                                                      strict=True))
        pages = k.shape[1]
        first_page = jnp.arange(size, dtype=jnp.int32) * pages
        table = jnp.clip(table, 0, pages - 1) + first_page.reshape(size, *[1] * (table.ndim - 1))
        k, v = (x.reshape(-1, *x.shape[2:]) for x in (k, v))
    if (dims[4] is None) != (dims[5] is None):
        q_lens, kv_lens = (jnp.broadcast_to(x, (size, *x.shape[1:])) for x in (q_lens, kv_lens))
    outs = paged.paged_forward_p.bind(q, k, v, table, q_lens, kv_lens, *extras, params=params,
                                      has_mask=has_mask, has_bias=has_bias)
    return outs, [0] * len(outs)


batching.primitive_batchers[paged.paged_forward_p] = _batch_paged


def _batch_every_operand(primitive):
    """For primitives whose operands all share the leading batch dims (dynamic attention's key
    helpers, whose operands are small int32 lists or the cotangent itself): an unmapped operand is
    broadcast."""
    def rule(args, dims, **params):
        size = next(x.shape[d] for x, d in zip(args, dims, strict=True) if d is not None)
        moved = [_leading(x, d, size, broadcast=True) for x, d in zip(args, dims, strict=True)]
        return primitive.bind(*moved, **params), 0

    return rule


for _primitive in (ops.sum_listed_keys_p, masks._range_mask_p):
    batching.primitive_batchers[_primitive] = _batch_every_operand(_primitive)
