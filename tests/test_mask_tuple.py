"""A tuple of masks (issue 24, item 1): ``mask=(m0, m1, ...)`` means all of them (their and), with
at most one dense bool mask and at most one each of ``masks.KeyRanges``, ``masks.RowRanges`` and
``masks.BlockIndices``.

The oracle is the float64 ``xla`` implementation run on one dense bool mask, the and of every
member's dense form built here with numpy (independently of the library's range and block code).
The CPU and the CUDA kernels read every member side by side (the GPU tests are marked ``gpu``).
"""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_block_indices as blocks
import test_key_ranges as key_ranges
import test_row_ranges as row_ranges
from conftest import fake_cuda_build, record_ffi_calls
from form_checks import (
    GPU_TABLE,
    assert_cuda_lowering_reads,
    assert_cuda_with_every_rule,
    assert_equals_dense_with_every_rule,
    assert_results_close,
    assert_vmap_matches_each,
    flash,
    lower_for_cuda,
    mask_summaries,
    outputs_and_grads,
    qkv,
    require_cuda_kernel,
    to64,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dmattn import _ffi, dot_product_attention, flash_dmattn, masks
from jax_dmattn.params import gate_cut

KINDS = ("dense", "keys", "rows", "blocks")

# ---- inputs and the oracle --------------------------------------------------------------------


def wide_ranges(rng: np.random.Generator, shape: tuple[int, ...],
                bound: int) -> tuple[np.ndarray, np.ndarray]:
    """int32 ``(start, end)`` of `shape`, values in ``[0, bound]``: runs over half of the bound
    or more (the and of several members keeps enough visible), a sixth of them empty
    (``start >= end``)."""
    start = rng.integers(0, bound // 2 + 1, shape)
    end = rng.integers(bound // 2, bound + 1, shape)
    empty = rng.random(shape) < 1 / 6
    return (np.where(empty, end, start).astype(np.int32),
            np.where(empty, start, end).astype(np.int32))


def random_members(rng: np.random.Generator, kinds: tuple[str, ...], batch: int, lq: int,
                   lk: int, heads: int, kv_heads: int, block: tuple[int, int, int] = (16, 48, 4)
                   ) -> tuple[tuple, np.ndarray]:
    """``(members, dense)``: one random mask of each of `kinds`, each with a batch of 1 or B and
    heads of 1, Hk or H drawn at random, and the and of their dense forms, bool
    ``[B|1, H|1, Lq, Lk]``. Ranges have empty ones (:func:`wide_ranges`); the block indices
    have unused slots, duplicates and a query block listing nothing."""
    members, dense = [], []
    for kind in kinds:
        b = int(rng.choice([1, batch]))
        h = int(rng.choice(sorted({1, kv_heads, heads})))
        if kind == "dense":
            m = rng.random((b, h, lq, lk)) < 0.75
            members.append(m)
            dense.append(m)
        elif kind == "keys":
            start, end = wide_ranges(rng, (b, h, lk), lq)
            members.append(masks.KeyRanges(start, end))
            dense.append(key_ranges.dense_mask(start, end, lq))
        elif kind == "rows":
            start, end = wide_ranges(rng, (b, h, lq), lk)
            members.append(masks.RowRanges(start, end))
            dense.append(row_ranges.dense_mask(start, end, lk))
        else:
            bq, bk, slots = block
            indices = blocks.random_indices(rng, (b, h), lq, lk, bq, bk, slots)
            members.append(masks.BlockIndices(indices, bq, bk))
            dense.append(blocks.dense_mask(indices, lq, lk, bq, bk))
    # A head dim of Hk maps like K/V: kv head g serves query heads g * (H / Hk) ...
    dense = [np.repeat(m, heads // m.shape[1], axis=1) if m.shape[1] not in (1, heads) else m
             for m in dense]
    return tuple(members), np.logical_and.reduce(np.broadcast_arrays(*dense))


def front(kind: str, implementation: str):
    """``fn(q, k, v, mask, bias) -> (out, lse-like)``: flash_dmattn (``"causal"``, ``"full"``) or
    dot_product_attention with a window (``"window"``)."""
    def fn(q, k, v, mask, bias):
        if kind == "window":
            return dot_product_attention(q, k, v, bias, mask, local_window_size=(60, 20),
                                         implementation=implementation, return_residual=True)
        return flash_dmattn(q, k, v, mask, bias, is_causal=kind == "causal", return_lse=True,
                            implementation=implementation)
    return fn


# ---- conformance against the float64 reference ------------------------------------------------

CASES = [
    # members, batch, Lq, Lk, H, Hk, D, front, bias, dtype
    (("dense", "keys"), 2, 130, 200, 4, 4, 32, "causal", None, jnp.float32),
    (("dense", "rows"), 2, 200, 130, 4, 2, 64, "full", "full", jnp.float32),
    (("dense", "blocks"), 1, 130, 200, 4, 1, 64, "causal", "keys", jnp.float32),
    (("keys", "rows"), 2, 96, 257, 6, 2, 64, "window", "full", jnp.float32),
    (("rows", "blocks"), 2, 129, 129, 4, 2, 128, "causal", "keys", jnp.float32),
    (("keys", "blocks"), 2, 150, 190, 4, 2, 64, "full", "full", jnp.bfloat16),
    (("keys", "rows", "blocks"), 2, 150, 190, 4, 2, 64, "causal", "full", jnp.float32),
    (("dense", "keys", "rows", "blocks"), 2, 190, 150, 4, 2, 32, "window", "full", jnp.float32),
    (("dense", "keys", "rows", "blocks"), 1, 150, 190, 2, 2, 64, "causal", "full", jnp.bfloat16),
]


# The CUDA kernels' cases, with the block indices' (block_q, block_k, K) last: head dims 64 / 128 /
# 256, bf16 and fp16, block sizes that are multiples of 64 and that are not, causal, windowed and
# full; one decodes (three rows, keys split over CTAs), the last grid is not split over keys.
GPU_CASES = [
    (("dense", "keys"), 2, 300, 500, 4, 2, 128, "causal", "full", jnp.bfloat16, (64, 128, 4)),
    (("rows", "blocks"), 1, 257, 700, 8, 2, 64, "window", "keys", jnp.float16, (48, 80, 5)),
    (("dense", "keys", "rows", "blocks"), 2, 330, 200, 4, 2, 256, "full", "full", jnp.bfloat16,
     (80, 48, 3)),
    (("keys", "rows", "blocks"), 2, 3, 3000, 8, 2, 128, "full", "keys", jnp.bfloat16,
     (1, 128, 12)),
    (("keys", "rows", "blocks"), 1, 1024, 1024, 16, 4, 128, "causal", None, jnp.bfloat16,
     (128, 64, 6)),
]


def _case_id(case) -> str:
    block = ["x".join(map(str, case[10]))] if len(case) > 10 else []
    return "-".join(map(str, (*case[0], *case[1:9], jnp.dtype(case[9]).name, *block)))


def _check_against_reference(case, implementation: str) -> None:
    """Outputs, lse and gradients (dbias included) of `implementation` on `case` (its block
    indices' sizes and slots in a last element, else (16, 48, 4)) against the float64 reference
    on the and of the members' dense forms."""
    kinds, batch, lq, lk, heads, kv_heads, d, kind, bias_kind, dtype = case[:10]
    block = case[10] if len(case) > 10 else (16, 48, 4)
    if implementation == "cuda":
        require_cuda_kernel(d, dtype)
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d, dtype)
    members, mask = random_members(rng, kinds, batch, lq, lk, heads, kv_heads, block)
    assert mask.mean() > 0.02 and not mask.all()
    bias = None
    if bias_kind == "full":
        bias = jnp.asarray(rng.standard_normal((batch, kv_heads, lq, lk)), dtype)
    elif bias_kind == "keys":
        bias = jnp.asarray(rng.standard_normal((1, heads, 1, lk)), dtype)
    out, lse, grads = outputs_and_grads(front(kind, implementation), q, k, v, bias, members)
    ref_out, ref_lse, ref_grads = outputs_and_grads(
        front(kind, "xla"), to64(q), to64(k), to64(v), to64(bias), jnp.asarray(mask))
    finite = np.isfinite(np.asarray(ref_lse))
    assert finite.any() and not finite.all(), "the case should have rows with and without keys"
    assert_results_close(out, lse, grads, ref_out, ref_lse, ref_grads, dtype)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case):
    """The CPU kernels on a tuple of masks against the float64 reference on the and of their
    dense forms: pairs and the triple, with and without a dense mask, causal or windowed, full
    and per-key biases, GQA, Lq != Lk, bf16."""
    _check_against_reference(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_cuda_matches_float64_reference(case):
    """The CUDA kernels (implementation="cuda": no fallback) on a tuple of masks against the
    float64 reference, as the CPU kernels above."""
    _check_against_reference(case, "cuda")


@pytest.mark.gpu
def test_cuda_with_every_rule():
    """The CUDA kernels with all three O(L) forms beside a dense mask, a bias, sequence lengths,
    segment ids and a window table with sinks, against the float64 reference."""
    rng = np.random.default_rng(17)
    lq, lk = 300, 500
    q, k, v = qkv(rng, 2, lq, lk, 4, 2, 128, jnp.bfloat16)
    members, dense = random_members(rng, KINDS[1:], 2, lq, lk, 4, 2, (64, 96, 5))
    assert_cuda_with_every_rule(rng, q, k, v, members, dense)


@pytest.mark.gpu
def test_cuda_deterministic():
    """deterministic=True with all four kinds in a tuple, causality, segment ids, a window table
    with sinks and a bias: the deterministic dq kernel reads every member too; the gradients are
    bitwise equal run to run and match the float64 reference."""
    rng = np.random.default_rng(23)
    batch, lq, lk, heads, kv_heads, d = 2, 300, 400, 4, 2, 128
    require_cuda_kernel(d, jnp.bfloat16)
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d, jnp.bfloat16)
    members, mask = random_members(rng, KINDS, batch, lq, lk, heads, kv_heads, (64, 80, 4))
    bias = jnp.asarray(rng.standard_normal((batch, kv_heads, lq, lk)), jnp.bfloat16)
    kw = dict(is_causal=True, window_sizes=GPU_TABLE,
              q_segment_ids=np.sort(rng.integers(0, 3, (batch, lq)), axis=1).astype(np.int32),
              kv_segment_ids=np.sort(rng.integers(0, 3, (batch, lk)), axis=1).astype(np.int32))
    got = [outputs_and_grads(flash("cuda", deterministic=True, **kw), q, k, v, bias, members)
           for _ in range(2)]
    want = outputs_and_grads(flash("xla", **kw), to64(q), to64(k), to64(v), to64(bias),
                             jnp.asarray(mask))
    assert_results_close(*got[0], *want, jnp.bfloat16)
    for a, b in zip(jax.tree_util.tree_leaves(got[0]), jax.tree_util.tree_leaves(got[1]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_reference_ands_every_member():
    """The xla implementation given the tuple equals it given the dense and (float64, with a
    bias and causality, gradients included)."""
    rng = np.random.default_rng(21)
    batch, lq, lk, heads, kv_heads = 2, 70, 90, 4, 2
    q, k, v = (to64(x) for x in qkv(rng, batch, lq, lk, heads, kv_heads, 16))
    members, mask = random_members(rng, KINDS, batch, lq, lk, heads, kv_heads, (8, 16, 3))
    bias = to64(rng.standard_normal((batch, heads, lq, lk)))
    got = outputs_and_grads(front("causal", "xla"), q, k, v, bias, members)
    want = outputs_and_grads(front("causal", "xla"), q, k, v, bias, jnp.asarray(mask))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_one_member_tuple_is_that_member(kind):
    """``mask=(m,)`` gives exactly what ``mask=m`` gives (outputs, lse, gradients), for both
    front ends."""
    rng = np.random.default_rng(KINDS.index(kind))
    q, k, v = qkv(rng, 2, 100, 120, 4, 2, 32)
    (member,), _ = random_members(rng, (kind,), 2, 100, 120, 4, 2)
    bias = jnp.asarray(rng.standard_normal((2, 4, 1, 120)), jnp.float32)
    for kind_of_front in ("causal", "window"):
        got = outputs_and_grads(front(kind_of_front, "cpu"), q, k, v, bias, (member,))
        want = outputs_and_grads(front(kind_of_front, "cpu"), q, k, v, bias, member)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_array_equal(g, w)


def test_equals_dense_and_with_every_rule():
    """A tuple of all four kinds gives what the dense and of its members gives through the same
    CPU kernels, with a window, sequence lengths and segment ids (dot_product_attention) and a
    bias."""
    rng = np.random.default_rng(7)
    batch, lq, lk, heads, kv_heads = 2, 140, 170, 4, 2
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, 64)
    members, dense = random_members(rng, KINDS, batch, lq, lk, heads, kv_heads)
    assert_equals_dense_with_every_rule(rng, q, k, v, members, dense)


def test_dot_product_attention_3d():
    """3-D (unbatched) inputs take a tuple of 3-D members: the same as the batched call."""
    rng = np.random.default_rng(22)
    lq, lk, heads, kv_heads = 90, 110, 4, 2
    q, k, v = qkv(rng, 1, lq, lk, heads, kv_heads, 32)
    members, _ = random_members(rng, KINDS, 1, lq, lk, heads, kv_heads)
    dense, keys, rows, block = members
    unbatched = (dense[0], masks.KeyRanges(keys.start[0], keys.end[0]),
                 masks.RowRanges(rows.start[0], rows.end[0]),
                 block._replace(indices=block.indices[0]))
    got = dot_product_attention(q[0], k[0], v[0], mask=unbatched, is_causal=True,
                                implementation="cpu")
    want = dot_product_attention(q, k, v, mask=members, is_causal=True, implementation="cpu")
    np.testing.assert_array_equal(got, want[0])


# ---- tile skipping ------------------------------------------------------------------------------


def _members_hiding(hider: str | None, lq: int, lk: int) -> tuple:
    """All four kinds of mask over ``[1, 1, Lq, Lk]``: every one lets every key through except
    `hider`, which hides keys 64..127 from every row (None: none hides them)."""
    hidden = (np.arange(lk) >= 64) & (np.arange(lk) < 128)
    rows_low = np.arange(lq) % 2 == 0  # a row's range is one run: [0, 64) or [128, Lk)
    hiding = {
        "dense": np.broadcast_to(~hidden, (1, 1, lq, lk)),
        "keys": masks.KeyRanges(np.zeros((1, 1, lk), np.int32),
                                np.where(hidden, 0, lq).astype(np.int32)[None, None]),
        "rows": masks.RowRanges(np.where(rows_low, 0, 128).astype(np.int32)[None, None],
                                np.where(rows_low, 64, lk).astype(np.int32)[None, None]),
        "blocks": masks.BlockIndices(
            np.broadcast_to(np.array([0, 2], np.int32), (1, 1, -(-lq // 64), 2)), 64, 64),
    }
    return tuple(hiding[kind] if kind == hider else _permissive(hiding[kind], lq, lk)
                 for kind in KINDS)


def _permissive(member, lq: int, lk: int):
    """A mask of `member`'s kind that hides nothing."""
    if isinstance(member, masks.KeyRanges):
        return masks.KeyRanges(np.zeros((1, 1, lk), np.int32), np.full((1, 1, lk), lq, np.int32))
    if isinstance(member, masks.RowRanges):
        return masks.RowRanges(np.zeros((1, 1, lq), np.int32), np.full((1, 1, lq), lk, np.int32))
    if isinstance(member, masks.BlockIndices):
        listed = np.arange(-(-lk // 64), dtype=np.int32)
        return masks.BlockIndices(np.broadcast_to(listed, (1, 1, -(-lq // 64), listed.size)), 64,
                                  64)
    return np.ones((1, 1, lq, lk), bool)


@pytest.mark.parametrize("hider", KINDS)
def test_tile_hidden_by_one_member_is_skipped(hider):
    """Keys 64..127 (one whole kernel tile) hidden by one member only, the others letting every
    key through: NaN values there reach no output (a processed tile would give 0 · NaN); the
    control, where no member hides them, does read them."""
    rng = np.random.default_rng(13)
    lq = lk = 192
    q, k, v = qkv(rng, 1, lq, lk, 2, 2, 32)
    v = v.at[:, 64:128].set(jnp.nan)
    out = flash_dmattn(q, k, v, _members_hiding(hider, lq, lk), implementation="cpu")
    assert np.isfinite(np.asarray(out)).all()
    control = flash_dmattn(q, k, v, _members_hiding(None, lq, lk), implementation="cpu")
    assert not np.isfinite(np.asarray(control)).any()


# ---- transformations -----------------------------------------------------------------------------


def test_jit_vmap_and_grad():
    """Under jit and vmap, each member with its own batch pattern (mapped, unmapped, one of a
    range pair mapped), the kernels agree with per-example calls, gradients included."""
    rng = np.random.default_rng(5)
    n, lq, lk, bq, bk = 3, 70, 90, 16, 32
    q, k, v = qkv(rng, n, lq, lk, 2, 1, 32)
    q, k, v = q[:, None], k[:, None], v[:, None]  # n examples of batch 1
    dense = jnp.asarray(rng.random((n, 1, 1, lq, lk)) < 0.75)
    ks, ke = key_ranges.random_ranges(rng, (n, 1, 1, lk), lq)
    rs, re_ = row_ranges.random_ranges(rng, (n, 1, 1, lq), lk)
    indices = blocks.random_indices(rng, (n, 1, 1), lq, lk, bq, bk, 3)

    def one(q, k, v, dense, ks, ke, rs, re_, indices):
        mask = (dense, masks.KeyRanges(ks, ke), masks.RowRanges(rs, re_),
                masks.BlockIndices(indices, bq, bk))
        return flash_dmattn(q, k, v, mask, is_causal=True, implementation="cpu")

    operands = (q, k, v, dense, ks, ke, rs, re_, indices)
    axes = [(0,) * 9, (0, 0, 0, 0, None, None, 0, 0, 0), (0, 0, 0, None, 0, 0, 0, None, None),
            (0, None, None, 0, None, 0, None, None, 0)]
    assert_vmap_matches_each(one, operands, axes, n)


def test_tuple_pytree_through_jit_and_vmap():
    """A tuple of masks is a pytree: jit takes it as an argument and vmap maps every member's
    leaves (the block sizes stay static)."""
    rng = np.random.default_rng(6)
    lq, lk = 40, 50
    q, k, v = qkv(rng, 2, lq, lk, 2, 2, 16)
    members, _ = random_members(rng, KINDS, 2, lq, lk, 2, 2, (8, 16, 2))
    batched = tuple(jax.tree_util.tree_map(
        lambda x: np.broadcast_to(x, (2, *x.shape[1:]))[:, None], m) for m in members)
    got = jax.vmap(lambda q, k, v, m: flash_dmattn(q[None], k[None], v[None], m,
                                                   implementation="cpu")[0])(q, k, v, batched)
    flat = tuple(jax.tree_util.tree_map(lambda x: x[:, 0], m) for m in batched)
    want = flash_dmattn(q, k, v, flat, implementation="cpu")
    np.testing.assert_allclose(got, want, atol=1e-6)
    fn = jax.jit(lambda q, k, v, m: flash_dmattn(q, k, v, m, implementation="cpu"))
    np.testing.assert_allclose(fn(q, k, v, flat), want, atol=1e-6)


def test_sharded_over_batch_and_heads():
    """Sharded over batch and heads, a tuple of all four kinds (and a bias) gives the
    single-device answer."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("b", "h"))
    rng = np.random.default_rng(8)
    lq, lk, bq, bk = 80, 100, 16, 24
    q, k, v = qkv(rng, 2, lq, lk, 4, 2, 32)
    dense = rng.random((2, 4, lq, lk)) < 0.75
    ks, ke = key_ranges.random_ranges(rng, (2, 2, lk), lq)
    rs, re_ = row_ranges.random_ranges(rng, (2, 1, lq), lk)
    indices = blocks.random_indices(rng, (1, 4), lq, lk, bq, bk, 3)
    bias = jnp.asarray(rng.standard_normal((2, 2, 1, lk)), jnp.float32)

    def loss(q, k, v, bias, dense, ks, ke, rs, re_, indices):
        mask = (dense, masks.KeyRanges(ks, ke), masks.RowRanges(rs, re_),
                masks.BlockIndices(indices, bq, bk))
        out = flash_dmattn(q, k, v, mask, bias, implementation="cpu")
        return jnp.sum(jnp.sin(out)), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    args = (q, k, v, bias, dense, ks, ke, rs, re_, indices)
    want_grads, want = fn(*args)
    specs = (P("b", None, "h"), P("b", None, "h"), P("b", None, "h"), P("b", "h"),
             P("b", "h"), P("b", "h"), P("b", "h"), P("b"), P("b"), P(None, "h"))
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs, strict=True)]
    got_grads, got = fn(*sharded)
    np.testing.assert_allclose(got, want, atol=1e-6)
    for g, ref in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-6)


def test_sequence_sharding_runs_no_ring_with_an_o_l_member():
    """q, k, v sharded over the sequence: a dense mask alone runs as a ring (collective
    permutes), the same mask in a tuple with key ranges does not (their rule names absolute
    positions) and gives the single-device answer."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    rng = np.random.default_rng(9)
    lq = lk = 128
    q, k, v = qkv(rng, 1, lq, lk, 2, 2, 16)
    dense = jnp.asarray(rng.random((1, 1, lq, lk)) < 0.75)
    ranges = masks.KeyRanges(*key_ranges.random_ranges(rng, (1, 1, lk), lq))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "seq")))  # noqa: E731

    def run(mask):
        fn = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(
            flash_dmattn(q, k, v, mask, implementation="cpu"))), argnums=(0, 1, 2)))
        text = fn.lower(put(q), put(k), put(v)).compile().as_text()
        return text, fn(put(q), put(k), put(v)), fn(q, k, v)

    text, _, _ = run(dense)
    assert re.search(r"collective-permute", text), "the control should run as a ring"
    text, got, want = run((dense, ranges))
    assert not re.search(r"collective-permute", text)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6)


@pytest.mark.parametrize("step", blocks.STEPS)
def test_training_step_has_no_lq_by_lk_array(monkeypatch, step):
    """jit(value_and_grad) of a causal call whose mask is a tuple of the three O(L) forms, given
    as an argument of the step: every array of the lowered program (and of the compiled one,
    where it is compiled) holds fewer than Lq·Lk elements, on the CPU kernels and on the CUDA
    kernels (the control, the same step given their dense and, holds one)."""
    step.prepare(monkeypatch)
    rng = np.random.default_rng(12)
    seqlen = 1024
    q, k, v = qkv(rng, 2, seqlen, seqlen, 4, 2, step.head_dim, step.dtype)
    members, dense = random_members(rng, KINDS[1:], 2, seqlen, seqlen, 4, 2, (64, 128, 4))

    for form, text in step.texts(q, k, v, members).items():
        sizes = step.sizes(text)
        assert sizes, form
        assert max(sizes)[0] < seqlen * seqlen, (form, sorted(sizes, reverse=True)[:5])
    for form, text in step.texts(q, k, v, jnp.asarray(dense)).items():
        assert max(step.sizes(text))[0] >= seqlen * seqlen, form


def test_ffi_operands_and_attributes(monkeypatch):
    """A tuple of all four kinds reaches both FFI calls as every operand in its own slot (mask
    after v, then segment ids, key ranges, row ranges, block indices), every flag set."""
    calls = record_ffi_calls(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16)
    members = (np.ones((2, 1, 24, 32), bool),
               masks.KeyRanges(*key_ranges.random_ranges(rng, (2, 2, 32), 24)),
               masks.RowRanges(*row_ranges.random_ranges(rng, (1, 4, 24), 32)),
               masks.BlockIndices(blocks.random_indices(rng, (2, 1), 24, 32, 5, 3, 4), 5, 3))
    ids = np.zeros((2, 24), np.int32), np.zeros((2, 32), np.int32)

    def loss(q, k, v):
        return jnp.sum(flash_dmattn(q, k, v, members, q_segment_ids=ids[0],
                                    kv_segment_ids=ids[1], implementation="cpu"))

    jax.jit(jax.grad(loss)).lower(q, k, v)
    by_target = {target: (operands, attrs) for target, operands, attrs in calls}
    assert set(by_target) == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}, calls
    i32, pred = jnp.dtype(jnp.int32), jnp.dtype(jnp.bool_)
    for target, (operands, attrs) in by_target.items():
        first = 3 if target == _ffi.FORWARD_TARGET else 7  # after q, k, v (out, dout, lse, dlse)
        assert operands[first:] == [
            ((2, 1, 24, 32), pred), ((2, 24), i32), ((2, 32), i32), ((2, 2, 1, 32), i32),
            ((2, 2, 1, 32), i32), ((1, 4, 24, 1), i32), ((1, 4, 24, 1), i32),
            ((2, 1, 5, 4), i32)], operands
        assert all(attrs[f"has_{name}"] is True for name in (
            "mask", "segments", "key_ranges", "row_ranges", "block_indices"))
        assert (attrs["block_q"], attrs["block_k"]) == (5, 3)


# ---- errors --------------------------------------------------------------------------------------


def _bad_tuples():
    rng = np.random.default_rng(0)
    (dense, keys, rows, block), _ = random_members(rng, KINDS, 2, 40, 50, 4, 2, (8, 16, 2))
    wrong_keys = masks.KeyRanges(np.zeros((2, 3, 50), np.int32), np.ones((2, 3, 50), np.int32))
    return [
        ((), ValueError, r"mask=\(\) holds no mask; pass None"),
        ((dense, keys, dense), ValueError,
         r"more than one bool mask \(elements 0 and 2\).*m0 & m1"),
        ((keys, keys), ValueError, r"more than one KeyRanges \(elements 0 and 1\).*maximum"),
        ((rows, block, rows), ValueError, r"more than one RowRanges \(elements 0 and 2\)"),
        ((block, block), ValueError, r"more than one BlockIndices .*to_mask"),
        ((dense, None), TypeError, r"mask tuple element 1 is NoneType, not a mask"),
        ((dense, (keys, rows)), TypeError, r"mask tuple element 1 is tuple, not a mask"),
        ((dense, wrong_keys), ValueError, r"KeyRanges.start shape \(2, 3, 50\)"),
        ((keys, dense.astype(np.int8)), TypeError, "mask must be bool"),
    ]


@pytest.mark.parametrize("front_end", ["flash_dmattn", "dot_product_attention"])
def test_bad_tuples(front_end):
    """An empty tuple, two members of one kind, a None or nested tuple, and a bad member each
    raise at trace time, naming what is wrong."""
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, 2, 40, 50, 4, 2, 16)
    for mask, error, match in _bad_tuples():
        with pytest.raises(error, match=match):
            if front_end == "flash_dmattn":
                jax.jit(lambda q, k, v, mask=mask: flash_dmattn(
                    q, k, v, mask, implementation="cpu")).trace(q, k, v)
            else:
                dot_product_attention(q, k, v, mask=mask, implementation="cpu")


# ---- the GPU: the CUDA kernels read every member ---------------------------------------------


def test_cuda_lowering_reads_every_combination(monkeypatch):
    """Lowered for a GPU whose build has kernels for the call (a fake CUDA build), a tuple of
    masks of any kinds calls the CUDA kernels (no warning, implementation="cuda" included) with
    every member in its own slot (mask, key ranges, row ranges, block indices; the mask's map and
    bits last) and its flags set, beside a gate too (alpha and delta after the members); beside a
    softmax threshold, which the CUDA kernels do not take yet, the same tuple goes to the
    reference ("cuda" raises)."""
    calls = record_ffi_calls(monkeypatch)
    fake_cuda_build(monkeypatch, [16], mask_map_cell=64)
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16, jnp.bfloat16)
    dense = rng.random((2, 1, 24, 32)) < 0.75
    keys = masks.KeyRanges(*key_ranges.random_ranges(rng, (2, 2, 32), 24))
    rows = masks.RowRanges(*row_ranges.random_ranges(rng, (1, 4, 24), 32))
    block = masks.BlockIndices(blocks.random_indices(rng, (2, 1), 24, 32, 5, 3, 4), 5, 3)
    i32 = jnp.dtype(jnp.int32)
    slots = {"dense": [((2, 1, 24, 32), jnp.dtype(jnp.bool_))],
             "keys": [((2, 2, 1, 32), i32)] * 2, "rows": [((1, 4, 24, 1), i32)] * 2,
             "blocks": [((2, 1, 5, 4), i32)]}
    members = {"dense": dense, "keys": keys, "rows": rows, "blocks": block}
    flags = {"dense": "has_mask", "keys": "has_key_ranges", "rows": "has_row_ranges",
             "blocks": "has_block_indices"}
    for kinds in (("dense", "keys"), ("rows", "dense", "blocks"), ("keys", "rows"),
                  ("keys", "blocks"), ("keys", "rows", "blocks"), KINDS):
        operands = [x for kind in KINDS if kind in kinds for x in slots[kind]]
        if "dense" in kinds:
            operands += mask_summaries(2, 1, 24, 32)
        assert_cuda_lowering_reads(calls, q, k, v, tuple(members[kind] for kind in kinds),
                                   operands, **{flags[kind]: kind in kinds for kind in KINDS})
    gate = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32)
                 for shape in ((2, 24, 4), (2, 32, 2)))
    operands = [x for kind in KINDS for x in slots[kind]]
    operands += [((2, 24, 4), jnp.dtype(jnp.float32)), ((2, 32, 2), jnp.dtype(jnp.float32))]
    operands += mask_summaries(2, 1, 24, 32)
    assert_cuda_lowering_reads(calls, q, k, v, tuple(members[kind] for kind in KINDS), operands,
                               gate=gate, has_gate=True, **{flags[kind]: True for kind in KINDS})
    with pytest.raises(ValueError, match="take softmax_threshold"):  # head dim 16, the forms
        lower_for_cuda(q, k, v, (dense, keys, rows, block), implementation="cuda",
                       softmax_threshold=0.5)


def test_cuda_workspaces_are_sized_with_every_index_mask(monkeypatch):
    """The CUDA calls' workspaces are sized by the extension from the shapes the kernels see: q
    and k, and each index mask's (segment ids, key_start, row_start, the block indices with
    their block sizes; None where absent), merged over batch dims under vmap, and the backward's
    deterministic flag (its dQ turn flags). A fake extension records what it is asked (a build
    without CUDA has no sizing functions)."""
    asked = []
    deterministic_flags = []

    class Extension:
        @staticmethod
        def cuda_forward_workspace_bytes(q, k, **index_masks):
            asked.append(("forward", tuple(q), index_masks))
            return 256

        @staticmethod
        def cuda_backward_workspace_bytes(q, k, dk, bias, dbias, deterministic, **index_masks):
            asked.append(("backward", tuple(bias), index_masks))
            deterministic_flags.append(deterministic)
            return 256

    _ffi.register_targets()  # with the real extension, before the fake one stands in
    monkeypatch.setattr(_ffi, "_extension", lambda: Extension)
    fake_cuda_build(monkeypatch, [16], mask_map_cell=64)
    rng = np.random.default_rng(5)
    v_, b, lq, lk = 3, 2, 24, 32  # vmap size, batch
    q, k, v = qkv(rng, v_ * b, lq, lk, 4, 2, 16, jnp.bfloat16)
    q, k, v = (x.reshape(v_, b, *x.shape[1:]) for x in (q, k, v))
    bias = jnp.asarray(rng.standard_normal((v_, b, 2, 1, lk)), jnp.bfloat16)
    dense = rng.random((v_, b, 1, lq, lk)) < 0.75
    ks, ke = key_ranges.random_ranges(rng, (v_, b, 2, lk), lq)
    rs, re_ = row_ranges.random_ranges(rng, (v_, b, 4, lq), lk)
    indices = blocks.random_indices(rng, (v_, b, 1), lq, lk, 5, 3, 4)
    q_ids = np.zeros((v_, b, lq), np.int32)
    kv_ids = np.zeros((v_, b, lk), np.int32)

    def loss(q, k, v, bias, dense, ks, ke, rs, re_, indices, q_ids, kv_ids):
        mask = (dense, masks.KeyRanges(ks, ke), masks.RowRanges(rs, re_),
                masks.BlockIndices(indices, 5, 3))
        return jnp.sum(flash_dmattn(q, k, v, mask, bias, q_segment_ids=q_ids,
                                    kv_segment_ids=kv_ids, implementation="cuda")
                       .astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    args = (q, k, v, bias, dense, ks, ke, rs, re_, indices, q_ids, kv_ids)
    shapes = dict(q_segments=(b, lq), kv_segments=(b, lk), key_ranges=(b, 2, 1, lk),
                  row_ranges=(b, 4, lq, 1), block_indices=(b, 1, 5, 4), alpha=None, delta=None,
                  block_q=5, block_k=3)
    jax.jit(grad).trace(*(x[0] for x in args)).lower(lowering_platforms=("cuda",))
    assert asked == [("forward", (b, lq, 4, 16), shapes), ("backward", (b, 2, 1, lk), shapes)]

    # every operand mapped alike: the two batch dims merge into one of v_ * b
    asked.clear()
    jax.jit(jax.vmap(grad)).trace(*args).lower(lowering_platforms=("cuda",))
    merged = {name: (v_ * b, *shape[1:]) if isinstance(shape, tuple) else shape
              for name, shape in shapes.items()}
    assert asked == [("forward", (v_ * b, lq, 4, 16), merged),
                     ("backward", (v_ * b, 2, 1, lk), merged)], asked

    # a gate with a threshold: alpha's and delta's shapes and the cut (its bounds take
    # workspace)
    asked.clear()
    alpha = jnp.asarray(rng.standard_normal((b, lq, 4)), jnp.float32)
    delta = jnp.asarray(rng.standard_normal((b, lk, 2)), jnp.float32)
    jax.jit(jax.grad(lambda q: jnp.sum(flash_dmattn(
        q, k[0], v[0], gate=(alpha, delta), gate_threshold=-1.0, implementation="cuda")
        .astype(jnp.float32)))).trace(q[0]).lower(lowering_platforms=("cuda",))
    gated = {**dict.fromkeys(("q_segments", "kv_segments", "key_ranges", "row_ranges",
                              "block_indices")),
             "alpha": (b, lq, 4), "delta": (b, lk, 2), "gate_cut": gate_cut(-1.0)}
    assert [index_masks for *_, index_masks in asked] == [gated, gated]

    # no index mask: every keyword None, no block sizes
    asked.clear()
    lower_for_cuda(q[0], k[0], v[0], dense[0], implementation="cuda")
    none = dict.fromkeys(("q_segments", "kv_segments", "key_ranges", "row_ranges",
                          "block_indices", "alpha", "delta"))
    assert [index_masks for *_, index_masks in asked] == [none, none]
    assert deterministic_flags == [False] * 4

    lower_for_cuda(q[0], k[0], v[0], dense[0], implementation="cuda", deterministic=True)
    assert deterministic_flags[-1] is True


@pytest.mark.gpu
def test_build_info_reports_cuda_index_masks():
    assert _ffi.build_info()["cuda_index_masks"] is True
