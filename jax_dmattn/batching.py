"""vmap rules: each mapped axis becomes one more leading batch dim of the primitive.

An unmapped k, v, mask, bias or length array gets a size-1 dim there (a free reshape) and is read
with stride 0, so vmap never copies it. The query-shaped operands (q, and out/dout/lse/dlse in the
backward) define the batch: if one of them is unmapped while another operand is mapped, it is
broadcast, which copies only a query-sized array.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.interpreters import batching

from jax_dmattn import ops


def _leading(x, dim, size: int, broadcast: bool):
    if dim is None:
        x = jnp.expand_dims(x, 0)
        return jnp.broadcast_to(x, (size, *x.shape[1:])) if broadcast else x
    return jnp.moveaxis(x, dim, 0)


def _batch(primitive, num_query_like: int):
    def rule(args, dims, **params):
        size = next(x.shape[d] for x, d in zip(args, dims, strict=True)
                    if d is not None)
        moved = [_leading(x, d, size, broadcast=i == 0 or (3 <= i < num_query_like))
                 for i, (x, d) in enumerate(zip(args, dims, strict=True))]
        outs = primitive.bind(*moved, **params)
        return outs, [0] * len(outs)

    return rule


batching.primitive_batchers[ops.forward_p] = _batch(ops.forward_p, num_query_like=1)
# q, out, dout, lse, dlse are query-shaped (indices 0 and 3..6).
batching.primitive_batchers[ops.backward_p] = _batch(ops.backward_p, num_query_like=7)
