"""Key ranges (``masks.KeyRanges``, issue 24): a mask in O(Lk) form, key ``j`` visible to the
query rows ``start[..., j] <= i < end[..., j]``, and-ed with every other rule.

The oracle is the float64 ``xla`` implementation run on the equivalent dense bool mask (built
here with numpy, independently of the library's range code). The CPU and the CUDA kernels read
the ranges directly (the GPU tests are marked ``gpu``).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fake_cuda_build, record_ffi_calls
from form_checks import (
    assert_cuda_lowering_reads,
    assert_cuda_with_every_rule,
    assert_equals_dense_with_every_rule,
    assert_results_close,
    assert_vmap_matches_each,
    flash,
    outputs_and_grads,
    qkv,
    require_cuda_kernel,
    to64,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dmattn import flash_dmattn, masks

# ---- inputs and the oracle --------------------------------------------------------------------


def random_ranges(rng: np.random.Generator, shape: tuple[int, ...], seqlen_q: int,
                  empty_rows: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """int32 ``(start, end)`` of `shape` with values in [0, Lq]: a third of the keys empty
    (start >= end, some with start > end), the rest random runs; `empty_rows` ``(lo, hi)``: rows
    no key reaches (every range is cut to end at lo or start at hi)."""
    a = rng.integers(0, seqlen_q + 1, shape)
    b = rng.integers(0, seqlen_q + 1, shape)
    start, end = np.minimum(a, b), np.maximum(a, b)
    empty = rng.random(shape) < 1 / 3
    start, end = np.where(empty, np.maximum(a, b), start), np.where(empty, np.minimum(a, b), end)
    if empty_rows is not None:
        lo, hi = empty_rows[0], min(empty_rows[1], seqlen_q)
        before = rng.random(shape) < 0.5
        end = np.where(before, np.minimum(end, lo), end)
        start = np.where(before, start, np.maximum(start, hi))
        end = np.where(before, end, np.maximum(end, hi))
    return start.astype(np.int32), end.astype(np.int32)


def dense_mask(start: np.ndarray, end: np.ndarray, seqlen_q: int) -> np.ndarray:
    """bool ``[B|1, Hr, Lq, Lk]`` of ranges ``[B|1, Hr, Lk]``."""
    i = np.arange(seqlen_q)[:, None]
    return (start[:, :, None, :] <= i) & (i < end[:, :, None, :])


# ---- conformance against the float64 reference ------------------------------------------------

CASES = [
    # batch, Lq, Lk, H, Hk, D, range heads (1, Hk or H), range batch, causal, bias, dtype
    (2, 130, 200, 4, 4, 32, 4, 2, False, None, jnp.float32),
    (2, 130, 200, 4, 2, 64, 2, 1, True, None, jnp.float32),
    (1, 200, 130, 4, 1, 80, 1, 1, True, "full", jnp.float32),
    (2, 96, 257, 6, 2, 64, 6, 2, False, "full", jnp.float32),
    (2, 129, 129, 4, 2, 128, 2, 2, True, "keys", jnp.float32),
    (1, 150, 190, 2, 2, 64, 2, 1, False, "full", jnp.bfloat16),
]


# The CUDA kernels' cases: head dims 64 / 128 / 256, bf16 and fp16, several key tiles, GQA with
# ranges per kv head, per query head and shared, both bias shapes (these small grids split their
# keys; test_mask_tuple has a grid that does not).
GPU_CASES = [
    (2, 300, 500, 4, 2, 128, 2, 2, True, "full", jnp.bfloat16),
    (1, 257, 700, 8, 2, 64, 8, 1, False, "keys", jnp.float16),
    (2, 200, 330, 4, 1, 256, 1, 2, True, None, jnp.bfloat16),
]


def _case_id(case) -> str:
    return "-".join(map(str, case[:10])) + "-" + jnp.dtype(case[10]).name


def _check_against_reference(case, implementation: str) -> None:
    """Outputs, lse and gradients (dbias included) of `implementation` on `case` against the
    float64 reference on the dense mask."""
    batch, lq, lk, heads, kv_heads, d, rheads, rbatch, causal, bias_kind, dtype = case
    if implementation == "cuda":
        require_cuda_kernel(d, dtype)
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d, dtype)
    start, end = random_ranges(rng, (rbatch, rheads, lk), lq, empty_rows=(lq // 3, lq // 3 + 70))
    bias = None
    if bias_kind == "full":
        bias = jnp.asarray(rng.standard_normal((batch, kv_heads, lq, lk)), dtype)
    elif bias_kind == "keys":
        bias = jnp.asarray(rng.standard_normal((1, heads, 1, lk)), dtype)
    mask = dense_mask(start, end, lq)
    out, lse, grads = outputs_and_grads(flash(implementation, is_causal=causal), q, k, v, bias,
                                        masks.KeyRanges(start, end))
    ref_out, ref_lse, ref_grads = outputs_and_grads(
        flash("xla", is_causal=causal), to64(q), to64(k), to64(v), to64(bias), jnp.asarray(mask))
    assert not np.isfinite(np.asarray(ref_lse)).all(), "the case should have empty rows"
    assert_results_close(out, lse, grads, ref_out, ref_lse, ref_grads, dtype)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case):
    """The CPU kernels against the float64 reference on the dense mask: random ranges with empty
    ones, rows no key reaches, GQA, causality, biases of full and per-key shape, several head
    dims."""
    _check_against_reference(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_cuda_matches_float64_reference(case):
    """The CUDA kernels (implementation="cuda": no fallback) against the float64 reference, as
    the CPU kernels above."""
    _check_against_reference(case, "cuda")


@pytest.mark.gpu
def test_cuda_with_every_rule():
    """The CUDA kernels with key ranges (per kv head) beside a dense mask, a bias, sequence
    lengths, segment ids and a window table with sinks, against the float64 reference."""
    rng = np.random.default_rng(17)
    lq, lk = 300, 500
    q, k, v = qkv(rng, 2, lq, lk, 4, 2, 128, jnp.bfloat16)
    start, end = random_ranges(rng, (2, 2, lk), lq)
    assert_cuda_with_every_rule(rng, q, k, v, (masks.KeyRanges(start, end),),
                                dense_mask(start, end, lq))


def test_equals_dense_mask_with_every_rule():
    """Key ranges give what the equivalent dense bool mask gives through the same CPU kernels,
    with a window, sequence lengths and segment ids (dot_product_attention) and a bias."""
    rng = np.random.default_rng(7)
    batch, lq, lk, heads, kv_heads, d = 2, 140, 170, 4, 2, 64
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d)
    start, end = random_ranges(rng, (batch, kv_heads, lk), lq)
    assert_equals_dense_with_every_rule(rng, q, k, v, masks.KeyRanges(start, end),
                                        dense_mask(start, end, lq))


def test_topk_key_ranges_form_and_to_mask():
    """The output of ``topk_key_ranges`` for a bias ``[B, Hk, 1, Lk]`` is accepted as is, and
    equals its dense mask ``topk_mask``."""
    rng = np.random.default_rng(3)
    batch, seqlen, heads, kv_heads, d = 1, 160, 4, 2, 32
    q, k, v = qkv(rng, batch, seqlen, seqlen, heads, kv_heads, d)
    scores = jnp.asarray(rng.standard_normal((batch, kv_heads, 1, seqlen)), jnp.float32)
    ranges = masks.KeyRanges(*masks.topk_key_ranges(scores, 24))
    dense = masks.topk_mask(scores, 24, is_causal=True)
    np.testing.assert_array_equal(ranges.to_mask(seqlen), dense)
    out = flash_dmattn(q, k, v, ranges, implementation="cpu")
    np.testing.assert_allclose(out, flash_dmattn(q, k, v, dense, implementation="cpu"),
                               atol=1e-6)


def test_tiles_of_empty_ranges_are_skipped():
    """A key block whose ranges all miss a query block is never read for it: NaN values there
    reach no output row of that block (a processed tile would give 0 · NaN)."""
    rng = np.random.default_rng(11)
    lq = lk = 192
    q, k, v = qkv(rng, 1, lq, lk, 2, 2, 32)
    start, end = random_ranges(rng, (1, 1, lk), lq)
    start[..., 64:128], end[..., 64:128] = 128, rng.integers(128, lq + 1, 64)  # rows 128.. only
    v = v.at[:, 64:128].set(jnp.nan)
    out = flash_dmattn(q, k, v, masks.KeyRanges(start, end), implementation="cpu")
    assert np.isfinite(np.asarray(out[:, :128])).all()


# ---- transformations -----------------------------------------------------------------------------


def test_jit_vmap_and_grad():
    """Under jit and vmap (ranges mapped, unmapped or only one of the pair mapped) the kernels
    agree with per-example calls, gradients included."""
    rng = np.random.default_rng(5)
    n, lq, lk = 3, 70, 90
    q, k, v = qkv(rng, n, lq, lk, 2, 1, 32)
    q, k, v = q[:, None], k[:, None], v[:, None]  # n examples of batch 1
    start, end = random_ranges(rng, (n, 1, 1, lk), lq)

    def one(q, k, v, start, end):
        return flash_dmattn(q, k, v, masks.KeyRanges(start, end), is_causal=True,
                            implementation="cpu")

    axes = [(0, 0, 0, 0, 0), (0, 0, 0, None, None), (0, 0, 0, 0, None), (0, None, None, None, 0)]
    assert_vmap_matches_each(one, (q, k, v, start, end), axes, n)


def test_key_ranges_pytree_through_vmap():
    """KeyRanges is a pytree: vmap over a KeyRanges argument maps both arrays."""
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, 2, 40, 50, 2, 2, 16)
    ranges = masks.KeyRanges(*random_ranges(rng, (2, 1, 1, 50), 40))
    got = jax.vmap(lambda q, k, v, r: flash_dmattn(q[None], k[None], v[None], r,
                                                   implementation="cpu")[0])(q, k, v, ranges)
    want = flash_dmattn(q, k, v, masks.KeyRanges(ranges.start[:, 0], ranges.end[:, 0]),
                        implementation="cpu")
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_sharded_over_batch_and_heads():
    """Sharded over batch and heads, key ranges give the single-device answer."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("b", "h"))
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 2, 80, 100, 4, 2, 32)
    start, end = random_ranges(rng, (2, 2, 100), 80)

    def loss(q, k, v, start, end):
        out = flash_dmattn(q, k, v, masks.KeyRanges(start, end), implementation="cpu")
        return jnp.sum(jnp.sin(out)), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    want_grads, want = fn(q, k, v, start, end)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    got_grads, got = fn(put(q, P("b", None, "h")), put(k, P("b", None, "h")),
                        put(v, P("b", None, "h")), put(start, P("b", "h")), put(end, P("b", "h")))
    np.testing.assert_allclose(got, want, atol=1e-6)
    for g, ref in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-6)


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("start_shape, end_shape, dtype, values, error, match", [
    ((2, 3, 50), (2, 3, 50), np.int32, None, ValueError, r"KeyRanges.start shape \(2, 3, 50\)"),
    ((2, 2, 49), (2, 2, 49), np.int32, None, ValueError, "shape"),
    ((2, 50), (2, 50), np.int32, None, ValueError, "shape"),
    ((2, 2, 2, 50), (2, 2, 2, 50), np.int32, None, ValueError, "shape"),
    ((2, 2, 50), (2, 4, 50), np.int32, None, ValueError, "do not broadcast"),
    ((2, 2, 50), (2, 2, 50), np.float32, None, TypeError, "integer"),
    ((2, 2, 50), (2, 2, 50), np.int32, (-1, 5), ValueError, r"\[0, Lq\] = \[0, 40\]"),
    ((2, 2, 50), (2, 2, 50), np.int32, (0, 41), ValueError, r"\[0, Lq\] = \[0, 40\]"),
])
def test_bad_key_ranges(start_shape, end_shape, dtype, values, error, match):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 2, 40, 50, 4, 2, 16)
    start, end = np.zeros(start_shape, dtype), np.full(end_shape, 10, dtype)
    if values is not None:
        start.flat[0], end.flat[0] = values
    with pytest.raises(error, match=match):
        flash_dmattn(q, k, v, masks.KeyRanges(start, end), implementation="cpu")


def test_values_unchecked_under_jit_follow_the_rule():
    """Traced ranges are not value-checked: out-of-range values act as the nearest bound."""
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, 1, 30, 40, 2, 2, 16)
    start, end = random_ranges(rng, (1, 1, 40), 30)
    wide_start, wide_end = np.where(start == 0, -5, start), np.where(end == 30, 99, end)
    fn = jax.jit(lambda s, e: flash_dmattn(q, k, v, masks.KeyRanges(s, e), implementation="cpu"))
    np.testing.assert_allclose(fn(wide_start, wide_end), fn(start, end), atol=0)


# ---- the GPU: the CUDA kernels read them ---------------------------------------------------------


def test_cuda_lowering_reads_key_ranges(monkeypatch):
    """Lowered for a GPU whose build has kernels for the call (a fake CUDA build), a call with
    key ranges calls the CUDA kernels (no warning, implementation="cuda" included) with key_start
    and key_end int32 ``[B, Hr, 1, Lk]`` as their last operands and ``has_key_ranges`` set."""
    calls = record_ffi_calls(monkeypatch)
    fake_cuda_build(monkeypatch, [16])
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16, jnp.bfloat16)
    ranges = masks.KeyRanges(*random_ranges(rng, (2, 2, 32), 24))
    i32 = jnp.dtype(jnp.int32)
    assert_cuda_lowering_reads(calls, q, k, v, ranges, [((2, 2, 1, 32), i32)] * 2,
                               has_key_ranges=True, has_row_ranges=False,
                               has_block_indices=False)


def test_concrete_values_are_checked_before_any_int32_cast():
    """Without x64, jnp.asarray wraps an int64 end of 2**32 + 1 to 1: the check reads the
    values as given (review) and rejects it, for key and row ranges alike."""
    rng = np.random.default_rng(41)
    with jax.enable_x64(False):
        q = jnp.asarray(rng.standard_normal((1, 16, 1, 16)), jnp.float32)
        k = v = jnp.asarray(rng.standard_normal((1, 16, 1, 16)), jnp.float32)
        start = np.zeros((1, 1, 16), np.int64)
        end = np.full((1, 1, 16), 2**32 + 1, np.int64)
        for form in (masks.KeyRanges, masks.RowRanges):
            with pytest.raises(ValueError, match="must lie in"):
                flash_dmattn(q, k, v, form(start, end), implementation="cpu")
