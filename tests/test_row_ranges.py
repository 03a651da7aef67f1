"""Row ranges (``masks.RowRanges``, issue 24): a mask in O(Lq) form, the mirror of key ranges:
query row ``i`` sees exactly the keys ``start[..., i] <= j < end[..., i]``, and-ed with every
other rule.

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

from jax_dmattn import _ffi, dot_product_attention, flash_dmattn, masks

# ---- inputs and the oracle --------------------------------------------------------------------


def random_ranges(rng: np.random.Generator, shape: tuple[int, ...], seqlen_k: int,
                  empty_cols: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """int32 ``(start, end)`` of `shape` (``[..., Lq]``) with values in [0, Lk]: a third of the
    rows empty (start >= end, some with start > end: rows with no visible key), the rest random
    runs; `empty_cols` ``(lo, hi)``: keys no row reaches (every range is cut to end at lo or
    start at hi)."""
    a = rng.integers(0, seqlen_k + 1, shape)
    b = rng.integers(0, seqlen_k + 1, shape)
    start, end = np.minimum(a, b), np.maximum(a, b)
    empty = rng.random(shape) < 1 / 3
    start, end = np.where(empty, np.maximum(a, b), start), np.where(empty, np.minimum(a, b), end)
    if empty_cols is not None:
        lo, hi = empty_cols[0], min(empty_cols[1], seqlen_k)
        before = rng.random(shape) < 0.5
        end = np.where(before, np.minimum(end, lo), end)
        start = np.where(before, start, np.maximum(start, hi))
        end = np.where(before, end, np.maximum(end, hi))
    return start.astype(np.int32), end.astype(np.int32)


def dense_mask(start: np.ndarray, end: np.ndarray, seqlen_k: int) -> np.ndarray:
    """bool ``[..., Lq, Lk]`` of ranges ``[..., Lq]``."""
    j = np.arange(seqlen_k)
    return (start[..., :, None] <= j) & (j < end[..., :, None])


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
# ranges per kv head, per query head and shared, both bias shapes; one decodes (a few rows, keys
# split over CTAs).
GPU_CASES = [
    (2, 300, 500, 4, 2, 128, 2, 2, True, "full", jnp.bfloat16),
    (1, 257, 700, 8, 2, 64, 8, 1, False, "keys", jnp.float16),
    (2, 330, 200, 4, 1, 256, 1, 2, True, None, jnp.bfloat16),
    (2, 3, 3000, 8, 2, 128, 2, 2, False, "keys", jnp.bfloat16),
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
    start, end = random_ranges(rng, (rbatch, rheads, lq), lk, empty_cols=(lk // 3, lk // 3 + 70))
    bias = None
    if bias_kind == "full":
        bias = jnp.asarray(rng.standard_normal((batch, kv_heads, lq, lk)), dtype)
    elif bias_kind == "keys":
        bias = jnp.asarray(rng.standard_normal((1, heads, 1, lk)), dtype)
    mask = dense_mask(start, end, lk)
    out, lse, grads = outputs_and_grads(flash(implementation, is_causal=causal), q, k, v, bias,
                                        masks.RowRanges(start, end))
    ref_out, ref_lse, ref_grads = outputs_and_grads(
        flash("xla", is_causal=causal), to64(q), to64(k), to64(v), to64(bias), jnp.asarray(mask))
    assert not np.isfinite(np.asarray(ref_lse)).all(), "the case should have empty rows"
    assert_results_close(out, lse, grads, ref_out, ref_lse, ref_grads, dtype)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case):
    """The CPU kernels against the float64 reference on the dense mask: random ranges with empty
    ones (rows with no visible key), keys no row reaches, GQA, causality, biases of full and
    per-key shape, several head dims."""
    _check_against_reference(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_cuda_matches_float64_reference(case):
    """The CUDA kernels (implementation="cuda": no fallback) against the float64 reference, as
    the CPU kernels above."""
    _check_against_reference(case, "cuda")


@pytest.mark.gpu
def test_cuda_with_every_rule():
    """The CUDA kernels with row ranges (per query head) beside a dense mask, a bias, sequence
    lengths, segment ids and a window table with sinks, against the float64 reference."""
    rng = np.random.default_rng(17)
    lq, lk = 300, 500
    q, k, v = qkv(rng, 2, lq, lk, 4, 2, 64, jnp.float16)
    start, end = random_ranges(rng, (1, 4, lq), lk)
    assert_cuda_with_every_rule(rng, q, k, v, (masks.RowRanges(start, end),),
                                dense_mask(start, end, lk))


def test_equals_dense_mask_with_every_rule():
    """Row ranges give what the equivalent dense bool mask gives through the same CPU kernels,
    with a window, sequence lengths and segment ids (dot_product_attention) and a bias."""
    rng = np.random.default_rng(7)
    batch, lq, lk, heads, kv_heads, d = 2, 140, 170, 4, 2, 64
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d)
    start, end = random_ranges(rng, (batch, kv_heads, lq), lk)
    assert_equals_dense_with_every_rule(rng, q, k, v, masks.RowRanges(start, end),
                                        dense_mask(start, end, lk))


def test_to_mask_and_a_band_is_a_window():
    """``to_mask`` is the dense form; the band ``max(0, i - 20) <= j <= i`` gives what
    dot_product_attention's window ``(20, 0)`` gives, also for 3-D (unbatched) inputs."""
    rng = np.random.default_rng(3)
    seqlen, heads, kv_heads, d = 160, 4, 2, 32
    q, k, v = qkv(rng, 1, seqlen, seqlen, heads, kv_heads, d)
    i = np.arange(seqlen, dtype=np.int32)
    band = masks.RowRanges(np.maximum(i - 20, 0)[None], (i + 1)[None])  # [1, Lq]: heads 1
    np.testing.assert_array_equal(band.to_mask(seqlen), dense_mask(*band, seqlen))
    got = dot_product_attention(q[0], k[0], v[0], mask=band, implementation="cpu")
    want = dot_product_attention(q[0], k[0], v[0], local_window_size=(20, 0),
                                 implementation="cpu")
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_tiles_no_row_range_meets_are_skipped():
    """A key block that no row range of a query block meets is never read for it: NaN values
    there reach no output row of that block (a processed tile would give 0 · NaN)."""
    rng = np.random.default_rng(11)
    lq = lk = 192
    q, k, v = qkv(rng, 1, lq, lk, 2, 2, 32)
    start, end = random_ranges(rng, (1, 1, lq), lk)
    # rows 0..127 see keys in [0, 64) or in [128, 192) only: key block 64..127 is out of reach
    low = rng.random(128) < 0.5
    a, b = rng.integers(0, 65, (2, 128))
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    start[..., :128] = np.where(low, lo, lo + 128)
    end[..., :128] = np.where(low, hi, hi + 128)
    v = v.at[:, 64:128].set(jnp.nan)
    out = flash_dmattn(q, k, v, masks.RowRanges(start, end), implementation="cpu")
    assert np.isfinite(np.asarray(out[:, :128])).all()


# ---- transformations -----------------------------------------------------------------------------


def test_jit_vmap_and_grad():
    """Under jit and vmap (ranges mapped, unmapped or only one of the pair mapped) the kernels
    agree with per-example calls, gradients included."""
    rng = np.random.default_rng(5)
    n, lq, lk = 3, 70, 90
    q, k, v = qkv(rng, n, lq, lk, 2, 1, 32)
    q, k, v = q[:, None], k[:, None], v[:, None]  # n examples of batch 1
    start, end = random_ranges(rng, (n, 1, 1, lq), lk)

    def one(q, k, v, start, end):
        return flash_dmattn(q, k, v, masks.RowRanges(start, end), is_causal=True,
                            implementation="cpu")

    axes = [(0, 0, 0, 0, 0), (0, 0, 0, None, None), (0, 0, 0, 0, None), (0, None, None, None, 0)]
    assert_vmap_matches_each(one, (q, k, v, start, end), axes, n)


def test_row_ranges_pytree_through_vmap():
    """RowRanges is a pytree: vmap over a RowRanges argument maps both arrays."""
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, 2, 40, 50, 2, 2, 16)
    ranges = masks.RowRanges(*random_ranges(rng, (2, 1, 1, 40), 50))
    got = jax.vmap(lambda q, k, v, r: flash_dmattn(q[None], k[None], v[None], r,
                                                   implementation="cpu")[0])(q, k, v, ranges)
    want = flash_dmattn(q, k, v, masks.RowRanges(ranges.start[:, 0], ranges.end[:, 0]),
                        implementation="cpu")
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_sharded_over_batch_and_heads():
    """Sharded over batch and heads, row ranges give the single-device answer."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("b", "h"))
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 2, 80, 100, 4, 2, 32)
    start, end = random_ranges(rng, (2, 2, 80), 100)

    def loss(q, k, v, start, end):
        out = flash_dmattn(q, k, v, masks.RowRanges(start, end), implementation="cpu")
        return jnp.sum(jnp.sin(out)), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    want_grads, want = fn(q, k, v, start, end)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    got_grads, got = fn(put(q, P("b", None, "h")), put(k, P("b", None, "h")),
                        put(v, P("b", None, "h")), put(start, P("b", "h")), put(end, P("b", "h")))
    np.testing.assert_allclose(got, want, atol=1e-6)
    for g, ref in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-6)


def test_ffi_operands_and_attribute(monkeypatch):
    """The row ranges reach both FFI calls as int32 ``[B, Hr, Lq, 1]`` after the segment ids,
    with ``has_row_ranges`` set (and ``has_key_ranges`` not); build_info reports them."""
    assert _ffi.build_info()["row_ranges"] is True
    calls = record_ffi_calls(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16)
    start, end = random_ranges(rng, (2, 2, 24), 32)
    ids = np.zeros((2, 24), np.int32), np.zeros((2, 32), np.int32)

    def loss(q, k, v):
        return jnp.sum(flash_dmattn(q, k, v, masks.RowRanges(start, end), q_segment_ids=ids[0],
                                    kv_segment_ids=ids[1], implementation="cpu"))

    jax.jit(jax.grad(loss)).lower(q, k, v)
    by_target = {target: (operands, attrs) for target, operands, attrs in calls}
    assert set(by_target) == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}, calls
    i32 = jnp.dtype(jnp.int32)
    for operands, attrs in by_target.values():
        assert operands[-4:] == [((2, 24), i32), ((2, 32), i32), ((2, 2, 24, 1), i32),
                                 ((2, 2, 24, 1), i32)], operands
        assert attrs["has_row_ranges"] is True and attrs["has_key_ranges"] is False


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("start_shape, end_shape, dtype, values, error, match", [
    ((2, 3, 40), (2, 3, 40), np.int32, None, ValueError, r"RowRanges.start shape \(2, 3, 40\)"),
    ((2, 2, 39), (2, 2, 39), np.int32, None, ValueError, "shape"),
    ((2, 40), (2, 40), np.int32, None, ValueError, "shape"),
    ((2, 2, 40, 2), (2, 2, 40, 2), np.int32, None, ValueError, "shape"),
    ((2, 2, 40), (2, 4, 40), np.int32, None, ValueError, "do not broadcast"),
    ((2, 2, 40), (2, 2, 40), np.float32, None, TypeError, "integer"),
    ((2, 2, 40), (2, 2, 40), np.int32, (-1, 5), ValueError, r"\[0, Lk\] = \[0, 50\]"),
    ((2, 2, 40), (2, 2, 40), np.int32, (0, 51), ValueError, r"\[0, Lk\] = \[0, 50\]"),
])
def test_bad_row_ranges(start_shape, end_shape, dtype, values, error, match):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 2, 40, 50, 4, 2, 16)
    start, end = np.zeros(start_shape, dtype), np.full(end_shape, 10, dtype)
    if values is not None:
        start.flat[0], end.flat[0] = values
    with pytest.raises(error, match=match):
        flash_dmattn(q, k, v, masks.RowRanges(start, end), implementation="cpu")


def test_values_unchecked_under_jit_follow_the_rule():
    """Traced ranges are not value-checked: out-of-range values act as the nearest bound."""
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, 1, 30, 40, 2, 2, 16)
    start, end = random_ranges(rng, (1, 1, 30), 40)
    wide_start, wide_end = np.where(start == 0, -5, start), np.where(end == 40, 99, end)
    fn = jax.jit(lambda s, e: flash_dmattn(q, k, v, masks.RowRanges(s, e), implementation="cpu"))
    np.testing.assert_allclose(fn(wide_start, wide_end), fn(start, end), atol=0)


# ---- the GPU: the CUDA kernels read them ---------------------------------------------------------


def test_cuda_lowering_reads_row_ranges(monkeypatch):
    """Lowered for a GPU whose build has kernels for the call (a fake CUDA build), a call with
    row ranges calls the CUDA kernels (no warning, implementation="cuda" included) with row_start
    and row_end int32 ``[B, Hr, Lq, 1]`` as their last operands and ``has_row_ranges`` set."""
    calls = record_ffi_calls(monkeypatch)
    fake_cuda_build(monkeypatch, [16])
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16, jnp.bfloat16)
    ranges = masks.RowRanges(*random_ranges(rng, (2, 2, 24), 32))
    i32 = jnp.dtype(jnp.int32)
    assert_cuda_lowering_reads(calls, q, k, v, ranges, [((2, 2, 24, 1), i32)] * 2,
                               has_row_ranges=True, has_key_ranges=False,
                               has_block_indices=False)
