"""The forward over a paged KV cache: its primitive, shapes and lowering per platform.

Operands ``q, k_pages, v_pages, page_table, q_lens, kv_lens, [mask], [bias] -> out, lse``: q
``[*B, Lq, H, D]``, the pools ``[P, page_size, Hk, D]`` (no batch dims: every sequence's pages
come from them), page_table int32 ``[*B|1, max_pages]``, the lengths int32 ``[*B|1]``, mask and
bias ``[*B|1, H|Hk|1, Lq|1, Lk|1]`` with ``Lk = max_pages * page_size``; out in q's dtype, lse
float32 ``[*B, H, Lq]``. Key ``j`` of sequence ``b`` is row ``j % page_size`` of page
``page_table[b, j // page_size]`` (clamped into ``[0, P)``, as the kernels read it).

Lowering: the CPU kernels and the CUDA decode forward read the pages in place (through
``sharding``'s partitioned call, handed over by :func:`register_lowerings` as for ``ops``); other
CUDA calls (more query rows than the decode forward takes, a head dim it lacks) gather the pages
into a contiguous cache first and run the forward primitive (a copy of the sequences' pages,
which a prefill's compute outweighs); without a kernel, the reference over gathered pages.
Forward only: differentiating it raises.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from jax_dmattn import reference
from jax_dmattn._primitives import _ffi, ops
from jax_dmattn.params import AttentionParams

paged_forward_p = Primitive("dmattn_paged_fwd")
paged_forward_p.multiple_results = True


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """The contiguous cache ``[*B, max_pages * page_size, Hk, D]`` of pools ``[P, page_size, Hk,
    D]`` and page_table int32 ``[*B, max_pages]`` (entries clamped into ``[0, P)``, as the
    kernels read them)."""
    gathered = pages[jnp.clip(page_table, 0, pages.shape[0] - 1)]
    return gathered.reshape(*page_table.shape[:-1], -1, *pages.shape[2:])


def paged_forward(params: AttentionParams, q, k_pages, v_pages, page_table, q_lens, kv_lens,
                  mask=None, bias=None) -> list:
    """``[out [*B, Lq, H, D], lse [*B, H, Lq] float32]``."""
    extras = [x for x in (mask, bias) if x is not None]
    return paged_forward_p.bind(q, k_pages, v_pages, page_table, q_lens, kv_lens, *extras,
                                params=params, has_mask=mask is not None,
                                has_bias=bias is not None)


def split_extras(extras, has_mask: bool, has_bias: bool) -> tuple:
    """``[mask], [bias]`` -> ``(mask, bias)`` with Nones."""
    extras = list(extras)
    mask = extras.pop(0) if has_mask else None
    bias = extras.pop(0) if has_bias else None
    return mask, bias


def _abstract_eval(q, k_pages, v_pages, page_table, q_lens, kv_lens, *extras, params, has_mask,
                   has_bias):
    return [ops._like(q, q.shape, q.dtype), ops._like(q, ops.lse_shape(q.shape), jnp.float32)]


def _no_gradient(primals, tangents, **params):
    raise NotImplementedError(
        "jax_dmattn.paged_attention is forward only (decoding); differentiate flash_dmattn over "
        "a contiguous cache (paged.gather_pages) instead")


def reference_forward(params: AttentionParams, q, k_pages, v_pages, page_table, q_lens, kv_lens,
                      mask=None, bias=None) -> tuple:
    """``(out, lse)`` of the pure-JAX reference over the gathered pages (differentiable)."""
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    out, lse = reference.attention(params, q, k, v, mask, bias, q_lens, kv_lens)
    return out.astype(q.dtype), lse


def _reference(params, has_mask, has_bias, q, k_pages, v_pages, page_table, q_lens, kv_lens,
               *extras):
    return reference_forward(params, q, k_pages, v_pages, page_table, q_lens, kv_lens,
                             *split_extras(extras, has_mask, has_bias))


def _gathered_kernel(params, has_mask, has_bias, q, k_pages, v_pages, page_table, q_lens,
                     kv_lens, *extras):
    mask, bias = split_extras(extras, has_mask, has_bias)
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    return ops.forward(params, q, k, v, mask, bias, q_lens, kv_lens)


def _reads_pages_in_place(platform: str, q, k_pages, page_table, mask, bias) -> bool:
    """Whether the platform's kernel reads this call's pages in place (the CUDA decode forward
    takes it), by the shapes the kernel sees."""
    if platform == "cpu":
        return True
    *_, seqlen_q, heads, head_dim = q.shape
    batch = math.prod(q.shape[:-3])
    keys = (batch, page_table.shape[-1] * k_pages.shape[1], k_pages.shape[2], head_dim)

    def flat(x):
        return None if x is None else (1, *x.shape[-3:])

    kernel = _ffi.cuda_forward_kernel((batch, seqlen_q, heads, head_dim), keys, flat(mask),
                                      flat(bias))
    return kernel == "decode"


def _lowering(platform: str, in_place: Callable | None):
    def rule(ctx, *args, params, has_mask, has_bias):
        q, k_pages, _, page_table, *_ = ctx.avals_in
        mask, bias = split_extras(ctx.avals_in[6:], has_mask, has_bias)
        if platform in ("cpu", "cuda") and ops.uses_kernel(platform, params, q.dtype,
                                                           q.shape[-1]):
            if _reads_pages_in_place(platform, q, k_pages, page_table, mask, bias):
                opts = ops.Optionals(has_mask, has_bias, has_seqlens=True)
                fn = functools.partial(in_place, platform, params, opts)
            else:
                fn = functools.partial(_gathered_kernel, params, has_mask, has_bias)
        else:
            fn = functools.partial(_reference, params, has_mask, has_bias)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    return rule


def register_lowerings(in_place: Callable) -> None:
    """Lowers the primitive on ``cpu`` and ``cuda`` with `in_place` (``in_place(platform,
    params, opts, *operands) -> [out, lse]``, opts the ``ops.Optionals`` of its mask and bias)
    where a kernel reads the call's pages, and to the reference elsewhere. Until then it has no
    lowering at all, like ``ops``' primitives."""
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(paged_forward_p, _lowering(platform, in_place), platform=platform)
    mlir.register_lowering(paged_forward_p, _lowering("other", None))


# The gathered fallback lowers the forward primitive, whose lowering needs the device assignment
# (ops.py).
dispatch.prim_requires_devices_during_lowering.add(paged_forward_p)
paged_forward_p.def_abstract_eval(_abstract_eval)
paged_forward_p.def_impl(ops._eager(paged_forward_p))
ad.primitive_jvps[paged_forward_p] = _no_gradient
