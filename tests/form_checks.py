"""Helpers the tests of the mask forms and window tables share (test_key_ranges.py,
test_row_ranges.py, test_block_indices.py, test_mask_tuple.py, test_window_sinks.py): random
inputs, a loss using out and lse with its gradients, and a closeness check that also demands the
same non-finite entries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dmattn import flash_dmattn


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
    """Equal non-finite entries, the finite ones within 2e-2 (bf16) or 2e-5 of the largest."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(actual), finite, err_msg=what)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    scale = max(1.0, np.abs(expected[finite]).max(initial=0.0))
    np.testing.assert_allclose(actual[finite], expected[finite], atol=tol * scale, rtol=tol,
                               err_msg=what)
