"""Per-kv-head windows with attention sinks (``window_sizes``, issue 27): rows ``(sink, left,
right)`` per kv head; query ``i`` of kv head ``g`` sees key ``j`` only where ``j < sink[g]`` or
``i + off - left[g] <= j <= i + off + right[g]`` (a negative bound unbounded; ``off = Lk - Lq``
for flash_dmattn, 0 for dot_product_attention), and-ed with every other rule (causality hides
sink keys of the future too).

The oracle is the float64 ``xla`` implementation run on the equivalent dense bool mask (built
here with numpy, independently of the library's window code). The CPU kernels read the table
as an attribute; on a GPU such calls run the reference (the CUDA kernels do not take it yet),
except a table that is one window without sink, which is the plain window everywhere.
"""

from __future__ import annotations

import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fake_cuda_build, record_ffi_calls
from form_checks import (
    assert_close,
    assert_cuda_refuses,
    assert_results_close,
    assert_vmap_matches_each,
    lower_for_cuda,
    outputs_and_grads,
    qkv,
    require_cuda_kernel,
    to64,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dmattn import _ffi, dot_product_attention, flash_dmattn, masks

# ---- inputs and the oracle --------------------------------------------------------------------


def window_mask(table, seqlen_q: int, seqlen_k: int, offset: int) -> np.ndarray:
    """bool ``[Hk, Lq, Lk]`` of the rows ``(sink, left, right)`` of `table`, the diagonal of
    query ``i`` at key ``i + offset``."""
    table = np.asarray(table, np.int64).reshape(-1, 3)[:, :, None, None]
    sink, left, right = table[:, 0], table[:, 1], table[:, 2]
    i = np.arange(seqlen_q)[:, None] + offset
    j = np.arange(seqlen_k)[None, :]
    band = ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))
    return (j < sink) | band


def random_key_ranges(rng, shape, seqlen_q):
    """int32 key ranges ``(start, end)`` of `shape` ``[..., Lk]`` with values in [0, Lq]."""
    a, b = rng.integers(0, seqlen_q + 1, (2, *shape))
    return np.minimum(a, b).astype(np.int32), np.maximum(a, b).astype(np.int32)


# ---- conformance against the float64 reference ------------------------------------------------

# Tables per kv head: different sinks (0 included), unbounded sides, a sink past Lk.
TABLES = {
    "mixed2": [[4, 40, 0], [0, 15, 30]],
    "unbounded2": [[70, -1, 10], [3, 25, -1]],
    "sink-past-lk": [[1000, 8, 8]],
    "mixed4": [[0, 64, 0], [16, 20, 20], [1, -1, 0], [130, 0, 0]],
    "shared-sink2": [[64, 100, 0], [64, 100, 0]],
}

CASES = [
    # front end, batch, Lq, Lk, H, Hk, D, table, causal, other mask, bias, dtype
    ("flash", 2, 130, 200, 4, 2, 32, "mixed2", False, None, None, jnp.float32),
    ("flash", 2, 130, 200, 4, 2, 64, "unbounded2", True, "dense", "full", jnp.float32),
    ("flash", 1, 200, 130, 4, 1, 32, "sink-past-lk", True, None, "keys", jnp.float32),
    ("flash", 2, 96, 257, 8, 4, 64, "mixed4", False, "keys", "full", jnp.float32),
    ("flash", 1, 300, 300, 4, 2, 128, "shared-sink2", True, "dense", None, jnp.float32),
    ("flash", 1, 150, 190, 4, 2, 64, "mixed2", True, None, "full", jnp.bfloat16),
    ("dpa", 2, 140, 170, 4, 2, 32, "unbounded2", False, "dense", "keys", jnp.float32),
    ("dpa", 2, 170, 140, 8, 4, 64, "mixed4", True, "keys", "full", jnp.float32),
]


def _case_id(case):
    return "-".join(str(x) for x in case[:11]) + "-" + jnp.dtype(case[11]).name


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case):
    """Outputs, lse and gradients (dbias included) of the CPU kernels against the float64
    reference on the dense mask: per-head tables (sinks 0 to past Lk, unbounded sides), with
    causality, a dense mask or key ranges, full and per-key biases, GQA, Lq != Lk, bf16, and
    (dot_product_attention) sequence lengths, which hide sink keys past them too."""
    _check_against_reference(case, "cpu")


# The CUDA kernels' cases: the FlashAttention-2-class forward (these small grids split their keys)
# at D 64 / 128 / 256, the Hopper forward at D 128 (the last two; tests/cuda/kernel_check.cu has
# its other head dims), the backward, sinks apart from the band over several 128-key blocks (the
# walks step over the gap) and inside it, fp16 and bf16.
GPU_TABLES = {
    "far-sinks2": [[64, 200, 0], [5, 300, 0]],
    "mixed4": TABLES["mixed4"],
    "near2": [[300, 100, 30], [0, -1, 50]],
}
GPU_CASES = [
    ("flash", 1, 1100, 1100, 4, 2, 128, "far-sinks2", True, None, None, jnp.bfloat16),
    ("flash", 2, 700, 900, 8, 4, 64, "mixed4", True, "dense", "full", jnp.float16),
    ("flash", 1, 600, 600, 4, 2, 256, "far-sinks2", True, None, "keys", jnp.bfloat16),
    ("flash", 2, 300, 500, 4, 2, 128, "near2", False, "dense", "keys", jnp.float16),
    ("dpa", 2, 500, 700, 4, 2, 64, "far-sinks2", True, None, "full", jnp.bfloat16),
    ("flash", 2, 3, 3000, 4, 2, 128, "far-sinks2", True, None, "keys", jnp.bfloat16),
    # grids the dispatcher does not split (>= 212 query-block CTAs): the Hopper forward
    ("flash", 1, 1024, 1024, 16, 4, 128, "mixed4", True, None, None, jnp.bfloat16),
    ("flash", 1, 1024, 1024, 16, 4, 128, "mixed4", True, "dense", "full", jnp.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_cuda_matches_float64_reference(case):
    """The CUDA kernels (implementation="cuda": no fallback) against the float64 reference, as
    the CPU kernels above; one case (3 query rows) runs the decode forward, the last two the
    Hopper forward (the others' grids are split over keys, which only the other kernels take)."""
    head_dim, dtype = case[6], case[11]
    require_cuda_kernel(head_dim, dtype)
    _check_against_reference(case, "cuda")


@pytest.mark.gpu
def test_cuda_with_segment_ids_and_lengths():
    """The CUDA kernels with a table beside segment ids, sequence lengths and a bias
    (dot_product_attention) against the float64 reference on the equivalent dense mask (the
    deterministic dq kernel's case is in tests/cuda/kernel_check.cu)."""
    rng = np.random.default_rng(31)
    batch, lq, lk, heads, kv_heads, d = 2, 300, 500, 4, 2, 128
    require_cuda_kernel(d, jnp.bfloat16)
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal((batch, heads, lq, lk)), jnp.bfloat16)
    q_seg = np.sort(rng.integers(0, 3, (batch, lq)), axis=1).astype(np.int32)
    kv_seg = np.sort(rng.integers(0, 3, (batch, lk)), axis=1).astype(np.int32)
    table = GPU_TABLES["far-sinks2"]
    kw = dict(is_causal=True, query_seq_lengths=jnp.array([300, 211], jnp.int32),
              key_value_seq_lengths=jnp.array([470, 500], jnp.int32), q_segment_ids=q_seg,
              kv_segment_ids=kv_seg, return_residual=True)

    def run(implementation, mask, window_sizes):
        def fn(q, k, v, bias):
            out, res = dot_product_attention(q, k, v, bias, mask, window_sizes=window_sizes,
                                             implementation=implementation, **kw)
            return out, jnp.swapaxes(res, -1, -2)
        return fn

    out, lse, grads = outputs_and_grads(run("cuda", None, table), q, k, v, bias)
    dense = jnp.asarray(window_mask(table, lq, lk, 0))
    ref_out, ref_lse, ref_grads = outputs_and_grads(run("xla", dense, None), to64(q), to64(k),
                                                    to64(v), to64(bias))
    assert_results_close(out, lse, grads, ref_out, ref_lse, ref_grads, jnp.bfloat16)


def _check_against_reference(case, implementation):
    front, batch, lq, lk, heads, kv_heads, d, name, causal, other, bias_kind, dtype = case
    rng = np.random.default_rng(zlib.crc32(_case_id(case).encode()))
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d, dtype)
    table = {**TABLES, **GPU_TABLES}[name]
    table = np.broadcast_to(np.asarray(table), (kv_heads, 3))
    offset = lk - lq if front == "flash" else 0
    dense = np.broadcast_to(window_mask(table, lq, lk, offset)[None], (batch, kv_heads, lq, lk))
    mask = None
    if other == "dense":
        extra = rng.random((batch, 1, lq, lk)) < 0.7
        mask, dense = jnp.asarray(extra), dense & extra
    elif other == "keys":
        start, end = random_key_ranges(rng, (1, heads, lk), lq)
        mask = masks.KeyRanges(start, end)
        rows = np.arange(lq)[:, None]
        in_range = (start[:, :, None, :] <= rows) & (rows < end[:, :, None, :])  # [1, H, Lq, Lk]
        dense = np.repeat(dense, heads // kv_heads, axis=1) & in_range
    bias = None
    if bias_kind == "full":
        bias = jnp.asarray(rng.standard_normal((batch, heads, lq, lk)), dtype)
    elif bias_kind == "keys":
        bias = jnp.asarray(rng.standard_normal((1, kv_heads, 1, lk)), dtype)

    if front == "flash":
        def run(implementation, mask, window_sizes):
            def fn(q, k, v, bias):
                return flash_dmattn(q, k, v, mask, bias, is_causal=causal, return_lse=True,
                                    window_sizes=window_sizes, implementation=implementation)
            return fn
    else:
        lens = dict(query_seq_lengths=jnp.asarray([lq, lq - 37][:batch], jnp.int32),
                    key_value_seq_lengths=jnp.asarray([lk - 20, lk][:batch], jnp.int32))

        def run(implementation, mask, window_sizes):
            def fn(q, k, v, bias):
                out, res = dot_product_attention(
                    q, k, v, bias, mask, is_causal=causal, window_sizes=window_sizes,
                    implementation=implementation, return_residual=True, **lens)
                return out, jnp.swapaxes(res, -1, -2)
            return fn

    out, lse, grads = outputs_and_grads(run(implementation, mask, table), q, k, v, bias)
    ref_out, ref_lse, ref_grads = outputs_and_grads(
        run("xla", jnp.asarray(dense), None), to64(q), to64(k), to64(v), to64(bias))
    assert_results_close(out, lse, grads, ref_out, ref_lse, ref_grads, dtype)


def test_library_reference_matches_the_dense_mask():
    """The ``xla`` implementation's own expansion of the table equals the dense mask built here
    (both front ends, causal and not)."""
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, 1, 90, 120, 4, 2, 16)
    q, k, v = to64(q), to64(k), to64(v)
    table = TABLES["unbounded2"]
    for causal in (False, True):
        got = flash_dmattn(q, k, v, is_causal=causal, window_sizes=table, implementation="xla")
        want = flash_dmattn(q, k, v, jnp.asarray(window_mask(table, 90, 120, 30)[None]),
                            is_causal=causal, implementation="xla")
        np.testing.assert_array_equal(got, want)
        got = dot_product_attention(q, k, v, is_causal=causal, window_sizes=table,
                                    implementation="xla")
        want = dot_product_attention(q, k, v, mask=jnp.asarray(window_mask(table, 90, 120, 0)),
                                     is_causal=causal, implementation="xla")
        np.testing.assert_array_equal(got, want)


def test_equals_dense_mask_with_every_rule():
    """A table gives what the equivalent dense bool mask gives through the same CPU kernels,
    with causality, sequence lengths, segment ids and a bias (dot_product_attention)."""
    rng = np.random.default_rng(7)
    batch, lq, lk, heads, kv_heads, d = 2, 140, 170, 4, 2, 64
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d)
    bias = jnp.asarray(rng.standard_normal((batch, heads, lq, lk)), jnp.float32)
    q_seg = np.repeat(np.arange(4), 35)[None].repeat(batch, 0)
    kv_seg = np.sort(rng.integers(0, 4, (batch, lk)), axis=1)
    table = [[20, 30, 5], [5, -1, 40]]
    kw = dict(is_causal=True, query_seq_lengths=jnp.array([140, 90], jnp.int32),
              key_value_seq_lengths=jnp.array([170, 120], jnp.int32), q_segment_ids=q_seg,
              kv_segment_ids=kv_seg, implementation="cpu", return_residual=True)

    def with_table(q, k, v, bias):
        return dot_product_attention(q, k, v, bias, window_sizes=table, **kw)

    def with_mask(q, k, v, bias):
        return dot_product_attention(q, k, v, bias, jnp.asarray(window_mask(table, lq, lk, 0)),
                                     **kw)

    out, lse, grads = outputs_and_grads(with_table, q, k, v, bias)
    ref_out, ref_lse, ref_grads = outputs_and_grads(with_mask, q, k, v, bias)
    np.testing.assert_allclose(out, ref_out, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-6)
    for g, ref in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-6)


@pytest.mark.parametrize("with_mask", [False, True])
def test_tiles_outside_every_window_and_sink_are_skipped(with_mask):
    """Keys 64..127 lie inside the keys that query rows 192..255 span (from the sinks to their
    bands) but outside every head's sink and band there: NaN values in them reach neither the
    output nor dq of those rows (a processed tile would give 0 · NaN). The control, one sink
    reaching into them, does read them for its heads only."""
    rng = np.random.default_rng(11)
    lq = lk = 256
    q, k, v = qkv(rng, 1, lq, lk, 4, 2, 32)
    v = v.at[:, 64:128].set(jnp.nan)
    mask = jnp.asarray(rng.random((1, 1, lq, lk)) < 0.9) if with_mask else None

    def run(table):
        def loss(q):
            out = flash_dmattn(q, k, v, mask, window_sizes=table, implementation="cpu")
            return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0)), out
        dq, out = jax.grad(loss, has_aux=True)(q)
        return np.asarray(out[:, 192:]), np.asarray(dq[:, 192:])

    for x in run([[16, 10, 20], [64, 0, 40]]):
        assert np.isfinite(x).all()
    for x in run([[16, 10, 20], [70, 0, 40]]):
        assert np.isfinite(x[:, :, :2]).all()
        assert not np.isfinite(x[:, :, 2:]).any()


# ---- a table that is one window without sink -------------------------------------------------


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("causal", [False, True])
def test_shared_window_without_sink_is_the_plain_window(causal):
    """``window_sizes=(0, left, right)`` (as one row or repeated per kv head) is exactly
    ``local_window_size=(left, right)``: the same lowered program (the same custom call
    attributes, no table) and bitwise equal results, gradients included."""
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, 2, 100, 100, 4, 2, 32)

    def loss(window, q, k, v):
        return jnp.sum(jnp.sin(dot_product_attention(q, k, v, is_causal=causal,
                                                     implementation="cpu", **window)))

    plain = dict(local_window_size=(30, 7))
    want = _lowered(jax.value_and_grad(lambda *a: loss(plain, *a), (0, 1, 2)), q, k, v)
    assert "window_sizes = dense<> : tensor<0xi64>" in want  # the attribute is there, empty
    for table in [(0, 30, 7), [[0, 30, 7], [0, 30, 7]], np.array([0, 30, 7], np.int8)]:
        window = dict(window_sizes=table)
        fn = jax.value_and_grad(lambda *a, w=window: loss(w, *a), (0, 1, 2))
        assert _lowered(fn, q, k, v) == want
        got = fn(q, k, v)
        ref = jax.value_and_grad(lambda *a: loss(plain, *a), (0, 1, 2))(q, k, v)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_array_equal(g, r)


def test_ffi_attributes(monkeypatch):
    """A per-head table reaches both FFI calls as the int64 attribute ``window_sizes`` (Hk rows
    flattened) with the shared bounds of causality alone; a shared window without sink reaches
    them as ``window_left`` / ``window_right`` with an empty table; rows bounded on neither side
    carry no sink. build_info reports the table."""
    assert _ffi.build_info()["window_sizes"] is True
    calls = record_ffi_calls(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16)

    def attrs_of(**kw):
        calls.clear()
        loss = lambda q, k, v: jnp.sum(flash_dmattn(q, k, v, implementation="cpu", **kw))  # noqa: E731
        jax.jit(jax.grad(loss)).lower(q, k, v)
        assert {t for t, *_ in calls} == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}
        forward, backward = (a for *_, a in calls)
        np.testing.assert_array_equal(forward["window_sizes"], backward["window_sizes"])
        return forward

    a = attrs_of(window_sizes=[[3, 5, -7], [9, -1, -1]], is_causal=True)
    np.testing.assert_array_equal(a["window_sizes"], [3, 5, -1, 0, -1, -1])
    assert a["window_sizes"].dtype == np.int64
    assert (a["window_left"], a["window_right"], a["diagonal_offset"]) == (-1, 0, 8)
    a = attrs_of(window_sizes=(0, 5, 2))
    assert a["window_sizes"].shape == (0,)
    assert (a["window_left"], a["window_right"], a["diagonal_offset"]) == (5, 2, 8)
    a = attrs_of(window_sizes=(0, 5, 2), is_causal=True)
    assert (a["window_left"], a["window_right"]) == (5, 0)
    a = attrs_of(window_sizes=(4, -1, -2))  # bounded nowhere: no window at all
    assert a["window_sizes"].shape == (0,)
    assert (a["window_left"], a["window_right"], a["diagonal_offset"]) == (-1, -1, 0)


# ---- transformations -----------------------------------------------------------------------------


def test_jit_vmap_and_grad():
    """Under jit and vmap (the table is static: nothing to map) the kernels agree with
    per-example calls, gradients included."""
    rng = np.random.default_rng(5)
    n, lq, lk = 3, 70, 90
    q, k, v = qkv(rng, n, lq, lk, 4, 2, 32)
    q, k, v = q[:, None], k[:, None], v[:, None]  # n examples of batch 1
    table = [[8, 12, 0], [0, -1, 3]]

    def one(q, k, v):
        return flash_dmattn(q, k, v, is_causal=True, window_sizes=table, implementation="cpu")

    assert_vmap_matches_each(one, (q, k, v), [(0, 0, 0), (0, None, None)], n)


@pytest.mark.parametrize("table", [
    [[8, 12, 0], [0, -1, 3], [30, 5, 5], [2, 40, -1]],  # a cut per shard: a switch over shards
    [[8, 12, 0], [0, -1, 3], [8, 12, 0], [0, -1, 3]],  # every shard's cut the same: one call
])
@pytest.mark.parametrize("seq", [False, True])
def test_sharded_over_batch_and_heads(table, seq):
    """Sharded over batch and kv heads (each shard runs its own heads' rows of the table), and
    with the query sequence sharded too (never a ring: the sink names absolute positions), a
    table gives the single-device answer, gradients included."""
    devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    mesh = Mesh(devices, ("b", "h", "s"))
    rng = np.random.default_rng(8)
    # Lq == Lk with causality: without the table, the sharded sequence would run as a ring.
    q, k, v = qkv(rng, 2, 96, 96, 8, 4, 32)
    bias = jnp.asarray(rng.standard_normal((1, 8, 1, 96)), jnp.float32)

    def loss(q, k, v, bias):
        out = flash_dmattn(q, k, v, None, bias, is_causal=True, window_sizes=table,
                           implementation="cpu")
        return jnp.sum(jnp.sin(out)), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    want_grads, want = fn(q, k, v, bias)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    s = "s" if seq else None
    got_grads, got = fn(put(q, P("b", s, "h")), put(k, P("b", s, "h")), put(v, P("b", s, "h")),
                        put(bias, P(None, "h")))
    np.testing.assert_allclose(got, want, atol=1e-6)
    # dbias is summed over the batch shards by a psum: float32 sums in another order, so its
    # error is relative to its size (values up to ~50).
    for g, ref in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-6, rtol=1e-6)


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("window_sizes, error, match", [
    ([[1, 2, 3]] * 3, ValueError, r"shape \(3, 3\) is not accepted; expected .*\[2, 3\]"),
    ([1, 2], ValueError, r"shape \(2,\)"),
    ([[[1, 2, 3]]] * 2, ValueError, "shape"),
    ([[-1, 2, 3], [0, 1, 1]], ValueError, "sinks must be >= 0"),
    ([1.0, 2.0, 3.0], TypeError, "dtype float"),
    ([True, False, True], TypeError, "dtype bool"),
    ("abc", TypeError, "window_sizes must be"),
])
def test_bad_window_sizes(window_sizes, error, match):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 2, 40, 50, 4, 2, 16)
    with pytest.raises(error, match=match):
        flash_dmattn(q, k, v, window_sizes=window_sizes, implementation="cpu")
    with pytest.raises(error, match=match):
        dot_product_attention(q, k, v, window_sizes=window_sizes, implementation="cpu")


def test_traced_table_and_local_window_size_refused():
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 1, 20, 20, 2, 1, 16)
    with pytest.raises(TypeError, match="traced array"):
        jax.jit(lambda w: flash_dmattn(q, k, v, window_sizes=w, implementation="cpu"))(
            jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match="cannot be combined"):
        dot_product_attention(q, k, v, local_window_size=(3, 3), window_sizes=(1, 3, 3),
                              implementation="cpu")


# ---- the GPU: the CUDA kernels take tables of up to build_info()["cuda_window_heads"] kv heads

def test_cuda_takes_per_head_windows(monkeypatch):
    """On a GPU with kernels for the call, a per-head table with sinks runs on them (segment
    ids too); one of more kv heads than the kernels' parameters hold goes to the reference (None
    warns once naming the reason, implementation="cuda" raises)."""
    from jax_dmattn import ops
    from jax_dmattn.params import AttentionParams

    table = ((4, 10, 0), (0, 3, 0))
    params = AttentionParams(scale=0.1, window_sizes=table)
    fake_cuda_build(monkeypatch, [16, 128])
    assert ops.uses_kernel("cuda", params, jnp.bfloat16, 128)
    fake_cuda_build(monkeypatch, [16, 128], cuda_window_heads=1)
    assert_cuda_refuses(params, "window tables .* of at most 1 kv heads, not 2")


def test_cuda_lowering(monkeypatch):
    """Lowered for a GPU whose build has kernels for the call (a fake CUDA build): a per-head
    table calls the CUDA kernels with the table as an attribute, implementation="cuda" too; a
    shared window without sink calls them with no table."""

    calls = record_ffi_calls(monkeypatch)
    fake_cuda_build(monkeypatch, [16, 128])
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16, jnp.bfloat16)

    def lower(implementation, table):
        lower_for_cuda(q, k, v, is_causal=True, window_sizes=table, implementation=implementation)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lower(None, [[4, 10, 0], [0, 3, 0]])
        lower("cuda", (1, 10, 0))
    assert {t for t, *_ in calls} == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}
    assert [list(attrs["window_sizes"]) for *_, attrs in calls] == (
        2 * [[4, 10, 0, 0, 3, 0]] + 2 * [[1, 10, 0, 1, 10, 0]])
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lower("cuda", [[0, 10, 3], [0, 10, 3]])
    assert {t for t, *_ in calls} == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}
    for *_, attrs in calls:
        assert attrs["window_sizes"].shape == (0,)
        assert (attrs["window_left"], attrs["window_right"]) == (10, 0)


# ---- bounds no key is that far from (review) --------------------------------------------------

_HUGE = np.iinfo(np.int64).max


@pytest.mark.parametrize("implementation", ["cpu", "xla"])
@pytest.mark.parametrize("table, seq", [
    ([[2, 3, _HUGE], [1, 5, _HUGE]], (40, 40)),  # sinks: the per-head table
    ([[2, _HUGE, 1], [1, _HUGE, 3]], (50, 20)),  # Lq > Lk: a negative diagonal
    ([[0, 3, _HUGE], [0, 3, _HUGE]], (40, 40)),  # no sink: the shared window
    ([[_HUGE, 2, 0], [7, 1, 2]], (30, 45)),      # a sink past Lk
], ids=["sinks", "lq_gt_lk", "shared", "sink_past_lk"])
def test_bounds_past_every_key(table, seq, implementation):
    """A bound as far as int64 goes is an unbounded side and a sink past Lk is Lk: added to a
    position, such a bound wrapped (the kernels' output was wrong or zero, xla overflowed)."""
    seqlen_q, seqlen_k = seq
    rng = np.random.default_rng(31)
    q, k, v = qkv(rng, 1, seqlen_q, seqlen_k, 4, 2, 16)
    tame = [[min(s, seqlen_k), -1 if lo == _HUGE else lo, -1 if hi == _HUGE else hi]
            for s, lo, hi in table]
    visible = np.repeat(window_mask(tame, seqlen_q, seqlen_k, seqlen_k - seqlen_q), 2, axis=0)
    want = flash_dmattn(to64(q), to64(k), to64(v), jnp.asarray(visible[None]),
                        implementation="xla")
    got = flash_dmattn(q, k, v, window_sizes=np.array(table, np.int64),
                       implementation=implementation)
    assert_close(got, want, jnp.float32, f"{implementation} {table}")


def test_local_window_past_every_key():
    """dot_product_attention's local_window_size as far as int64 goes: the whole sequence."""
    rng = np.random.default_rng(32)
    q, k, v = qkv(rng, 1, 30, 40, 2, 1, 16)
    got = dot_product_attention(q, k, v, local_window_size=(_HUGE, _HUGE), implementation="cpu")
    want = dot_product_attention(q, k, v, implementation="cpu")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
