"""The differentiable attention operation behind both front ends.

``attention`` takes validated, normalised operands (see ``attention.py``) and returns
``(out, lse)``. The ``xla`` implementation is the pure-JAX reference, differentiated by JAX; every
other choice runs the kernels through a ``custom_vjp`` whose forward saves q, k, v, mask, bias,
out and lse, and whose backward returns dq, dk, dv and dbias (the mask and lengths get none).
"""

from __future__ import annotations

import functools

import jax

from jax_dmattn import batching, ops, reference  # noqa: F401  (batching registers vmap rules)
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
) -> tuple[jax.Array, jax.Array]:
    """``(out [B, Lq, H, D], lse [B, H, Lq] float32)`` for normalised operands."""
    if params.implementation == "xla":
        return reference.attention(params, q, k, v, mask, bias, q_lens, kv_lens)
    return _attention(params, q, k, v, mask, bias, q_lens, kv_lens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(params, q, k, v, mask, bias, q_lens, kv_lens):
    out, lse = ops.forward(params, q, k, v, mask, bias, q_lens, kv_lens)
    return out, lse


def _attention_fwd(params, q, k, v, mask, bias, q_lens, kv_lens):
    out, lse = ops.forward(params, q, k, v, mask, bias, q_lens, kv_lens)
    return (out, lse), (q, k, v, mask, bias, q_lens, kv_lens, out, lse)


def _attention_bwd(params, residuals, cotangents):
    q, k, v, mask, bias, q_lens, kv_lens, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv, dbias = ops.backward(params, q, k, v, out, dout, lse, dlse, mask, bias, q_lens,
                                     kv_lens)
    return dq, dk, dv, None, dbias, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
