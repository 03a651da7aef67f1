"""implementation="cuda" on a GPU (every test is marked ``gpu``: skipped without a GPU backend and
the CUDA kernels). The conformance cases of test_conformance.py in float16/bfloat16 for every
CUDA head dim, and jit / vmap / grad / checkpoint on the GPU."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    FULL,
    HALF_DTYPES,
    Case,
    assert_close,
    cases_ids,
    check_case,
    hopper_kernels_built,
    make_inputs,
    reference,
    reference_jit,
    round_to,
    run_case,
    tolerance,
    with_infinite_bias,
)
from form_checks import require_cuda_kernel
from test_conformance import (
    BROADCAST_CASES,
    DPA_CASES,
    INFINITE_BIAS_CASES,
    SHAPE_CASES,
    SPECIAL_CASES,
)

from jax_dmattn import _ffi, flash_dmattn
from jax_dmattn.params import AttentionParams

pytestmark = pytest.mark.gpu

IMPL = "cuda"
GPU_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def _on_gpu(case: Case, dtype: str, head_dim: int | None = None) -> Case:
    """A CPU case in a CUDA dtype; head dims the CUDA build lacks (16) become 32."""
    d = head_dim if head_dim is not None else max(case.D, 32)
    return dataclasses.replace(case, dtype=dtype, D=d)


# Every head dim and dtype over a spread of lengths (incl. 1, 17, 127/128/129, 1000, 4095).
HEAD_DIM_CASES = [
    _on_gpu(SHAPE_CASES[i], dtype, d)
    for d in GPU_HEAD_DIMS for dtype in HALF_DTYPES for i in (1, 2, 5, 6, 9)
] + [_on_gpu(c, "bfloat16", 128) for c in SHAPE_CASES[10:]]
PATTERN_CASES = [_on_gpu(c, dtype) for c in BROADCAST_CASES for dtype in HALF_DTYPES]
GPU_SPECIAL_CASES = [_on_gpu(c, dtype) for c in SPECIAL_CASES + DPA_CASES for dtype in HALF_DTYPES]
# -inf bias elements through every forward and backward generation (the last: the Hopper kernels)
INFINITE_BIAS_GPU_CASES = [
    _on_gpu(c, dtype, d) for c in INFINITE_BIAS_CASES for dtype in HALF_DTYPES for d in (64, 128)
] + [Case(B=1, Lq=512, Lk=1024, H=4, Hk=2, D=128, dtype="bfloat16", causal=True, bias=FULL)]


@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=cases_ids(HEAD_DIM_CASES))
def test_head_dims(case):
    check_case(case, IMPL)


@pytest.mark.parametrize("case", PATTERN_CASES, ids=cases_ids(PATTERN_CASES))
def test_broadcast_patterns(case):
    check_case(case, IMPL, expand_reference=True)


@pytest.mark.parametrize("case", GPU_SPECIAL_CASES, ids=cases_ids(GPU_SPECIAL_CASES))
def test_special(case):
    check_case(case, IMPL)


@pytest.mark.parametrize("case", INFINITE_BIAS_GPU_CASES, ids=cases_ids(INFINITE_BIAS_GPU_CASES))
def test_infinite_bias_hides_keys(case):
    """A -inf bias element hides its key as a mask would (test_conformance's test, on CUDA)."""
    check_case(case, IMPL, with_infinite_bias(case, make_inputs(case)))


# Grids too small to fill the GPU (decoding): the forward splits the keys and merges the parts.
SPLIT_CASES = [
    Case(B=2, Lq=1, Lk=1000, H=8, Hk=2, D=128, dtype="bfloat16", mask=("B", "1", "Lq", "Lk"),
         mask_kind="blocks", bias=("1", "H", "1", "Lk")),
    Case(B=1, Lq=200, Lk=3000, H=2, Hk=1, D=64, dtype="float16", causal=True, softcap=20.0,
         bias=("1", "H", "Lq", "Lk")),
    Case(B=3, Lq=5, Lk=2000, H=4, Hk=4, D=256, dtype="bfloat16", front_end="dpa", causal=True,
         q_lens=(5, 3, 0), kv_lens=(2000, 700, 9), mask=("B", "1", "Lq", "Lk"),
         mask_kind="rows"),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=cases_ids(SPLIT_CASES))
def test_split_kv(case):
    splits = _ffi.cuda_forward_splits(case.q_shape, case.kv_shape)
    assert splits > 1, splits
    check_case(case, IMPL)


# Grids of more than one wave on an H200 (132 SMs) whose mask varies over queries and keys and
# whose CTAs may visit at least 32 tiles each: the forward runs each (batch, head)'s query blocks
# heaviest first, the backward each (kv head, batch)'s key blocks (csrc/cuda/block_order.cuh).
ORDER_CASES = [
    Case(B=2, Lq=1100, Lk=4100, H=8, Hk=2, D=128, dtype="bfloat16", causal=True,
         mask=("B", "1", "Lq", "Lk"), mask_kind="blocks", bias=("1", "H", "1", "Lk")),
    Case(B=2, Lq=1100, Lk=4100, H=8, Hk=8, D=128, dtype="float16", front_end="dpa",
         q_lens=(1100, 700), kv_lens=(3800, 4100), mask=("B", "H", "Lq", "Lk"),
         mask_kind="blocks"),
    Case(B=2, Lq=1100, Lk=1100, H=16, Hk=8, D=128, dtype="bfloat16", causal=True,
         mask=("B", "1", "Lq", "Lk"), mask_kind="blocks", bias=("B", "H", "Lq", "Lk")),
]


def _ordered(case) -> tuple[bool, bool]:
    """Whether the D=128 forward and backward order their blocks for `case` on an H200."""
    def blocks(n, size):
        return -(-n // size)
    forward = (blocks(case.Lq, 64) * case.B * case.H > 2 * 132
               and blocks(case.Lk, 128) >= 32)
    narrow = blocks(case.Lk, 128) * case.B * case.Hk < 2 * 132  # the backward's 64-key tile
    backward = (blocks(case.Lk, 64 if narrow else 128) * case.B * case.Hk > 132
                and case.H // case.Hk * blocks(case.Lq, 64) >= 32)
    return forward, backward


def test_block_order_cases_cover_both_passes():
    ordered = [_ordered(case) for case in ORDER_CASES]
    assert any(f for f, _ in ordered) and any(b for _, b in ordered), ordered


@pytest.mark.parametrize("case", ORDER_CASES, ids=cases_ids(ORDER_CASES))
def test_block_order(case):
    assert any(_ordered(case)), case
    check_case(case, IMPL)


# Calls that the warp-specialised Hopper forward takes (grids large enough not to split their
# keys; masks and biases with rows of whole 16-byte units): each runs with both forward
# generations against the float64 reference, and on a Hopper GPU the dispatcher must pick the
# Hopper kernel.
HOPPER_CASES = [
    Case(B=2, Lq=1000, Lk=1024, H=8, Hk=2, D=128, dtype="bfloat16", causal=True,
         mask=("B", "H", "Lq", "Lk"), mask_kind="blocks", bias=("B", "H", "Lq", "Lk")),
    Case(B=4, Lq=600, Lk=512, H=16, Hk=4, D=64, dtype="float16", mask=("1", "1", "Lq", "Lk"),
         mask_kind="rows", bias=("1", "H", "1", "Lk"), softcap=10.0),
    Case(B=2, Lq=1000, Lk=1000, H=8, Hk=2, D=128, dtype="bfloat16", causal=True),
    Case(B=2, Lq=1000, Lk=700, H=8, Hk=1, D=128, dtype="float16", front_end="dpa",
         q_lens=(1000, 333), kv_lens=(700, 129), window=(100, 20)),
    Case(B=1, Lq=17, Lk=64, H=2, Hk=1, D=64, dtype="float16", causal=True),
    Case(B=4, Lq=1100, Lk=1500, H=8, Hk=8, D=64, dtype="bfloat16", causal=True, softcap=30.0),
    Case(B=2, Lq=300, Lk=257, H=32, Hk=8, D=256, dtype="bfloat16", softcap=20.0),
    Case(B=2, Lq=1000, Lk=203, H=16, Hk=4, D=128, dtype="bfloat16", causal=True,
         mask=("B", "Hk", "Lq", "Lk")),
]


@pytest.mark.parametrize("kernel", ["auto", "flash2"])
@pytest.mark.parametrize("case", HOPPER_CASES, ids=cases_ids(HOPPER_CASES))
def test_forward_generations(case, kernel):
    if kernel == "auto" and hopper_kernels_built() and case.D in _ffi.cuda_head_dims():
        kernel_name = _ffi.cuda_forward_kernel(
            case.q_shape, case.kv_shape, case.mask and case.resolve(case.mask),
            case.bias and case.resolve(case.bias))
        assert kernel_name == "hopper", kernel_name
    _ffi.cuda_set_forward_kernel(kernel)
    jax.clear_caches()
    try:
        check_case(case, IMPL)
    finally:
        _ffi.cuda_set_forward_kernel("auto")
        jax.clear_caches()


# Calls the warp-specialised Hopper backward takes (no softcap; head dims 64 and 128): causal
# GQA, lengths with a window and MQA, a short causal one, rows whose lse / D vectors start off
# 16-byte boundaries (Lq odd), masks (per batch entry with whole rows hidden, per head broadcast
# over queries, block-sparse) and full-size biases (their dbias stored from the dS tiles) with a
# mask or a window.
HOPPER_BACKWARD_CASES = [
    Case(B=2, Lq=1000, Lk=1000, H=8, Hk=2, D=128, dtype="bfloat16", causal=True),
    Case(B=2, Lq=1000, Lk=700, H=8, Hk=1, D=128, dtype="float16", front_end="dpa",
         q_lens=(1000, 333), kv_lens=(700, 129), window=(100, 20)),
    Case(B=1, Lq=17, Lk=64, H=2, Hk=1, D=64, dtype="float16", causal=True),
    Case(B=3, Lq=333, Lk=130, H=4, Hk=4, D=64, dtype="bfloat16"),
    Case(B=2, Lq=700, Lk=650, H=4, Hk=2, D=128, dtype="bfloat16", causal=True,
         mask=("B", "1", "Lq", "Lk"), mask_kind="rows"),
    Case(B=2, Lq=333, Lk=520, H=4, Hk=1, D=64, dtype="float16", mask=("1", "H", "1", "Lk")),
    Case(B=1, Lq=1024, Lk=1024, H=2, Hk=2, D=128, dtype="bfloat16", mask=("1", "1", "Lq", "Lk"),
         mask_kind="blocks"),
    Case(B=2, Lq=333, Lk=520, H=4, Hk=2, D=128, dtype="bfloat16", causal=True,
         mask=("B", "1", "Lq", "Lk"), mask_kind="rows", bias=("B", "H", "Lq", "Lk")),
    Case(B=1, Lq=200, Lk=264, H=2, Hk=1, D=64, dtype="float16", window=(100, 30),
         bias=("1", "H", "Lq", "Lk")),
]


@pytest.mark.parametrize("kernel", ["auto", "flash2"])
@pytest.mark.parametrize("case", HOPPER_BACKWARD_CASES, ids=cases_ids(HOPPER_BACKWARD_CASES))
def test_backward_generations(case, kernel):
    require_cuda_kernel(case.D, jnp.dtype(case.dtype))
    _ffi.cuda_set_backward_kernel(kernel)
    jax.clear_caches()
    try:
        check_case(case, IMPL)
    finally:
        _ffi.cuda_set_backward_kernel("auto")
        jax.clear_caches()
    with pytest.raises(ValueError, match="backward kernel"):
        _ffi.cuda_set_backward_kernel("hopper")


# Deterministic calls the warp-specialised backward takes: causal GQA, and MQA with Lq odd.
DETERMINISTIC_CASES = [
    HOPPER_BACKWARD_CASES[0],
    Case(B=2, Lq=777, Lk=900, H=4, Hk=1, D=64, dtype="float16"),
]


@pytest.mark.parametrize("kernel", ["auto", "flash2"])
@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=cases_ids(DETERMINISTIC_CASES))
def test_backward_generations_deterministic(case, kernel):
    """deterministic=True: ten backward passes give the same bits (the warp-specialised kernel
    adds the key blocks' dQ in turns, the FlashAttention-2-class one runs a dq kernel), within
    the float64 reference's tolerance."""
    require_cuda_kernel(case.D, jnp.dtype(case.dtype))
    _ffi.cuda_set_backward_kernel(kernel)
    jax.clear_caches()
    try:
        inputs = make_inputs(case)
        ref = reference(case, inputs)
        lse_finite = np.isfinite(ref["lse"])
        runs = [run_case(case, inputs, IMPL, case.dtype, lse_finite, deterministic=True)
                for _ in range(10)]
    finally:
        _ffi.cuda_set_backward_kernel("auto")
        jax.clear_caches()
    for name in ("dq", "dk", "dv"):
        assert_close(name, runs[0][name], ref[name], tolerance(case.dtype, name))
        for run in runs[1:]:
            assert run[name].tobytes() == runs[0][name].tobytes(), name


def test_forward_kernel_query():
    hopper = "hopper" if hopper_kernels_built() else "flash2"
    q, k = (8, 4096, 16, 128), (8, 4096, 16, 128)
    assert _ffi.cuda_forward_kernel((1, 1, 8, 128), (1, 4096, 8, 128)) == "decode"
    assert _ffi.cuda_forward_kernel((1, 1, 8, 256), (1, 4096, 8, 256)) == "flash2_split"
    assert _ffi.cuda_forward_kernel((1, 17, 8, 128), (1, 4096, 8, 128)) == "flash2_split"
    assert _ffi.cuda_forward_kernel(q, k, (8, 16, 4096, 4096), (1, 16, 1, 4096)) == hopper
    assert _ffi.cuda_forward_kernel(q, k, (8, 16, 4096, 1)) == "flash2"  # broadcast over keys
    odd = (8, 4090, 16, 128)  # bias rows of 8180 bytes, which TMA cannot address; the mask's
    assert _ffi.cuda_forward_kernel(q, odd, None, (1, 1, 4096, 4090)) == "flash2"
    assert _ffi.cuda_forward_kernel(q, odd, (1, 1, 4096, 4090)) == hopper  # bits pad their rows
    # key and row ranges, and block indices of blocks that split tiles, run the
    # FlashAttention-2-class forward (test_block_indices covers the block sizes the Hopper one
    # takes); segment ids the Hopper one
    assert _ffi.cuda_forward_kernel(q, k, key_ranges=(8, 16, 1, 4096)) == "flash2"
    assert _ffi.cuda_forward_kernel(q, k, row_ranges=(1, 1, 4096, 1)) == "flash2"
    assert _ffi.cuda_forward_kernel(q, k, block_indices=(1, 16, 128, 8), block_q=32,
                                    block_k=64) == "flash2"
    assert _ffi.cuda_forward_kernel(q, k, q_segments=(8, 4096), kv_segments=(8, 4096)) == hopper
    with pytest.raises(ValueError, match="forward kernel"):
        _ffi.cuda_set_forward_kernel("hopper3")


def test_default_implementation_uses_cuda():
    require_cuda_kernel(64, jnp.bfloat16)
    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    text = jax.jit(lambda q: flash_dmattn(q, q, q)).lower(q).as_text()
    assert "dmattn_fwd" in text


def _expected_summaries(mask: np.ndarray, params: AttentionParams,
                        cell: int) -> tuple[np.ndarray, np.ndarray]:
    """The mask map of csrc/cuda/attention.h: per cell kTileAny (1) | kTileAll (2) of its
    elements, or kTileAll alone where the band rule of `params` hides the whole cell; and the
    mask's bits, zero in those cells, rows padded to 16 bytes (where the pass writes them)."""
    *lead, rows, cols = mask.shape
    out = np.zeros((*lead, -(-rows // cell), -(-cols // cell)), np.uint8)
    seen = mask.copy()
    in_band = _in_band(rows, cols, params)
    for r in range(out.shape[-2]):
        for c in range(out.shape[-1]):
            rs, cs = slice(r * cell, (r + 1) * cell), slice(c * cell, (c + 1) * cell)
            if not in_band[rs, cs].any():
                out[..., r, c] = 2
                seen[..., rs, cs] = False
                continue
            part = mask[..., rs, cs].reshape(*lead, -1)
            out[..., r, c] = np.where(part.any(-1), 1 | np.where(part.all(-1), 2, 0), 0)
    bits = np.packbits(seen, axis=-1, bitorder="little")
    padding = [(0, 0)] * (bits.ndim - 1) + [(0, -(-cols // 128) * 16 - bits.shape[-1])]
    return out, np.pad(bits, padding)


@pytest.mark.parametrize("lq,lk,offset,left,right", [
    (300, 450, 150, -1, 0),     # causal, Lq < Lk
    (450, 200, -250, -1, 0),    # causal, Lq > Lk
    (333, 333, 0, 100, 20),     # local window
    (200, 330, 0, -1, -1),      # no band: every cell read
    (192, 320, 128, -1, 0),     # causal, rows of whole 16-byte units (vector loads)
    (130, 256, 0, -1, -1),      # the same without a band
])
def test_mask_map_skips_cells_the_band_hides(lq, lk, offset, left, right):
    cell = _ffi.build_info()["mask_map_cell"]
    rng = np.random.default_rng(lq * lk + left)
    mask = rng.random((2, 3, lq, lk)) < 0.5
    mask[0, 0, :cell, :] = True   # whole cells all true
    mask[1, 2, :, :cell] = False  # and all false
    params = AttentionParams(scale=1.0, diagonal_offset=offset, window_left=left,
                             window_right=right)
    cells, bits = jax.jit(lambda m: _ffi.call_mask_map(m, params))(jnp.asarray(mask))
    expected_cells, expected_bits = _expected_summaries(mask, params, cell)
    np.testing.assert_array_equal(np.asarray(cells), expected_cells)
    written = _bits_written(lq, lk, expected_bits.shape[-1], params, cell)
    needed = np.repeat(np.repeat(_band_cells(lq, lk, params, cell), cell, 0)[:lq], cell // 8, 1)
    assert written[:, :needed.shape[1]][needed].all()  # every cell a tile reads
    np.testing.assert_array_equal(np.asarray(bits)[..., written], expected_bits[..., written])


def _in_band(rows: int, cols: int, params: AttentionParams) -> np.ndarray:
    """[rows, cols]: the elements the diagonal / window rule of `params` shows."""
    i = np.arange(rows)[:, None]
    j = np.arange(cols)[None, :]
    in_band = np.ones((rows, cols), bool)
    if params.window_left >= 0:
        in_band &= j >= i + params.diagonal_offset - params.window_left
    if params.window_right >= 0:
        in_band &= j <= i + params.diagonal_offset + params.window_right
    return in_band


def _band_cells(rows: int, cols: int, params: AttentionParams, cell: int) -> np.ndarray:
    """[row cells, col cells]: the cells with an element the band rule of `params` shows."""
    padded = np.zeros((-(-rows // cell) * cell, -(-cols // cell) * cell), bool)
    padded[:rows, :cols] = _in_band(rows, cols, params)
    return padded.reshape(padded.shape[0] // cell, cell, -1, cell).any(axis=(1, 3))


def _bits_written(rows: int, cols: int, pitch: int, params: AttentionParams, cell: int,
                  tallest_tile: int = 192, group: int = 512) -> np.ndarray:
    """[rows, pitch] bytes of bits the mask pass writes (block_map.cu): a 64-row band's
    `group`-key groups that the keys visible to any kernel tile holding the band reach (tiles of
    up to `tallest_tile` rows); bits elsewhere are never read."""
    inf = 1 << 30
    dmin = params.diagonal_offset - params.window_left if params.window_left >= 0 else -inf
    dmax = params.diagonal_offset + params.window_right if params.window_right >= 0 else inf
    written = np.zeros((rows, pitch), bool)
    for r0 in range(0, rows, cell):
        first, last = max(0, r0 + cell - tallest_tile), min(rows, r0 + tallest_tile) - 1
        lo, hi = max(0, first + dmin), min(cols, last + dmax + 1)
        for g0 in range(0, pitch * 8, group):
            if lo < hi and hi > g0 and lo < g0 + group:
                written[r0:r0 + cell, g0 // 8:(g0 + group) // 8] = True
    return written


def test_deterministic_gradients_bitwise():
    case = Case(B=2, Lq=300, Lk=520, H=8, Hk=1, D=64, dtype="bfloat16",
                mask=("B", "1", "Lq", "Lk"), bias=("1", "1", "1", "Lk"))
    require_cuda_kernel(case.D, case.dtype)
    inputs = make_inputs(case)
    first = run_case(case, inputs, IMPL, case.dtype, deterministic=True)
    second = run_case(case, inputs, IMPL, case.dtype, deterministic=True)
    for name in first:
        a, b = np.asarray(first[name]), np.asarray(second[name])
        assert a.tobytes() == b.tobytes(), name


# ---- transformations: the same transformation of the xla implementation is the oracle --------

B, LQ, LK, H, HK, D = 2, 70, 130, 4, 2, 64
N = 3


def _inputs(seed, dtype):
    rng = np.random.default_rng(seed)
    x = dict(q=rng.standard_normal((N, B, LQ, H, D)), k=rng.standard_normal((N, B, LK, HK, D)),
             v=rng.standard_normal((N, B, LK, HK, D)), bias=rng.standard_normal((1, H, 1, LK)),
             w=rng.standard_normal((N, B, LQ, H, D)))
    x = {n: round_to(a, dtype) for n, a in x.items()}
    x["mask"] = (rng.random((N, 1, 1, LQ, LK)) < 0.75) | (np.arange(LK) == 0)
    return x


def _transformed(kind, impl):
    """A function of (q, k, v, mask, bias, w) -> (out, dq, dk, dv, dbias) under `kind`."""

    def attn(q, k, v, mask, bias):
        return flash_dmattn(q, k, v, mask, bias, implementation=impl)

    if kind == "checkpoint":
        attn = jax.checkpoint(attn)
    if kind in ("vmap", "checkpoint"):
        f = jax.vmap(attn, in_axes=(0, 0, 0, 0, None))
    else:  # "vmap_of_grad" handles its own batching below
        f = attn

    def loss(q, k, v, bias, mask, w):
        out = f(q, k, v, mask, bias)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out

    if kind == "vmap_of_grad":
        per = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)

        def run(q, k, v, bias, mask, w):
            grads, out = jax.vmap(per, in_axes=(0, 0, 0, None, 0, 0))(q, k, v, bias, mask, w)
            return (out, *grads)
    else:
        def run(q, k, v, bias, mask, w):
            (_, out), grads = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(
                q, k, v, bias, mask, w)
            return (out, *grads)

    return run


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("kind", ["vmap", "vmap_of_grad", "checkpoint"])
def test_transformations(kind, dtype):
    """jit of vmap + grad, vmap of grad, and checkpoint, against the same transformation of the
    xla implementation in float64 (tolerance) and in `dtype` (at most 2x its error)."""
    require_cuda_kernel(D, dtype)
    x = _inputs(zlib.crc32(kind.encode()), dtype)
    names = ("q", "k", "v", "bias", "mask", "w")

    def args(dt):
        return [jnp.asarray(x[n]) if n == "mask" else jnp.asarray(x[n], dt) for n in names]

    got = jax.jit(_transformed(kind, IMPL))(*args(dtype))
    base = jax.jit(_transformed(kind, "xla"))(*args(dtype))
    ref = reference_jit(_transformed(kind, "xla"))(*args(jnp.float64))
    for name, g, b, r in zip(("out", "dq", "dk", "dv", "dbias"), got, base, ref, strict=True):
        assert g.shape == r.shape, name
        assert_close(name, g, r, tolerance(dtype, name), baseline=b)
