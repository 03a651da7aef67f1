"""Tests of jax_dmattn.masks: the dynamic top-window mask against brute-force NumPy references
(both the fast per-key path and the lax.top_k fallback), its O(Lk) range form, jit/vmap, error
messages, the static mask helpers, and flash_dmattn run with a generated mask."""

from __future__ import annotations

import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dmattn
from jax_dmattn import masks

# ---- references -------------------------------------------------------------------------------


def reference_topk(scores, window, *, is_causal, valid=None, seqlen_q=None) -> np.ndarray:
    """Row by row: the visible keys, stably sorted by (-score, index), the first `window` kept."""
    s = np.asarray(scores, np.float64)
    lk = s.shape[-1]
    per_key = s.ndim == 1 or s.shape[-2] == 1
    lq = (seqlen_q or lk) if per_key else s.shape[-2]
    shape = (*s.shape[:-2], lq, lk)
    s = np.broadcast_to(np.where(np.isnan(s), -np.inf, s), shape)
    v = np.ones(shape, bool) if valid is None else np.broadcast_to(np.asarray(valid), shape)
    out = np.zeros(shape, bool)
    keys = np.arange(lk)
    for idx in np.ndindex(*shape[:-1]):
        visible = v[idx] & ((keys <= idx[-1] + lk - lq) if is_causal else True)
        js = keys[visible]
        order = js[np.lexsort((js, -s[idx][js]))]  # last key sorts first: score desc, index asc
        out[(*idx, order[:window])] = True
    return out


def heap_ranges(scores, window, seqlen_q, valid=None):
    """(first_row, end_row) of 1-D per-key scores by simulating a bounded heap over the growing
    causal prefix: independent of the library's sort/wavelet algorithm."""
    s = np.where(np.isnan(scores), -np.inf, np.asarray(scores, np.float64))
    lk = s.shape[0]
    offset = lk - seqlen_q
    leave = np.full(lk, lk)  # prefix end (key coordinates) at which each key leaves
    heap = []  # min-heap of (score, -index): its top is the worst key kept
    for t in range(lk):
        if valid is not None and not valid[t]:
            leave[t] = t
            continue
        heapq.heappush(heap, (s[t], -t))
        if len(heap) > window:
            _, neg = heapq.heappop(heap)
            leave[-neg] = t
    first = np.clip(np.arange(lk) - offset, 0, seqlen_q)
    end = np.clip(leave - offset, first, seqlen_q)
    return first, end


def make_scores(rng, shape, kind) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "tied":  # heavy ties: the tie rule decides most rows
        return rng.integers(0, 4, shape).astype(np.float32)
    assert kind == "special"  # NaN, infinities and signed zeros among ties
    s = rng.choice(np.array([np.nan, -np.inf, np.inf, -0.0, 0.0, 1.0, -1.0], np.float32), shape)
    return s.astype(np.float32)


def uses_top_k(fn, *args) -> bool:
    return "top_k" in str(jax.make_jaxpr(fn)(*args))


def assert_mask_equal(got, expected, label=""):
    got = np.asarray(got)
    assert got.dtype == np.bool_, got.dtype
    assert got.shape == expected.shape, (got.shape, expected.shape)
    bad = np.argwhere(got != expected)
    assert bad.size == 0, f"{label}: {len(bad)} entries differ, first at {bad[:3].tolist()}"


KINDS = ("normal", "tied", "special")

# (leading dims, Lq, Lk, window). Each distinct case compiles the fast path once (~2 s here).
PER_KEY_CASES = [
    ((2, 3), 37, 37, 5),
    ((2,), 13, 50, 1),  # Lq < Lk, window = 1
    ((1, 1), 1, 20, 4),  # Lq = 1 (decoding)
    ((2, 1), 30, 20, 3),  # Lq > Lk: the first rows see nothing
    ((1, 2), 300, 300, 17),  # three wavelet levels
    ((2, 2), 10, 10, 64),  # window > Lk
    ((), 24, 24, 24),  # 1-D scores, window = Lk
]


def per_key_scores(rng, lead, lk, kind):
    return make_scores(rng, (*lead, 1, lk) if lead else (lk,), kind)


# ---- topk_mask --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lead,lq,lk,window", PER_KEY_CASES)
def test_per_key_causal_matches_bruteforce(lead, lq, lk, window, kind):
    rng = np.random.default_rng(lq * 1000 + lk + window)
    s = per_key_scores(rng, lead, lk, kind)
    fn = functools.partial(masks.topk_mask, window=window, seqlen_q=lq)  # jitted inside
    got = fn(s)
    expected = reference_topk(s, window, is_causal=True, seqlen_q=lq)
    assert_mask_equal(got, expected, "causal per-key")
    assert not uses_top_k(fn, s), "per-key causal scores must take the fast path"
    rows_kept = expected.sum(-1)
    assert rows_kept.max() == min(window, lk)  # the case exercises the window


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lead,lq,lk,window", PER_KEY_CASES[:4])
def test_per_key_noncausal_matches_bruteforce(lead, lq, lk, window, kind):
    rng = np.random.default_rng(7 + lq + lk)
    s = per_key_scores(rng, lead, lk, kind)
    fn = functools.partial(masks.topk_mask, window=window, is_causal=False, seqlen_q=lq)
    expected = reference_topk(s, window, is_causal=False, seqlen_q=lq)
    assert_mask_equal(fn(s), expected, "non-causal per-key")
    assert not uses_top_k(fn, s)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("lq,lk,window", [(9, 23, 4), (23, 9, 2), (5, 6, 6)])
def test_per_query_key_scores_fallback(lq, lk, window, is_causal, kind):
    rng = np.random.default_rng(lq * 31 + lk)
    s = make_scores(rng, (2, 3, lq, lk), kind)
    fn = functools.partial(masks.topk_mask, window=window, is_causal=is_causal)
    expected = reference_topk(s, window, is_causal=is_causal)
    assert_mask_equal(fn(s), expected, "per-(query, key) scores")
    assert uses_top_k(fn, s) == (window < lk)


@pytest.mark.parametrize("kind", ["normal", "tied"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_valid_per_key_fast_path(is_causal, kind):
    rng = np.random.default_rng(11)
    lq, lk, window = 40, 40, 8  # the shapes of test_padding_split_...: one compilation
    s = make_scores(rng, (2, 2, 1, lk), kind)
    valid = rng.random((2, 1, 1, lk)) < 0.6
    fn = functools.partial(masks.topk_mask, window=window, is_causal=is_causal)
    expected = reference_topk(s, window, is_causal=is_causal, valid=valid, seqlen_q=lq)
    got = fn(s, valid=valid)
    assert_mask_equal(got, expected, "per-key valid")
    assert not np.asarray(got)[np.broadcast_to(~valid, got.shape)].any()
    assert not uses_top_k(lambda x, v: fn(x, valid=v), s, valid)


@pytest.mark.parametrize("kind", ["normal", "special"])
def test_valid_per_query_takes_fallback(kind):
    rng = np.random.default_rng(12)
    lq, lk, window = 17, 30, 5
    s = make_scores(rng, (2, 1, 1, lk), kind)
    valid = rng.random((2, 1, lq, lk)) < 0.7  # differs per row: no fast path
    fn = functools.partial(masks.topk_mask, window=window, seqlen_q=lq)
    expected = reference_topk(s, window, is_causal=True, valid=valid, seqlen_q=lq)
    assert_mask_equal(fn(s, valid=valid), expected, "per-row valid")
    assert uses_top_k(lambda x, v: fn(x, valid=v), s, valid)


def test_padding_split_equals_full_padding_mask():
    """Key padding as `valid` + query padding ANDed afterwards == a full per-row padding mask;
    query padding alone ([B, 1, Lq, 1]) also keeps the fast path."""
    rng = np.random.default_rng(13)
    lq = lk = 40
    s = make_scores(rng, (2, 2, 1, lk), "normal")
    q_lens, kv_lens = jnp.array([40, 25]), jnp.array([33, 18])
    full = masks.padding_mask(q_lens, kv_lens, lq, lk)
    key_pad = masks.padding_mask(None, kv_lens, 1, lk)  # [B, 1, 1, Lk]
    query_pad = masks.padding_mask(q_lens, None, lq, 1)  # [B, 1, Lq, 1]
    fast = masks.topk_mask(s, 8, valid=key_pad) & query_pad
    slow = masks.topk_mask(s, 8, valid=full)
    assert_mask_equal(fast, np.asarray(slow), "split padding")
    assert_mask_equal(slow, reference_topk(s, 8, is_causal=True, valid=np.asarray(full)), "ref")
    rows_only = functools.partial(masks.topk_mask, window=8)
    expected = reference_topk(s, 8, is_causal=True, valid=np.asarray(query_pad))
    assert_mask_equal(rows_only(s, valid=query_pad), expected, "query padding only")
    assert not uses_top_k(lambda x, v: rows_only(x, valid=v), s, query_pad)
    assert uses_top_k(lambda x, v: rows_only(x, valid=v), s, full)


def test_low_precision_and_integer_scores():
    rng = np.random.default_rng(14)
    s = make_scores(rng, (1, 2, 1, 50), "tied")
    expected = reference_topk(s, 6, is_causal=False, seqlen_q=3)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int32):
        got = masks.topk_mask(jnp.asarray(s, dtype), 6, is_causal=False, seqlen_q=3)
        assert_mask_equal(got, expected, str(dtype))


# ---- topk_key_ranges --------------------------------------------------------------------------


def test_ranges_match_heap_simulation():
    """Long sequences (15-bit ranks: four wavelet levels), Lq < Lk, one batch row per kind of
    scores, key padding on all but the first."""
    lq, lk, window = 15000, 20000, 1024
    rng = np.random.default_rng(18)
    s = np.stack([make_scores(rng, (lk,), kind) for kind in KINDS])
    valid = rng.random(s.shape) < 0.8
    valid[0] = True
    first, end = masks.topk_key_ranges(s, window, seqlen_q=lq, valid=valid)
    assert first.dtype == end.dtype == jnp.int32 and first.shape == s.shape
    for b, kind in enumerate(KINDS):
        ref_first, ref_end = heap_ranges(s[b], window, lq, valid[b])
        np.testing.assert_array_equal(np.asarray(first[b]), ref_first, kind)
        np.testing.assert_array_equal(np.asarray(end[b]), ref_end, kind)
    # every row keeps exactly min(window, visible keys) keys
    kept = np.zeros(lq + 1, np.int64)
    np.add.at(kept, np.asarray(first[0]), 1)
    np.add.at(kept, np.asarray(end[0]), -1)
    per_row = np.cumsum(kept)[:lq]
    seen = np.arange(lq) + lk - lq + 1
    np.testing.assert_array_equal(per_row, np.minimum(seen, window))


@pytest.mark.parametrize("lq,lk,window", [(60, 40, 8), (30, 40, 64)])  # 60: Lq > Lk
def test_ranges_equal_mask(lq, lk, window):
    rng = np.random.default_rng(lq * 7 + lk)
    s = make_scores(rng, (2, 2, 1, lk), "tied")
    valid = rng.random((2, 1, 1, lk)) < 0.75
    first, end = masks.topk_key_ranges(s, window, seqlen_q=lq, valid=valid)
    assert first.shape == end.shape == s.shape
    i = jnp.arange(lq)[:, None]
    from_ranges = (first <= i) & (i < end)
    mask = masks.topk_mask(s, window, seqlen_q=lq, valid=valid)
    assert_mask_equal(from_ranges, np.asarray(mask), "ranges vs mask")
    assert_mask_equal(mask, reference_topk(s, window, is_causal=True, valid=valid, seqlen_q=lq))


# ---- transformations --------------------------------------------------------------------------


def test_jit_and_vmap():
    rng = np.random.default_rng(15)
    s = make_scores(rng, (2, 3, 1, 37), "tied")  # PER_KEY_CASES[0]'s shapes
    expected = reference_topk(s, 5, is_causal=True)
    vm = jax.jit(jax.vmap(lambda x: masks.topk_mask(x, 5)))(s)
    assert_mask_equal(vm, expected, "jit(vmap(fast path))")

    jitted = jax.jit(masks.topk_mask, static_argnames=("window", "is_causal", "seqlen_q"))
    got = jitted(s, window=5, is_causal=False, seqlen_q=7)
    assert_mask_equal(got, reference_topk(s, 5, is_causal=False, seqlen_q=7), "jit, static args")

    valid = rng.random((2, 1, 1, 37)) < 0.7
    vm_valid = jax.vmap(lambda x, v: masks.topk_mask(x, 5, is_causal=False, valid=v))(s, valid)
    assert_mask_equal(vm_valid, reference_topk(s, 5, is_causal=False, valid=valid), "vmap valid")

    pq = make_scores(rng, (4, 2, 12, 12), "tied")
    vm_pq = jax.vmap(lambda x: masks.topk_mask(x, 3))(pq)
    assert_mask_equal(vm_pq, reference_topk(pq, 3, is_causal=True), "vmap fallback")

    first, end = jax.jit(jax.vmap(lambda x: masks.topk_key_ranges(x, 5, seqlen_q=20)))(s)
    i = np.arange(20)[:, None]
    from_ranges = (np.asarray(first) <= i) & (i < np.asarray(end))
    assert_mask_equal(from_ranges, reference_topk(s, 5, is_causal=True, seqlen_q=20), "ranges")


# ---- bad input --------------------------------------------------------------------------------

_S = np.zeros((1, 1, 1, 8), np.float32)
_PQ = np.zeros((1, 1, 4, 8), np.float32)

BAD_CALLS = [
    (lambda: masks.topk_mask(_S, 0), ValueError, "window must be >= 1"),
    (lambda: masks.topk_mask(_S, 2.5), TypeError, "window must be a Python int"),
    (lambda: masks.topk_mask(_S, True), TypeError, "window must be a Python int"),
    (lambda: masks.topk_mask(np.float32(1.0), 2), ValueError, "at least one dim"),
    (lambda: masks.topk_mask(np.zeros((1, 0), np.float32), 2), ValueError, "at least one key"),
    (lambda: masks.topk_mask(_S > 0, 2), TypeError, "scores must be a floating"),
    (lambda: masks.topk_mask(_S, 2, is_causal=None), TypeError, "is_causal must be"),
    (lambda: masks.topk_mask(_S, 2, valid=np.ones(8)), TypeError, "valid must be a bool"),
    (lambda: masks.topk_mask(_S, 2, valid=np.ones((1, 1, 1, 9), bool)), ValueError,
     "does not broadcast"),
    (lambda: masks.topk_mask(_S, 2, valid=np.ones((2, 1, 1, 1, 8), bool)), ValueError,
     "does not broadcast"),
    (lambda: masks.topk_mask(_S, 2, seqlen_q=0), ValueError, "seqlen_q must be >= 1"),
    (lambda: masks.topk_mask(_PQ, 2, seqlen_q=5), ValueError, "does not match the query dim"),
    (lambda: jax.jit(masks.topk_mask)(_S, 2), TypeError, "static under jit"),
    (lambda: masks.topk_key_ranges(_S, -1), ValueError, "window must be >= 1"),
    (lambda: masks.topk_key_ranges(_S, 2, valid=np.ones(8, np.int32)), TypeError,
     "valid must be a bool"),
    (lambda: masks.causal_mask(0, 4), ValueError, "seqlen_q must be >= 1"),
    (lambda: masks.causal_mask(4, 4, bottom_right="yes"), TypeError, "bottom_right"),
    (lambda: masks.window_mask(4, 4, -1, 0), ValueError, "left must be >= 0"),
    (lambda: masks.window_mask(4, 4, 2, 1.0), TypeError, "right must be a Python int"),
    (lambda: masks.padding_mask(None, None, 4, 4), ValueError, "needs q_lens or kv_lens"),
    (lambda: masks.padding_mask(np.ones(2, np.float32), None, 4, 4), TypeError,
     "q_lens must be an integer"),
    (lambda: masks.padding_mask(np.ones((2, 1), np.int32), None, 4, 4), ValueError,
     r"q_lens must be 1-D \[B\]"),
    (lambda: masks.padding_mask(np.ones(2, np.int32), np.ones(3, np.int32), 4, 4), ValueError,
     "must both be"),
    (lambda: masks.block_mask(np.ones((2, 3), bool), 4, 4, 8, 8), ValueError,
     r"\[\.\.\., 2, 2\]"),
    (lambda: masks.block_mask(np.ones(2, bool), 4, 4, 8, 8), ValueError, "nQ, nK"),
    (lambda: masks.block_mask(np.ones((2, 2), np.int8), 4, 4, 8, 8), TypeError,
     "block_keep must be bool"),
    (lambda: masks.block_mask(np.ones((2, 2), bool), 0, 4, 8, 8), ValueError,
     "block_q must be >= 1"),
]


@pytest.mark.parametrize("call,error,match", BAD_CALLS, ids=[m for _, _, m in BAD_CALLS])
def test_bad_inputs_raise(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---- static helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize("lq,lk", [(5, 9), (9, 5), (7, 7)])
def test_causal_and_window_masks(lq, lk):
    i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
    for bottom_right, d in ((True, i + lk - lq), (False, i)):
        causal = masks.causal_mask(lq, lk, bottom_right=bottom_right)
        assert causal.shape == (1, 1, lq, lk) and causal.dtype == jnp.bool_
        np.testing.assert_array_equal(np.asarray(causal)[0, 0], j <= d)
        for left, right in ((2, 0), (0, 3), (None, 1), (1, None), (None, None)):
            got = np.asarray(masks.window_mask(lq, lk, left, right, bottom_right=bottom_right))
            lo = -np.inf if left is None else d - left
            hi = np.inf if right is None else d + right
            expected = np.broadcast_to((j >= lo) & (j <= hi), (lq, lk))
            np.testing.assert_array_equal(got[0, 0], expected, str((left, right)))
    np.testing.assert_array_equal(np.asarray(masks.window_mask(lq, lk, None, 0)),
                                  np.asarray(masks.causal_mask(lq, lk)))


def test_padding_mask():
    q_lens, kv_lens = np.array([3, 6, 0]), np.array([5, 2, 7])
    got = np.asarray(jax.jit(masks.padding_mask, static_argnums=(2, 3))(q_lens, kv_lens, 6, 7))
    assert got.shape == (3, 1, 6, 7)
    i, j = np.arange(6)[:, None], np.arange(7)[None, :]
    for b in range(3):
        np.testing.assert_array_equal(got[b, 0], (i < q_lens[b]) & (j < kv_lens[b]))
    kv_only = np.asarray(masks.padding_mask(None, kv_lens, 6, 7))
    np.testing.assert_array_equal(kv_only[:, 0], np.broadcast_to(j < kv_lens[:, None, None],
                                                                 (3, 6, 7)))


def test_block_mask():
    rng = np.random.default_rng(16)
    keep = rng.random((2, 1, 3, 4)) < 0.5  # Lq=10 in blocks of 4 (last partial), Lk=13 of 4
    got = np.asarray(jax.jit(masks.block_mask, static_argnums=(1, 2, 3, 4))(keep, 4, 4, 10, 13))
    expected = np.repeat(np.repeat(keep, 4, axis=-2), 4, axis=-1)[..., :10, :13]
    np.testing.assert_array_equal(got, expected)
    vm = jax.vmap(lambda k: masks.block_mask(k, 4, 4, 10, 13))(keep)
    np.testing.assert_array_equal(np.asarray(vm), expected)


# ---- with flash_dmattn ------------------------------------------------------------------------


def test_flash_dmattn_with_topk_mask():
    """The paper's workload in miniature: per-key bias [B, Hk, 1, Lk], causal top-W mask; the C++
    kernels where built (else the pure-JAX implementation)."""
    implementation = "cpu" if "cpu" in jax_dmattn.available_implementations() else "xla"
    rng = np.random.default_rng(17)
    B, L, H, Hk, D, W = 2, 37, 6, 3, 16, 5  # the mask has PER_KEY_CASES[0]'s shapes
    q = jnp.asarray(rng.standard_normal((B, L, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, L, Hk, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, L, Hk, D)), jnp.float32)
    bias = jnp.asarray(rng.integers(0, 3, (B, Hk, 1, L)), jnp.float32)  # ties
    mask = masks.topk_mask(bias, W)
    brute = reference_topk(bias, W, is_causal=True)
    assert_mask_equal(mask, brute, "generated mask")

    def run(m):
        return jax_dmattn.flash_dmattn(q, k, v, m, bias, is_causal=True,
                                       implementation=implementation)

    out = np.asarray(run(mask))
    expected = np.asarray(run(jnp.asarray(brute)))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    dense = np.asarray(run(None))  # the mask must matter
    assert np.abs(out - dense).max() > 1e-3


# ---- the CUDA leave-position kernel -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,lk,window", [
    (1, 1, 1), (3, 33, 1), (2, 130, 7), (1, 300, 299), (2, 5000, 1024), (3, 4099, 700),
    (1, 16384, 1024),
])
def test_leave_positions_cuda_match_xla(rows, lk, window, kind):
    """The CUDA kernel (one warp per key) against the wavelet-matrix XLA program, exactly, on
    order keys with ties, NaN and infinities; under vmap (the batching rule) too. Rows of a length
    that is not a multiple of 4 start unaligned (the kernel's scalar loads)."""
    rng = np.random.default_rng(rows * 100003 + lk + window)
    key = masks._order_key(jnp.asarray(make_scores(rng, (rows, lk), kind)))
    got = jax.jit(functools.partial(masks._leave_positions, window=window))(key)
    expected = jax.jit(functools.partial(masks._leave_positions_xla, window=window))(key)
    if window < lk:  # else no key ever leaves: no kernel
        assert "dmattn_topk_leave" in jax.jit(
            functools.partial(masks._leave_positions, window=window)).lower(key).as_text()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    batched = jax.vmap(functools.partial(masks._leave_positions, window=window))(key[:, None])
    np.testing.assert_array_equal(np.asarray(batched)[:, 0], np.asarray(expected))


RANGE_MASK_CASES = [  # (leading dims, blocks, block, slots)
    ((), 1, 1, 1), ((2,), 3, 5, 37), ((1, 2), 4, 64, 128), ((2, 1), 2, 100, 1536),
]


def range_mask_bruteforce(first, end, block):
    rows = np.arange(first.shape[-2])[:, None, None] * block + np.arange(block)[:, None]
    return (first[..., None, :] <= rows) & (rows < end[..., None, :])


def random_row_ranges(rng, lead, num_blocks, block, slots):
    """Ranges around each block's rows: empty (first >= end), inside, across and outside."""
    lq = num_blocks * block
    first = rng.integers(-2, lq + 2, (*lead, num_blocks, slots)).astype(np.int32)
    end = (first + rng.integers(-3, 2 * block, first.shape)).astype(np.int32)
    return first, end


@pytest.mark.parametrize("lead,num_blocks,block,slots", RANGE_MASK_CASES)
def test_block_range_mask_matches_bruteforce(lead, num_blocks, block, slots):
    rng = np.random.default_rng(num_blocks * 1000 + block + slots)
    first, end = random_row_ranges(rng, lead, num_blocks, block, slots)
    expected = range_mask_bruteforce(first, end, block)
    assert expected.size < 100 or (expected.any() and not expected.all())
    got = jax.jit(masks.block_range_mask, static_argnums=2)(first, end, block)
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(got), expected)
    batched = jax.vmap(masks.block_range_mask, in_axes=(0, None, None))(
        np.stack([first, end - 1]), end, block)
    np.testing.assert_array_equal(np.asarray(batched[0]), expected)
    np.testing.assert_array_equal(np.asarray(batched[1]),
                                  range_mask_bruteforce(end - 1, end, block))


@pytest.mark.gpu
@pytest.mark.parametrize("lead,num_blocks,block,slots", RANGE_MASK_CASES)
def test_block_range_mask_on_gpu(lead, num_blocks, block, slots):
    """The CUDA kernel (16-byte stores when U % 16 == 0, bytes otherwise) against the brute
    force."""
    assert "dmattn_range_mask" in jax.jit(masks.block_range_mask, static_argnums=2).lower(
        np.zeros((*lead, num_blocks, slots), np.int32), np.zeros((*lead, num_blocks, slots),
                                                                 np.int32), block).as_text()
    test_block_range_mask_matches_bruteforce(lead, num_blocks, block, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lead,lq,lk,window", PER_KEY_CASES)
def test_per_key_causal_matches_bruteforce_on_gpu(lead, lq, lk, window, kind):
    test_per_key_causal_matches_bruteforce(lead, lq, lk, window, kind)
