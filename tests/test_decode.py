"""Decode-shaped forward calls (issue 26): few query rows (``Lq <= 16``) against long, irregular key
lengths, GQA groups of 1 to 8 query heads per kv head, head dims 64 / 128 / 256, fp16 and bf16,
beside every rule the CUDA decode kernel takes: bool masks broadcast in several ways (with
all-False 64-key stretches, a quarter of the keys among them, and rows that see no key), biases
(per key, full, shared), softcap, causality with ``Lq > 1``, local windows, per-kv-head window
tables with sinks, and sequence lengths (dot_product_attention; lengths of 0 included).

The oracle is the float64 ``xla`` implementation on the same inputs and rules. Out and lse are
compared for every case; a few cases also compare the gradients (the backward reads the forward's
out and lse, so a new forward must leave them exact enough for it). A row that sees no key must
give exact zeros and lse ``-inf``.

On a GPU (tests marked ``gpu``), implementation="cuda" runs these calls, the dispatcher must name
the decode kernel for each of its head dims (``_ffi.cuda_forward_kernel``; DECODE_HEAD_DIMS: D256
keeps the older kernels), and one call runs with the decode
kernel and with the FlashAttention-2-class forward forced, both against the oracle. The CPU
kernels run a subset, so that CI without a GPU exercises the same shapes and rules.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import infinite_bias_elements
from form_checks import (
    assert_close,
    assert_results_close,
    outputs_and_grads,
    qkv,
    require_cuda_kernel,
    to64,
)

from jax_dmattn import _ffi, dot_product_attention, flash_dmattn

# ---- cases ------------------------------------------------------------------------------------

Dims = tuple[str, ...]  # each dim of a mask or bias: "1", "B", "H", "Hk", "Lq" or "Lk"


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One forward call. `mask` / `bias`: the dims of a bool mask / bias (None: absent).
    `table`: flash_dmattn's ``window_sizes``, rows ``(sink, left, right)`` per kv head, or one
    row ``[3]`` for every kv head (``(0, left, right)`` is the plain local window). `q_lens`,
    `kv_lens` or `local_window` make the call go through dot_product_attention (top-left
    aligned; no softcap there). `grad`: also compare the gradients (dbias included).
    `infinite_bias`: a third of the bias elements and the whole first bias row are -inf (keys
    hidden by the bias alone, as a mask would)."""

    B: int
    Lq: int
    Lk: int
    H: int
    Hk: int
    D: int
    dtype: str
    mask: Dims | None = None
    bias: Dims | None = None
    softcap: float | None = None
    causal: bool = False
    table: tuple[int, int, int] | tuple[tuple[int, int, int], ...] | None = None
    q_lens: tuple[int, ...] | None = None
    kv_lens: tuple[int, ...] | None = None
    local_window: tuple[int, int] | None = None
    grad: bool = False
    infinite_bias: bool = False

    @property
    def front_end(self) -> str:
        dpa = self.q_lens or self.kv_lens or self.local_window
        return "dpa" if dpa else "flash"

    def resolve(self, dims: Dims) -> tuple[int, ...]:
        sizes = {"1": 1, "B": self.B, "H": self.H, "Hk": self.Hk, "Lq": self.Lq, "Lk": self.Lk}
        return tuple(sizes[d] for d in dims)

    @property
    def q_shape(self) -> tuple[int, ...]:
        return (self.B, self.Lq, self.H, self.D)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        return (self.B, self.Lk, self.Hk, self.D)

    @property
    def sees_no_key_somewhere(self) -> bool:
        """Rows with no visible key: every mask hides one (decode_mask), a length of 0 hides a
        whole example, a query length below Lq hides the rows past it, and an infinite bias
        its first row."""
        short_q = self.q_lens is not None and min(self.q_lens) < self.Lq
        return (self.mask is not None or short_q or 0 in (self.kv_lens or ())
                or self.infinite_bias)

    def id(self) -> str:
        parts = [self.front_end, f"B{self.B}", f"q{self.Lq}", f"k{self.Lk}",
                 f"h{self.H}kv{self.Hk}", f"d{self.D}", self.dtype]
        if self.mask:
            parts.append("m" + ".".join(self.mask))
        if self.bias:
            parts.append("b" + ".".join(self.bias))
        for flag, label in ((self.softcap, f"cap{self.softcap}"), (self.causal, "causal"),
                            (self.table, f"table{np.size(self.table) // 3}"),
                            (self.q_lens, "ql" + ".".join(map(str, self.q_lens or ()))),
                            (self.kv_lens, "kl" + ".".join(map(str, self.kv_lens or ()))),
                            (self.local_window, "win" + ".".join(map(str, self.local_window
                                                                     or ()))),
                            (self.grad, "grad"), (self.infinite_bias, "infbias")):
            if flag:
                parts.append(label)
        return "-".join(parts)


FULL, PER_KEY, SHARED_KEYS = ("B", "H", "Lq", "Lk"), ("B", "H", "1", "Lk"), ("1", "1", "1", "Lk")
KV_HEAD_KEYS, ROWS_KEYS = ("1", "Hk", "1", "Lk"), ("B", "1", "Lq", "Lk")

# The head dims the dispatcher runs the decode kernel at (csrc/cuda/launch.h, HasDecodeForward:
# at D256 it spilled, so the FlashAttention-2-class split forward keeps those calls). Decode-shaped
# calls of other head dims must still be right, on whichever kernel runs them.
DECODE_HEAD_DIMS = (64, 128)
OLDER_KERNELS = {"hopper", "flash2", "flash2_split"}

# Lq 1 / 4 / 16, H / Hk 1 / 4 / 8 (packed rows: 1 to 128, one to two row blocks of a CTA), Lk 1000
# / 777 (not a multiple of 64) / 4100 (> 4096: several key splits), D 64 / 128 (the decode
# kernel) and 256, both half dtypes.
CASES = [
    DecodeCase(2, 1, 1000, 8, 8, 128, "bfloat16"),
    DecodeCase(2, 1, 4100, 32, 8, 128, "float16", bias=PER_KEY),
    DecodeCase(2, 4, 777, 16, 2, 64, "bfloat16", mask=FULL, bias=FULL, grad=True),
    # the mask hides every key from kv head 1: all 8 query heads of its group see nothing
    DecodeCase(1, 16, 4100, 16, 2, 128, "bfloat16", mask=KV_HEAD_KEYS, softcap=5.0),
    DecodeCase(2, 16, 1000, 8, 2, 128, "float16", mask=ROWS_KEYS, bias=SHARED_KEYS, causal=True,
               grad=True),
    DecodeCase(3, 4, 4100, 4, 4, 64, "float16", bias=PER_KEY, softcap=5.0, causal=True),
    DecodeCase(2, 1, 777, 16, 2, 64, "float16", table=(0, 300, 0)),  # the plain window
    DecodeCase(1, 16, 4100, 32, 4, 128, "bfloat16", bias=PER_KEY, causal=True,
               table=((100, 700, 0), (5, 1500, 0), (0, 300, 0), (2000, 64, 0))),
    DecodeCase(2, 4, 4100, 8, 1, 128, "bfloat16", mask=FULL, bias=PER_KEY),
    # a cache of 0 keys, one short, one full; one query row each
    DecodeCase(3, 1, 4100, 32, 8, 128, "bfloat16", mask=ROWS_KEYS, bias=PER_KEY,
               q_lens=(1, 1, 1), kv_lens=(4100, 2500, 0)),
    # a query length of 0 and one of 5, short caches, a local window
    DecodeCase(3, 16, 1000, 8, 1, 64, "float16", bias=PER_KEY, q_lens=(16, 0, 5),
               kv_lens=(1000, 700, 333), local_window=(200, 300)),
    # D256
    DecodeCase(2, 4, 777, 16, 2, 256, "bfloat16", mask=KV_HEAD_KEYS, bias=PER_KEY, softcap=5.0),
    DecodeCase(2, 1, 4100, 32, 8, 256, "float16", mask=ROWS_KEYS, bias=FULL),
    # -inf bias elements (a third, and every key of one bias row): keys the bias hides
    DecodeCase(2, 16, 1000, 32, 8, 128, "bfloat16", bias=PER_KEY, infinite_bias=True),
    DecodeCase(2, 1, 777, 16, 2, 64, "float16", bias=FULL, infinite_bias=True, grad=True),
    DecodeCase(1, 4, 4100, 8, 1, 128, "bfloat16", mask=ROWS_KEYS, bias=PER_KEY,
               infinite_bias=True),
]
CPU_CASES = [CASES[i] for i in (1, 2, 3, 4, 7, 9, 10, 11, 13, 14)]


def _ids(cases: list[DecodeCase]) -> list[str]:
    return [c.id() for c in cases]


# ---- inputs and the oracle --------------------------------------------------------------------


def decode_mask(rng: np.random.Generator, shape: tuple[int, ...],
                hide_last_tile: bool = True) -> np.ndarray:
    """A bool mask of `shape` ``[B|1, H|Hk|1, Lq|1, Lk]``: 85 % True, with all-False key
    stretches hiding whole 64-key tiles (the first, the fourth, the second quarter of the keys
    (a whole key split of a long call) and, with `hide_last_tile`, the last, partial one), and
    index ``[0, -1, -1]`` (batch 0, last head, last query row, each dim where it is not
    broadcast) hiding every key."""
    seqlen_k = shape[-1]
    mask = rng.random(shape) < 0.85
    quarter = seqlen_k // 4 // 64 * 64
    stretches = [(0, 64), (192, 256), (quarter, 2 * quarter)]
    if hide_last_tile:
        stretches.append(((seqlen_k - 1) // 64 * 64, seqlen_k))
    for start, end in stretches:
        mask[..., start:end] = False
    mask[0, -1, -1, :] = False
    return mask


def attend(case: DecodeCase, implementation: str):
    """``fn(q, k, v, mask, bias) -> (out [B, Lq, H, D], lse [B, H, Lq])`` of the case's call."""
    if case.front_end == "flash":
        def fn(q, k, v, mask, bias):
            return flash_dmattn(q, k, v, mask, bias, is_causal=case.causal, softcap=case.softcap,
                                window_sizes=case.table, return_lse=True,
                                implementation=implementation)
        return fn
    assert case.softcap is None and case.table is None
    lens = {name: None if x is None else jnp.asarray(x, jnp.int32)
            for name, x in (("query_seq_lengths", case.q_lens),
                            ("key_value_seq_lengths", case.kv_lens))}

    def fn(q, k, v, mask, bias):
        out, res = dot_product_attention(q, k, v, bias, mask, is_causal=case.causal,
                                         local_window_size=case.local_window,
                                         return_residual=True, implementation=implementation,
                                         **lens)
        return out, jnp.swapaxes(res, -1, -2)
    return fn


def inputs(case: DecodeCase, salt: str = "") -> tuple:
    """Fresh random q, k, v, mask (or None), bias (or None) for `case`, seeded by its id."""
    rng = np.random.default_rng(zlib.crc32((case.id() + salt).encode()))
    dtype = jnp.dtype(case.dtype)
    q, k, v = qkv(rng, case.B, case.Lq, case.Lk, case.H, case.Hk, case.D, dtype)
    # causality hides only keys of the last tile from decode rows: they stay visible there
    mask = (None if case.mask is None
            else jnp.asarray(decode_mask(rng, case.resolve(case.mask), not case.causal)))
    bias = None
    if case.bias is not None:
        bias = rng.standard_normal(case.resolve(case.bias))
        if case.infinite_bias:
            bias = infinite_bias_elements(rng, bias)
        bias = jnp.asarray(bias, dtype)
    return q, k, v, mask, bias


def assert_rows_without_keys_zero(case: DecodeCase, out, lse, ref_lse) -> None:
    """Where the reference's lse is -inf (a row that sees no key), out is exactly zero and lse
    -inf; such rows exist exactly where the case has them."""
    dead = ~np.isfinite(np.asarray(ref_lse))
    assert dead.any() == case.sees_no_key_somewhere, int(dead.sum())
    np.testing.assert_array_equal(np.asarray(lse)[dead], -np.inf)
    rows = np.moveaxis(np.asarray(out, np.float32), 1, 2)  # [B, H, Lq, D], as lse
    np.testing.assert_array_equal(rows[dead], 0.0)


def check_against_reference(case: DecodeCase, implementation: str, salt: str = "") -> None:
    """The case through `implementation` against the float64 ``xla`` implementation: out and
    lse (and with ``case.grad`` the gradients) as form_checks.assert_results_close."""
    q, k, v, mask, bias = inputs(case, salt)
    fn, ref_fn = attend(case, implementation), attend(case, "xla")
    ref_args = (to64(q), to64(k), to64(v), mask, to64(bias))
    if case.grad:
        out, lse, grads = outputs_and_grads(fn, q, k, v, bias, mask)
        ref_out, ref_lse, ref_grads = outputs_and_grads(ref_fn, *ref_args[:3], ref_args[4],
                                                        mask)
        assert len(grads) == (4 if bias is not None else 3)
        assert_results_close(out, lse, grads, ref_out, ref_lse, ref_grads, q.dtype)
    else:
        out, lse = fn(q, k, v, mask, bias)
        ref_out, ref_lse = ref_fn(*ref_args)
        assert out.dtype == q.dtype and lse.dtype == jnp.float32
        assert_close(out, ref_out, q.dtype, "out")
        assert_close(lse, ref_lse, jnp.float32, "lse")
    assert_rows_without_keys_zero(case, out, lse, ref_lse)


# ---- the CPU kernels (CI) ---------------------------------------------------------------------


@pytest.mark.parametrize("case", CPU_CASES, ids=_ids(CPU_CASES))
def test_cpu_matches_float64_reference(case):
    """The CPU kernels on decode shapes (CI has no GPU): the same checks as the CUDA test."""
    check_against_reference(case, "cpu")


def test_mask_helper_hides_what_it_says():
    """decode_mask's stretches and its row without keys (the cases above lean on them)."""
    mask = decode_mask(np.random.default_rng(0), (2, 3, 4, 777))
    for start, end in ((0, 64), (192, 256), (192, 384), (768, 777)):
        assert not mask[..., start:end].any(), (start, end)
    assert not mask[0, 2, 3].any()
    assert mask[1].any(axis=-1).all() and mask[0, :2].any(axis=-1).all()
    assert 0.7 < mask[..., 384:768].mean() < 0.95


# ---- the CUDA kernels -------------------------------------------------------------------------


def assert_dispatches(case: DecodeCase, expected: set[str]) -> None:
    """The CUDA forward the dispatcher names for the case's shapes is one of `expected` (skips
    where this build has no kernel for the case's head dim or dtype)."""
    require_cuda_kernel(case.D, jnp.dtype(case.dtype))
    mask = None if case.mask is None else case.resolve(case.mask)
    bias = None if case.bias is None else case.resolve(case.bias)
    name = _ffi.cuda_forward_kernel(case.q_shape, case.kv_shape, mask, bias)
    assert name in expected, (name, case.id())


@pytest.fixture
def forward_kernel():
    """``set(name)``: the CUDA forward kernel for the calls compiled after it ("auto" or
    "flash2"); "auto" again after the test, whatever happens in it. The caches are cleared each
    time: an executable may hold its kernels in a CUDA graph."""
    def set_kernel(name: str) -> None:
        _ffi.cuda_set_forward_kernel(name)
        jax.clear_caches()

    yield set_kernel
    set_kernel("auto")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_cuda_decode_matches_float64_reference(case):
    """implementation="cuda" (no fallback) against the float64 reference; the dispatcher names
    the decode kernel for every such call of its head dims, an older kernel for the others."""
    assert_dispatches(case, {"decode"} if case.D in DECODE_HEAD_DIMS else OLDER_KERNELS)
    check_against_reference(case, "cuda")


@pytest.mark.gpu
def test_cuda_decode_and_flash2_forward_agree(forward_kernel):
    """One call with the decode kernel and with the FlashAttention-2-class forward forced (which
    turns the decode kernel off), on the same inputs: each against the float64 reference."""
    case = DecodeCase(2, 4, 4100, 32, 8, 128, "bfloat16", mask=ROWS_KEYS, bias=PER_KEY,
                      softcap=20.0)
    for kernel, expected in (("auto", {"decode"}), ("flash2", OLDER_KERNELS - {"hopper"})):
        forward_kernel(kernel)
        assert_dispatches(case, expected)
        check_against_reference(case, "cuda", salt="same inputs")


@pytest.mark.gpu
def test_cuda_dispatcher_keeps_other_calls_off_decode():
    """The decode kernel's bounds: 16 query rows decode, 17 do not; segment ids, the O(L) mask
    forms and the gate keep the older kernels; head dims outside DECODE_HEAD_DIMS too (where
    built)."""
    q, k = (2, 16, 32, 128), (2, 4100, 8, 128)
    assert _ffi.cuda_forward_kernel(q, k) == "decode"
    assert _ffi.cuda_forward_kernel((2, 17, 32, 128), k) != "decode"
    assert _ffi.cuda_forward_kernel(q, k, q_segments=(2, 16), kv_segments=(2, 4100)) != "decode"
    assert _ffi.cuda_forward_kernel(q, k, key_ranges=(2, 32, 1, 4100)) != "decode"
    assert _ffi.cuda_forward_kernel(q, k, row_ranges=(2, 32, 16, 1)) != "decode"
    assert _ffi.cuda_forward_kernel(q, k, gate=((2, 16, 32), (2, 4100, 8))) != "decode"
    for d in set(_ffi.cuda_head_dims()) - set(DECODE_HEAD_DIMS):
        assert _ffi.cuda_forward_kernel((2, 1, 32, d), (2, 4100, 8, d)) != "decode", d
