"""Block indices (``masks.BlockIndices``, issue 24): a block-sparse mask in O(Lq / block_q · K)
form: each block of ``block_q`` query rows sees exactly the key blocks (of ``block_k`` keys) it
lists, and-ed with every other rule.

The oracle is the float64 ``xla`` implementation run on the equivalent dense bool mask (built
here with numpy, independently of the library's block code). The CPU and the CUDA kernels read
the indices directly (the GPU tests are marked ``gpu``).
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fake_cuda_build, hopper_kernels_built, record_ffi_calls
from form_checks import (
    assert_cuda_lowering_reads,
    assert_cuda_with_every_rule,
    assert_equals_dense_with_every_rule,
    assert_results_close,
    assert_vmap_matches_each,
    causal_step_texts,
    flash,
    outputs_and_grads,
    qkv,
    require_cuda_kernel,
    to64,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_segments import array_sizes, fake_cuda_lowering

from jax_dmattn import _ffi, dot_product_attention, flash_dmattn, masks

# ---- inputs and the oracle --------------------------------------------------------------------


def num_blocks(length: int, block: int) -> int:
    return -(-length // block)


def random_indices(rng: np.random.Generator, lead: tuple[int, ...], seqlen_q: int, seqlen_k: int,
                   block_q: int, block_k: int, slots: int,
                   unlisted: tuple[int, ...] = ()) -> np.ndarray:
    """int32 ``[*lead, ceil(Lq / block_q), slots]`` of key block numbers and -1 (about a quarter
    of the slots), with duplicates (slot 1 repeats slot 0 in about a third of the query blocks),
    query block 1 listing nothing (its rows see no key) and the key blocks `unlisted` listed by
    no query block."""
    nq, nk = num_blocks(seqlen_q, block_q), num_blocks(seqlen_k, block_k)
    choices = np.array([m for m in range(nk) if m not in unlisted])
    x = rng.choice(choices, (*lead, nq, slots))
    x = np.where(rng.random(x.shape) < 0.25, -1, x)
    if slots > 1:
        repeat = rng.random((*lead, nq)) < 1 / 3
        x[..., 1] = np.where(repeat, x[..., 0], x[..., 1])
    if nq > 1:
        x[..., 1, :] = -1
    return x.astype(np.int32)


def dense_mask(indices: np.ndarray, seqlen_q: int, seqlen_k: int, block_q: int,
               block_k: int) -> np.ndarray:
    """bool ``[..., Lq, Lk]`` of indices ``[..., nQB, K]``: (i, j) where ``j // block_k`` is
    among ``indices[..., i // block_q, :]``."""
    key_block = np.arange(seqlen_k) // block_k  # [Lk]
    rows = indices[..., np.arange(seqlen_q) // block_q, :]  # [..., Lq, K]
    return (rows[..., :, :, None] == key_block).any(axis=-2)


# ---- conformance against the float64 reference ------------------------------------------------

CASES = [
    # batch, Lq, Lk, H, Hk, D, index heads (1, Hk or H), index batch, block_q, block_k, K,
    # causal, bias, dtype
    (2, 130, 200, 4, 4, 32, 4, 2, 16, 64, 4, False, None, jnp.float32),
    (2, 130, 200, 4, 2, 64, 2, 1, 48, 16, 6, True, None, jnp.float32),
    (1, 200, 130, 4, 1, 80, 1, 1, 128, 48, 3, True, "full", jnp.float32),
    (2, 96, 257, 6, 2, 64, 6, 2, 64, 128, 2, False, "full", jnp.float32),
    (2, 129, 129, 4, 2, 128, 2, 2, 7, 1, 40, True, "keys", jnp.float32),
    (1, 150, 190, 2, 2, 64, 2, 1, 48, 48, 4, False, "full", jnp.bfloat16),
]


# Block indices alone whose blocks hold whole tiles: the Hopper forward's walks on sm_90a (blocks
# of multiples of 64 x 64; 64-key tiles where the key blocks are not multiples of 128, and each
# consumer warpgroup passing the blocks only the other's query block lists where the query blocks
# have 64 rows), the Hopper backward's where the key blocks are multiples of 128
# (test_cuda_block_indices_dispatch; grids large enough not to split their keys); Lk off the tiles,
# causality, GQA, indices per kv head, and per query head broadcast over the batch.
HOPPER_BLOCK_CASES = [
    (2, 1000, 900, 8, 2, 128, 2, 2, 128, 128, 3, True, None, jnp.bfloat16),
    (2, 700, 1300, 32, 8, 64, 32, 1, 64, 128, 4, False, None, jnp.float16),
    (2, 1000, 1100, 16, 4, 128, 16, 1, 64, 64, 6, True, None, jnp.bfloat16),
]

# The CUDA kernels' cases: head dims 64 / 128 / 256, bf16 and fp16, block sizes that are multiples
# of 64 and that are not (48, 80, 100: a block straddles the kernels' tiles), GQA with indices per
# kv head, per query head and shared, both bias shapes; the last grid is not split over keys (the
# others' small grids are).
GPU_CASES = [
    (2, 300, 500, 4, 2, 128, 2, 2, 64, 128, 3, True, "full", jnp.bfloat16),
    (1, 257, 700, 8, 2, 64, 8, 1, 48, 80, 5, False, "keys", jnp.float16),
    (2, 330, 200, 4, 1, 256, 1, 2, 80, 48, 3, True, None, jnp.bfloat16),
    (1, 1024, 1024, 16, 4, 128, 4, 1, 128, 100, 4, True, "keys", jnp.bfloat16),
    *HOPPER_BLOCK_CASES,
]


def _case_id(case) -> str:
    return "-".join(map(str, case[:13])) + "-" + jnp.dtype(case[13]).name


def _check_against_reference(case, implementation: str) -> None:
    """Outputs, lse and gradients (dbias included) of `implementation` on `case` against the
    float64 reference on the dense mask."""
    batch, lq, lk, heads, kv_heads, d, iheads, ibatch, bq, bk, slots, causal, bias_kind, dtype = \
        case
    if implementation == "cuda":
        require_cuda_kernel(d, dtype)
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d, dtype)
    indices = random_indices(rng, (ibatch, iheads), lq, lk, bq, bk, slots)
    bias = None
    if bias_kind == "full":
        bias = jnp.asarray(rng.standard_normal((batch, kv_heads, lq, lk)), dtype)
    elif bias_kind == "keys":
        bias = jnp.asarray(rng.standard_normal((1, heads, 1, lk)), dtype)
    mask = dense_mask(indices, lq, lk, bq, bk)
    assert mask.any() and not mask.all()
    out, lse, grads = outputs_and_grads(flash(implementation, is_causal=causal), q, k, v, bias,
                                        masks.BlockIndices(indices, bq, bk))
    ref_out, ref_lse, ref_grads = outputs_and_grads(
        flash("xla", is_causal=causal), to64(q), to64(k), to64(v), to64(bias), jnp.asarray(mask))
    assert not np.isfinite(np.asarray(ref_lse)).all(), "the case should have empty rows"
    assert_results_close(out, lse, grads, ref_out, ref_lse, ref_grads, dtype)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_reference(case):
    """The CPU kernels against the float64 reference on the dense mask: random indices with
    unused slots and duplicates, a query block listing nothing (rows with no visible key), block
    sizes that do not divide Lq / Lk and differ from the kernels' tiles, GQA, causality, biases
    of full and per-key shape, head dims 32-128."""
    _check_against_reference(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_cuda_matches_float64_reference(case):
    """The CUDA kernels (implementation="cuda": no fallback) against the float64 reference, as
    the CPU kernels above."""
    _check_against_reference(case, "cuda")


@pytest.mark.gpu
def test_cuda_block_indices_dispatch():
    """On a Hopper GPU of an sm_90a build, block indices alone whose blocks are multiples of 64 x
    64 run the Hopper forward (it skips the unlisted tiles and tests no score); other block
    sizes, another form, a bias or D = 256 beside them run the FlashAttention-2-class forward."""
    require_cuda_kernel(128, jnp.bfloat16)
    q, k = (2, 2048, 16, 128), (2, 2048, 4, 128)

    def kernel(block_q: int, block_k: int, q=q, k=k, **forms) -> str:
        indices = (2, 4, num_blocks(2048, block_q), 4)
        return _ffi.cuda_forward_kernel(q, k, block_indices=indices, block_q=block_q,
                                        block_k=block_k, **forms)

    hopper = "hopper" if hopper_kernels_built() else "flash2"
    for block_q, block_k in ((128, 256), (64, 128), (128, 64), (192, 128), (64, 64)):
        assert kernel(block_q, block_k) == hopper, (block_q, block_k)
    for batch, lq, lk, heads, kv_heads, d, iheads, ibatch, bq, bk, slots, *_ in HOPPER_BLOCK_CASES:
        indices = (ibatch, iheads, num_blocks(lq, bq), slots)
        assert _ffi.cuda_forward_kernel((batch, lq, heads, d), (batch, lk, kv_heads, d),
                                        block_indices=indices, block_q=bq, block_k=bk) == hopper
    for block_q, block_k in ((48, 128), (128, 96), (32, 64)):
        assert kernel(block_q, block_k) == "flash2", (block_q, block_k)
    assert kernel(128, 128, bias_shape=(1, 16, 1, 2048)) == "flash2"
    assert kernel(128, 128, key_ranges=(1, 4, 1, 2048)) == "flash2"
    assert kernel(128, 128, q=(2, 2048, 16, 256), k=(2, 2048, 4, 256)) == "flash2"


@pytest.mark.gpu
def test_cuda_with_every_rule():
    """The CUDA kernels with block indices (per kv head, blocks of 48 x 80) beside a dense mask,
    a bias, sequence lengths, segment ids and a window table with sinks, against the float64
    reference."""
    rng = np.random.default_rng(17)
    lq, lk, bq, bk = 300, 500, 48, 80
    q, k, v = qkv(rng, 2, lq, lk, 4, 2, 256, jnp.bfloat16)
    indices = random_indices(rng, (2, 2), lq, lk, bq, bk, 4)
    assert_cuda_with_every_rule(rng, q, k, v, (masks.BlockIndices(indices, bq, bk),),
                                dense_mask(indices, lq, lk, bq, bk))


def test_reference_matches_float64_dense_mask():
    """The ``xla`` implementation's own expansion of the indices (float64) gives what it gives on
    the dense mask built here."""
    rng = np.random.default_rng(9)
    lq, lk, bq, bk = 90, 110, 16, 24
    q, k, v = (to64(x) for x in qkv(rng, 2, lq, lk, 4, 2, 32))
    indices = random_indices(rng, (2, 1), lq, lk, bq, bk, 3)
    got = flash_dmattn(q, k, v, masks.BlockIndices(indices, bq, bk), return_lse=True,
                       implementation="xla")
    want = flash_dmattn(q, k, v, jnp.asarray(dense_mask(indices, lq, lk, bq, bk)),
                        return_lse=True, implementation="xla")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_equals_dense_mask_with_every_rule():
    """Block indices give what the equivalent dense bool mask gives through the same CPU
    kernels, with a window, sequence lengths and segment ids (dot_product_attention) and a
    bias."""
    rng = np.random.default_rng(7)
    batch, lq, lk, heads, kv_heads, d = 2, 140, 170, 4, 2, 64
    bq, bk = 20, 30
    q, k, v = qkv(rng, batch, lq, lk, heads, kv_heads, d)
    indices = random_indices(rng, (batch, kv_heads), lq, lk, bq, bk, 4)
    assert_equals_dense_with_every_rule(rng, q, k, v, masks.BlockIndices(indices, bq, bk),
                                        dense_mask(indices, lq, lk, bq, bk))


def test_to_mask_and_unbatched_inputs():
    """``to_mask`` is the dense form; dot_product_attention takes 3-D inputs with indices
    ``[N|K|1, nQB, K]`` and gives the 4-D call's answer; indices with K = 0 list nothing."""
    rng = np.random.default_rng(3)
    lq, lk, heads, kv_heads, d, bq, bk = 100, 120, 4, 2, 32, 32, 16
    q, k, v = qkv(rng, 1, lq, lk, heads, kv_heads, d)
    indices = random_indices(rng, (1, kv_heads), lq, lk, bq, bk, 3)
    blocks = masks.BlockIndices(indices, bq, bk)
    np.testing.assert_array_equal(blocks.to_mask(lq, lk), dense_mask(indices, lq, lk, bq, bk))
    got = dot_product_attention(q[0], k[0], v[0], mask=masks.BlockIndices(indices[0], bq, bk),
                                implementation="cpu")
    want = dot_product_attention(q, k, v, mask=blocks, implementation="cpu")
    np.testing.assert_allclose(got, want[0], atol=0)
    none = masks.BlockIndices(np.zeros((1, 1, num_blocks(lq, bq), 0), np.int32), bq, bk)
    out, lse = flash_dmattn(q, k, v, none, return_lse=True, implementation="cpu")
    np.testing.assert_array_equal(out, 0)
    assert np.isneginf(np.asarray(lse)).all()


def test_tiles_of_unlisted_key_blocks_are_skipped():
    """A key block no query block lists is never read: NaN values there reach no output row (a
    processed tile would give 0 · NaN). The control lists one of them for query block 0, whose
    rows then do read it."""
    rng = np.random.default_rng(11)
    lq = lk = 192
    bq, bk = 48, 32  # the kernels' 64-key tile 64..127 is key blocks 2 and 3
    q, k, v = qkv(rng, 1, lq, lk, 2, 2, 32)
    v = v.at[:, 64:128].set(jnp.nan)
    indices = random_indices(rng, (1, 2), lq, lk, bq, bk, 4, unlisted=(2, 3))
    out = flash_dmattn(q, k, v, masks.BlockIndices(indices, bq, bk), implementation="cpu")
    assert np.isfinite(np.asarray(out)).all()
    indices[..., 0, 0] = 2
    out = flash_dmattn(q, k, v, masks.BlockIndices(indices, bq, bk), implementation="cpu")
    assert not np.isfinite(np.asarray(out[:, :bq])).all()


# ---- transformations -----------------------------------------------------------------------------


def test_jit_vmap_and_grad():
    """Under jit and vmap (indices mapped or not) the kernels agree with per-example calls,
    gradients included."""
    rng = np.random.default_rng(5)
    n, lq, lk, bq, bk = 3, 70, 90, 16, 32
    q, k, v = qkv(rng, n, lq, lk, 2, 1, 32)
    q, k, v = q[:, None], k[:, None], v[:, None]  # n examples of batch 1
    indices = random_indices(rng, (n, 1, 1), lq, lk, bq, bk, 3)

    def one(q, k, v, indices):
        return flash_dmattn(q, k, v, masks.BlockIndices(indices, bq, bk), is_causal=True,
                            implementation="cpu")

    axes = [(0, 0, 0, 0), (0, 0, 0, None), (0, None, None, 0)]
    assert_vmap_matches_each(one, (q, k, v, indices), axes, n)


def test_block_indices_pytree_through_jit_and_vmap():
    """BlockIndices is a pytree whose only leaf is the indices: the block sizes stay static
    through jit (a new size retraces) and vmap maps the indices alone."""
    rng = np.random.default_rng(6)
    lq, lk = 40, 50
    q, k, v = qkv(rng, 2, lq, lk, 2, 2, 16)
    blocks = masks.BlockIndices(random_indices(rng, (2, 1, 1), lq, lk, 8, 16, 2), 8, 16)
    assert jax.tree_util.tree_leaves(blocks) == [blocks.indices]
    got = jax.vmap(lambda q, k, v, b: flash_dmattn(q[None], k[None], v[None], b,
                                                   implementation="cpu")[0])(q, k, v, blocks)
    want = flash_dmattn(q, k, v, blocks._replace(indices=blocks.indices[:, 0]),
                        implementation="cpu")
    np.testing.assert_allclose(got, want, atol=1e-6)
    fn = jax.jit(lambda q, k, v, b: flash_dmattn(q, k, v, b, implementation="cpu"))
    other = masks.BlockIndices(random_indices(rng, (2, 1), lq, lk, 8, 10, 2), 8, 10)
    for b in (blocks._replace(indices=blocks.indices[:, 0]), other):
        np.testing.assert_allclose(fn(q, k, v, b), flash_dmattn(q, k, v, b, implementation="cpu"),
                                   atol=1e-6)


def test_sharded_over_batch_and_heads():
    """Sharded over batch and heads, block indices give the single-device answer."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("b", "h"))
    rng = np.random.default_rng(8)
    lq, lk, bq, bk = 80, 100, 16, 24
    q, k, v = qkv(rng, 2, lq, lk, 4, 2, 32)
    indices = random_indices(rng, (2, 2), lq, lk, bq, bk, 3)

    def loss(q, k, v, indices):
        out = flash_dmattn(q, k, v, masks.BlockIndices(indices, bq, bk), implementation="cpu")
        return jnp.sum(jnp.sin(out)), out

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    want_grads, want = fn(q, k, v, indices)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    got_grads, got = fn(put(q, P("b", None, "h")), put(k, P("b", None, "h")),
                        put(v, P("b", None, "h")), put(indices, P("b", "h")))
    np.testing.assert_allclose(got, want, atol=1e-6)
    for g, ref in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-6)


def test_ffi_operands_and_attributes(monkeypatch):
    """The block indices reach both FFI calls as int32 ``[B, Hr, nQB, K]`` after the segment
    ids, with ``has_block_indices`` and the block sizes set (and no range flag); build_info
    reports them."""
    assert _ffi.build_info()["block_indices"] is True
    calls = record_ffi_calls(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16)
    indices = random_indices(rng, (2, 2), 24, 32, 5, 3, 4).astype(np.int64)
    ids = np.zeros((2, 24), np.int32), np.zeros((2, 32), np.int32)

    def loss(q, k, v):
        return jnp.sum(flash_dmattn(q, k, v, masks.BlockIndices(indices, 5, 3),
                                    q_segment_ids=ids[0], kv_segment_ids=ids[1],
                                    implementation="cpu"))

    jax.jit(jax.grad(loss)).lower(q, k, v)
    by_target = {target: (operands, attrs) for target, operands, attrs in calls}
    assert set(by_target) == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}, calls
    i32 = jnp.dtype(jnp.int32)
    for operands, attrs in by_target.values():
        assert operands[-3:] == [((2, 24), i32), ((2, 32), i32), ((2, 2, 5, 4), i32)], operands
        assert attrs["has_block_indices"] is True
        assert (attrs["block_q"], attrs["block_k"]) == (5, 3)
        assert attrs["has_key_ranges"] is False and attrs["has_row_ranges"] is False


# ---- the arrays of a training step ------------------------------------------------------------

# The CUDA kernels' workspaces are flat uint8 arrays (index-mask summaries, block orders, split-KV
# partials: O(L·D) bytes per split, which can pass Lq·Lk); an [Lq, Lk] array has two dims or more.
_FLAT_UINT8 = re.compile(r"tensor<\d+xui8>|u8\[\d+\]")


@dataclasses.dataclass(frozen=True)
class TrainingStep:
    """A training step whose arrays test_training_step_has_no_lq_by_lk_array reads (here and in
    test_mask_tuple): on the CPU kernels (float32, lowered and compiled), on the CUDA kernels
    lowered on this machine with a fake CUDA build (StableHLO only, the workspaces left out) or
    on a GPU's CUDA kernels (lowered and compiled; bf16 at a compiled head dim)."""

    implementation: str
    head_dim: int
    dtype: Any
    fake_cuda: bool = False

    def prepare(self, monkeypatch) -> None:
        """Fakes the CUDA build, or skips where a GPU build lacks the kernel."""
        if self.fake_cuda:
            fake_cuda_lowering(monkeypatch)
        elif self.implementation == "cuda":
            require_cuda_kernel(self.head_dim, self.dtype)

    def texts(self, q, k, v, mask) -> dict[str, str]:
        return causal_step_texts(q, k, v, mask, self.implementation,
                                 "cuda" if self.fake_cuda else None)

    @staticmethod
    def sizes(text: str) -> list[tuple[int, str]]:
        """test_segments.array_sizes of `text`, less the CUDA kernels' flat workspaces."""
        return [(n, t) for n, t in array_sizes(text) if not _FLAT_UINT8.fullmatch(t)]


STEPS = [
    pytest.param(TrainingStep("cpu", 16, jnp.float32), id="cpu"),
    pytest.param(TrainingStep("cuda", 16, jnp.bfloat16, fake_cuda=True), id="cuda-lowered"),
    pytest.param(TrainingStep("cuda", 64, jnp.bfloat16), id="cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("step", STEPS)
def test_training_step_has_no_lq_by_lk_array(monkeypatch, step):
    """jit(value_and_grad) of a causal call with block indices as an argument of the step: every
    array of the lowered program (and of the compiled one, where it is compiled) holds fewer
    than Lq·Lk elements, on the CPU kernels and on the CUDA kernels (the control, the same step
    given the dense mask, does hold one)."""
    step.prepare(monkeypatch)
    rng = np.random.default_rng(12)
    seqlen, bq, bk = 1024, 64, 128
    q, k, v = qkv(rng, 2, seqlen, seqlen, 4, 2, step.head_dim, step.dtype)
    indices = jnp.asarray(random_indices(rng, (2, 2), seqlen, seqlen, bq, bk, 4))

    texts = step.texts(q, k, v, masks.BlockIndices(indices, bq, bk))
    for form, text in texts.items():
        sizes = step.sizes(text)
        assert sizes, form
        assert max(sizes)[0] < seqlen * seqlen, (form, sorted(sizes, reverse=True)[:5])
    dense = masks.BlockIndices(indices, bq, bk).to_mask(seqlen, seqlen)
    for form, text in step.texts(q, k, v, dense).items():
        assert max(step.sizes(text))[0] >= seqlen * seqlen, form


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, dtype, block_q, block_k, value, error, match", [
    ((2, 3, 5, 2), np.int32, 8, 10, None, ValueError, r"BlockIndices.indices shape \(2, 3, 5, 2\)"),
    ((2, 2, 4, 2), np.int32, 8, 10, None, ValueError, r"ceil\(Lq / block_q\)"),
    ((2, 5, 2), np.int32, 8, 10, None, ValueError, "shape"),
    ((3, 2, 5, 2), np.int32, 8, 10, None, ValueError, "shape"),
    ((2, 2, 5, 2), np.float32, 8, 10, None, TypeError, "integer"),
    ((2, 2, 5, 2), np.int32, 8, 10, 5, ValueError, r"\[0, 5\) \(Lk = 50, block_k = 10\)"),
    ((2, 2, 5, 2), np.int32, 8, 10, -2, ValueError, r"-1 \(unused\)"),
    ((2, 2, 5, 2), np.int32, 0, 10, None, ValueError, "block_q must be >= 1"),
    ((2, 2, 5, 2), np.int32, 8, -1, None, ValueError, "block_k must be >= 1"),
    ((2, 2, 5, 2), np.int32, 8.0, 10, None, TypeError, "block_q must be a Python int"),
    ((2, 2, 5, 2), np.int32, 8, True, None, TypeError, "block_k must be a Python int"),
])
def test_bad_block_indices(shape, dtype, block_q, block_k, value, error, match):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 2, 40, 50, 4, 2, 16)
    indices = np.zeros(shape, dtype)
    if value is not None:
        indices.flat[3] = value
    with pytest.raises(error, match=match):
        flash_dmattn(q, k, v, masks.BlockIndices(indices, block_q, block_k), implementation="cpu")


def test_traced_out_of_range_entries_are_ignored():
    """Traced indices are not value-checked: entries outside [0, ceil(Lk / block_k)) name no key
    block, as -1 does; int64 entries that an int32 cast would wrap onto a real block (2**32 + 1)
    included. The xla implementation agrees."""
    rng = np.random.default_rng(1)
    lq, lk, bq, bk = 30, 40, 8, 10
    q, k, v = qkv(rng, 1, lq, lk, 2, 2, 16)
    indices = random_indices(rng, (1, 1), lq, lk, bq, bk, 4).astype(np.int64)
    wild = indices.copy()
    unused = wild == -1
    assert unused.sum() >= 4
    values = np.resize(np.array([-7, 4, 2**31 - 1, 2**32 + 1, -(2**32) + 2], np.int64),
                       unused.sum())
    wild[unused] = values
    for impl in ("cpu", "xla"):
        fn = jax.jit(lambda x, impl=impl: flash_dmattn(
            q, k, v, masks.BlockIndices(x, bq, bk), implementation=impl))
        np.testing.assert_allclose(fn(wild), fn(indices), atol=0, err_msg=impl)


# ---- the GPU: the CUDA kernels read them ---------------------------------------------------------


def test_cuda_lowering_reads_block_indices(monkeypatch):
    """Lowered for a GPU whose build has kernels for the call (a fake CUDA build), a call with
    block indices calls the CUDA kernels (no warning, implementation="cuda" included) with the
    indices int32 ``[B, Hr, nQB, K]`` as their last operand, ``has_block_indices`` and the block
    sizes set."""
    calls = record_ffi_calls(monkeypatch)
    fake_cuda_build(monkeypatch, [16])
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 2, 24, 32, 4, 2, 16, jnp.bfloat16)
    blocks = masks.BlockIndices(random_indices(rng, (2, 2), 24, 32, 8, 16, 2), 8, 16)
    assert_cuda_lowering_reads(calls, q, k, v, blocks, [((2, 2, 3, 2), jnp.dtype(jnp.int32))],
                               has_block_indices=True, block_q=8, block_k=16,
                               has_key_ranges=False, has_row_ranges=False)


# ---- integer edges (review): narrow dtypes, wide concrete values, huge block sizes -------------


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("implementation", ["cpu", "xla"])
def test_narrow_index_dtypes_name_every_block(dtype, implementation):
    """int8 / uint8 indices with more key blocks than their dtype holds: the range check must
    not compare in that dtype (300 blocks wrapped to 44 there and block 100 was dropped)."""
    rng = np.random.default_rng(21)
    q, k, v = qkv(rng, 1, 8, 300, 2, 2, 16)
    entries = np.broadcast_to(np.array([0, 5, 100, 7], dtype), (1, 2, 8, 4))
    got = flash_dmattn(q, k, v, masks.BlockIndices(entries, 1, 1), implementation=implementation)
    want = flash_dmattn(q, k, v, masks.BlockIndices(entries.astype(np.int32), 1, 1),
                 implementation=implementation)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_concrete_entries_are_checked_before_any_int32_cast():
    """Without x64, jnp.asarray wraps int64 2**32 + 1 to block 1: the check reads the values
    as given and rejects it."""
    rng = np.random.default_rng(22)
    with jax.enable_x64(False):
        q, k, v = qkv(rng, 1, 16, 16, 1, 1, 16)
        entries = np.full((1, 1, 2, 2), -1, np.int64)
        entries[..., 0] = 2**32 + 1
        with pytest.raises(ValueError, match="key block numbers"):
            flash_dmattn(q, k, v, masks.BlockIndices(entries, 8, 8), implementation="cpu")


@pytest.mark.parametrize("implementation", ["cpu", "xla"])
def test_blocks_longer_than_the_sequences(implementation):
    """Block sizes past int32 (and past the lengths) mean one block of the whole sequence."""
    rng = np.random.default_rng(23)
    q, k, v = qkv(rng, 1, 10, 12, 2, 1, 16)
    listed = masks.BlockIndices(np.zeros((1, 1, 1, 1), np.int32), 2**31, 2**40)
    unlisted = masks.BlockIndices(np.full((1, 1, 1, 1), -1, np.int32), 2**31, 2**40)
    def attend(mask):
        return np.asarray(flash_dmattn(q, k, v, mask, implementation=implementation))

    np.testing.assert_allclose(attend(listed), attend(None), atol=1e-6)
    assert not attend(unlisted).any()
