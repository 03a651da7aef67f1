"""Tests of jax_dmattn.dynamic (attention over compacted keys) and masks.topk_block_keys: the
key lists rebuild the brute-force dynamic mask exactly, and dynamic_attention's out, lse and
gradients match the float64 reference run with that mask (on the C++ kernels where built, and on
CUDA in the ``gpu`` tests)."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HALF_DTYPES, assert_close, reference_jit, round_to, tolerance
from test_masks import KINDS, assert_mask_equal, make_scores, reference_topk

import jax_dmattn
from jax_dmattn import masks, ops
from jax_dmattn.dynamic import default_query_block, dynamic_attention

CPU_IMPL = "cpu" if "cpu" in jax_dmattn.available_implementations() else "xla"

# ---- masks.topk_block_keys --------------------------------------------------------------------


def rebuild_mask(keys, first_row, end_row, block: int, lq: int, lk: int) -> np.ndarray:
    """The ``[..., Lq, Lk]`` mask that the per-block key lists describe."""
    keys, first_row, end_row = (np.asarray(x) for x in (keys, first_row, end_row))
    out = np.zeros((*keys.shape[:-2], lq, lk), bool)
    for row in range(lq):
        n = row // block
        keep = (first_row[..., n, :] <= row) & (row < end_row[..., n, :])
        for lead in np.ndindex(*keys.shape[:-2]):
            assert not out[(*lead, row)][keys[(*lead, n)][keep[lead]]].any(), "key listed twice"
            out[(*lead, row, keys[(*lead, n)][keep[lead]])] = True
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("lq,lk,window,block", [
    (37, 37, 5, 8), (13, 50, 3, 4), (30, 20, 3, 7), (300, 300, 17, 64), (10, 10, 64, 3),
    (1, 40, 6, 1), (64, 64, 16, 64),
])
def test_block_keys_rebuild_the_mask(lq, lk, window, block, is_causal, kind):
    scores = make_scores(np.random.default_rng(lq * lk + window), (2, 3, lk), kind)
    keys, first_row, end_row = masks.topk_block_keys(scores, window, block, is_causal=is_causal,
                                                     seqlen_q=lq)
    size = min(window + block - 1 if is_causal else window, lk)
    assert keys.shape == first_row.shape == end_row.shape == (2, 3, -(-lq // block), size)
    assert (np.diff(np.asarray(keys), axis=-1)[np.asarray(first_row < end_row)[..., 1:]]
            > 0).all(), "listed keys are not ascending"
    expected = reference_topk(scores[..., None, :], window, is_causal=is_causal, seqlen_q=lq)
    got = rebuild_mask(keys, first_row, end_row, block, lq, lk)
    assert_mask_equal(got, expected, f"causal={is_causal}")


# ---- dynamic_attention ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DynCase:
    B: int = 2
    Lq: int = 100
    Lk: int = 100
    H: int = 4
    Hk: int = 2
    D: int = 32
    window: int = 16
    bias_shape: str = "B,Hk"  # the bias's leading dims: "B,Hk", "1,Hk", "B,1" or "1,1"
    causal: bool = True
    block: int | None = None
    softcap: float | None = None
    dtype: str = "float32"
    score_kind: str = "normal"
    compact: bool = True  # expected to run over compacted keys (else flash_dmattn as is)

    def id(self) -> str:
        return (f"B{self.B}-q{self.Lq}-k{self.Lk}-h{self.H}kv{self.Hk}-d{self.D}-w{self.window}"
                f"-b{self.bias_shape.replace(',', '.')}-{'causal' if self.causal else 'full'}"
                f"-blk{self.block}-cap{self.softcap}-{self.dtype}-{self.score_kind}")

    @property
    def bias_dims(self) -> tuple[int, int, int, int]:
        b, h = self.bias_shape.split(",")
        return (self.B if b == "B" else 1, self.Hk if h == "Hk" else 1, 1, self.Lk)


CPU_CASES = [
    DynCase(Lq=200, Lk=200, block=16),
    DynCase(Lk=230, bias_shape="B,1", block=24),  # Lq < Lk, one key list for every head
    DynCase(B=1, Lq=230, Lk=150, H=2, Hk=1, window=9, bias_shape="1,Hk"),  # Lq > Lk: empty rows
    DynCase(Lq=50, Lk=200, H=4, Hk=4, window=20, causal=False, bias_shape="1,1"),
    DynCase(B=1, Lq=1, Lk=200, H=4, Hk=1, window=20),  # decoding
    DynCase(Lq=77, Lk=190, window=8, block=16, softcap=5.0, score_kind="tied"),
    DynCase(Lq=33, Lk=100, window=4, block=3, score_kind="tied"),
    DynCase(Lq=96, Lk=96, window=8, block=32, dtype="bfloat16"),
    DynCase(Lq=100, Lk=100, compact=False),  # 79 keys per block of 64 rows: no gain, dense mask
    DynCase(Lq=64, Lk=64, H=2, Hk=2, window=100, compact=False),  # window > Lk: no mask
]


def make_dyn_inputs(case: DynCase) -> dict[str, np.ndarray]:
    """Random q, k, v, the per-key bias (also the scores that choose the keys) and cotangents."""
    rng = np.random.default_rng(zlib.crc32(case.id().encode()))
    q_shape, kv_shape = (case.B, case.Lq, case.H, case.D), (case.B, case.Lk, case.Hk, case.D)
    inputs = {"q": rng.standard_normal(q_shape), "k": rng.standard_normal(kv_shape),
              "v": rng.standard_normal(kv_shape), "w": rng.standard_normal(q_shape),
              "bias": make_scores(rng, case.bias_dims, case.score_kind).astype(np.float64)}
    inputs = {n: round_to(x, case.dtype) for n, x in inputs.items()}
    inputs["wl"] = 0.1 * rng.standard_normal((case.B, case.H, case.Lq))
    return inputs


def run_dense(case: DynCase, inputs: dict, implementation: str, dtype: str) -> dict:
    """flash_dmattn with the brute-force dynamic mask: out, lse and the gradients."""
    mask = jnp.asarray(reference_topk(inputs["bias"], case.window, is_causal=case.causal,
                                      seqlen_q=case.Lq))

    def attend(q, k, v, bias):
        return jax_dmattn.flash_dmattn(q, k, v, mask, bias, is_causal=case.causal,
                                       softcap=case.softcap, return_lse=True,
                                       implementation=implementation)

    return value_and_grads(reference_jit if dtype == "float64" else jax.jit, attend, inputs,
                           dtype)


def run_dynamic(case: DynCase, inputs: dict, implementation: str | None) -> dict:
    def attend(q, k, v, bias):
        return dynamic_attention(q, k, v, bias, case.window, is_causal=case.causal,
                                 softcap=case.softcap, return_lse=True, query_block=case.block,
                                 implementation=implementation)

    return value_and_grads(jax.jit, attend, inputs, case.dtype)


def value_and_grads(jit, attend, inputs: dict, dtype: str) -> dict:
    """out, lse and the gradients wrt q, k, v and bias of ``sum(out·w) + sum(lse·wl)``."""
    ct = jnp.float64 if dtype == "float64" else jnp.float32

    def loss(q, k, v, bias, w, wl):
        out, lse = attend(q, k, v, bias)
        value = jnp.sum(out.astype(ct) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * wl)
        return value, (out, lse)

    args = [jnp.asarray(inputs[n], jnp.dtype(dtype)) for n in ("q", "k", "v", "bias")]
    cotangents = [jnp.asarray(inputs[n], ct) for n in ("w", "wl")]
    (_, (out, lse)), grads = jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        *args, *cotangents)
    return dict(zip(("out", "lse", "dq", "dk", "dv", "dbias"), (out, lse, *grads), strict=True))


def check_dynamic(case: DynCase, implementation: str | None) -> None:
    """dynamic_attention against the float64 reference with the brute-force mask (DESIGN.md §4
    tolerances; half precision also within 2x of the xla implementation in that dtype)."""
    inputs = make_dyn_inputs(case)
    ref = run_dense(case, inputs, "xla", "float64")
    got = run_dynamic(case, inputs, implementation)
    baseline = run_dense(case, inputs, "xla", case.dtype) if case.dtype in HALF_DTYPES else {}
    for name in ref:
        base = None if name == "lse" else baseline.get(name)
        assert_close(name, got[name], ref[name], tolerance(case.dtype, name), base)
    empty = ~np.isfinite(np.asarray(ref["lse"]))
    assert (np.asarray(got["out"]).transpose(0, 2, 1, 3)[empty] == 0).all(), "empty rows not 0"


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.id() for c in CPU_CASES])
def test_matches_reference(case):
    check_dynamic(case, CPU_IMPL)


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.id() for c in CPU_CASES])
def test_compacts_where_it_pays(case):
    """The kernel gets keys gathered to ``[B·nb, U, Hk, D]`` (U = window + block - 1 rounded up
    to 64) exactly where U < Lk."""
    inputs = make_dyn_inputs(case)
    args = [jnp.asarray(inputs[n], jnp.float32) for n in ("q", "k", "v", "bias")]
    text = str(jax.make_jaxpr(lambda q, k, v, b: dynamic_attention(
        q, k, v, b, case.window, is_causal=case.causal, query_block=case.block,
        implementation=CPU_IMPL))(*args))
    block = min(case.block or default_query_block(case.window), case.Lq) if case.causal else (
        case.Lq)
    listed = min(case.window + block - 1 if case.causal else case.window, case.Lk)
    size = -(-listed // 64) * 64
    assert (size < case.Lk) == case.compact, (size, case.Lk)
    if case.compact:
        gathered = f"f32[{case.B * -(-case.Lq // block)},{size},{case.Hk},{case.D}]"
        assert gathered in text, gathered


def test_compacts_keys_under_jit():
    """The kernel sees ``window + block - 1`` keys per block (padded to 64), not Lk, and no
    [Lq, Lk] array."""
    case = DynCase(B=1, Lq=256, Lk=256, H=2, Hk=1, window=16, block=32)
    inputs = make_dyn_inputs(case)
    args = [jnp.asarray(inputs[n], jnp.float32) for n in ("q", "k", "v", "bias")]
    text = str(jax.make_jaxpr(lambda q, k, v, b: dynamic_attention(
        q, k, v, b, case.window, query_block=case.block, implementation=CPU_IMPL))(*args))
    assert "f32[8,64,1,32]" in text, "keys were not gathered into 8 blocks of 47 (padded to 64)"
    assert "256,256" not in text, "an [Lq, Lk] array was built"


def test_vmap_over_a_leading_axis():
    case = DynCase(B=1, Lq=40, Lk=40, H=2, Hk=1, window=6, block=8)
    inputs = make_dyn_inputs(case)
    q, k, v, bias = (jnp.asarray(inputs[n], jnp.float32) for n in ("q", "k", "v", "bias"))

    def attend(q, k, v, bias):
        return dynamic_attention(q, k, v, bias, case.window, query_block=case.block,
                                 implementation=CPU_IMPL)

    stacked = [jnp.stack([x, 0.5 * x]) for x in (q, k, v, bias)]
    got = jax.vmap(attend)(*stacked)
    for i in range(2):
        np.testing.assert_allclose(got[i], attend(*(x[i] for x in stacked)), rtol=1e-6,
                                   atol=1e-6)


BAD_CALLS = [
    (dict(bias=np.zeros((2, 2, 8, 8), np.float32)), ValueError, "per-key bias"),
    (dict(bias=np.zeros((2, 4, 1, 8), np.float32)), ValueError, "per-key bias"),
    (dict(bias=np.zeros((2, 2, 1, 8), np.int32)), TypeError, "floating"),
    (dict(window=0), ValueError, "window must be >= 1"),
    (dict(window=2.0), TypeError, "window must be a Python int"),
    (dict(query_block=0), ValueError, "query_block must be >= 1"),
    (dict(is_causal=1), TypeError, "is_causal must be a Python bool"),
]


@pytest.mark.parametrize("overrides,error,match", BAD_CALLS, ids=[m for _, _, m in BAD_CALLS])
def test_bad_inputs_raise(overrides, error, match):
    q = jnp.ones((2, 8, 4, 16), jnp.float32)
    kv = jnp.ones((2, 8, 2, 16), jnp.float32)
    call = dict(bias=np.zeros((2, 2, 1, 8), np.float32), window=2)
    call.update(overrides)
    with pytest.raises(error, match=match):
        dynamic_attention(q, kv, kv, call.pop("bias"), call.pop("window"),
                          implementation=CPU_IMPL, **call)


# ---- ops.sum_listed_keys: the gathers' gradient ------------------------------------------------


def listed_keys_problem(rng, batch, seqlen_k, block, channels, key_channels, dim, dtype):
    """Random key ranges listed per block (masks.list_block_keys_and_slots), the blocks' spans
    and a random cotangent ``[B, nb, U, C, D]``."""
    first = rng.integers(0, seqlen_k, (batch, key_channels, seqlen_k)).astype(np.int32)
    end = np.minimum(first + rng.integers(0, 3 * block, first.shape), seqlen_k).astype(np.int32)
    size = seqlen_k
    keys, _, _, slots = masks.list_block_keys_and_slots(
        jnp.asarray(first), jnp.asarray(end), block=block, size=size, seqlen_q=seqlen_k)
    start = first // block
    stop = np.where(first < end, (end - 1) // block + 1, start)
    spans = np.stack([start, stop], axis=2).astype(np.int32)
    num_blocks = keys.shape[2]
    grad = rng.standard_normal((batch, num_blocks, size, channels, dim)).astype(np.float32)
    return jnp.asarray(round_to(grad, dtype), dtype), keys, slots, jnp.asarray(spans)


def sum_listed_keys_bruteforce(grad, keys, spans):
    grad, keys, spans = (np.asarray(x, np.float64) for x in (grad, keys, spans))
    batch, num_blocks, size, channels, dim = grad.shape
    out = np.zeros((batch, spans.shape[-1], channels, dim))
    for b, c, n in np.ndindex(batch, channels, num_blocks):
        cc = c if keys.shape[1] > 1 else 0
        for u in range(size):
            j = int(keys[b, cc, n, u])
            first_slot = u == 0 or keys[b, cc, n, u - 1] != j
            if first_slot and spans[b, cc, 0, j] <= n < spans[b, cc, 1, j]:
                out[b, j, c] += grad[b, n, u, c]
    return out


LISTED_KEYS_CASES = [  # (B, Lk, block, C, Cc, D, dtype)
    (2, 50, 8, 3, 3, "float32"),
    (1, 70, 16, 2, 1, "bfloat16"),
    (3, 33, 5, 1, 1, "float16"),
    (1, 3000, 200, 2, 1, "bfloat16"),  # lists of 3000 slots: the CUDA kernel's long search
]


@pytest.mark.parametrize("dim", [1, 20])
@pytest.mark.parametrize("case", LISTED_KEYS_CASES, ids=str)
def test_sum_listed_keys_matches_bruteforce(case, dim):
    batch, seqlen_k, block, channels, key_channels, dtype = case
    rng = np.random.default_rng(seqlen_k * 10 + dim)
    grad, keys, slots, spans = listed_keys_problem(rng, batch, seqlen_k, block, channels,
                                                   key_channels, dim, dtype)
    assert np.any(np.diff(np.asarray(keys), axis=-1) == 0), "some tail slots repeat a key"
    expected = sum_listed_keys_bruteforce(grad, keys, spans)
    got = jax.jit(ops.sum_listed_keys)(grad, slots, spans)
    if CPU_IMPL == "cpu":  # the extension's kernel, not the XLA fallback
        assert "dmattn_sum_listed_keys" in jax.jit(ops.sum_listed_keys).lower(
            grad, slots, spans).as_text()
    assert got.dtype == grad.dtype and got.shape == expected.shape
    # float32 sums, one rounding to the output dtype (half an ulp: 2^-8 relative for bfloat16)
    rtol = {"float32": 1e-6, "bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=rtol, atol=1e-6)
    xla = jax.jit(ops._sum_listed_keys_xla)(grad, slots, spans)
    np.testing.assert_allclose(np.asarray(xla, np.float64), expected, rtol=rtol, atol=1e-6)
    batched = jax.vmap(ops.sum_listed_keys, in_axes=(0, None, None))(
        jnp.stack([grad, -grad]), slots, spans)
    np.testing.assert_array_equal(np.asarray(batched[0]), np.asarray(got))
    np.testing.assert_array_equal(np.asarray(batched[1]), -np.asarray(got))


# ---- on the GPU -------------------------------------------------------------------------------

GPU_CASES = [
    DynCase(B=1, Lq=1000, Lk=1000, H=2, Hk=1, D=128, window=100, dtype="bfloat16"),
    DynCase(B=2, Lq=700, Lk=900, H=4, Hk=2, D=64, window=64, block=128, dtype="float16",
            bias_shape="1,Hk"),
    DynCase(B=1, Lq=300, Lk=2000, H=8, Hk=2, D=96, window=50, causal=False, dtype="bfloat16",
            bias_shape="B,1"),
    DynCase(B=1, Lq=4, Lk=3000, H=8, Hk=1, D=128, window=256, dtype="bfloat16"),  # decoding
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id() for c in GPU_CASES])
def test_matches_reference_on_gpu(case):
    check_dynamic(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1, 6, 20, 128, 130, 300])
@pytest.mark.parametrize("case", LISTED_KEYS_CASES, ids=str)
def test_sum_listed_keys_on_gpu(case, dim):
    """The CUDA kernel (one warp per key and channel) against the brute force: lanes over blocks
    (1, 6), lanes over elements with vector loads (20, 128; 300: three chunks) and without (130)."""
    test_sum_listed_keys_matches_bruteforce(case, dim)
