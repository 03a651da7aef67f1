"""The Flax and Equinox front ends: ``jax_dmattn.flax.attention_fn`` against Flax's default
attention, and the Dynamic Mask Attention layers (NNX, Linen, Equinox) against a plain-JAX float64
implementation of the same layer, with gradients, jit and KV-cache decoding; packed rows
(segment ids) against each document run alone and against the float64 implementation."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOL_FP32, TOL_HALF_GRAD, TOL_HALF_OUT, assert_close, reference_jit, rel_error
from form_checks import require_cuda_kernel

eqx = pytest.importorskip("equinox")  # optional dependencies of jax_dmattn
pytest.importorskip("flax")

from flax import linen, nnx  # noqa: E402

from jax_dmattn import equinox as dma_eqx  # noqa: E402
from jax_dmattn import flax as dma_flax  # noqa: E402
from jax_dmattn import masks  # noqa: E402
from jax_dmattn.layers import common  # noqa: E402

# ---- attention_fn as Flax's attention_fn ------------------------------------------------------

FEATURES, HEADS = 32, 4


def normal(shape: tuple[int, ...], seed: int) -> jax.Array:
    """float32 standard normals (numpy: no per-shape compilation of jax.random)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _tokens(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    return normal((*shape, FEATURES), seed)


def _mask(kind: str, batch: tuple[int, ...], length: int) -> jax.Array | None:
    """None, Flax's causal mask ``[*batch, 1, L, L]``, or a padding mask (last keys hidden)."""
    if kind == "none":
        return None
    if kind == "causal":
        return nnx.make_causal_mask(jnp.ones((*batch, length)))
    lengths = np.arange(np.prod(batch)).reshape(batch) % 3 + length - 4
    keep = np.arange(length) < lengths[..., None]  # [*batch, L]
    return nnx.make_attention_mask(np.ones((*batch, length), bool), keep)


@pytest.mark.parametrize(("batch", "mask_kind"), [((2,), "none"), ((2,), "padding"),
                                                 ((2, 3), "causal"), ((2, 3), "padding")])
def test_attention_fn_in_nnx_multihead_attention(batch, mask_kind):
    length = 16
    x = _tokens((*batch, length))
    mask = _mask(mask_kind, batch, length)

    def mha(**kw) -> nnx.MultiHeadAttention:
        return nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                      rngs=nnx.Rngs(0), **kw)

    ref = mha()(x, mask=mask)
    got = mha(attention_fn=dma_flax.attention_fn)(x, mask=mask)
    assert_close("out", got, ref, TOL_FP32)


@pytest.mark.parametrize("mask_kind", ["none", "causal"])
def test_attention_fn_in_linen_multihead_attention(mask_kind):
    batch, length = (2,), 16
    x = _tokens((*batch, length))
    mask = _mask(mask_kind, batch, length)
    ref_layer = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES)
    our_layer = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES,
                                                   attention_fn=dma_flax.attention_fn)
    variables = ref_layer.init(jax.random.PRNGKey(0), x, mask=mask)
    ref = ref_layer.apply(variables, x, mask=mask)
    got = jax.jit(our_layer.apply)(variables, x, mask=mask)
    assert_close("out", got, ref, TOL_FP32)


@pytest.mark.parametrize(("batch", "is_causal"), [((), False), ((3,), True), ((2, 3), False),
                                                 ((2, 3), True)])
def test_attention_fn_direct_with_bias_and_mask(batch, is_causal):
    """Same as ``nnx.dot_product_attention`` with a full bias, a broadcast mask and GQA."""
    lq, lk, heads, kv_heads, dim = 12, 12, 4, 2, 8
    q = normal((*batch, lq, heads, dim), 1)
    k = normal((*batch, lk, kv_heads, dim), 2)
    v = normal((*batch, lk, kv_heads, dim), 3)
    bias = normal((*batch, heads, lq, lk), 4)
    mask = np.random.default_rng(5).random((1, lq, lk)) < 0.7
    mask[..., 0] = True  # every row sees a key (Flax averages empty rows)
    ref = nnx.dot_product_attention(q, k, v, bias, mask, is_causal=is_causal)
    got = dma_flax.attention_fn(q, k, v, bias, mask, is_causal=is_causal)
    assert got.shape == ref.shape
    assert_close("out", got, ref, TOL_FP32)


def test_attention_fn_rejects_dropout_and_sown_weights():
    x = _tokens((2, 8))
    layer = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                   dropout_rate=0.1, rngs=nnx.Rngs(0),
                                   attention_fn=dma_flax.attention_fn)
    with pytest.raises(NotImplementedError, match="dropout"):
        layer(x, deterministic=False)
    assert layer(x, deterministic=True).shape == x.shape  # no dropout: fine
    layer = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, decode=False,
                                   rngs=nnx.Rngs(0), attention_fn=dma_flax.attention_fn)
    with pytest.raises(NotImplementedError, match="sow"):
        layer(x, sow_weights=True)


# ---- the Dynamic Mask Attention layers ---------------------------------------------------------

HIDDEN, H, HK, D = 32, 4, 2, 8
B, L = 2, 24
PARAM_NAMES = ("q_proj", "k_proj", "v_proj", "dt_proj", "o_proj")


def brute_force_topk_mask(score: jax.Array, window: int,
                          visible: jax.Array | None = None) -> jax.Array:
    """Causal top-`window` mask ``[..., L, L]`` of per-key scores ``[..., L]`` (ties to the lower
    index), by ranking every key of every row: key ``j`` is kept in row ``i`` iff it is visible
    (default ``j <= i``; else `visible` ``[..., L, L]``, e.g. causal and same document) and
    fewer than `window` visible keys beat it."""
    n = score.shape[-1]
    idx = jnp.arange(n)
    if visible is None:
        visible = idx[None, :] <= idx[:, None]  # [i, j]
    sa, sb = score[..., :, None], score[..., None, :]  # key a beats key b
    beats = (sa > sb) | ((sa == sb) & (idx[:, None] < idx[None, :]))
    rank = jnp.matmul(visible.astype(jnp.int32), beats.astype(jnp.int32))  # [..., i, b]
    return visible & (rank < window)


def rope_reference(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """RoPE as a complex rotation of the pairs ``(x[i], x[i + D/2])``; x ``[B, L, N, D]``."""
    half = x.shape[-1] // 2
    angles = positions[..., None] * theta ** (-jnp.arange(half) / half)  # [B|, L, D/2]
    z = (x[..., :half] + 1j * x[..., half:]) * jnp.exp(1j * angles)[..., None, :]
    return jnp.concatenate([z.real, z.imag], axis=-1)


def reference_layer(p: dict, x: jax.Array, window: int, rope: bool,
                    segment_ids: jax.Array | None = None) -> jax.Array:
    """The layer in plain JAX: dense float64 softmax attention with the same bias and mask.
    `p` holds the kernels ``[in, out]`` under PARAM_NAMES and ``A [Hk]``. With `segment_ids`
    ``[B, L]`` (one distinct id per document), a token sees the earlier tokens of its own
    document, keeps the top-`window` of them and has its index in the document as position."""
    x = x.astype(jnp.float64)
    p = {n: jnp.asarray(a, jnp.float64) for n, a in p.items()}
    b, n, _ = x.shape
    q = (x @ p["q_proj"]).reshape(b, n, H, D)
    k = (x @ p["k_proj"]).reshape(b, n, HK, D)
    v = (x @ p["v_proj"]).reshape(b, n, HK, D)
    score = p["A"] * jax.nn.softplus(v.reshape(b, n, HK * D) @ p["dt_proj"])  # [B, L, Hk]
    score = jnp.swapaxes(score, 1, 2)  # [B, Hk, L]
    idx = jnp.arange(n)
    causal = idx[None, :] <= idx[:, None]  # [i, j]
    if segment_ids is None:
        pos, visible = idx.astype(jnp.float64), causal
    else:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, i, j]
        # ids are distinct per document: a token's position is its count of earlier same ids
        pos = jnp.sum(same & (idx[None, :] < idx[:, None]), axis=-1).astype(jnp.float64)
        visible = (causal & same)[:, None]  # [B, 1, i, j]
    if rope:
        q, k = rope_reference(q, pos, 10000.0), rope_reference(k, pos, 10000.0)
    group = H // HK
    mask = brute_force_topk_mask(jax.lax.stop_gradient(score), window, visible)
    mask = jnp.repeat(mask, group, 1)
    logits = (jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, group, 2)) / np.sqrt(D)
              + jnp.repeat(score, group, 1)[:, :, None, :])
    if "a_proj" in p:  # a gated layer: + logsigmoid(alpha_i delta_j)
        alpha = jnp.swapaxes(x @ p["a_proj"], 1, 2)  # [B, H, L]
        delta = jnp.repeat(jnp.swapaxes(x @ p["d_proj"], 1, 2), group, 1)  # [B, H, L]
        logits = logits + jax.nn.log_sigmoid(alpha[..., :, None] * delta[..., None, :])
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, jnp.repeat(v, group, 2)).reshape(b, n, H * D)
    return out @ p["o_proj"]


reference_output = reference_jit(reference_layer, static_argnames=("window", "rope"))


def make_nnx_layer(window: int, rope: bool = True, seed: int = 0) -> dma_flax.DynamicMaskAttention:
    layer = dma_flax.DynamicMaskAttention(HIDDEN, H, num_kv_heads=HK, head_dim=D, window=window,
                                          rope=rope, rngs=nnx.Rngs(seed))
    layer.A[...] = jnp.array([0.7, -1.3], jnp.float32)  # not the init: test the gain itself
    return layer


def nnx_params(layer: dma_flax.DynamicMaskAttention) -> dict[str, jax.Array]:
    out = {n: getattr(layer, n).kernel[...] for n in PARAM_NAMES}
    out["A"] = layer.A[...]
    return out


def layer_input(seed: int = 1, length: int = L) -> jax.Array:
    return normal((B, length, HIDDEN), seed)


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "norope"])
@pytest.mark.parametrize("window", [5, L], ids=["window5", "windowL"])
def test_nnx_layer_matches_plain_jax(window, rope):
    layer, x = make_nnx_layer(window, rope), layer_input()
    ref = reference_output(nnx_params(layer), x, window, rope)
    got = nnx.jit(lambda m, x: m(x))(layer, x)
    assert got.shape == x.shape and got.dtype == jnp.float32
    assert_close("out", got, ref, TOL_FP32)


def test_nnx_layer_gradients_match_plain_jax():
    window = 7
    layer, x = make_nnx_layer(window), layer_input()
    w = normal(x.shape, 2)
    graphdef, state = nnx.split(layer)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x) * w)

    g_state, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x)
    got = nnx_params(nnx.merge(graphdef, g_state))
    got["x"] = g_x

    def ref_loss(p, x):
        return jnp.sum(reference_layer(p, x, window, rope=True) * w)

    ref_p, ref_x = reference_jit(jax.grad(ref_loss, argnums=(0, 1)))(
        jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), nnx_params(layer)),
        x.astype(jnp.float64))
    ref = {**ref_p, "x": ref_x}
    assert set(got) == set(ref)
    for name in ref:
        assert_close(f"d{name}", got[name], ref[name], 1e-4)
    assert float(jnp.abs(got["A"]).min()) > 0  # the bias's own gradient reaches A


def linen_variables(p: dict[str, jax.Array]) -> dict:
    params = {n: {"kernel": p[n]} for n in PARAM_NAMES}
    params["A"] = p["A"]
    return {"params": params}


def equinox_layer(p: dict[str, jax.Array], window: int, **kw) -> dma_eqx.DynamicMaskAttention:
    layer = eqx.filter_eval_shape(  # shapes only: every array is replaced below
        dma_eqx.DynamicMaskAttention, HIDDEN, H, num_kv_heads=HK, head_dim=D, window=window,
        dtype=jnp.float32, key=jax.random.PRNGKey(9), **kw)
    return eqx.tree_at(lambda m: [getattr(m, n).weight for n in PARAM_NAMES] + [m.A], layer,
                       [p[n].T for n in PARAM_NAMES] + [p["A"]])


def nnx_output_and_grads(layer: dma_flax.DynamicMaskAttention, x: jax.Array):
    """The NNX layer's output and the gradients of ``sum(out²)`` w.r.t. its parameters."""
    graphdef, state = nnx.split(layer)

    def loss(state):
        out = nnx.merge(graphdef, state)(x)
        return jnp.sum(out**2), out

    grads, out = jax.jit(jax.grad(loss, has_aux=True))(state)
    return out, nnx_params(nnx.merge(graphdef, grads))


def test_linen_twin_matches_nnx():
    window = 6
    layer, x = make_nnx_layer(window), layer_input()
    p = nnx_params(layer)
    want, want_grads = nnx_output_and_grads(layer, x)
    linen_layer = dma_flax.DynamicMaskAttentionLinen(HIDDEN, H, window, num_kv_heads=HK,
                                                     head_dim=D)
    init = jax.eval_shape(linen_layer.init, jax.random.PRNGKey(0), x)
    assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, linen_variables(p))

    def loss(variables):
        out = linen_layer.apply(variables, x)
        return jnp.sum(out**2), out

    grads, got = jax.jit(jax.grad(loss, has_aux=True))(linen_variables(p))
    assert_close("linen", got, want, TOL_FP32)
    for n in PARAM_NAMES:
        assert_close(f"linen d{n}", grads["params"][n]["kernel"], want_grads[n], TOL_FP32)
    assert_close("linen dA", grads["params"]["A"], want_grads["A"], TOL_FP32)


def test_equinox_twin_matches_nnx():
    window = 6
    layer, x = make_nnx_layer(window), layer_input()
    want, want_grads = nnx_output_and_grads(layer, x)
    eqx_layer = equinox_layer(nnx_params(layer), window)

    @eqx.filter_jit
    def run(m):
        def loss(m):
            out = m(x)
            return jnp.sum(out**2), out

        grads, out = eqx.filter_grad(loss, has_aux=True)(m)
        return out, grads, jax.vmap(m)(x)  # also one sequence at a time, under vmap

    got, grads, got_vmap = run(eqx_layer)
    assert_close("equinox", got, want, TOL_FP32)
    assert_close("equinox vmap", got_vmap, want, TOL_FP32)
    for n in PARAM_NAMES:
        assert_close(f"equinox d{n}", getattr(grads, n).weight.T, want_grads[n], TOL_FP32)
    assert_close("equinox dA", grads.A, want_grads["A"], TOL_FP32)


def test_explicit_positions_shift_invariance():
    """RoPE is relative: shifting every position leaves the output unchanged; [B, L] and [L]
    positions agree. (Also the eager, un-jitted path.)"""
    layer, x = make_nnx_layer(5), layer_input()
    base = layer(x)
    shifted = layer(x, positions=jnp.arange(L, dtype=jnp.int32) + 37)
    per_batch = layer(x, positions=jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)))
    assert rel_error(shifted, base) < 1e-5
    assert rel_error(per_batch, base) < 1e-6


@pytest.mark.parametrize("window", [5, 64], ids=["window5", "window64"])
def test_kv_cache_decoding_matches_full_sequence(window):
    """A prefill chunk, then single tokens: each call's rows equal the full-sequence rows."""
    layer, x = make_nnx_layer(window), layer_input(length=L)
    full = layer(x)
    layer.init_cache(B, L + 3)  # spare slots stay unfilled and hidden
    step = nnx.jit(lambda m, x: m(x))
    prefill = 9
    outs = [step(layer, x[:, :prefill])]
    outs += [step(layer, x[:, i:i + 1]) for i in range(prefill, L)]
    assert int(layer.cache_index[...]) == L
    decoded = jnp.concatenate(outs, axis=1)
    for i in (0, prefill - 1, prefill, L - 1):
        assert_close(f"row {i}", decoded[:, i], full[:, i], TOL_FP32)
    assert_close("all rows", decoded, full, TOL_FP32)


def test_bad_configurations_raise():
    with pytest.raises(ValueError, match="num_kv_heads"):
        dma_flax.DynamicMaskAttention(32, 4, num_kv_heads=3, window=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="window"):
        dma_eqx.DynamicMaskAttention(32, 4, window=0, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="even head_dim"):
        dma_flax.DynamicMaskAttention(32, 4, head_dim=7, window=4, rngs=nnx.Rngs(0))


# ---- packed rows: segment ids -----------------------------------------------------------------


def packed_segment_ids(seed: int, length: int = L) -> np.ndarray:
    """int32 ``[B, length]``: each row cut at random into 2-5 documents of random lengths (one
    of length 1 somewhere, documents shorter and longer than the windows tested), each with
    its own random id (ids need not be sorted or consecutive)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        docs = rng.integers(2, 6)
        cuts = np.sort(rng.choice(np.arange(1, length), docs - 1, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [length]]))
        ids = rng.choice(1000, docs, replace=False)
        rows.append(np.repeat(ids, lengths))
    rows[0][-1] = rows[0][-2] + 1  # a one-token document at the end of a row
    return np.stack(rows).astype(np.int32)


def documents(segment_ids: np.ndarray):
    """``(b, start, end)`` of every document (run of equal ids) of every row."""
    for b, row in enumerate(segment_ids):
        starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
        for start, end in zip(starts, [*starts[1:], len(row)], strict=True):
            yield b, int(start), int(end)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_document_scores_choose_within_each_document(window):
    """The dense mask the layers build for packed rows: with many tied scores and signed zeros,
    each row keeps the top-`window` keys of its own document's causal prefix (ties to the lower
    index), as a brute-force ranking over the visible keys gives."""
    rng = np.random.default_rng(20 + window)
    ids = jnp.asarray(packed_segment_ids(21 + window, length=40))
    scores = rng.integers(-2, 3, (B, HK, 1, 40)).astype(np.float32)
    scores[scores == 0] = np.where(rng.random((scores == 0).sum()) < 0.5, -0.0, 0.0)
    mask = masks.topk_mask(common.document_scores(jnp.asarray(scores), ids), window,
                           is_causal=True)
    same = ids[:, None, :, None] == ids[:, None, None, :]  # [B, 1, L, L]
    causal = jnp.tril(jnp.ones((40, 40), bool))
    want = brute_force_topk_mask(jnp.asarray(scores[:, :, 0]), window, causal & same)
    np.testing.assert_array_equal(np.asarray(mask & same), np.asarray(want))


@pytest.mark.parametrize("rope", [True, False], ids=["rope", "norope"])
@pytest.mark.parametrize("window", [4, L], ids=["window4", "windowL"])
def test_packed_rows_match_documents_run_alone(window, rope):
    """A packed row's output equals each document run through the layer alone, and the float64
    implementation of documents in one row (jitted; fresh inputs and document cuts)."""
    seed = 10 + window + 2 * rope
    layer, x = make_nnx_layer(window, rope, seed=seed), layer_input(seed)
    ids = packed_segment_ids(seed)
    got = nnx.jit(lambda m, x, ids: m(x, segment_ids=ids))(layer, x, ids)
    assert got.shape == x.shape and got.dtype == jnp.float32
    ref = reference_output(nnx_params(layer), x, window, rope, ids)
    assert_close("packed vs float64", got, ref, TOL_FP32)
    for b, start, end in documents(ids):
        alone = layer(x[b:b + 1, start:end])[0]
        assert_close(f"row {b} document [{start}, {end})", got[b, start:end], alone, TOL_FP32)


def test_packed_gradients_match_plain_jax_and_documents_alone():
    """Gradients w.r.t. the parameters and the input: against the float64 implementation, and
    the parameter gradients against the sum over documents each run alone."""
    window = 5
    layer, x, ids = make_nnx_layer(window, seed=3), layer_input(4), packed_segment_ids(5)
    w = normal(x.shape, 6)
    graphdef, state = nnx.split(layer)

    def loss(state, x, w, ids):
        return jnp.sum(nnx.merge(graphdef, state)(x, segment_ids=ids) * w)

    g_state, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x, w, ids)
    got = nnx_params(nnx.merge(graphdef, g_state))

    def ref_loss(p, x):
        return jnp.sum(reference_layer(p, x, window, True, jnp.asarray(ids)) * w)

    ref_p, ref_x = reference_jit(jax.grad(ref_loss, argnums=(0, 1)))(
        jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), nnx_params(layer)),
        x.astype(jnp.float64))
    assert set(got) == set(ref_p)
    for name in ref_p:
        assert_close(f"d{name}", got[name], ref_p[name], 1e-4)
    assert_close("dx", g_x, ref_x, 1e-4)

    alone = jax.jit(jax.grad(lambda state, x, w: loss(state, x, w, None)))
    summed = None
    for b, start, end in documents(ids):
        g = nnx_params(nnx.merge(graphdef, alone(state, x[b:b + 1, start:end],
                                                 w[b:b + 1, start:end])))
        summed = g if summed is None else jax.tree.map(jnp.add, summed, g)
    for name in ref_p:
        assert_close(f"d{name} vs documents alone", got[name], summed[name], 1e-4)


def test_packed_linen_and_equinox_twins_match_nnx():
    """Same parameters, same packed input: Linen, Equinox (batched, and one row at a time under
    vmap with ``[L]`` ids) give the NNX layer's outputs and parameter gradients."""
    window = 6
    layer, x, ids = make_nnx_layer(window, seed=7), layer_input(8), packed_segment_ids(9)
    p = nnx_params(layer)
    graphdef, state = nnx.split(layer)

    def nnx_loss(state):
        out = nnx.merge(graphdef, state)(x, segment_ids=ids)
        return jnp.sum(out**2), out

    want_grads, want = jax.jit(jax.grad(nnx_loss, has_aux=True))(state)
    want_grads = nnx_params(nnx.merge(graphdef, want_grads))

    linen_layer = dma_flax.DynamicMaskAttentionLinen(HIDDEN, H, window, num_kv_heads=HK,
                                                     head_dim=D)

    def linen_loss(variables):
        out = linen_layer.apply(variables, x, segment_ids=ids)
        return jnp.sum(out**2), out

    grads, got = jax.jit(jax.grad(linen_loss, has_aux=True))(linen_variables(p))
    assert_close("linen", got, want, TOL_FP32)
    for n in (*PARAM_NAMES, "A"):
        g = grads["params"][n] if n == "A" else grads["params"][n]["kernel"]
        assert_close(f"linen d{n}", g, want_grads[n], TOL_FP32)

    @eqx.filter_jit
    def run(m):
        def loss(m):
            out = m(x, segment_ids=ids)
            return jnp.sum(out**2), out

        grads, out = eqx.filter_grad(loss, has_aux=True)(m)
        return out, grads, jax.vmap(lambda x, ids: m(x, segment_ids=ids))(x, ids)

    got, grads, got_vmap = run(equinox_layer(p, window))
    assert_close("equinox", got, want, TOL_FP32)
    assert_close("equinox vmap", got_vmap, want, TOL_FP32)
    for n in PARAM_NAMES:
        assert_close(f"equinox d{n}", getattr(grads, n).weight.T, want_grads[n], TOL_FP32)
    assert_close("equinox dA", grads.A, want_grads["A"], TOL_FP32)


@pytest.mark.parametrize("window", [3, 64], ids=["window3", "window64"])
def test_packed_kv_cache_decoding_matches_full_sequence(window):
    """Prefill and single-token calls with their segment ids (documents that start before, at
    and after the prefill's end) give the rows of the full packed call."""
    prefill = 8
    # row 0: a document that straddles the prefill's end, a one-token one, one that starts in
    # the decoding; row 1: the prefill inside one document
    ids = np.stack([np.repeat([4, 9, 2, 7], [6, 5, 1, 12]),
                    np.repeat([1, 3, 5, 6], [9, 3, 11, 1])]).astype(np.int32)
    layer, x = make_nnx_layer(window, seed=11), layer_input(12)
    full = layer(x, segment_ids=ids)
    layer.init_cache(B, L + 3)
    step = nnx.jit(lambda m, x, ids: m(x, segment_ids=ids))
    outs = [step(layer, x[:, :prefill], ids[:, :prefill])]
    outs += [step(layer, x[:, i:i + 1], ids[:, i:i + 1]) for i in range(prefill, L)]
    assert int(layer.cache_index[...]) == L
    np.testing.assert_array_equal(np.asarray(layer.cached_segment_ids[...])[:, :L], ids)
    assert_close("all rows", jnp.concatenate(outs, axis=1), full, TOL_FP32)


@pytest.mark.parametrize("batch", [(2,), (2, 3)])
def test_attention_fn_with_segment_ids(batch):
    """Segment ids (cross-attention lengths, broadcast over a batch dim) give Flax's attention
    with the equivalent mask, and its causal variant."""
    lq, lk, heads, kv_heads, dim = 10, 14, 4, 2, 8
    rng = np.random.default_rng(13)
    q = normal((*batch, lq, heads, dim), 14)
    k = normal((*batch, lk, kv_heads, dim), 15)
    v = normal((*batch, lk, kv_heads, dim), 16)
    q_ids = np.sort(rng.integers(0, 3, (*batch, lq)), axis=-1)
    kv_ids = rng.integers(0, 3, (1,) * (len(batch) - 1) + (batch[-1], lk))  # broadcast
    kv_ids[..., :3] = [0, 1, 2]  # every query sees a key (Flax averages over empty rows)
    kv_ids = np.sort(kv_ids, axis=-1)
    mask = nnx.make_attention_mask(q_ids, np.broadcast_to(kv_ids, (*batch, lk)), jnp.equal)
    ref = nnx.dot_product_attention(q, k, v, mask=mask)
    got = dma_flax.attention_fn(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    assert_close("out", got, ref, TOL_FP32)
    ids = np.sort(rng.integers(0, 3, (*batch, lq)), axis=-1)
    ref = nnx.dot_product_attention(q[..., :lq, :, :], k[..., :lq, :, :], v[..., :lq, :, :],
                                    mask=nnx.make_attention_mask(ids, ids, jnp.equal),
                                    is_causal=True)
    got = jax.jit(lambda q, k, v, ids: dma_flax.attention_fn(
        q, k, v, is_causal=True, q_segment_ids=ids, kv_segment_ids=ids))(
        q[..., :lq, :, :], k[..., :lq, :, :], v[..., :lq, :, :], ids)
    assert_close("causal", got, ref, TOL_FP32)


def test_bad_segment_ids_raise():
    layer, x = make_nnx_layer(5), layer_input()
    ids = packed_segment_ids(0)
    with pytest.raises(ValueError, match=r"segment_ids must be .*shape \[2, 24\].*got shape "
                                         r"\(2, 23\)"):
        layer(x, segment_ids=ids[:, :-1])
    with pytest.raises(ValueError, match="segment_ids"):
        layer(x, segment_ids=ids[:, None])  # [B, 1, L]
    with pytest.raises(TypeError, match="integer"):
        layer(x, segment_ids=ids.astype(np.float32))
    linen_layer = dma_flax.DynamicMaskAttentionLinen(HIDDEN, H, 5, num_kv_heads=HK, head_dim=D)
    variables = linen_variables(nnx_params(layer))
    with pytest.raises(ValueError, match="segment_ids"):
        linen_layer.apply(variables, x, segment_ids=ids[:1, :-2])
    eqx_layer = equinox_layer(nnx_params(layer), 5)
    with pytest.raises(ValueError, match=r"segment_ids .* must be 1-D \[L\]"):
        eqx_layer(x[0], segment_ids=ids)  # one sequence, batched ids
    with pytest.raises(ValueError, match="segment_ids"):
        eqx_layer(x, segment_ids=ids[0, :-1])
    layer.init_cache(B, L)
    with pytest.raises(ValueError, match="segment_ids"):
        layer(x[:, :3], segment_ids=ids[:, :4])
    q = normal((2, 6, 4, 8), 1)
    with pytest.raises(ValueError, match="q_segment_ids"):
        dma_flax.attention_fn(q, q, q, q_segment_ids=np.zeros((2, 5), np.int32),
                              kv_segment_ids=np.zeros((2, 6), np.int32))
    with pytest.raises(ValueError, match="together"):
        dma_flax.attention_fn(q, q, q, q_segment_ids=np.zeros((2, 6), np.int32))


# ---- gated layers (gated=True: the gate of gated attention from a_proj / d_proj) --------------

GATED_NAMES = (*PARAM_NAMES, "a_proj", "d_proj")


def make_gated_nnx_layer(window: int, seed: int = 0) -> dma_flax.DynamicMaskAttention:
    layer = dma_flax.DynamicMaskAttention(HIDDEN, H, num_kv_heads=HK, head_dim=D, window=window,
                                          gated=True, rngs=nnx.Rngs(seed))
    layer.A[...] = jnp.array([0.7, -1.3], jnp.float32)
    # Large enough gates that logsigmoid matters (init scale ~1/sqrt(hidden) gives |x W| ~ 1).
    layer.a_proj.kernel[...] = layer.a_proj.kernel[...] * 3.0
    return layer


def gated_params(layer: dma_flax.DynamicMaskAttention) -> dict[str, jax.Array]:
    out = {n: getattr(layer, n).kernel[...] for n in GATED_NAMES}
    out["A"] = layer.A[...]
    return out


@pytest.mark.parametrize("window", [5, L], ids=["window5", "windowL"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_gated_nnx_layer_matches_plain_jax(window, packed):
    """gated=True adds a_proj (hidden -> H) and d_proj (hidden -> Hk): the layer equals the
    plain-JAX float64 layer whose logits gain logsigmoid(alpha_i delta_j), alpha = x Wa and
    delta = x Wd, gradients of every parameter (a_proj and d_proj included) and of x too; with
    and without packed rows."""
    layer, x = make_gated_nnx_layer(window), layer_input()
    ids = jnp.asarray(packed_segment_ids(3)) if packed else None
    assert getattr(make_nnx_layer(window), "a_proj", None) is None  # not without gated
    w = normal(x.shape, 2)
    graphdef, state = nnx.split(layer)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, segment_ids=ids) * w)

    g_state, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x)
    got = gated_params(nnx.merge(graphdef, g_state))
    got["x"] = g_x
    got["out"] = nnx.jit(lambda m, x: m(x, segment_ids=ids))(layer, x)

    def ref_loss(p, x):
        return jnp.sum(reference_layer(p, x, window, rope=True, segment_ids=ids) * w)

    p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), gated_params(layer))
    ref_p, ref_x = reference_jit(jax.grad(ref_loss, argnums=(0, 1)))(p64, x.astype(jnp.float64))
    ref = {**ref_p, "x": ref_x,
           "out": reference_jit(reference_layer, static_argnames=("window", "rope"))(
               p64, x.astype(jnp.float64), window, True, ids)}
    assert set(got) == set(ref)
    for name in ref:
        assert_close(f"d{name}", got[name], ref[name], 1e-4)
    assert float(jnp.abs(got["a_proj"]).min()) > 0 and float(jnp.abs(got["d_proj"]).min()) > 0


def test_gated_twins_match_nnx():
    """The gated Linen and Equinox layers equal the gated NNX layer given its parameters, output
    and gradients; a gated NNX layer refuses a KV cache."""
    window = 6
    layer, x = make_gated_nnx_layer(window), layer_input()
    p = gated_params(layer)
    graphdef, state = nnx.split(layer)

    def nnx_loss(state):
        out = nnx.merge(graphdef, state)(x)
        return jnp.sum(out**2), out

    grads, want = jax.jit(jax.grad(nnx_loss, has_aux=True))(state)
    want_grads = gated_params(nnx.merge(graphdef, grads))

    linen_layer = dma_flax.DynamicMaskAttentionLinen(HIDDEN, H, window, num_kv_heads=HK,
                                                     head_dim=D, gated=True)
    variables = {"params": {**{n: {"kernel": p[n]} for n in GATED_NAMES}, "A": p["A"]}}
    init = jax.eval_shape(linen_layer.init, jax.random.PRNGKey(0), x)
    assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, variables)

    def linen_loss(variables):
        out = linen_layer.apply(variables, x)
        return jnp.sum(out**2), out

    l_grads, got = jax.jit(jax.grad(linen_loss, has_aux=True))(variables)
    assert_close("linen", got, want, TOL_FP32)
    for n in GATED_NAMES:
        assert_close(f"linen d{n}", l_grads["params"][n]["kernel"], want_grads[n], TOL_FP32)

    eqx_layer = eqx.filter_eval_shape(
        dma_eqx.DynamicMaskAttention, HIDDEN, H, num_kv_heads=HK, head_dim=D, window=window,
        dtype=jnp.float32, gated=True, key=jax.random.PRNGKey(9))
    eqx_layer = eqx.tree_at(lambda m: [getattr(m, n).weight for n in GATED_NAMES] + [m.A],
                            eqx_layer, [p[n].T for n in GATED_NAMES] + [p["A"]])

    @eqx.filter_jit
    def run(m):
        def loss(m):
            out = m(x)
            return jnp.sum(out**2), out
        return eqx.filter_grad(loss, has_aux=True)(m)

    e_grads, got = run(eqx_layer)
    assert_close("equinox", got, want, TOL_FP32)
    for n in GATED_NAMES:
        assert_close(f"equinox d{n}", getattr(e_grads, n).weight.T, want_grads[n], TOL_FP32)
    plain = dma_eqx.DynamicMaskAttention(HIDDEN, H, window=4, key=jax.random.PRNGKey(0))
    assert plain.a_proj is None and plain.d_proj is None

    with pytest.raises(NotImplementedError, match="no KV cache"):
        layer.init_cache(B, L)


# ---- softmax-threshold skipping (softmax_threshold=t: flash_dmattn's, on the layer's mask) -----

def test_softmax_threshold_layers():
    """A layer with a softmax threshold runs flash_dmattn's rule on its top-window mask (given
    as key ranges): a threshold that drops nothing equals the exact layer (which runs the
    compact-key path), one that drops blocks changes the output; the Linen and Equinox twins
    equal the NNX layer (output and gradients); such an NNX layer refuses a KV cache."""
    length, window = 300, 300  # several 128-key blocks: the rule's grid has something to drop
    x = layer_input(length=length)
    exact = make_nnx_layer(window)
    p = nnx_params(exact)

    def nnx_layer(t):
        layer = dma_flax.DynamicMaskAttention(HIDDEN, H, num_kv_heads=HK, head_dim=D,
                                              window=window, softmax_threshold=t,
                                              rngs=nnx.Rngs(0))
        layer.A[...] = exact.A[...]
        return layer

    want = nnx.jit(lambda m, x: m(x))(exact, x)
    kept = nnx.jit(lambda m, x: m(x))(nnx_layer(1e-9), x)
    assert_close("no block dropped", kept, want, TOL_FP32)

    t = 50.0  # cut = lse + log(t / n): above flat scores once a block is in
    layer = nnx_layer(t)
    got, want_grads = nnx_output_and_grads(layer, x)
    assert rel_error(got, want) > 1e-3  # the threshold reached the kernel

    linen_layer = dma_flax.DynamicMaskAttentionLinen(HIDDEN, H, window, num_kv_heads=HK,
                                                     head_dim=D, softmax_threshold=t)
    l_grads, l_out = jax.jit(jax.grad(
        lambda v: (jnp.sum(linen_layer.apply(v, x)**2), linen_layer.apply(v, x)),
        has_aux=True))(linen_variables(p))
    assert_close("linen", l_out, got, TOL_FP32)
    for n in PARAM_NAMES:
        assert_close(f"linen d{n}", l_grads["params"][n]["kernel"], want_grads[n], TOL_FP32)

    eqx_layer = equinox_layer(p, window, softmax_threshold=t)

    @eqx.filter_jit
    def run(m):
        return eqx.filter_grad(lambda m: (jnp.sum(m(x)**2), m(x)), has_aux=True)(m)

    e_grads, e_out = run(eqx_layer)
    assert_close("equinox", e_out, got, TOL_FP32)
    for n in PARAM_NAMES:
        assert_close(f"equinox d{n}", getattr(e_grads, n).weight.T, want_grads[n], TOL_FP32)

    with pytest.raises(NotImplementedError, match="softmax_threshold"):
        layer.init_cache(B, length)


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_softmax_threshold_layer_on_cuda(gated):
    """On a GPU a layer with a softmax threshold (its top-window mask as key ranges beside it;
    gated or not) runs the CUDA kernels: no fallback warning with implementation="cuda", and the
    output and its gradient wrt the input equal the same layer on the reference."""
    require_cuda_kernel(64, jnp.bfloat16)
    hidden, heads, kv_heads, dim, length, window, t = 128, 2, 1, 64, 600, 300, 50.0

    def layer(implementation):
        return dma_flax.DynamicMaskAttention(hidden, heads, num_kv_heads=kv_heads, head_dim=dim,
                                             window=window, softmax_threshold=t, gated=gated,
                                             dtype=jnp.bfloat16, implementation=implementation,
                                             rngs=nnx.Rngs(0))

    def output_and_grad(m, x):
        return jax.value_and_grad(lambda x: jnp.sum(m(x).astype(jnp.float32) ** 2))(x), m(x)

    x = jax.random.normal(jax.random.PRNGKey(1), (2, length, hidden), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (_, got_dx), got = nnx.jit(output_and_grad)(layer("cuda"), x)
    (_, want_dx), want = nnx.jit(output_and_grad)(layer("xla"), x)
    assert_close("cuda layer", got.astype(jnp.float32), want.astype(jnp.float32), TOL_HALF_OUT)
    assert_close("cuda layer dx", got_dx, want_dx, TOL_HALF_GRAD)
