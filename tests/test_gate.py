"""Gated attention (``gate=(alpha, delta)``, ``gate_threshold``, issue 27 item 0): the logits gain
``logsigmoid(alpha[b, i, h] * delta[b, j, h // (H // Hk)])`` (before the softcap, with the bias);
with a threshold, the blocks of the fixed 128 x 128 grid whose gate is below it at every pair are
dropped (never computed).

Oracles: the float64 ``xla`` implementation with the same gate, and, independently of the
library's gate code, the float64 ``xla`` implementation given the gate as a dense bias
``logsigmoid(alpha_i * delta_j)`` (and the threshold's kept blocks as a dense mask built here
with numpy from every pair's gate).
"""

from __future__ import annotations

import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fake_cuda_build, hopper_kernels_built, record_ffi_calls
from form_checks import (
    assert_close,
    assert_vmap_matches_each,
    lower_for_cuda,
    qkv,
    require_cuda_kernel,
    to64,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_segments import array_sizes

from jax_dmattn import _ffi, dot_product_attention, flash_dmattn, masks
from jax_dmattn.params import GATE_BLOCK_K, GATE_BLOCK_Q, gate_cut

# ---- inputs and helpers -----------------------------------------------------------------------


def random_gate(rng, batch, seqlen_q, seqlen_k, heads, kv_heads, dtype=np.float32, scale=1.5):
    """Fresh normal alpha ``[B, Lq, H]`` and delta ``[B, Lk, Hk]`` (never zeros)."""
    alpha = rng.standard_normal((batch, seqlen_q, heads)) * scale
    delta = rng.standard_normal((batch, seqlen_k, kv_heads)) * scale
    return jnp.asarray(alpha, dtype), jnp.asarray(delta, dtype)


def results(fn, q, k, v, bias, alpha, delta):
    """out, lse and the gradients (q, k, v, [bias], alpha, delta) of a loss using out and lse of
    ``fn(q, k, v, bias, alpha, delta) -> (out, lse)``."""

    def loss(q, k, v, bias, alpha, delta):
        out, lse = fn(q, k, v, bias, alpha, delta)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
        return (jnp.sum(out.astype(jnp.float32) * weights)
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.3)), (out, lse)

    argnums = (0, 1, 2, 3, 4, 5) if bias is not None else (0, 1, 2, 4, 5)
    grads, (out, lse) = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, bias, alpha, delta)
    return out, lse, grads


def assert_all_close(got, want, dtype, with_bias):
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = want
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, jnp.float32, "lse")
    names = ["q", "k", "v"] + (["bias"] if with_bias else []) + ["alpha", "delta"]
    for name, g, ref in zip(names, grads, ref_grads, strict=True):
        assert_close(g, ref, dtype, f"d{name}")


def kept_pairs(alpha, delta, threshold, heads, kv_heads) -> np.ndarray:
    """bool ``[B, H, Lq, Lk]``: the pairs the threshold keeps, built here from every pair's
    gate: a pair is kept when some pair of its 128 x 128 block has logsigmoid >= threshold."""
    a = np.asarray(alpha, np.float64)  # [B, Lq, H]
    d = np.repeat(np.asarray(delta, np.float64), heads // kv_heads, axis=2)  # [B, Lk, H]
    gate = -np.logaddexp(0.0, -(a.transpose(0, 2, 1)[..., :, None]
                                * d.transpose(0, 2, 1)[..., None, :]))  # [B, H, Lq, Lk]
    lq, lk = a.shape[1], d.shape[1]
    kept = np.zeros_like(gate, bool)
    for i0 in range(0, lq, GATE_BLOCK_Q):
        for j0 in range(0, lk, GATE_BLOCK_K):
            block = gate[:, :, i0:i0 + GATE_BLOCK_Q, j0:j0 + GATE_BLOCK_K]
            keep = (block >= threshold).any(axis=(2, 3))  # [B, H]
            kept[:, :, i0:i0 + GATE_BLOCK_Q, j0:j0 + GATE_BLOCK_K] = keep[:, :, None, None]
    return kept


def as_bias(alpha, delta, heads, kv_heads):
    """The gate as a dense bias ``[B, H, Lq, Lk]`` (differentiable in alpha and delta)."""
    d = jnp.repeat(delta, heads // kv_heads, axis=2)
    return jax.nn.log_sigmoid(jnp.swapaxes(alpha, 1, 2)[..., :, None]
                              * jnp.swapaxes(d, 1, 2)[..., None, :])


# ---- conformance against the float64 reference (threshold None: exact) ----------------------

CASES = [
    # front, batch, Lq, Lk, H, Hk, D, causal, mask, bias, softcap, dtype
    ("flash", 2, 130, 200, 4, 2, 32, False, None, None, None, jnp.float32),
    ("flash", 2, 200, 130, 4, 2, 64, True, "dense", "full", None, jnp.float32),
    ("flash", 1, 257, 300, 8, 2, 128, True, "keys", "keys", None, jnp.float32),
    ("flash", 2, 96, 190, 4, 1, 64, False, "dense", "keys", 8.0, jnp.float32),
    ("flash", 1, 150, 190, 4, 2, 64, True, None, "full", None, jnp.bfloat16),
    ("flash", 1, 70, 260, 8, 8, 96, False, "keys", None, 5.0, jnp.bfloat16),
    ("dpa", 2, 140, 170, 4, 2, 32, True, "dense", "keys", None, jnp.float32),
]


def _case_id(case):
    return "-".join(str(x) for x in case[:11]) + "-" + jnp.dtype(case[11]).name


def _case_inputs(case, rng):
    _, batch, lq, lk, heads, kv_heads, d, _, mask_kind, bias_kind, _, dtype = case
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d, dtype)
    alpha, delta = random_gate(rng, batch, lq, lk, heads, kv_heads, dtype)
    mask = None
    if mask_kind == "dense":
        mask = jnp.asarray(rng.random((batch, 1, lq, lk)) < 0.7)
    elif mask_kind == "keys":
        a, b = rng.integers(0, lq + 1, (2, 1, heads, lk))
        mask = masks.KeyRanges(np.minimum(a, b).astype(np.int32),
                               np.maximum(a, b).astype(np.int32))
    bias = None
    if bias_kind == "full":
        bias = jnp.asarray(rng.standard_normal((batch, heads, lq, lk)), dtype)
    elif bias_kind == "keys":
        bias = jnp.asarray(rng.standard_normal((1, kv_heads, 1, lk)), dtype)
    return q, k, v, mask, bias, alpha, delta


def _runner(front, mask, causal, softcap, threshold, implementation, lens=None):
    if front == "flash":
        def fn(q, k, v, bias, alpha, delta):
            return flash_dmattn(q, k, v, mask, bias, is_causal=causal, softcap=softcap,
                                return_lse=True, gate=(alpha, delta), gate_threshold=threshold,
                                implementation=implementation)
        return fn

    def fn(q, k, v, bias, alpha, delta):
        out, res = dot_product_attention(q, k, v, bias, mask, is_causal=causal,
                                         gate=(alpha, delta), gate_threshold=threshold,
                                         implementation=implementation, return_residual=True,
                                         **(lens or {}))
        return out, jnp.swapaxes(res, -1, -2)
    return fn


def _check_against_float64(case, implementation):
    """out, lse and the gradients of q, k, v, bias, alpha and delta (each in its own dtype and
    shape) of `implementation` against the float64 reference, threshold None."""
    front, batch, lq, lk, _, _, _, causal, _, _, softcap, dtype = case
    rng = np.random.default_rng(zlib.crc32(_case_id(case).encode()))
    q, k, v, mask, bias, alpha, delta = _case_inputs(case, rng)
    lens = None
    if front == "dpa":
        lens = dict(query_seq_lengths=jnp.asarray([lq, lq - 37][:batch], jnp.int32),
                    key_value_seq_lengths=jnp.asarray([lk - 20, lk][:batch], jnp.int32))
    got = results(_runner(front, mask, causal, softcap, None, implementation, lens), q, k, v,
                  bias, alpha, delta)
    for g, x in zip(got[2], [q, k, v] + ([bias] if bias is not None else []) + [alpha, delta],
                    strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape
    want = results(_runner(front, mask, causal, softcap, None, "xla", lens), to64(q), to64(k),
                   to64(v), to64(bias), to64(alpha), to64(delta))
    assert_all_close(got, want, dtype, bias is not None)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case):
    """The CPU kernels against the float64 reference: causal, a dense mask, key ranges, full and
    per-key bias, softcap, GQA / MQA, head dims 32-128, Lq != Lk, bf16, and
    (dot_product_attention) sequence lengths."""
    _check_against_float64(case, "cpu")


@pytest.mark.parametrize("causal, softcap", [(False, None), (True, 6.0)])
def test_reference_is_the_gate_as_a_dense_bias(causal, softcap):
    """The float64 reference with a gate equals the reference given the gate as a dense bias
    ``logsigmoid(alpha_i delta_j)`` added to the user's bias (gradients of alpha and delta
    through that bias included): the gate enters with the bias, before the softcap."""
    rng = np.random.default_rng(3)
    lq, lk, heads, kv_heads = 90, 140, 4, 2
    q, k, v = (to64(x) for x in qkv(rng, 2, lq, lk, heads, kv_heads, 16))
    alpha, delta = (to64(x) for x in random_gate(rng, 2, lq, lk, heads, kv_heads))
    bias = to64(rng.standard_normal((2, heads, lq, lk)))
    kw = dict(is_causal=causal, softcap=softcap, return_lse=True, implementation="xla")

    def gated(q, k, v, bias, alpha, delta):
        return flash_dmattn(q, k, v, None, bias, gate=(alpha, delta), **kw)

    def dense(q, k, v, bias, alpha, delta):
        return flash_dmattn(q, k, v, None, bias + as_bias(alpha, delta, heads, kv_heads), **kw)

    got = results(gated, q, k, v, bias, alpha, delta)
    want = results(dense, q, k, v, bias, alpha, delta)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


# ---- the threshold ----------------------------------------------------------------------------


def structured_gate(rng, batch, seqlen_q, seqlen_k, heads, kv_heads):
    """alpha and delta whose 128 x 128 blocks the threshold -1 partly drops: delta negative in
    [-3, -1] on odd key blocks, normal elsewhere; alpha positive in [1, 2] on query block 1 (its
    rows then drop every odd key block, and with Lk <= 128 * 2 every key of a key block 0 that
    is negative too) and normal elsewhere; per head, some heads flipped."""
    alpha = rng.standard_normal((batch, seqlen_q, heads)) * 1.5
    rows = (np.arange(seqlen_q) // GATE_BLOCK_Q) == 1
    alpha[:, rows] = rng.uniform(1.0, 2.0, (batch, rows.sum(), heads))
    delta = rng.standard_normal((batch, seqlen_k, kv_heads)) * 1.5
    odd = (np.arange(seqlen_k) // GATE_BLOCK_K) % 2 == 1
    delta[:, odd] = -rng.uniform(1.0, 3.0, (batch, odd.sum(), kv_heads))
    delta[:, :, 0] = np.where(odd[None], delta[:, :, 0], -np.abs(delta[:, :, 0]) - 1.0)
    return jnp.asarray(alpha, jnp.float32), jnp.asarray(delta, jnp.float32)


THRESHOLD_CASES = [
    # batch, Lq, Lk, H, Hk, D, causal, mask, bias, threshold
    (2, 300, 290, 4, 2, 32, False, None, None, -1.0),
    (1, 260, 384, 4, 2, 64, True, "dense", "full", -1.0),
    (2, 256, 200, 4, 1, 32, False, "keys", "keys", -0.5),
]


@pytest.mark.parametrize("case", THRESHOLD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_threshold_matches_reference_block_rule(case):
    """With a threshold that drops some blocks (and every block of some rows: zeros, lse -inf),
    the CPU kernels equal the float64 reference applying the same block rule, gradients of q, k,
    v, bias, alpha and delta included; the reference equals the gate as a dense bias under the
    mask of kept blocks built here from every pair's gate; the result differs from threshold
    None."""
    batch, lq, lk, heads, kv_heads, d, causal, mask_kind, bias_kind, threshold = case
    rng = np.random.default_rng(sum(map(hash, map(str, case))) % 2**32)
    q, k, v, mask, bias, _, _ = _case_inputs(
        ("flash", batch, lq, lk, heads, kv_heads, d, causal, mask_kind, bias_kind, None,
         jnp.float32), rng)
    alpha, delta = structured_gate(rng, batch, lq, lk, heads, kv_heads)
    kept = kept_pairs(alpha, delta, threshold, heads, kv_heads)
    assert kept.any() and not kept.all()

    got = results(_runner("flash", mask, causal, None, threshold, "cpu"), q, k, v, bias, alpha,
                  delta)
    args64 = [to64(x) for x in (q, k, v, bias, alpha, delta)]
    want = results(_runner("flash", mask, causal, None, threshold, "xla"), *args64)
    assert_all_close(got, want, jnp.float32, bias is not None)

    # The reference's rule is the one defined on pairs.
    if mask_kind is None and bias is not None:
        def dense(q, k, v, bias, alpha, delta):
            return flash_dmattn(q, k, v, jnp.asarray(kept), bias + as_bias(alpha, delta, heads,
                                                                           kv_heads),
                                is_causal=causal, return_lse=True, implementation="xla")
        oracle = results(dense, *args64)
        for g, w in zip(jax.tree.leaves(want), jax.tree.leaves(oracle), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
    exact = results(_runner("flash", mask, causal, None, None, "cpu"), q, k, v, bias, alpha,
                    delta)
    assert not np.allclose(got[0], exact[0], atol=1e-3)


def test_threshold_rule_against_pairs_without_bias():
    """Without a bias or mask: the reference with a threshold is the dense-bias gate under the
    numpy mask of kept blocks, and rows whose every block is dropped give zeros, lse -inf and
    zero gradients (dalpha included)."""
    rng = np.random.default_rng(21)
    lq, lk, heads, kv_heads, threshold = 300, 256, 4, 2, -1.0
    q, k, v = (to64(x) for x in qkv(rng, 1, lq, lk, heads, kv_heads, 16))
    alpha, delta = structured_gate(rng, 1, lq, lk, heads, kv_heads)
    # Query block 1 positive, every delta negative: all its blocks dropped for every head.
    delta = -jnp.abs(delta) - 1.0
    alpha, delta = to64(alpha), to64(delta)
    kept = kept_pairs(alpha, delta, threshold, heads, kv_heads)
    assert not kept[:, :, 128:256].any() and kept.any()

    def gated(q, k, v, bias, alpha, delta, implementation="xla"):
        return flash_dmattn(q, k, v, gate=(alpha, delta), gate_threshold=threshold,
                            return_lse=True, implementation=implementation)

    def dense(q, k, v, bias, alpha, delta):
        return flash_dmattn(q, k, v, jnp.asarray(kept), as_bias(alpha, delta, heads, kv_heads),
                            return_lse=True, implementation="xla")

    got = results(gated, q, k, v, None, alpha, delta)
    want = results(dense, q, k, v, None, alpha, delta)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
    cpu = results(lambda *a: gated(*a, implementation="cpu"),
                  *(x.astype(jnp.float32) for x in (q, k, v)), None, alpha.astype(jnp.float32),
                  delta.astype(jnp.float32))
    assert_all_close(cpu, want, jnp.float32, False)
    out, lse, grads = cpu
    np.testing.assert_array_equal(out[:, 128:256], 0.0)
    assert np.isneginf(lse[:, :, 128:256]).all() and np.isfinite(lse[:, :, :128]).all()
    np.testing.assert_array_equal(grads[0][:, 128:256], 0.0)  # dq
    np.testing.assert_array_equal(grads[3][:, 128:256], 0.0)  # dalpha


@pytest.mark.parametrize("with_mask", [False, True])
def test_dropped_block_is_never_read(with_mask):
    """Key block 1 (keys 128..255) is dropped by the threshold for every query block and head.
    NaN values there reach neither the output nor any gradient (a processed tile would give
    0 · NaN = NaN: the control, threshold None, does read them), and NaN keys and values there
    change nothing at all: the results equal, bitwise, those of the same call with clean ones."""
    rng = np.random.default_rng(11)
    lq, lk, heads, kv_heads = 200, 300, 4, 2
    q, k, v = qkv(rng, 1, lq, lk, heads, kv_heads, 32)
    alpha = jnp.asarray(rng.uniform(0.5, 2.0, (1, lq, heads)), jnp.float32)
    delta = rng.standard_normal((1, lk, kv_heads))
    delta[:, 128:256] = -rng.uniform(3.0, 4.0, (1, 128, kv_heads))
    delta = jnp.asarray(delta, jnp.float32)
    mask = jnp.asarray(rng.random((1, 1, lq, lk)) < 0.9) if with_mask else None
    dropped = ~kept_pairs(alpha, delta, -1.0, heads, kv_heads)
    assert dropped[..., 128:256].all() and not dropped[..., :128].any()

    def run(k, v, threshold):
        def loss(q, k, v, alpha, delta):
            out = flash_dmattn(q, k, v, mask, gate=(alpha, delta), gate_threshold=threshold,
                               implementation="cpu")
            return jnp.sum(jnp.sin(out)), out
        grads, out = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, alpha, delta)
        return out, grads

    nan_v = v.at[:, 128:256].set(jnp.nan)
    out, grads = run(k, nan_v, -1.0)
    assert np.isfinite(out).all()
    dq, dk, dv, dalpha, ddelta = grads
    for g in (dq, dalpha, ddelta, dk, dv[:, :128], dv[:, 256:]):
        assert np.isfinite(g).all()
    np.testing.assert_array_equal(ddelta[:, 128:256], 0.0)
    np.testing.assert_array_equal(dv[:, 128:256], 0.0)
    out, _ = run(k, nan_v, None)
    assert not np.isfinite(out).any()

    clean = run(k, v, -1.0)
    poisoned = run(k.at[:, 128:256].set(jnp.nan), nan_v, -1.0)
    np.testing.assert_array_equal(poisoned[0], clean[0])
    for name, g, ref in zip("q k v alpha delta".split(), poisoned[1], clean[1], strict=True):
        if name in ("k", "v"):  # the NaN rows' own gradients are zero in both
            g, ref = np.delete(g, np.s_[128:256], axis=1), np.delete(ref, np.s_[128:256], axis=1)
        np.testing.assert_array_equal(g, ref, err_msg=name)


@pytest.mark.parametrize("threshold", [-60.0, -1e30])
def test_threshold_dropping_nothing_equals_none(threshold):
    """A threshold that drops no block gives bitwise the results of threshold None (the same
    tiles, in the same order), gradients included."""
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, 2, 200, 270, 4, 2, 32)
    alpha, delta = random_gate(rng, 2, 200, 270, 4, 2, scale=3.0)
    bias = jnp.asarray(rng.standard_normal((2, 4, 1, 270)), jnp.float32)
    assert kept_pairs(alpha, delta, threshold, 4, 2).all()
    got = results(_runner("flash", None, True, None, threshold, "cpu"), q, k, v, bias, alpha,
                  delta)
    want = results(_runner("flash", None, True, None, None, "cpu"), q, k, v, bias, alpha, delta)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


def test_gate_cut():
    """gate_cut(t) is the product whose logsigmoid is t, and -inf for None."""
    assert gate_cut(None) == -np.inf
    for t in (-1e-6, -0.3, -1.0, -7.0, -40.0, -1e4):
        x = gate_cut(t)
        np.testing.assert_allclose(-np.logaddexp(0.0, -x), t, rtol=1e-12)


# ---- transformations -----------------------------------------------------------------------------


def test_jit_vmap_and_grad():
    """jit(vmap) of the gated call and of its gradients (q, k, v, alpha, delta) equal per-example
    calls, with alpha / delta mapped or not (an unmapped one: every example reads the same, and
    its per-example gradient is returned)."""
    rng = np.random.default_rng(5)
    n, lq, lk = 3, 150, 140
    q, k, v = qkv(rng, n, lq, lk, 4, 2, 32)
    q, k, v = q[:, None], k[:, None], v[:, None]  # n examples of batch 1
    alpha, delta = random_gate(rng, n, lq, lk, 4, 2)
    alpha, delta = alpha[:, None], delta[:, None]

    def one(q, k, v, alpha, delta):
        return flash_dmattn(q, k, v, is_causal=True, gate=(alpha, delta), gate_threshold=-2.0,
                            implementation="cpu")

    axes = [(0, 0, 0, 0, 0), (0, 0, 0, None, 0), (0, None, None, 0, None), (0, 0, 0, None, None)]
    assert_vmap_matches_each(one, (q, k, v, alpha, delta), axes, n, argnums=(0, 1, 2, 3, 4))


def test_grad_of_unmapped_gate_sums_examples():
    """jax.grad through vmap with an unmapped alpha / delta sums the examples' gradients."""
    rng = np.random.default_rng(6)
    n, lq, lk = 2, 70, 90
    q, k, v = qkv(rng, n, lq, lk, 4, 2, 16)
    alpha, delta = random_gate(rng, 1, lq, lk, 4, 2)

    def one(q, k, v, alpha, delta):
        return flash_dmattn(q[None], k[None], v[None], gate=(alpha, delta), implementation="cpu")

    def batched(alpha, delta):
        return jnp.sum(jnp.sin(jax.vmap(one, in_axes=(0, 0, 0, None, None))(q, k, v, alpha,
                                                                             delta)))

    def looped(alpha, delta):
        return sum(jnp.sum(jnp.sin(one(q[e], k[e], v[e], alpha, delta))) for e in range(n))

    for g, ref in zip(jax.grad(batched, (0, 1))(alpha, delta),
                      jax.grad(looped, (0, 1))(alpha, delta), strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-5)


@pytest.mark.parametrize("kv_heads, seq", [(4, False), (1, False), (4, True)])
def test_sharded_over_batch_and_heads(kv_heads, seq):
    """Sharded over batch and heads on 8 CPU devices (kv heads sharded with them, or MQA: kv
    heads replicated, ddelta summed over the head shards), and with the query sequence sharded
    too (never a ring: gathered), the gated call with a threshold gives the single-device
    answer, gradients of q, k, v, bias, alpha and delta included."""
    if seq:
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("b", "h", "s"))
    else:
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("b", "h"))
    rng = np.random.default_rng(8)
    lq = lk = 256
    q, k, v = qkv(rng, 2, lq, lk, 8, kv_heads, 32)
    alpha, delta = structured_gate(rng, 2, lq, lk, 8, kv_heads)
    bias = jnp.asarray(rng.standard_normal((1, 8, 1, lk)), jnp.float32)

    def loss(q, k, v, bias, alpha, delta):
        out = flash_dmattn(q, k, v, None, bias, is_causal=True, gate=(alpha, delta),
                           gate_threshold=-1.0, implementation="cpu")
        return jnp.sum(jnp.sin(out)), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))
    want_grads, want = fn(q, k, v, bias, alpha, delta)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    s = "s" if seq else None
    kv = "h" if kv_heads > 1 else None
    got_grads, got = fn(put(q, P("b", s, "h")), put(k, P("b", s, kv)), put(v, P("b", s, kv)),
                        put(bias, P(None, "h")), put(alpha, P("b", s, "h")),
                        put(delta, P("b", s, kv)))
    np.testing.assert_allclose(got, want, atol=1e-6)
    for g, ref in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-5, rtol=1e-5)


def test_training_step_has_no_lq_by_lk_array():
    """jit(value_and_grad) of a causal gated call with a threshold on the CPU kernels: every
    array of the lowered and of the compiled program holds fewer than Lq·Lk elements (the
    control, the xla implementation, does hold one)."""
    rng = np.random.default_rng(12)
    seqlen = 1024
    q, k, v = qkv(rng, 1, seqlen, seqlen, 4, 2, 16)
    alpha, delta = random_gate(rng, 1, seqlen, seqlen, 4, 2)

    def texts(implementation):
        def loss(q, k, v, alpha, delta):
            return jnp.sum(flash_dmattn(q, k, v, is_causal=True, gate=(alpha, delta),
                                        gate_threshold=-2.0, implementation=implementation) ** 2)
        lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).lower(
            q, k, v, alpha, delta)
        return {"stablehlo": lowered.as_text(), "compiled": lowered.compile().as_text()}

    for form, text in texts("cpu").items():
        sizes = array_sizes(text)
        assert sizes, form
        assert max(sizes)[0] < seqlen * seqlen, (form, sorted(sizes, reverse=True)[:5])
    assert max(array_sizes(texts("xla")["stablehlo"]))[0] >= seqlen * seqlen


def test_ffi_operands_and_attributes(monkeypatch):
    """The kernels get alpha and delta as float32 operands after the others (whatever their
    dtype), the backward returns dalpha and ddelta, and the attributes carry has_gate and the
    threshold as the product gate_cut (-inf for None). build_info reports the gate."""
    assert _ffi.build_info()["gate"] is True
    calls = record_ffi_calls(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16, jnp.bfloat16)
    alpha, delta = random_gate(rng, 2, 24, 32, 4, 2, jnp.bfloat16)

    def lower(threshold):
        calls.clear()

        def loss(q, alpha, delta):
            return jnp.sum(flash_dmattn(q, k, v, gate=(alpha, delta), gate_threshold=threshold,
                                        implementation="cpu").astype(jnp.float32))
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, alpha, delta)
        assert [t for t, *_ in calls] == [_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET]
        return calls

    for threshold, cut in [(None, -np.inf), (-1.5, gate_cut(-1.5))]:
        (_, fwd_ops, fwd), (_, bwd_ops, bwd) = lower(threshold)
        assert fwd_ops[-2:] == [((2, 24, 4), np.float32), ((2, 32, 2), np.float32)]
        assert bwd_ops[-2:] == fwd_ops[-2:]
        for attrs in (fwd, bwd):
            assert attrs["has_gate"] is True
            assert attrs["gate_cut"] == np.float64(cut)
            assert attrs["gate_cut"].dtype == np.float64
    calls.clear()
    jax.jit(lambda q: flash_dmattn(q, k, v, implementation="cpu")).lower(q)
    assert calls[0][2]["has_gate"] is False and calls[0][2]["gate_cut"] == -np.inf


def test_unbatched_dot_product_attention():
    """dot_product_attention with 3-D inputs takes alpha ``[T, N]`` and delta ``[S, K]``."""
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, 1, 50, 60, 4, 2, 16)
    alpha, delta = random_gate(rng, 1, 50, 60, 4, 2)
    got = dot_product_attention(q[0], k[0], v[0], gate=(alpha[0], delta[0]),
                                implementation="cpu")
    want = dot_product_attention(q, k, v, gate=(alpha, delta), implementation="cpu")[0]
    np.testing.assert_array_equal(got, want)


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate, threshold, error, match", [
    ("alpha", None, TypeError, "pair"),
    (("a", "d", "x"), None, TypeError, "length 3"),
    ((None, "d"), None, TypeError, "alpha is None"),
    (("a_bad_shape", "d"), None, ValueError, r"alpha shape \(2, 40, 2\)"),
    (("a", "d_bad_shape"), None, ValueError, r"delta shape \(2, 50, 4\)"),
    (("a_int", "d"), None, TypeError, "alpha must be floating, got dtype int32"),
    (("a", "d_bool"), None, TypeError, "delta must be floating, got dtype bool"),
    (("a", "d"), 0.0, ValueError, "finite float < 0"),
    (("a", "d"), 0.5, ValueError, "finite float < 0"),
    (("a", "d"), -np.inf, ValueError, "finite float < 0"),
    (("a", "d"), np.nan, ValueError, "finite float < 0"),
    (("a", "d"), "x", TypeError, "concrete Python float"),
    (("a", "d"), True, TypeError, "concrete Python float"),
    (None, -1.0, ValueError, "needs a gate"),
])
def test_bad_gate(gate, threshold, error, match):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 2, 40, 50, 4, 2, 16)
    alpha, delta = random_gate(rng, 2, 40, 50, 4, 2)
    named = {"a": alpha, "d": delta, "a_bad_shape": alpha[:, :, :2],
             "d_bad_shape": jnp.concatenate([delta, delta], 2),
             "a_int": alpha.astype(jnp.int32), "d_bool": delta > 0, "x": "x", None: None}
    if isinstance(gate, tuple):
        gate = tuple(named[x] for x in gate)
    with pytest.raises(error, match=match):
        flash_dmattn(q, k, v, gate=gate, gate_threshold=threshold, implementation="cpu")
    with pytest.raises(error, match=match):
        dot_product_attention(q, k, v, gate=gate, gate_threshold=threshold, implementation="cpu")


def test_traced_threshold_refused():
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 1, 20, 20, 2, 1, 16)
    alpha, delta = random_gate(rng, 1, 20, 20, 2, 1)
    with pytest.raises(TypeError, match="concrete Python float"):
        jax.jit(lambda t: flash_dmattn(q, k, v, gate=(alpha, delta), gate_threshold=t,
                                       implementation="cpu"))(-1.0)


# ---- the GPU: the CUDA kernels ----------------------------------------------------------------


def test_cuda_lowering(monkeypatch):
    """Lowered for a GPU whose build has kernels for the call (a fake CUDA build): a gated call,
    with or without a threshold, makes the CUDA forward and backward calls with the gate's
    operands, and no warning."""
    calls = record_ffi_calls(monkeypatch)
    fake_cuda_build(monkeypatch, [16, 128])
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16, jnp.bfloat16)
    gate = random_gate(rng, 2, 24, 32, 4, 2, jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lower_for_cuda(q, k, v, is_causal=True, gate=gate)
        lower_for_cuda(q, k, v, gate=gate, gate_threshold=-1.0, implementation="cuda")
    targets = [t for t, *_ in calls]
    assert sorted(targets) == sorted([_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET] * 2)
    assert all(attrs["has_gate"] is True for *_, attrs in calls)
    assert [attrs["gate_cut"] for *_, attrs in calls] == [-np.inf] * 2 + [gate_cut(-1.0)] * 2


# The CUDA kernels' cases (head dims the GPU builds compile; bf16): the conformance cases and the
# threshold's, against the float64 reference.
CUDA_CASES = [
    ("flash", 2, 200, 130, 4, 2, 64, True, "dense", "full", None, jnp.bfloat16),
    ("flash", 1, 257, 300, 8, 2, 128, True, "keys", "keys", None, jnp.bfloat16),
    ("flash", 2, 96, 190, 4, 1, 64, False, "dense", "keys", 8.0, jnp.bfloat16),
    ("dpa", 2, 140, 170, 4, 2, 128, True, "dense", None, None, jnp.bfloat16),
    # without a mask or bias: the Hopper forward where it runs, and the Hopper backward without
    # a softcap
    ("flash", 1, 257, 300, 8, 2, 128, True, None, None, None, jnp.bfloat16),
    ("flash", 2, 130, 333, 4, 4, 64, False, None, None, 5.0, jnp.bfloat16),
    ("flash", 3, 190, 260, 4, 1, 64, True, None, None, None, jnp.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_CASES, ids=_case_id)
def test_cuda_matches_float64_reference(case):
    """The CUDA kernels against the float64 reference, threshold None."""
    require_cuda_kernel(case[6], case[11])
    _check_against_float64(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", [(2, 300, 290, 4, 2, 64, False, None, None, -1.0),
                                  (1, 260, 384, 4, 2, 128, True, "dense", "full", -1.0)],
                         ids=lambda c: "-".join(map(str, c)))
def test_cuda_threshold_matches_reference_block_rule(case, deterministic):
    """With a threshold that drops some blocks, the CUDA kernels (and their deterministic dQ)
    equal the float64 reference applying the same block rule, gradients included."""
    batch, lq, lk, heads, kv_heads, d, causal, mask_kind, bias_kind, threshold = case
    require_cuda_kernel(d, jnp.bfloat16)
    rng = np.random.default_rng(sum(map(hash, map(str, case))) % 2**32)
    q, k, v, mask, bias, _, _ = _case_inputs(
        ("flash", batch, lq, lk, heads, kv_heads, d, causal, mask_kind, bias_kind, None,
         jnp.bfloat16), rng)
    alpha, delta = structured_gate(rng, batch, lq, lk, heads, kv_heads)
    assert kept_pairs(alpha, delta, threshold, heads, kv_heads).any()

    def cuda(q, k, v, bias, alpha, delta):
        return flash_dmattn(q, k, v, mask, bias, is_causal=causal, return_lse=True,
                            gate=(alpha, delta), gate_threshold=threshold,
                            deterministic=deterministic, implementation="cuda")
    got = results(cuda, q, k, v, bias, alpha, delta)
    args64 = [to64(x) for x in (q, k, v, bias, alpha, delta)]
    want = results(_runner("flash", mask, causal, None, threshold, "xla"), *args64)
    assert_all_close(got, want, jnp.bfloat16, bias is not None)


@pytest.mark.gpu
def test_cuda_gated_calls_dispatch_and_threshold_bounds_workspace():
    """Gated calls run the Hopper forward on a Hopper GPU of an sm_90a build unless a mask, bias
    or softcap comes with the gate (then, and elsewhere, the FlashAttention-2-class forward); a
    threshold's bounds (float2 [min, max] of alpha and of delta over each 128-row and 128-key
    grid block) join the workspaces sized at trace time: without them the backward of a small
    call ran out of workspace and failed with "invalid argument"."""
    require_cuda_kernel(128, jnp.bfloat16)
    q, k, dk = (2, 1000, 16, 128), (2, 900, 4, 128), (2, 900, 4, 128)
    alpha, delta = (2, 1000, 16), (2, 900, 4)
    hopper = hopper_kernels_built()
    for threshold in (None, -1.0):
        assert _ffi.cuda_forward_kernel(q, k, gate=(alpha, delta), gate_threshold=threshold) == (
            "hopper" if hopper else "flash2")
    assert _ffi.cuda_forward_kernel(q, k, bias_shape=(2, 16, 1000, 900),
                                    gate=(alpha, delta)) == "flash2"
    # the Hopper forward's factored gate holds without a softcap only (gate.cuh)
    assert _ffi.cuda_forward_kernel(q, k, gate=(alpha, delta), softcap=6.0) == "flash2"
    ext = _ffi._extension()
    bounds = -(-(2 * 16 * 8 + 2 * 4 * 8) * 8 // 256) * 256  # float2 a grid block, 256-aligned
    fwd = [ext.cuda_forward_workspace_bytes(q, k, alpha=alpha, delta=delta, gate_cut=cut)
           for cut in (-np.inf, gate_cut(-1.0))]
    bwd = [ext.cuda_backward_workspace_bytes(q, k, dk, [], [], alpha=alpha, delta=delta,
                                             gate_cut=cut)
           for cut in (-np.inf, gate_cut(-1.0))]
    assert fwd[1] - fwd[0] == bounds
    assert bwd[1] - bwd[0] == bounds


# ---- review: the threshold's decision in the reference (x64) --------------------------------


def _product_rounding_up_to_the_cut(threshold):
    """float32 a, d with a * d below gate_cut(threshold) exactly, while the float32 product
    rounds to float32(gate_cut): the kernels (double) drop such a block."""
    cut = gate_cut(threshold)
    a = np.float32(1.1)
    for d in np.float32(cut / 1.1) + np.arange(-64, 64, dtype=np.float32) * np.spacing(
            np.float32(cut)):
        d = np.float32(d)
        if float(a) * float(d) < cut and a * d >= np.float32(cut):
            return a, d
    raise AssertionError("no such pair")


def _edge_problem(seed):
    """``(threshold, q, k, v, alpha, delta)``: one head, 128 query rows, two 128-key blocks; the
    gate bound of block 0 lies well above gate_cut(threshold), that of block 1 exactly below it
    while its float32 product rounds up to it."""
    threshold = -1.0
    a, d = _product_rounding_up_to_the_cut(threshold)
    q, k, v = qkv(np.random.default_rng(seed), 1, 128, 256, 1, 1, 16)
    alpha = jnp.full((1, 128, 1), a, jnp.float32)
    delta = jnp.concatenate([jnp.full((1, 128, 1), 5.0, jnp.float32),
                             jnp.full((1, 128, 1), d, jnp.float32)], axis=1)
    return threshold, q, k, v, alpha, delta


def test_reference_threshold_decision_is_exact_with_x64():
    """With x64 (as in this suite) and float32 inputs, the reference (implementation='xla',
    which also serves GPUs) decides the threshold's blocks exactly as the kernels do: a block
    whose bound alpha * delta lies below gate_cut exactly, but whose float32 product rounds up
    to it, is dropped by both (the reference computed the bound in float32 and kept it: its
    output differed from the CPU kernels' by 0.2)."""
    threshold, q, k, v, alpha, delta = _edge_problem(31)
    kept = kept_pairs(alpha, delta, threshold, 1, 1)
    assert kept[..., :128].all() and not kept[..., 128:].any()
    got = {impl: flash_dmattn(q, k, v, gate=(alpha, delta), gate_threshold=threshold,
                              return_lse=True, implementation=impl) for impl in ("cpu", "xla")}
    dense = flash_dmattn(to64(q), to64(k), to64(v), jnp.asarray(kept),
                         as_bias(to64(alpha), to64(delta), 1, 1), return_lse=True,
                         implementation="xla")
    for impl, (out, lse) in got.items():
        np.testing.assert_allclose(out, dense[0], atol=2e-6, err_msg=impl)
        np.testing.assert_allclose(lse, dense[1], atol=2e-6, err_msg=impl)


def test_documented_error_bound():
    """flash_dmattn's documented bound: a row whose exact softmax gives its dropped pairs
    probability m moves by at most 2m / (1 - m) max_j |v_j|, and a dropped pair's weight
    exp(logit) is below exp(threshold) times its ungated weight. Its probability is not: here
    every pair's gate is about -1, so a dropped pair keeps 92 % of its ungated probability (the
    docstring claimed below exp(-1) = 37 %)."""
    threshold = -1.0
    rng = np.random.default_rng(32)
    lq, lk = 4, 256
    q, k, v = (to64(x) for x in qkv(rng, 1, lq, lk, 1, 1, 8))

    def product(g):  # alpha * delta whose logsigmoid is g
        return g - np.log(-np.expm1(g))

    alpha = jnp.ones((1, lq, 1), jnp.float64)
    delta = jnp.concatenate([jnp.full((1, 128, 1), product(-0.9)),
                             jnp.full((1, 128, 1), product(-1.05))], axis=1)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8.0)
    gated = logits + np.asarray(as_bias(alpha, delta, 1, 1))
    prob = np.exp(gated - gated.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    ungated = np.exp(logits - logits.max(-1, keepdims=True))
    ungated /= ungated.sum(-1, keepdims=True)
    assert (gated - logits)[..., 128:].max() < threshold  # the weights' bound
    assert (prob / ungated)[..., 128:].min() > 0.9 > np.exp(threshold)  # not the probabilities'

    m = prob[..., 128:].sum(-1)[0, 0]  # [Lq]
    exact = flash_dmattn(q, k, v, gate=(alpha, delta), implementation="xla")
    for impl, cast in (("xla", to64), ("cpu", lambda x: x.astype(jnp.float32))):
        out = flash_dmattn(*(cast(x) for x in (q, k, v)), gate=(cast(alpha), cast(delta)),
                           gate_threshold=threshold, implementation=impl)
        change = np.abs(np.asarray(out, np.float64) - np.asarray(exact))[0, :, 0].max(-1)
        assert (change > 0.05).all()
        assert (change <= 2 * m / (1 - m) * np.abs(np.asarray(v)).max()).all(), impl
        assert (change <= 2 * m * np.abs(np.asarray(v)).max() + 1e-6).all(), impl


def test_reference_threshold_decision_without_x64():
    """Without x64 the reference rounds the bound to float32, as its docstring says: it keeps
    every block the kernels keep, and keeps one they drop only where the float32 bound rounds
    up to float32(gate_cut) (the pair of the test above); elsewhere the two agree."""
    threshold, q, k, v, alpha, edge = _edge_problem(33)
    below = edge.at[:, 128:].set(np.nextafter(np.float32(edge[0, 128, 0]), np.float32(-np.inf)))

    def run(delta, implementation):
        return flash_dmattn(q, k, v, gate=(alpha, delta), gate_threshold=threshold,
                            implementation=implementation)

    with jax.enable_x64(False):
        kept_all = flash_dmattn(q, k, v, gate=(alpha, edge), implementation="cpu")
        np.testing.assert_allclose(run(edge, "xla"), kept_all, atol=2e-6)  # kept
        assert not np.allclose(run(edge, "cpu"), kept_all, atol=1e-2)  # dropped
        np.testing.assert_allclose(run(below, "xla"), run(below, "cpu"), atol=2e-6)


@pytest.mark.parametrize("which", ["alpha", "delta"])
def test_unbatched_dot_product_attention_bad_gate_shape(which):
    """With 3-D inputs a batched alpha [1, T, N] (or delta [1, S, K]) is refused naming the
    shape as given and the 3-D shapes wanted ([T, N], [S, K]); the message had named the shape
    after dot_product_attention's own expansion, (1, 1, T, N), and asked for [1, T, N]: the very
    shape passed."""
    rng = np.random.default_rng(34)
    q, k, v = qkv(rng, 1, 50, 60, 4, 2, 16)
    alpha, delta = random_gate(rng, 1, 50, 60, 4, 2)
    gate = (alpha, delta[0]) if which == "alpha" else (alpha[0], delta)
    shape = r"\(1, 50, 4\)" if which == "alpha" else r"\(1, 60, 2\)"
    wanted = r"alpha \[T, N\] = \[50, 4\] and delta \[S, K\] = \[60, 2\]"
    with pytest.raises(ValueError, match=rf"gate {which} shape {shape} .*{wanted}"):
        dot_product_attention(q[0], k[0], v[0], gate=gate, implementation="cpu")


@pytest.mark.parametrize("nan_row", [200, 255])
@pytest.mark.parametrize("kept_anyway", [False, True])
def test_nan_gate_on_a_padding_row_keeps_its_block(nan_row, kept_anyway):
    """A NaN alpha on a padding row (past query_seq_lengths) makes its block's pairs with it NaN,
    not below the threshold, so the block is kept (the rule drops a block only when every pair
    is below it), by the CPU kernels and the reference alike. The kernels' min / max skipped a
    NaN (except on a block's first row) and decided on the other rows, while the reference
    dropped every such block: without row 129 both dropped it, with it they disagreed on the
    block's valid rows."""
    threshold, lq, lk = -1.0, 256, 256
    rng = np.random.default_rng(35)
    q, k, v = qkv(rng, 1, lq, lk, 1, 1, 16)
    alpha = np.ones((1, lq, 1), np.float32)
    if kept_anyway:
        alpha[:, 129] = -1.0  # (129, j) of key block 1 is kept by its own gate: 3 > cut
    alpha[:, nan_row] = np.nan
    delta = np.ones((1, lk, 1), np.float32)
    delta[:, 128:] = -3.0  # logsigmoid(-3) < -1: query block 0 drops key block 1
    alpha, delta = jnp.asarray(alpha), jnp.asarray(delta)
    lens = dict(query_seq_lengths=jnp.asarray([200], jnp.int32),
                key_value_seq_lengths=jnp.asarray([lk], jnp.int32))
    kept = np.ones((1, 1, lq, lk), bool)
    kept[..., :128, 128:] = False
    want = dot_product_attention(
        to64(q), to64(k), to64(v),
        jnp.nan_to_num(as_bias(to64(alpha), to64(delta), 1, 1)), jnp.asarray(kept),
        implementation="xla", **lens)
    for impl in ("cpu", "xla"):
        out = dot_product_attention(q, k, v, gate=(alpha, delta), gate_threshold=threshold,
                                    implementation=impl, **lens)
        np.testing.assert_allclose(out[:, :200], want[:, :200], atol=2e-6, err_msg=impl)
        np.testing.assert_array_equal(out[:, 200:], 0.0)
