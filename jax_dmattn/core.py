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
    return _attention(params, *_vary_alike(q, k, v, mask, bias, q_lens, kv_lens))


def _varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside shard_map (empty elsewhere)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary_alike(*operands):
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
