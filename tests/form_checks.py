"""Helpers the tests of the mask forms and window tables share (test_key_ranges.py,
test_row_ranges.py, test_block_indices.py, test_mask_tuple.py, test_window_sinks.py): random
inputs, a loss using out and lse with its gradients, closeness checks that also demand the same
non-finite entries, the comparison with a dense mask under every other rule, the jit / vmap
check, the HLO of a training step, and the checks that the CUDA path refuses a form it does not
read."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dmattn import dot_product_attention, flash_dmattn


def qkv(rng, batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype=np.float32):
    """Fresh normal q ``[B, Lq, H, D]``, k and v ``[B, Lk, Hk, D]`` in `dtype`."""
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim))
    k = rng.standard_normal((batch, seqlen_k, kv_heads, head_dim))
    v = rng.standard_normal((batch, seqlen_k, kv_heads, head_dim))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def outputs_and_grads(fn, q, k, v, bias, *mask):
    """out, lse and the gradients of a loss using both (q, k, v and bias when given) of
    ``fn(q, k, v, [mask,] bias) -> (out, lse)``."""

    def loss(q, k, v, bias):
        out, lse = fn(q, k, v, *mask, bias)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
        return (jnp.sum(out.astype(jnp.float32) * weights)
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.3)), (out, lse)

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    grads, (out, lse) = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias)
    return out, lse, grads


def flash(implementation, **kw):
    """``fn(q, k, v, mask, bias) -> (out, lse)``: flash_dmattn with `implementation` and `kw`."""
    def fn(q, k, v, mask, bias):
        return flash_dmattn(q, k, v, mask, bias, return_lse=True, implementation=implementation,
                            **kw)
    return fn


def to64(x):
    return None if x is None else jnp.asarray(x, jnp.float64)


def assert_close(actual, expected, dtype, what):
    """Equal non-finite entries, the finite ones within 2e-2 (bf16), 2.5e-3 (fp16: the same
    multiple of its epsilon, 2^-11 against bf16's 2^-8) or 2e-5 (fp32) of the largest."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(actual), finite, err_msg=what)
    half = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2.5e-3}
    tol = half.get(jnp.dtype(dtype), 2e-5)
    scale = max(1.0, np.abs(expected[finite]).max(initial=0.0))
    np.testing.assert_allclose(actual[finite], expected[finite], atol=tol * scale, rtol=tol,
                               err_msg=what)


def assert_results_close(out, lse, grads, ref_out, ref_lse, ref_grads, dtype):
    """out (and each gradient, which must be of `dtype`) as assert_close in `dtype`, lse as in
    float32, against a reference's; gradients named in the order q, k, v, bias."""
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, jnp.float32, "lse")
    names = "q k v bias".split()[:len(grads)]
    for name, g, ref in zip(names, grads, ref_grads, strict=True):
        assert g.dtype == dtype, name
        assert_close(g, ref, dtype, f"d{name}")

def assert_equals_dense_with_every_rule(rng, q, k, v, form, dense):
    """`form` gives through the CPU kernels what its dense bool mask `dense` gives, gradients
    included, with every other rule: dot_product_attention with a bias, the window (50, 10),
    sequence lengths (all, and 90 queries / 120 keys: batch 2) and segment ids (four query
    segments of Lq / 4 rows, sorted random key ids). The bias and key ids are drawn from `rng`."""
    batch, lq, heads, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    bias = jnp.asarray(rng.standard_normal((batch, heads, lq, lk)), jnp.float32)
    q_seg = np.repeat(np.arange(4), lq // 4)[None].repeat(batch, 0)
    kv_seg = np.sort(rng.integers(0, 4, (batch, lk)), axis=1)
    kw = dict(local_window_size=(50, 10), query_seq_lengths=jnp.array([lq, 90], jnp.int32),
              key_value_seq_lengths=jnp.array([lk, 120], jnp.int32), q_segment_ids=q_seg,
              kv_segment_ids=kv_seg, implementation="cpu", return_residual=True)

    def fn(q, k, v, mask, bias):
        return dot_product_attention(q, k, v, bias, mask, **kw)

    got = outputs_and_grads(fn, q, k, v, bias, form)
    want = outputs_and_grads(fn, q, k, v, bias, jnp.asarray(dense))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6)

def assert_cuda_refuses(params, reason, **form):
    """With a (fake) CUDA build that has kernels for the call, ``ops.uses_kernel`` refuses
    `params` with `form` (its keyword flags, e.g. ``has_key_ranges=True``): None warns once naming
    `reason`, then stays silent; implementation="cuda" raises; the CPU kernels take the call."""
    from jax_dmattn import ops

    call = (jnp.bfloat16, 128)
    with pytest.warns(RuntimeWarning, match=reason):
        assert not ops.uses_kernel("cuda", params, *call, **form)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ops.uses_kernel("cuda", params, *call, **form)
    with pytest.raises(ValueError, match=reason):
        ops.uses_kernel("cuda", dataclasses.replace(params, implementation="cuda"), *call, **form)
    assert ops.uses_kernel("cpu", params, *call, **form)


def lower_for_cuda(q, k, v, *mask, **kw):
    """Traces ``jit(grad)`` of a loss of ``flash_dmattn(q, k, v, *mask, **kw)`` and lowers it for
    the cuda platform (no GPU needed: with a fake CUDA build, the FFI calls it makes are what
    conftest.record_ffi_calls records)."""
    def loss(q, k, v):
        return jnp.sum(flash_dmattn(q, k, v, *mask, **kw).astype(jnp.float32))

    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",))


def assert_vmap_matches_each(one, operands, in_axes, count, argnums=(0, 1, 2)):
    """``jit(vmap(one))`` and ``jit(vmap(grad))`` (by the operands `argnums`: q, k, v by default)
    of a loss of `one`, for each tuple of `in_axes`, equal `one` and its gradients on each of the
    `count` examples; an operand with axis None is passed as its example 0 to every call."""
    def loss(*args):
        return jnp.sum(jnp.sin(one(*args)))

    grad = jax.grad(loss, argnums=argnums)
    for axes in in_axes:
        args = [x if a is not None else x[0] for x, a in zip(operands, axes, strict=True)]
        got = jax.jit(jax.vmap(one, in_axes=axes))(*args)
        got_grad = jax.jit(jax.vmap(grad, in_axes=axes))(*args)
        for e in range(count):
            each = [x[e] if a is not None else x for x, a in zip(args, axes, strict=True)]
            np.testing.assert_allclose(got[e], one(*each), atol=1e-6, err_msg=str(axes))
            for g, ref in zip(got_grad, grad(*each), strict=True):
                np.testing.assert_allclose(g[e], ref, atol=1e-5, err_msg=str(axes))


def causal_step_texts(q, k, v, mask):
    """The StableHLO and the compiled HLO (``{"stablehlo": .., "compiled": ..}``) of a jitted
    causal CPU-kernel value-and-grad step of ``flash_dmattn(q, k, v, mask)``, for checking which
    arrays it creates."""
    def loss(q, k, v, mask):
        return jnp.sum(flash_dmattn(q, k, v, mask, is_causal=True, implementation="cpu") ** 2)

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v, mask)
    return {"stablehlo": lowered.as_text(), "compiled": lowered.compile().as_text()}
