"""implementation="cpu" under jit, grad, vmap (any subset of mapped operands, nested, non-leading
axes), grad-of-vmap, vmap-of-grad and checkpoint, each compared with the float64 reference
computed per example by a Python loop; and the HLO check that vmap never materialises a
broadcast mask."""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, reference_jit, round_to

from jax_dmattn import dot_product_attention, flash_dmattn

OPS = ("q", "k", "v", "mask", "bias")
B, LQ, LK, H, HK, D = 2, 9, 13, 4, 2, 8
SHAPES = {"q": (B, LQ, H, D), "k": (B, LK, HK, D), "v": (B, LK, HK, D),
          "mask": (1, 1, LQ, LK), "bias": (1, H, 1, LK), "w": (B, LQ, H, D), "wl": (B, H, LQ)}
TOL = 1e-5


def _random(rng, name, lead=()):
    shape = (*lead, *SHAPES[name])
    if name == "mask":
        mask = rng.random(shape) < 0.75
        mask[..., 0] = True  # every row keeps a key: lse is finite everywhere
        return mask
    return round_to(rng.standard_normal(shape), "float32")


def _examples(seed: int, mapped, n: int) -> dict[str, np.ndarray]:
    """Operands with a leading axis of size n where mapped, plus stacked cotangents w, wl."""
    rng = np.random.default_rng(seed)
    out = {name: _random(rng, name, (n,) if name in mapped else ()) for name in OPS}
    out["w"] = _random(rng, "w", (n,))
    out["wl"] = 0.1 * _random(rng, "wl", (n,))
    return out


def _cpu(x):
    return x if x.dtype == bool else jnp.asarray(x, jnp.float32)


@functools.cache
def _reference_fn():
    """Per example: (out, lse) and the gradients wrt q, k, v, bias of sum(out·w) + sum(lse·wl)."""

    def loss(q, k, v, bias, mask, w, wl):
        out, lse = flash_dmattn(q, k, v, mask, bias, return_lse=True, implementation="xla")
        return jnp.sum(out * w) + jnp.sum(lse * wl), (out, lse)

    return reference_jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def reference_example(ex: dict) -> dict[str, np.ndarray]:
    args = [jnp.asarray(ex[n]) for n in ("q", "k", "v", "bias", "mask", "w", "wl")]
    (_, (out, lse)), grads = _reference_fn()(*args)
    return dict(out=np.asarray(out), lse=np.asarray(lse),
                **{n: np.asarray(g) for n, g in zip(("dq", "dk", "dv", "dbias"), grads,
                                                     strict=True)})


def _pick(ex: dict, mapped, index) -> dict:
    """One example: mapped operands indexed by `index`, others as they are."""
    return {n: ex[n][index] if (n in mapped or n in ("w", "wl")) else ex[n] for n in ex}


def _expected(ex, mapped, n, grads_summed_over_unmapped=True):
    refs = [reference_example(_pick(ex, mapped, i)) for i in range(n)]
    exp = {name: np.stack([r[name] for r in refs]) for name in refs[0]}
    if grads_summed_over_unmapped:
        for name, op in (("dq", "q"), ("dk", "k"), ("dv", "v"), ("dbias", "bias")):
            if op not in mapped:
                exp[name] = exp[name].sum(axis=0)
    return exp


def _check(got: dict, exp: dict):
    for name, value in got.items():
        assert value.shape == exp[name].shape, (name, value.shape, exp[name].shape)
        assert_close(name, value, exp[name], TOL)


def _attention(q, k, v, mask, bias, **kw):
    return flash_dmattn(q, k, v, mask, bias, return_lse=True, implementation="cpu", **kw)


# ---- jit, eager, grad, checkpoint --------------------------------------------------------


def test_eager_and_jit_agree_with_reference():
    ex = _examples(0, (), 1)
    ex1 = _pick(ex, (), 0)
    args = [_cpu(ex1[n]) for n in OPS]
    eager = _attention(*args)
    jitted = jax.jit(_attention)(*args)
    ref = reference_example(ex1)
    for got in (eager, jitted):
        assert_close("out", got[0], ref["out"], TOL)
        assert_close("lse", got[1], ref["lse"], TOL)
    assert np.allclose(eager[0], jitted[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy", [None, "nothing_saveable", "dots_saveable"])
def test_checkpoint(policy):
    ex = _pick(_examples(1, (), 1), (), 0)
    ckpt_kw = {} if policy is None else dict(policy=getattr(jax.checkpoint_policies, policy))
    inner = jax.checkpoint(_attention, **ckpt_kw)

    def loss(q, k, v, bias, mask):
        # two chained calls so that rematerialisation has something to recompute
        out, lse = inner(q, k, v, mask, bias)
        out2, _ = inner(out, k, v, mask, bias)
        return jnp.sum(out2 * ex["w"]) + jnp.sum(lse * ex["wl"])

    def ref_loss(q, k, v, bias, mask):
        out, lse = flash_dmattn(q, k, v, mask, bias, return_lse=True, implementation="xla")
        out2 = flash_dmattn(out, k, v, mask, bias, implementation="xla")
        return jnp.sum(out2 * ex["w"]) + jnp.sum(lse * ex["wl"])

    args = [ex[n] for n in ("q", "k", "v", "bias", "mask")]
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*map(_cpu, args))
    exp = reference_jit(jax.grad(ref_loss, argnums=(0, 1, 2, 3)))(*map(jnp.asarray, args))
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), got, exp, strict=True):
        assert_close(name, g, e, TOL)


def test_grad_through_lse_only():
    """A loss of lse alone: dv is exactly zero, dq/dk/dbias match the reference."""
    ex = _pick(_examples(2, (), 1), (), 0)

    def loss(impl):
        def fn(q, k, v, bias):
            _, lse = flash_dmattn(q, k, v, ex["mask"], bias, return_lse=True, implementation=impl)
            return jnp.sum(lse * ex["wl"])
        return fn

    args = [ex[n] for n in ("q", "k", "v", "bias")]
    got = jax.jit(jax.grad(loss("cpu"), argnums=(0, 1, 2, 3)))(*map(_cpu, args))
    exp = reference_jit(jax.grad(loss("xla"), argnums=(0, 1, 2, 3)))(*map(jnp.asarray, args))
    assert np.all(np.asarray(got[2]) == 0)
    for name, g, e in zip(("dq", "dk", "dbias"), (got[0], got[1], got[3]),
                          (exp[0], exp[1], exp[3]), strict=True):
        assert_close(name, g, e, TOL)


# ---- vmap -----------------------------------------------------------------------------------

SUBSETS = [s for r in range(1, 6) for s in itertools.combinations(OPS, r)]


@pytest.mark.parametrize("mapped", SUBSETS, ids=["+".join(s) for s in SUBSETS])
def test_vmap_and_grad_of_vmap(mapped):
    """vmap over any subset of (q, k, v, mask, bias), forward and grad of the vmapped call (a
    gradient of an unmapped operand is the sum over examples)."""
    n = 3
    ex = _examples(10 + SUBSETS.index(mapped), mapped, n)
    in_axes = tuple(0 if name in mapped else None for name in OPS)
    w, wl = jnp.asarray(ex["w"], jnp.float32), jnp.asarray(ex["wl"], jnp.float32)

    def loss(q, k, v, bias, mask):
        out, lse = jax.vmap(_attention, in_axes)(q, k, v, mask, bias)
        return jnp.sum(out * w) + jnp.sum(lse * wl), (out, lse)

    args = [_cpu(ex[n]) for n in ("q", "k", "v", "bias", "mask")]
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(*args)
    got = dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv", "dbias"), grads, strict=True)))
    _check(got, _expected(ex, mapped, n))


VMAP_OF_GRAD = [("q",), ("k", "v", "bias"), ("mask",), ("q", "mask"), OPS]


@pytest.mark.parametrize("mapped", VMAP_OF_GRAD, ids=["+".join(s) for s in VMAP_OF_GRAD])
def test_vmap_of_grad(mapped):
    """Per-example gradients: vmap of grad gives every gradient per example."""
    n = 3
    ex = _examples(50 + VMAP_OF_GRAD.index(mapped), mapped, n)

    def loss(q, k, v, bias, mask, w, wl):
        out, lse = _attention(q, k, v, mask, bias)
        return jnp.sum(out * w) + jnp.sum(lse * wl)

    names = ("q", "k", "v", "bias", "mask", "w", "wl")
    in_axes = tuple(0 if (name in mapped or name in ("w", "wl")) else None for name in names)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3)), in_axes))(
        *[_cpu(ex[name]) for name in names])
    exp = _expected(ex, mapped, n, grads_summed_over_unmapped=False)
    _check(dict(zip(("dq", "dk", "dv", "dbias"), grads, strict=True)),
           {k: exp[k] for k in ("dq", "dk", "dv", "dbias")})


NESTED = {
    # name: (outer mapped, inner mapped); operands are stacked [outer, inner, ...] where both map
    "qkv-then-q.mask": (("q", "k", "v"), ("q", "mask")),
    "bias.mask-then-q": (("bias", "mask"), ("q",)),
    "all-then-kv.bias": (OPS, ("k", "v", "bias")),
}


@pytest.mark.parametrize("name", list(NESTED))
def test_nested_vmap(name):
    """Two levels of vmap, forward and grad, against a double Python loop."""
    outer, inner = NESTED[name]
    n1, n2 = 2, 3
    rng = np.random.default_rng(70 + list(NESTED).index(name))
    ex = {}
    for op in OPS:
        lead = ((n1,) if op in outer else ()) + ((n2,) if op in inner else ())
        ex[op] = _random(rng, op, lead)
    ex["w"] = _random(rng, "w", (n1, n2))
    ex["wl"] = 0.1 * _random(rng, "wl", (n1, n2))
    w, wl = jnp.asarray(ex["w"], jnp.float32), jnp.asarray(ex["wl"], jnp.float32)
    f = jax.vmap(_attention, tuple(0 if op in inner else None for op in OPS))
    f = jax.vmap(f, tuple(0 if op in outer else None for op in OPS))

    def loss(q, k, v, bias, mask):
        out, lse = f(q, k, v, mask, bias)
        return jnp.sum(out * w) + jnp.sum(lse * wl), (out, lse)

    args = [_cpu(ex[n]) for n in ("q", "k", "v", "bias", "mask")]
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(*args)

    refs = {}
    for i, j in itertools.product(range(n1), range(n2)):
        one = {}
        for op in (*OPS, "w", "wl"):
            x = ex[op]
            if op in outer or op in ("w", "wl"):
                x = x[i]
            if op in inner or op in ("w", "wl"):
                x = x[j]
            one[op] = x
        refs[i, j] = reference_example(one)
    for got_name, got in (("out", out), ("lse", lse)):
        exp = np.stack([np.stack([refs[i, j][got_name] for j in range(n2)]) for i in range(n1)])
        assert_close(got_name, got, exp, TOL)
    for got_name, op, got in zip(("dq", "dk", "dv", "dbias"), ("q", "k", "v", "bias"), grads,
                                 strict=True):
        per = np.stack([np.stack([refs[i, j][got_name] for j in range(n2)]) for i in range(n1)])
        if op not in inner:
            per = per.sum(axis=1)
        if op not in outer:
            per = per.sum(axis=0)
        assert_close(got_name, got, per, TOL)


def test_vmap_over_non_leading_axes():
    """q mapped on axis 2, k on its last axis, v on axis 1, bias on axis 1, out and lse returned
    on axis 1."""
    n = 3
    mapped = ("q", "k", "v", "bias")
    rng = np.random.default_rng(90)
    ex = {op: _random(rng, op, (n,) if op in mapped else ()) for op in OPS}
    ex["w"] = _random(rng, "w", (n,))
    ex["wl"] = 0.1 * _random(rng, "wl", (n,))
    q_t = np.moveaxis(ex["q"], 0, 2)  # [B, Lq, n, H, D]
    k_t = np.moveaxis(ex["k"], 0, -1)  # [B, Lk, Hk, D, n]
    v_t = np.moveaxis(ex["v"], 0, 1)  # [B, n, Lk, Hk, D]
    bias_t = np.moveaxis(ex["bias"], 0, 1)  # [1, n, H, 1, Lk]
    w = jnp.asarray(np.moveaxis(ex["w"], 0, 1), jnp.float32)
    wl = jnp.asarray(np.moveaxis(ex["wl"], 0, 1), jnp.float32)
    f = jax.vmap(_attention, in_axes=(2, 4, 1, None, 1), out_axes=1)

    def loss(q, k, v, bias, mask):
        out, lse = f(q, k, v, mask, bias)
        return jnp.sum(out * w) + jnp.sum(lse * wl), (out, lse)

    args = [_cpu(x) for x in (q_t, k_t, v_t, bias_t, ex["mask"])]
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(*args)
    exp = _expected(ex, mapped, n)
    assert_close("out", out, np.moveaxis(exp["out"], 0, 1), TOL)
    assert_close("lse", lse, np.moveaxis(exp["lse"], 0, 1), TOL)
    assert_close("dq", grads[0], np.moveaxis(exp["dq"], 0, 2), TOL)
    assert_close("dk", grads[1], np.moveaxis(exp["dk"], 0, -1), TOL)
    assert_close("dv", grads[2], np.moveaxis(exp["dv"], 0, 1), TOL)
    assert_close("dbias", grads[3], np.moveaxis(exp["dbias"], 0, 1), TOL)


# ---- vmap keeps an unmapped mask broadcast ----------------------------------------------------

_TENSOR = re.compile(r"tensor<((?:\d+x)+)[a-z]+\d*>")
_HLO_SHAPE = re.compile(r"\b(?:pred|[subf]\d+|bf16)\[([\d,]+)\]")


def materialised_broadcasts(text: str, vmap_size: int, length: int) -> list[tuple[int, ...]]:
    """Array shapes in StableHLO or HLO text that hold both the vmap size and an L×L plane."""
    shapes = [tuple(int(d) for d in m.rstrip("x").split("x")) for m in _TENSOR.findall(text)]
    shapes += [tuple(int(d) for d in m.split(",")) for m in _HLO_SHAPE.findall(text)]
    return sorted({s for s in shapes if vmap_size in s and s.count(length) >= 2})


def test_hlo_check_fires_on_a_materialised_mask():
    """The detector itself: it flags a mask deliberately broadcast over the vmap axis, in
    StableHLO and in compiled HLO text, and ignores shapes without the L×L plane."""
    length, n = 256, 4
    _, k, qs, m = _hlo_operands(length, n)
    bad = jax.jit(lambda qs: jax.vmap(
        lambda q, m: flash_dmattn(q, k, k, mask=m, implementation="cpu"))(
            qs, jnp.broadcast_to(m, (n, *m.shape))))
    assert (n, 1, 1, length, length) in materialised_broadcasts(bad.lower(qs).as_text(), n,
                                                                 length)
    assert materialised_broadcasts(bad.lower(qs).compile().as_text(), n, length)
    assert not materialised_broadcasts("tensor<4x1x256x1x16xf32> f32[4,256,1,16]", n, length)
    assert materialised_broadcasts("pred[4,1,1,256,256]", n, length)


def _hlo_operands(length, n):
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, length, 1, 16)), jnp.float32)
    qs = jnp.asarray(rng.standard_normal((n, 1, length, 1, 16)), jnp.float32)
    m = jnp.asarray(np.tril(np.ones((length, length), bool))[None, None])
    return q, q, qs, m


@pytest.mark.parametrize("operand", ["mask", "bias"])
def test_vmap_does_not_broadcast_unmapped_mask_or_bias(operand):
    """vmap(lambda q: flash_dmattn(q, k, v, mask=m)) with m [1, 1, L, L]: no array in the lowered
    HLO has both the vmap size and L×L (forward; and for the mask the grad wrt q too; an unmapped
    bias legitimately gets a per-example dbias in the backward, which vmap-of-grad needs)."""
    length, n = 256, 4
    _, k, qs, m = _hlo_operands(length, n)
    extra = dict(mask=m) if operand == "mask" else dict(bias=m.astype(jnp.float32))

    def f(q):
        return flash_dmattn(q, k, k, implementation="cpu", **extra)

    fwd = jax.jit(jax.vmap(f))
    text = fwd.lower(qs).as_text()
    assert "custom_call" in text  # the kernel, not the reference, was lowered
    assert not materialised_broadcasts(text, n, length)
    if operand == "mask":
        bwd = jax.jit(jax.grad(lambda qs: jnp.sum(jax.vmap(f)(qs))))
        assert not materialised_broadcasts(bwd.lower(qs).as_text(), n, length)
    # and the numbers are right
    out = fwd(qs)
    extra64 = {key: x if x.dtype == bool else x.astype(jnp.float64) for key, x in extra.items()}
    k64 = k.astype(jnp.float64)
    ref = reference_jit(jax.vmap(lambda q: flash_dmattn(
        q, k64, k64, implementation="xla", **extra64)))(qs.astype(jnp.float64))
    assert_close("out", out, ref, TOL)


def test_vmap_dot_product_attention_with_mapped_lengths():
    """dot_product_attention under vmap with per-example sequence lengths (mapped) and an
    unmapped bias, forward and grad, against the per-example float64 reference."""
    n = 3
    rng = np.random.default_rng(95)
    q = round_to(rng.standard_normal((n, B, LQ, H, D)), "float32")
    k = round_to(rng.standard_normal((n, B, LK, HK, D)), "float32")
    bias = round_to(rng.standard_normal((1, H, LQ, LK)), "float32")
    w = round_to(rng.standard_normal((n, B, LQ, H, D)), "float32")
    q_lens = rng.integers(0, LQ + 1, (n, B)).astype(np.int32)
    kv_lens = rng.integers(1, LK + 1, (n, B)).astype(np.int32)

    def loss(impl):
        def per_example(q, k, bias, ql, kl, w):
            out = dot_product_attention(q, k, k, bias, query_seq_lengths=ql,
                                        key_value_seq_lengths=kl, is_causal=True,
                                        implementation=impl)
            return jnp.sum(out * w), out
        return per_example

    in_axes = (0, 0, None, 0, 0, 0)

    def batched(q, k, bias, ql, kl, w):
        vals, outs = jax.vmap(loss("cpu"), in_axes)(q, k, bias, ql, kl, w)
        return jnp.sum(vals), outs

    (_, out), grads = jax.jit(jax.value_and_grad(batched, (0, 1, 2), has_aux=True))(
        *(jnp.asarray(x, jnp.float32) if x.dtype != np.int32 else jnp.asarray(x)
          for x in (q, k, bias, q_lens, kv_lens, w)))
    ref = reference_jit(jax.value_and_grad(loss("xla"), (0, 1, 2), has_aux=True))
    exp = [ref(*(jnp.asarray(x[i]) for x in (q, k)), jnp.asarray(bias),
               *(jnp.asarray(x[i]) for x in (q_lens, kv_lens, w))) for i in range(n)]
    assert_close("out", out, np.stack([e[0][1] for e in exp]), TOL)
    assert_close("dq", grads[0], np.stack([e[1][0] for e in exp]), TOL)
    assert_close("dk", grads[1], np.stack([e[1][1] for e in exp]), TOL)
    assert_close("dbias", grads[2], np.sum([e[1][2] for e in exp], axis=0), TOL)
    padded = np.arange(LQ)[None, None, :] >= q_lens[:, :, None]  # [n, B, LQ]
    assert np.all(np.asarray(out)[padded] == 0)


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_backward_reads_a_float32_out(dtype):
    # D_i = dout_i . out_i cancels against sum_j P_ij dP_ij for a sharp softmax: the backward
    # must see the forward's float32 output, not its rounding to q's dtype.
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 40, 2, 16)), dtype) for _ in range(3))

    def loss(q, k, v):
        return flash_dmattn(q, k, v, implementation="cpu").astype(jnp.float32).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    by_name = {eqn.primitive.name: eqn for eqn in _equations(jaxpr)}
    forward, backward = by_name["dmattn_fwd"], by_name["dmattn_bwd"]
    assert forward.outvars[0].aval.dtype == jnp.float32
    assert backward.invars[3].aval.dtype == jnp.float32  # q, k, v, out, ...
    assert backward.outvars[0].aval.dtype == jnp.dtype(dtype)  # dq in q's dtype
    # ... and the output the caller sees is in q's dtype, as without differentiation.
    primal, _ = jax.vjp(lambda q: flash_dmattn(q, k, v, implementation="cpu"), q)
    plain = flash_dmattn(q, k, v, implementation="cpu")
    assert primal.dtype == plain.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(primal, np.float32), np.asarray(plain, np.float32))
