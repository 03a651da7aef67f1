"""Softmax-threshold tile skipping (``softmax_threshold``, issue 27 item 1) on the CPU kernels.

The rule (flash_dmattn's docstring, reference.softmax_skip_blocks): on the fixed grid of 64 x 128
blocks from position 0, each block of rows visits its key blocks in increasing order and drops a
block when every visible score of every row there is below the row's log-sum-exp over the blocks
kept before it plus ``log(threshold / n_i)``. The forward records the dropped blocks, the
backward skips exactly those.

Oracles: the float64 ``xla`` implementation with the same threshold (which applies the rule block
by block in float64), the rule written again here in numpy (a loop over blocks), and exact
attention (threshold None) for the documented error bound.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_block_indices as blocks
from conftest import fake_cuda_build, record_ffi_calls
from form_checks import (
    assert_close,
    assert_vmap_matches_each,
    lower_for_cuda,
    outputs_and_grads,
    qkv,
    require_cuda_kernel,
    to64,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dmattn import _ffi, dot_product_attention, flash_dmattn, masks, ops, reference
from jax_dmattn.params import SKIP_BLOCK_K, SKIP_BLOCK_Q, AttentionParams

# ---- inputs and helpers -----------------------------------------------------------------------


def sharp_qkv(rng, batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype=np.float32,
              sharp=(0, 1, 2), extra=0):
    """Trained-like inputs: the queries share a direction u, and a few keys per row (those at
    `sharp`, plus `extra` random ones per 128 keys after the first block) point along it, so
    each row's softmax is dominated by a few keys. Fresh normal noise everywhere (never zeros)."""
    u = rng.standard_normal(head_dim)
    u /= np.linalg.norm(u)
    q = 0.5 * rng.standard_normal((batch, seqlen_q, heads, head_dim)) + 4.0 * u
    k = rng.standard_normal((batch, seqlen_k, kv_heads, head_dim))
    v = rng.standard_normal((batch, seqlen_k, kv_heads, head_dim))
    picks = list(sharp)
    for j0 in range(SKIP_BLOCK_K, seqlen_k, SKIP_BLOCK_K):
        picks += list(rng.integers(j0, min(j0 + SKIP_BLOCK_K, seqlen_k), extra))
    k[:, picks] += 30.0 * u
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def runner(implementation, threshold, mask=None, **kw):
    def fn(q, k, v, bias):
        return flash_dmattn(q, k, v, mask, bias, return_lse=True, softmax_threshold=threshold,
                            implementation=implementation, **kw)
    return fn


def kernel_drop_map(params, q, k, v, mask=None, bias=None):
    """The kernel forward's drop map (the CPU kernels', or on a GPU the CUDA kernels')."""
    return np.asarray(jax.jit(lambda q, k, v, mask, bias: ops.forward(
        params, q, k, v, mask, bias)[2])(q, k, v, mask, bias))


def numpy_rule(s, visible, counts, threshold):
    """The rule written with loops, in float64: dropped blocks ``[nQB, nKB]`` of one head's
    scores ``s [Lq, Lk]`` (visible bool, counts n_i [Lq])."""
    lq, lk = s.shape
    nqb, nkb = -(-lq // SKIP_BLOCK_Q), -(-lk // SKIP_BLOCK_K)
    dropped = np.zeros((nqb, nkb), bool)
    for qb in range(nqb):
        rows = slice(qb * SKIP_BLOCK_Q, (qb + 1) * SKIP_BLOCK_Q)
        lse = np.full(s[rows].shape[0], -np.inf)
        for kb in range(nkb):
            cols = slice(kb * SKIP_BLOCK_K, (kb + 1) * SKIP_BLOCK_K)
            block = np.where(visible[rows, cols], s[rows, cols], -np.inf)
            if not np.isfinite(block).any():
                continue
            with np.errstate(divide="ignore"):
                cut = lse + np.log(threshold / np.maximum(counts[rows], 1))
            if not (block >= cut[:, None])[np.isfinite(block)].any():
                dropped[qb, kb] = True
                continue
            lse = np.logaddexp(lse, np.logaddexp.reduce(block, axis=1))
    return dropped


def assert_matches_rule(implementation, t, q, k, v, mask, bias, causal, softcap=None, **kw):
    """out, lse and every gradient of `implementation` (no fallback warning) equal the float64
    reference applying the same rule; its drop map equals the reference's and drops blocks.
    Returns the drop map."""
    dtype, dim = q.dtype, q.shape[-1]
    lq, lk = q.shape[-3], k.shape[-3]
    kw = dict(is_causal=causal, softcap=softcap, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = outputs_and_grads(runner(implementation, t, mask, **kw), q, k, v, bias)
    want = outputs_and_grads(runner("xla", t, mask, **kw), to64(q), to64(k), to64(v),
                             to64(bias))
    assert_close(got[0], want[0], dtype, "out")
    assert_close(got[1], want[1], jnp.float32, "lse")
    for name, g, w in zip("q k v bias".split(), got[2], want[2], strict=False):
        assert g.dtype == dtype
        assert_close(g, w, dtype, f"d{name}")

    params = AttentionParams(scale=dim ** -0.5, softcap=softcap or 0.0,
                             diagonal_offset=lk - lq if causal else 0,
                             window_right=0 if causal else -1, softmax_threshold=t)
    drops = kernel_drop_map(params, q, k, v, mask, bias)
    _, _, ref_drops = reference.attention(params, to64(q), to64(k), to64(v), mask, to64(bias),
                                          return_drop_map=True)
    np.testing.assert_array_equal(drops, ref_drops)
    assert drops.any()
    return drops


# ---- exact when off ---------------------------------------------------------------------------


@pytest.mark.parametrize("front", ["flash", "dpa"])
def test_none_and_zero_are_exact(front):
    """softmax_threshold None and 0 give bitwise today's results (no threshold keyword), and
    0 is normalised to None in the params (the same call)."""
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, 2, 200, 260, 4, 2, 32)
    bias = jnp.asarray(rng.standard_normal((2, 4, 1, 260)), jnp.float32)

    def fn(threshold):
        def call(q, k, v, bias):
            extra = {} if threshold == "absent" else {"softmax_threshold": threshold}
            if front == "flash":
                return flash_dmattn(q, k, v, None, bias, is_causal=True, return_lse=True,
                                    implementation="cpu", **extra)
            out, res = dot_product_attention(q, k, v, bias, is_causal=True,
                                             return_residual=True, implementation="cpu",
                                             **extra)
            return out, jnp.swapaxes(res, -1, -2)
        return outputs_and_grads(call, q, k, v, bias)

    want = fn("absent")
    for threshold in (None, 0, 0.0):
        got = fn(threshold)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(g, w)


# ---- against the float64 reference applying the same rule -----------------------------------

# (name, Lq, Lk, H, Hk, D, dtype, causal, with mask, with bias, softcap, threshold)
CASES = [
    ("causal", 520, 520, 2, 2, 32, jnp.float32, True, False, False, None, 0.5),
    ("gqa-mask-bias", 300, 420, 4, 2, 32, jnp.float32, False, True, True, None, 1.0),
    ("lq>lk-causal", 400, 260, 4, 1, 64, jnp.float32, True, False, True, None, 0.2),
    ("lq<lk-causal-softcap", 200, 450, 4, 2, 32, jnp.float32, True, True, False, 30.0, 2.0),
    ("bf16-causal-bias", 390, 390, 4, 2, 64, jnp.bfloat16, True, False, True, None, 0.5),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_rule(case):
    """out, lse and every gradient equal the float64 reference applying the same rule, the
    kernel's drop map equals the reference's (and the rule written in numpy), and the rule does
    drop blocks here (so the comparison is not the exact one)."""
    _, lq, lk, heads, kv_heads, dim, dtype, causal, with_mask, with_bias, softcap, t = case
    rng = np.random.default_rng(lq + lk)
    q, k, v = sharp_qkv(rng, 2, lq, lk, heads, kv_heads, dim, dtype, sharp=(0, 1, 2, lk // 2))
    mask = jnp.asarray(rng.random((2, 1, lq, lk)) < 0.85) if with_mask else None
    bias = (jnp.asarray(rng.standard_normal((2, heads, 1, lk)), dtype) if with_bias else None)
    drops = assert_matches_rule("cpu", t, q, k, v, mask, bias, causal, softcap)
    # The rule written in numpy, for batch 0 / head 0
    s = (np.asarray(q, np.float64)[0, :, 0] @ np.asarray(k, np.float64)[0, :, 0].T) * dim ** -0.5
    if bias is not None:
        s = s + np.asarray(bias, np.float64)[0, 0]
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(lq)[:, None], np.arange(lk)[None]
    positional = (j <= i + lk - lq) if causal else np.ones((lq, lk), bool)
    visible = positional & (np.asarray(mask)[0, 0] if mask is not None else True)
    np.testing.assert_array_equal(drops[0, 0], numpy_rule(s, visible, positional.sum(1), t))


def test_with_other_rules():
    """With key ranges, a per-kv-head window with sinks, segment ids, sequence lengths and a
    gate, the kernels equal the float64 reference applying the rule (n_i counts the keys the
    window, sink and lengths leave, not those the masks leave), and blocks are dropped."""
    rng = np.random.default_rng(3)
    lq = lk = 400
    q, k, v = sharp_qkv(rng, 2, lq, lk, 4, 2, 32, sharp=(0, 1, 2, 250, 251))
    start = jnp.asarray(rng.integers(0, 50, (2, 1, lk)), jnp.int32)
    ranges = masks.KeyRanges(start, jnp.full((2, 1, lk), lq, jnp.int32))
    alpha = jnp.asarray(rng.uniform(0.5, 1.5, (2, lq, 4)), jnp.float32)
    delta = jnp.asarray(rng.uniform(0.5, 1.5, (2, lk, 2)), jnp.float32)
    q_seg = np.repeat([0, 1], [250, 150])[None].repeat(2, 0)
    kv_seg = np.repeat([0, 1], [250, 150])[None].repeat(2, 0)
    kw = dict(window_sizes=[[3, 300, 0], [0, -1, 0]], q_segment_ids=q_seg,
              kv_segment_ids=kv_seg, gate=(alpha, delta))

    def fn(implementation):
        def call(q, k, v, bias):
            gate = kw["gate"] if implementation == "cpu" else tuple(map(to64, kw["gate"]))
            out, res = dot_product_attention(
                q, k, v, bias, ranges, query_seq_lengths=jnp.array([lq, 350], jnp.int32),
                key_value_seq_lengths=jnp.array([lk, 380], jnp.int32), return_residual=True,
                softmax_threshold=0.5, implementation=implementation,
                **{**kw, "gate": gate})
            return out, jnp.swapaxes(res, -1, -2)
        return call

    got = outputs_and_grads(fn("cpu"), q, k, v, None)
    want = outputs_and_grads(fn("xla"), to64(q), to64(k), to64(v), None)
    assert_close(got[0], want[0], jnp.float32, "out")
    assert_close(got[1], want[1], jnp.float32, "lse")
    for name, g, w in zip("qkv", got[2], want[2], strict=True):
        assert_close(g, w, jnp.float32, f"d{name}")
    exact = dot_product_attention(q, k, v, None, ranges, implementation="cpu",
                                  query_seq_lengths=jnp.array([lq, 350], jnp.int32),
                                  key_value_seq_lengths=jnp.array([lk, 380], jnp.int32), **kw)
    assert not np.array_equal(got[0], exact)  # blocks were dropped


# ---- a trained-like input: most blocks dropped, the error bound, nothing read ---------------


def test_sharp_keys_drop_most_blocks_within_the_bound():
    """A few sharp keys per row, causal, L 1024: the rule drops >= 70 % of the blocks that hold
    a visible pair; against exact attention (float64, threshold None) each row's lse is lower by
    at most log(1 + t) and each output coordinate moves by at most m · (max_j v_jd - min_j v_jd),
    m = 1 - exp(lse - exact lse) the dropped probability, itself below t / (1 + t)."""
    rng = np.random.default_rng(4)
    seqlen, t = 1024, 0.5
    q, k, v = sharp_qkv(rng, 1, seqlen, seqlen, 2, 2, 32)
    out, lse = flash_dmattn(q, k, v, is_causal=True, softmax_threshold=t, return_lse=True,
                            implementation="cpu")
    params = AttentionParams(scale=32 ** -0.5, window_right=0, softmax_threshold=t)
    drops = kernel_drop_map(params, q, k, v)
    last_rows = np.arange(seqlen // SKIP_BLOCK_Q)[:, None] * SKIP_BLOCK_Q + SKIP_BLOCK_Q - 1
    visible_blocks = np.arange(seqlen // SKIP_BLOCK_K) * SKIP_BLOCK_K <= last_rows  # causal
    assert not drops[..., ~visible_blocks].any()
    assert drops[..., visible_blocks].mean() >= 0.7, drops[..., visible_blocks].mean()
    assert not drops[..., 0].any()  # every row's first block

    ex_out, ex_lse = flash_dmattn(to64(q), to64(k), to64(v), is_causal=True, return_lse=True,
                                  implementation="xla")
    ex_out, ex_lse, out, lse = map(np.asarray, (ex_out, ex_lse, out, lse))
    gap = ex_lse - lse  # [B, H, L]
    assert (gap >= -1e-5).all() and (gap <= np.log1p(t) + 1e-5).all()
    m = np.maximum(-np.expm1(-gap), 0.0)  # dropped probability (0 up to rounding: none)
    assert (m < t / (1 + t) + 1e-5).all()
    vv = np.asarray(v, np.float64)[0]  # [L, H, D]
    for i in range(0, seqlen, 37):
        spread = vv[:i + 1].max(0) - vv[:i + 1].min(0)  # [H, D]
        bound = m[0, :, i, None] * spread + 1e-5
        assert (np.abs(out[0, i] - ex_out[0, i]) <= bound).all(), i
    assert np.abs(out - ex_out).max() > 1e-4  # not exact: the bound is what holds


def test_dropped_block_is_never_read():
    """Key block 1 (keys 128..255) holds no sharp key and is dropped for every row block and
    head. NaN values there reach neither the output nor any gradient: the forward never reads
    V there (no P·V), and the backward does no dP = dO·Vᵀ work there (a computed tile would put
    NaN into dq); their dv is exactly 0. NaN keys and values there change nothing at all against
    clean ones (bitwise), gradients included. The control, threshold None, reads them."""
    rng = np.random.default_rng(5)
    lq, lk = 300, 384
    q, k, v = sharp_qkv(rng, 1, lq, lk, 4, 2, 32, sharp=(0, 1, 300), extra=0)
    params = AttentionParams(scale=32 ** -0.5, softmax_threshold=0.5)
    drops = kernel_drop_map(params, q, k, v)
    assert drops[..., 1].all() and not drops[..., 0].any()

    def run(k, v, threshold):
        def loss(q, k, v):
            out = flash_dmattn(q, k, v, softmax_threshold=threshold, implementation="cpu")
            return jnp.sum(jnp.sin(out)), out
        grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    nan_v = v.at[:, 128:256].set(jnp.nan)
    out, (dq, dk, dv) = run(k, nan_v, 0.5)
    assert np.isfinite(out).all()
    for g in (dq, dk, dv[:, :128], dv[:, 256:]):
        assert np.isfinite(g).all()
    np.testing.assert_array_equal(dv[:, 128:256], 0.0)
    np.testing.assert_array_equal(dk[:, 128:256], 0.0)
    out, _ = run(k, nan_v, None)
    assert not np.isfinite(out).any()

    clean = run(k, v, 0.5)
    poisoned = run(k.at[:, 128:256].set(jnp.nan), nan_v, 0.5)
    np.testing.assert_array_equal(poisoned[0], clean[0])
    for name, g, ref in zip("qkv", poisoned[1], clean[1], strict=True):
        if name in ("k", "v"):
            g, ref = np.delete(g, np.s_[128:256], axis=1), np.delete(ref, np.s_[128:256], axis=1)
        np.testing.assert_array_equal(g, ref, err_msg=name)


def test_blocks_of_minus_inf_scores_are_not_recorded():
    """Key blocks whose visible scores are all -inf (a -inf bias there) weigh nothing, and the
    kernel records them in the drop map as the reference does: not dropped (the reference's
    rule looks at the finite scores only). Block 0 is the rows' first block with a visible key,
    block 2 comes after a kept one. The kernel dropped both (its decision read a -inf score as
    a hidden one, yet counted the block as holding visible pairs)."""
    rng = np.random.default_rng(11)
    lq, lk, dim = 200, 384, 32
    q, k, v = qkv(rng, 1, lq, lk, 2, 1, dim)
    bias = np.zeros((1, 2, 1, lk), np.float32)
    bias[..., :SKIP_BLOCK_K] = -np.inf
    bias[..., 2 * SKIP_BLOCK_K:] = -np.inf
    bias = jnp.asarray(bias)
    params = AttentionParams(scale=dim ** -0.5, softmax_threshold=0.5)
    drops = kernel_drop_map(params, q, k, v, None, bias)
    _, _, ref_drops = reference.attention(params, to64(q), to64(k), to64(v), None, to64(bias),
                                          return_drop_map=True)
    np.testing.assert_array_equal(drops, ref_drops)
    assert not drops.any()


# ---- transformations -----------------------------------------------------------------------------


def test_jit_vmap_and_grad():
    """jit(vmap) of the call and of its gradients equal per-example calls (the drop map is a
    per-example residual), with k / v mapped or not."""
    rng = np.random.default_rng(6)
    n, lq, lk = 3, 300, 280
    q, k, v = sharp_qkv(rng, n, lq, lk, 4, 2, 32)
    q, k, v = q[:, None], k[:, None], v[:, None]

    def one(q, k, v):
        return flash_dmattn(q, k, v, is_causal=True, softmax_threshold=0.5, implementation="cpu")

    assert_vmap_matches_each(one, (q, k, v), [(0, 0, 0), (0, None, None)], n)


@pytest.mark.parametrize("kv_heads, seq", [(4, False), (1, False), (4, True)])
def test_sharded_over_batch_and_heads(kv_heads, seq):
    """Sharded over batch and heads on 8 CPU devices (and with the sequence sharded too: never
    a ring, gathered), the call gives the single-device answer, gradients included."""
    if seq:
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("b", "h", "s"))
    else:
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("b", "h"))
    rng = np.random.default_rng(8)
    q, k, v = sharp_qkv(rng, 2, 384, 384, 8, kv_heads, 32)
    bias = jnp.asarray(rng.standard_normal((1, 8, 1, 384)), jnp.float32)

    def loss(q, k, v, bias):
        out = flash_dmattn(q, k, v, None, bias, is_causal=True, softmax_threshold=0.5,
                           implementation="cpu")
        return jnp.sum(jnp.sin(out)), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    want_grads, want = fn(q, k, v, bias)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    s = "s" if seq else None
    kv = "h" if kv_heads > 1 else None
    got_grads, got = fn(put(q, P("b", s, "h")), put(k, P("b", s, kv)), put(v, P("b", s, kv)),
                        put(bias, P(None, "h")))
    np.testing.assert_allclose(got, want, atol=1e-6)
    for g, ref in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-5)


def test_ffi_operands_and_attributes(monkeypatch):
    """The forward returns the uint8 drop map [B, H, ceil(Lq / 64), ceil(Lk / 128)] after out
    and lse, the backward takes it as its last operand, and both carry softmax_threshold as a
    float64 attribute (0 without). build_info reports it."""
    assert _ffi.build_info()["softmax_threshold"] is True
    calls = record_ffi_calls(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 2, 200, 300, 4, 2, 16, jnp.bfloat16)

    def loss(q):
        return jnp.sum(flash_dmattn(q, k, v, softmax_threshold=0.25,
                                    implementation="cpu").astype(jnp.float32))

    jax.jit(jax.grad(loss)).lower(q)
    (t1, _, fwd), (t2, bwd_ops, bwd) = calls
    assert (t1, t2) == (_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET)
    assert bwd_ops[-1] == ((2, 4, 4, 3), np.uint8)
    for attrs in (fwd, bwd):
        assert attrs["softmax_threshold"] == np.float64(0.25)
        assert attrs["softmax_threshold"].dtype == np.float64
    calls.clear()
    jax.jit(lambda q: flash_dmattn(q, k, v, implementation="cpu")).lower(q)
    assert calls[0][2]["softmax_threshold"] == 0.0


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold, error, match", [
    (-0.5, ValueError, "finite float >= 0"),
    (np.inf, ValueError, "finite float >= 0"),
    (np.nan, ValueError, "finite float >= 0"),
    ("x", TypeError, "concrete Python float"),
    (True, TypeError, "concrete Python float"),
    (np.array([0.5, 0.5]), TypeError, "concrete Python float"),
])
def test_bad_threshold(threshold, error, match):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 2, 40, 50, 4, 2, 16)
    with pytest.raises(error, match=match):
        flash_dmattn(q, k, v, softmax_threshold=threshold, implementation="cpu")
    with pytest.raises(error, match=match):
        dot_product_attention(q, k, v, softmax_threshold=threshold, implementation="cpu")


def test_traced_threshold_refused():
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 1, 20, 20, 2, 1, 16)
    with pytest.raises(TypeError, match="concrete Python float"):
        jax.jit(lambda t: flash_dmattn(q, k, v, softmax_threshold=t,
                                       implementation="cpu"))(0.5)


# ---- the GPU: the Hopper kernels, else the reference with a warning ----------------------------


def test_cuda_takes_a_threshold(monkeypatch):
    """With a fake CUDA build the CUDA kernels take a threshold at head dims 64 and 128, on an
    sm_90 GPU and an sm_80 one alike, with the O(L) mask forms, segment ids, a window table and
    a gate too; other head dims and a gate threshold go to the reference (None warns once naming
    the reason, implementation="cuda" raises, the CPU kernels take it)."""
    fake_cuda_build(monkeypatch, [16, 64, 128])
    params = AttentionParams(scale=0.1, softmax_threshold=0.5)
    for head_dim in (64, 128):
        assert ops.uses_kernel("cuda", params, jnp.bfloat16, head_dim)
    with pytest.warns(RuntimeWarning, match="at head dims 64 and 128, not 16"):
        assert not ops.uses_kernel("cuda", params, jnp.bfloat16, 16)
    gated = ops.Optionals.of(None, None, None, alpha=jnp.zeros(1))
    cut = AttentionParams(scale=0.1, softmax_threshold=0.5, gate_threshold=-2.0)
    with pytest.warns(RuntimeWarning, match="with a gate threshold"):
        assert not ops.uses_kernel("cuda", cut, jnp.bfloat16, 128, gated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for opts in (gated, ops.Optionals.of(None, None, None, key_start=jnp.zeros(1)),
                     ops.Optionals.of(None, None, None, q_segments=jnp.zeros(1))):
            assert ops.uses_kernel("cuda", params, jnp.bfloat16, 128, opts)
        table = AttentionParams(scale=0.1, softmax_threshold=0.5, window_sizes=((0, 8, 0),))
        assert ops.uses_kernel("cuda", table, jnp.bfloat16, 64)
    fake_cuda_build(monkeypatch, [16, 64, 128], cuda_archs="80")
    monkeypatch.setattr(_ffi, "local_gpu_compute_capability", lambda: "8.0")
    assert ops.uses_kernel("cuda", params, jnp.bfloat16, 128)


def test_cuda_lowering(monkeypatch):
    """Lowered for a GPU with a fake CUDA build: a call with a threshold at head dim 64 calls
    the CUDA forward (which returns the drop map) and backward (which takes it), with None and
    "cuda" alike and no warning; at head dim 16 it makes no FFI call (None warns and lowers the
    reference, forward and backward, "cuda" raises)."""
    calls = record_ffi_calls(monkeypatch)
    fake_cuda_build(monkeypatch, [16, 64])
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 2, 200, 300, 4, 2, 64, jnp.bfloat16)
    for implementation in (None, "cuda"):
        calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lower_for_cuda(q, k, v, is_causal=True, softmax_threshold=0.5,
                           implementation=implementation)
        (t1, _, fwd), (t2, bwd_ops, bwd) = calls
        assert (t1, t2) == (_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET)
        assert fwd["softmax_threshold"] == bwd["softmax_threshold"] == 0.5
        assert ((2, 4, 4, 3), np.uint8) in bwd_ops  # the forward's drop map
    calls.clear()
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16, jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="at head dims 64 and 128"):
        lower_for_cuda(q, k, v, is_causal=True, softmax_threshold=0.5)
    assert calls == []
    with pytest.raises(ValueError, match="at head dims 64 and 128"):
        lower_for_cuda(q, k, v, softmax_threshold=0.5, implementation="cuda")


# ---- on the GPU: the Hopper kernels ---------------------------------------------------------

# (name, B, Lq, Lk, H, Hk, D, dtype, causal, mask, bias ("row": [B, H, 1, Lk], "full":
# [B, H, Lq, Lk]), softcap, deterministic, threshold)
GPU_CASES = [
    ("causal", 2, 1000, 1000, 4, 2, 128, jnp.bfloat16, True, False, None, None, False, 0.5),
    ("gqa-mask-rowbias", 2, 300, 424, 4, 2, 64, jnp.bfloat16, False, True, "row", None, False,
     1.0),
    ("lq>lk-causal-fullbias", 1, 400, 264, 4, 1, 128, jnp.float16, True, False, "full", None,
     False, 0.2),
    ("lq<lk-causal-mask-softcap", 2, 200, 450, 4, 2, 64, jnp.bfloat16, True, True, None, 30.0,
     False, 2.0),
    ("irregular-mask-fullbias", 1, 17, 520, 2, 1, 128, jnp.bfloat16, True, True, "full", None,
     False, 0.5),
    ("deterministic-mask", 1, 330, 520, 4, 2, 128, jnp.bfloat16, True, True, None, None, True,
     0.5),
    ("odd-lk-fullbias", 1, 130, 301, 2, 1, 64, jnp.bfloat16, True, False, "full", None, False,
     0.5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("forward", ["auto", "flash2"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cuda_matches_reference_rule(case, forward):
    """The CUDA kernels (implementation="cuda": no fallback; the forward the dispatcher picks, a
    Hopper one where it takes the call, or the FlashAttention-2-class one) give the float64
    reference's drop map, out, lse and every gradient (dbias included), and drop blocks here."""
    _, batch, lq, lk, heads, kv_heads, dim, dtype, *_, t = case
    require_cuda_kernel(dim, dtype)
    _ffi.cuda_set_forward_kernel(forward)
    jax.clear_caches()
    try:
        if forward == "flash2":
            assert _ffi.cuda_forward_kernel((batch, lq, heads, dim), (batch, lk, kv_heads, dim),
                                            softmax_threshold=t) == "flash2"
        check_cuda_case(case)
    finally:
        _ffi.cuda_set_forward_kernel("auto")
        jax.clear_caches()


def check_cuda_case(case):
    """One GPU_CASES case against the float64 reference applying the rule."""
    (_, batch, lq, lk, heads, kv_heads, dim, dtype, causal, with_mask, bias_kind, softcap,
     deterministic, t) = case
    rng = np.random.default_rng(lq * lk + dim)
    q, k, v = sharp_qkv(rng, batch, lq, lk, heads, kv_heads, dim, dtype,
                        sharp=(0, 1, 2, lk // 2))
    mask = jnp.asarray(rng.random((batch, 1, lq, lk)) < 0.85) if with_mask else None
    bias = None
    if bias_kind is not None:
        rows = 1 if bias_kind == "row" else lq
        bias = jnp.asarray(rng.standard_normal((batch, heads, rows, lk)), dtype)
    assert_matches_rule("cuda", t, q, k, v, mask, bias, causal, softcap,
                        deterministic=deterministic)


# Rules beside the threshold that the FlashAttention-2-class forward alone takes: segment ids,
# key ranges, block indices (64 x 128 blocks, a quarter of the slots unlisted), a per-kv-head
# window table with sinks and a gate (without its threshold).
GPU_RULES = ("segments", "key-ranges", "block-indices", "window-table", "gate")


def rule_operands(rng, rule, batch, lq, lk, heads, kv_heads):
    """(params keywords, ops.forward / reference keywords, flash_dmattn keywords) of `rule`."""
    if rule == "segments":
        ids = jnp.asarray(np.repeat([0, 1, 2], [lq // 3, lq // 3, lq - 2 * (lq // 3)])[None]
                          .repeat(batch, 0), jnp.int32)
        kv_ids = jnp.asarray(np.repeat([0, 1, 2], [lk // 3, lk // 3, lk - 2 * (lk // 3)])[None]
                             .repeat(batch, 0), jnp.int32)
        return ({}, dict(q_segments=ids, kv_segments=kv_ids),
                dict(q_segment_ids=ids, kv_segment_ids=kv_ids))
    if rule == "key-ranges":
        start = jnp.asarray(rng.integers(0, lq // 2, (batch, kv_heads, lk)), jnp.int32)
        end = jnp.asarray(rng.integers(lq // 2, lq + 1, (batch, kv_heads, lk)), jnp.int32)
        return ({}, dict(key_start=start[:, :, None], key_end=end[:, :, None]),
                dict(mask=masks.KeyRanges(start, end)))
    if rule == "block-indices":
        indices = jnp.asarray(blocks.random_indices(rng, (batch, kv_heads), lq, lk, 64, 128, 4),
                              jnp.int32)
        return (dict(block_q=64, block_k=128), dict(block_indices=indices),
                dict(mask=masks.BlockIndices(indices, 64, 128)))
    if rule == "gate":
        alpha = jnp.asarray(rng.uniform(-1.5, 1.5, (batch, lq, heads)), jnp.float32)
        delta = jnp.asarray(rng.uniform(-1.5, 1.5, (batch, lk, kv_heads)), jnp.float32)
        return {}, dict(alpha=alpha, delta=delta), dict(gate=(alpha, delta))
    table = ((64, 200, 0), (0, 300, 0))[:kv_heads]
    return dict(window_sizes=table), {}, dict(window_sizes=table)


def gate_to64(kw):
    """`kw` with the gate's alpha and delta (keywords alpha and delta, or gate) in float64."""
    kw = dict(kw)
    for name in ("alpha", "delta"):
        if name in kw:
            kw[name] = to64(kw[name])
    if "gate" in kw:
        kw["gate"] = tuple(map(to64, kw["gate"]))
    return kw


@pytest.mark.gpu
@pytest.mark.parametrize("rule", GPU_RULES)
def test_cuda_with_other_rules(rule):
    """A threshold beside segment ids, key ranges, block indices, a window table with sinks or a
    gate runs on the CUDA kernels (the FlashAttention-2-class forward walking up the keys past the
    blocks the rule hides; no fallback warning): its drop map equals the float64 reference's,
    and out, lse and the gradients equal the reference applying the rule; blocks are dropped."""
    require_cuda_kernel(128, jnp.bfloat16)
    rng = np.random.default_rng(GPU_RULES.index(rule))
    batch, lq, lk, heads, kv_heads, dim, t = 2, 520, 700, 4, 2, 128, 0.5
    q, k, v = sharp_qkv(rng, batch, lq, lk, heads, kv_heads, dim, jnp.bfloat16,
                        sharp=(0, 1, 2, 260, 261, 600))
    param_kw, op_kw, call_kw = rule_operands(rng, rule, batch, lq, lk, heads, kv_heads)
    params = AttentionParams(scale=dim ** -0.5, diagonal_offset=lk - lq, window_right=0,
                             softmax_threshold=t, **param_kw)
    drops = np.asarray(jax.jit(lambda q, k, v: ops.forward(params, q, k, v, **op_kw)[2])(q, k, v))
    _, _, want_drops = reference.attention(params, to64(q), to64(k), to64(v),
                                           return_drop_map=True, **gate_to64(op_kw))
    np.testing.assert_array_equal(drops, want_drops)
    assert drops.any()
    mask = call_kw.pop("mask", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = outputs_and_grads(runner("cuda", t, mask, is_causal=True, **call_kw), q, k, v, None)
    want = outputs_and_grads(runner("xla", t, mask, is_causal=True, **gate_to64(call_kw)),
                             to64(q), to64(k), to64(v), None)
    assert_close(got[0], want[0], jnp.bfloat16, "out")
    assert_close(got[1], want[1], jnp.float32, "lse")
    for name, g, w in zip("qkv", got[2], want[2], strict=True):
        assert_close(g, w, jnp.bfloat16, f"d{name}")


@pytest.mark.gpu
def test_cuda_deterministic_gradients_repeat():
    """deterministic=True with a threshold: bitwise the same gradients over repeats."""
    require_cuda_kernel(128, jnp.bfloat16)
    rng = np.random.default_rng(9)
    q, k, v = sharp_qkv(rng, 1, 700, 700, 4, 2, 128, jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: outputs_and_grads(
        runner("cuda", 0.5, None, is_causal=True, deterministic=True), q, k, v, None))
    first = jax.tree.leaves(fn(q, k, v))
    for _ in range(3):
        for g, w in zip(jax.tree.leaves(fn(q, k, v)), first, strict=True):
            np.testing.assert_array_equal(g, w)
