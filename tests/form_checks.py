"""Helpers the tests of the mask forms and window tables share (test_key_ranges.py,
test_row_ranges.py, test_block_indices.py, test_mask_tuple.py, test_window_sinks.py): random
inputs, a loss using out and lse with its gradients, closeness checks that also demand the same
non-finite entries, the comparison with a dense mask under every other rule (CPU kernels; CUDA
kernels against the float64 reference), the jit / vmap check, the HLO of a training step, the
check that the CUDA lowering hands a form's operands to the kernels, and the check that the CUDA
path refuses what it does not take."""

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

def assert_cuda_refuses(params, reason):
    """With a (fake) CUDA build that has kernels for the call, ``ops.uses_kernel`` refuses
    `params`: None warns once naming `reason`, then stays silent; implementation="cuda" raises;
    the CPU kernels take the call."""
    from jax_dmattn import ops

    call = (jnp.bfloat16, 128)
    with pytest.warns(RuntimeWarning, match=reason):
        assert not ops.uses_kernel("cuda", params, *call)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ops.uses_kernel("cuda", params, *call)
    with pytest.raises(ValueError, match=reason):
        ops.uses_kernel("cuda", dataclasses.replace(params, implementation="cuda"), *call)
    assert ops.uses_kernel("cpu", params, *call)


def lower_for_cuda(q, k, v, *mask, **kw):
    """Traces ``jit(grad)`` of a loss of ``flash_dmattn(q, k, v, *mask, **kw)`` and lowers it for
    the cuda platform (no GPU needed: with a fake CUDA build, the FFI calls it makes are what
    conftest.record_ffi_calls records)."""
    def loss(q, k, v):
        return jnp.sum(flash_dmattn(q, k, v, *mask, **kw).astype(jnp.float32))

    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",))


def assert_cuda_lowering_reads(calls, q, k, v, mask, operands, gate=None, **attrs):
    """Lowered for cuda with a fake CUDA build (conftest.fake_cuda_build; `calls` from
    conftest.record_ffi_calls), ``jit(grad)`` of ``flash_dmattn(q, k, v, mask, gate=gate)``
    calls the CUDA kernels' forward and backward, with implementation None and "cuda" alike and
    without a warning (a fallback to the reference would warn or raise): each call's operands
    after the fixed ones (q, k, v; and out, dout, lse, dlse for the backward) are `operands`,
    ``(shape, dtype)`` pairs, the CUDA mask map and bits last with a bool mask, and its
    attributes hold `attrs`."""
    from jax_dmattn import _ffi

    for implementation in (None, "cuda"):
        calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lower_for_cuda(q, k, v, mask, implementation=implementation, gate=gate)
        by_target = {target: (ops, got) for target, ops, got in calls}
        assert set(by_target) == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}, calls
        for target, (ops, got) in by_target.items():
            first = 3 if target == _ffi.FORWARD_TARGET else 7
            assert ops[first:] == operands, (implementation, target, ops)
            assert {name: got[name] for name in attrs} == attrs, (implementation, target)


def mask_summaries(batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                   cell: int = 64) -> list[tuple]:
    """``(shape, dtype)`` of the CUDA mask map and bits of a bool mask ``[batch, heads, Lq, Lk]``
    (_ffi.call_mask_map) with a mask map cell of `cell`."""
    u8 = jnp.dtype(jnp.uint8)
    return [((batch, heads, -(-seqlen_q // cell), -(-seqlen_k // cell)), u8),
            ((batch, heads, seqlen_q, -(-seqlen_k // 128) * 16), u8)]


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


def causal_step_texts(q, k, v, mask, implementation: str = "cpu",
                      lowering_platform: str | None = None) -> dict[str, str]:
    """The StableHLO and the compiled HLO (``{"stablehlo": .., "compiled": ..}``) of a jitted
    causal value-and-grad step of ``flash_dmattn(q, k, v, mask)`` with `implementation`, the mask
    an argument of the step, for checking which arrays it creates. With `lowering_platform`
    (e.g. ``"cuda"`` with a fake CUDA build on this machine) the step is lowered for that
    platform and not compiled: the StableHLO alone."""
    def loss(q, k, v, mask):
        out = flash_dmattn(q, k, v, mask, is_causal=True, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, k, v, mask)
    if lowering_platform is not None:
        return {"stablehlo": traced.lower(lowering_platforms=(lowering_platform,)).as_text()}
    lowered = traced.lower()
    return {"stablehlo": lowered.as_text(), "compiled": lowered.compile().as_text()}


# ---- the CUDA kernels against the float64 reference (GPU tests) -------------------------------


def require_cuda_kernel(head_dim: int, dtype) -> None:
    """Skips the calling GPU test where this build has no CUDA kernel for `head_dim` / `dtype`
    (a partial build: JAX_DMATTN_HEAD_DIMS, JAX_DMATTN_DTYPES)."""
    from jax_dmattn import _ffi

    name = jnp.dtype(dtype).name
    if head_dim not in _ffi.cuda_head_dims() or name not in _ffi.cuda_dtypes():
        pytest.skip(f"this build has no CUDA kernel for head dim {head_dim} / {name}")


# A window table (sink, left, right) per kv head for two kv heads: sinks apart from the band (the
# walks step over the gap) and inside it.
GPU_TABLE = ((64, 200, 0), (5, 300, 40))


def assert_cuda_with_every_rule(rng, q, k, v, forms: tuple, dense):
    """implementation="cuda" with the O(L) masks `forms` in a tuple with a random dense bool mask
    ``[B, 1, Lq, Lk]``, beside a bias ``[B, H, Lq, Lk]``, sequence lengths (the second example
    shorter on both sides), segment ids and a window table with sinks (GPU_TABLE: Hk = 2)
    through dot_product_attention, against the float64 ``xla`` implementation given the same
    rules with the and of the dense mask and `dense`, the and of `forms` as a bool mask
    ``[B|1, H|Hk|1, Lq, Lk]``: out, lse and the gradients (dbias too), as
    :func:`assert_results_close` in q's dtype. q ``[2, Lq, H, D]``, k and v ``[2, Lk, 2, D]``."""
    batch, lq, heads, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    require_cuda_kernel(q.shape[-1], q.dtype)
    bias = jnp.asarray(rng.standard_normal((batch, heads, lq, lk)), q.dtype)
    member = rng.random((batch, 1, lq, lk)) < 0.9
    kw = dict(query_seq_lengths=jnp.array([lq, 2 * lq // 3], jnp.int32),
              key_value_seq_lengths=jnp.array([lk - 30, lk], jnp.int32),
              q_segment_ids=np.sort(rng.integers(0, 3, (batch, lq)), axis=1).astype(np.int32),
              kv_segment_ids=np.sort(rng.integers(0, 3, (batch, lk)), axis=1).astype(np.int32),
              window_sizes=GPU_TABLE, return_residual=True)

    def attend(implementation):
        def fn(q, k, v, mask, bias):
            return dot_product_attention(q, k, v, bias, mask, implementation=implementation, **kw)
        return fn

    got = outputs_and_grads(attend("cuda"), q, k, v, bias, (member, *forms))
    want = outputs_and_grads(attend("xla"), to64(q), to64(k), to64(v), to64(bias),
                             jnp.asarray(member & dense))
    assert_results_close(*got, *want, q.dtype)
