"""implementation="cpu" on 8 host devices: sharded jit over batch and heads (no all-gather,
results equal to the unsharded ones, dbias/dk/dv psum-med where their input was replicated),
shard_map and pmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, reference_jit, round_to
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dmattn import flash_dmattn
from jax_dmattn.dynamic import dynamic_attention

B, LQ, LK, H, D = 4, 32, 48, 8, 16
TOL = 1e-5


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "conftest must set --xla_force_host_platform_device_count=8"
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def _inputs(seed, hk, mask_shape, bias_shape):
    rng = np.random.default_rng(seed)
    out = dict(q=rng.standard_normal((B, LQ, H, D)), k=rng.standard_normal((B, LK, hk, D)),
               v=rng.standard_normal((B, LK, hk, D)), bias=rng.standard_normal(bias_shape),
               w=rng.standard_normal((B, LQ, H, D)), wl=0.1 * rng.standard_normal((B, H, LQ)))
    out = {n: np.asarray(round_to(x, "float32"), np.float32) for n, x in out.items()}
    mask = rng.random(mask_shape) < 0.75
    mask[..., 0] = True
    out["mask"] = mask
    return out


def _attention(q, k, v, mask, bias):
    return flash_dmattn(q, k, v, mask, bias, return_lse=True, implementation="cpu")


def _loss(q, k, v, bias, mask, w, wl):
    out, lse = _attention(q, k, v, mask, bias)
    return jnp.sum(out * w) + jnp.sum(lse * wl)


_grad = jax.grad(_loss, argnums=(0, 1, 2, 3))

HEADS = P("data", None, "model", None)  # q (and k/v where Hk divides) over batch and heads
BATCH = P("data", None, None, None)

# (id, q spec, Hk, mask shape, mask spec, bias shape, bias spec, gradients that need a psum)
LAYOUTS = [
    ("gqa4-replicated-mask-bias", HEADS, 4, (1, 1, LQ, LK), P(), (1, H, 1, LK), P(), ["dbias"]),
    ("mha-replicated-mask-bias", HEADS, 8, (1, 1, LQ, LK), P(), (1, H, 1, LK), P(), ["dbias"]),
    ("mqa-kv-replicated", HEADS, 1, (1, 1, LQ, LK), P(), (B, H, LQ, LK), P("data", "model"),
     ["dk", "dv"]),
    ("gqa4-sharded-bias", HEADS, 4, (B, 1, LQ, LK), P("data"), (B, H, LQ, LK),
     P("data", "model"), []),
    ("mha-bias-over-heads", HEADS, 8, (1, H, 1, LK), P(None, "model"), (B, 1, 1, LK), P("data"),
     ["dbias"]),
    ("mqa-batch-only", BATCH, 1, (1, 1, LQ, LK), P(), (B, H, LQ, LK), P("data"), []),
    ("gqa2-batch-only", BATCH, 2, (B, 2, LQ, LK), P("data"), (1, 1, 1, LK), P(), ["dbias"]),
]


def _shard(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay[0] for lay in LAYOUTS])
def test_sharded_jit(mesh, layout):
    _, q_spec, hk, mask_shape, mask_spec, bias_shape, bias_spec, psummed = layout
    x = _inputs(hk, hk, mask_shape, bias_shape)
    kv_spec = q_spec if hk > 1 else BATCH
    specs = dict(q=q_spec, k=kv_spec, v=kv_spec, mask=mask_spec, bias=bias_spec, w=q_spec,
                 wl=P("data", q_spec[2], None))
    sharded = {n: _shard(mesh, x[n], specs[n]) for n in x}
    order = ("q", "k", "v", "mask", "bias")
    g_order = ("q", "k", "v", "bias", "mask", "w", "wl")

    fwd = jax.jit(_attention)
    fwd_text = fwd.lower(*(sharded[n] for n in order)).compile().as_text()
    assert "all-gather" not in fwd_text
    assert "custom-call" in fwd_text or "custom_call" in fwd_text
    out, lse = fwd(*(sharded[n] for n in order))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, q_spec), 4), out.sharding
    ref_out, ref_lse = jax.jit(_attention)(*(jnp.asarray(x[n]) for n in order))
    assert_close("out", out, ref_out, TOL)
    assert_close("lse", lse, ref_lse, TOL)

    grad = jax.jit(_grad)
    grad_text = grad.lower(*(sharded[n] for n in g_order)).compile().as_text()
    assert "all-gather" not in grad_text
    assert ("all-reduce" in grad_text) == bool(psummed), (
        f"expected an all-reduce exactly when {psummed or 'no gradient'} needs a psum")
    grads = grad(*(sharded[n] for n in g_order))
    ref_grads = jax.jit(_grad)(*(jnp.asarray(x[n]) for n in g_order))
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        assert g.shape == r.shape, name
        assert_close(name, g, r, TOL)


# q's heads over mesh axes whose size does not divide the kv heads: the 4-way "model" axis with
# Hk = 2, and both axes (8-way) with Hk = 4. Shardy used to give k / v's heads part of an axis,
# which custom partitioning cannot take (IndivisibleError under grad); the call now runs with
# the heads replicated inside it.
@pytest.mark.parametrize("q_spec,hk", [(HEADS, 2), (P(None, None, ("data", "model"), None), 4)],
                         ids=["model-axis-hk2", "both-axes-hk4"])
def test_heads_sharded_past_the_kv_heads(mesh, q_spec, hk):
    x = _inputs(5, hk, (1, 1, LQ, LK), (1, H, 1, LK))
    specs = dict(q=q_spec, k=BATCH, v=BATCH, mask=P(), bias=P(), w=q_spec,
                 wl=P(q_spec[0], q_spec[2], None))
    sharded = {n: _shard(mesh, x[n], specs[n]) for n in x}
    order = ("q", "k", "v", "mask", "bias")
    g_order = ("q", "k", "v", "bias", "mask", "w", "wl")
    out, lse = jax.jit(_attention)(*(sharded[n] for n in order))
    ref_out, ref_lse = jax.jit(_attention)(*(jnp.asarray(x[n]) for n in order))
    assert_close("out", out, ref_out, TOL)
    assert_close("lse", lse, ref_lse, TOL)
    grads = jax.jit(_grad)(*(sharded[n] for n in g_order))
    ref_grads = jax.jit(_grad)(*(jnp.asarray(x[n]) for n in g_order))
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        assert_close(name, g, r, TOL)


def test_dynamic_attention_sharded_over_batch(mesh):
    """dynamic_attention's gradients under jit with batch-sharded inputs: equal to the unsharded
    ones, and no floating array is gathered (the key gathers' gradient sum stays per shard; only
    small int32 key-list arrays are)."""
    rng = np.random.default_rng(5)
    length = 160  # > 64 compact keys per block of 16 rows: the gathers run
    q, w = (rng.standard_normal((B, length, H, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, length, 2, D)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal((B, 2, 1, length)).astype(np.float32)

    def loss(q, k, v, bias):
        out = dynamic_attention(q, k, v, bias, 8, query_block=16, implementation="cpu")
        return jnp.sum(out * w)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    sharded = [_shard(mesh, x, P("data")) for x in (q, k, v, bias)]
    text = grad.lower(*sharded).compile().as_text()
    assert "dmattn_sum_listed_keys" in text
    gathers = [line for line in text.splitlines() if " all-gather(" in line]
    assert all(" s32[" in line for line in gathers), gathers
    for g, r in zip(grad(*sharded), grad(q, k, v, bias), strict=True):
        assert g.sharding.spec[0] == "data"
        assert_close("grad", g, r, TOL)


def _reference_loss(q, k, v, bias, mask, w, wl):
    out, lse = flash_dmattn(q, k, v, mask, bias, return_lse=True, implementation="xla")
    return jnp.sum(out * w) + jnp.sum(lse * wl), (out, lse)


_reference_fn = reference_jit(jax.value_and_grad(_reference_loss, (0, 1, 2, 3), has_aux=True))


def _f64_reference(x):
    """out, lse and gradients in float64 through implementation="xla"."""
    args = [jnp.asarray(x[n], jnp.float64) if n != "mask" else jnp.asarray(x[n])
            for n in ("q", "k", "v", "bias", "mask", "w", "wl")]
    (_, (out, lse)), grads = _reference_fn(*args)
    return out, lse, grads


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("heads_too", [False, True], ids=["batch", "batch+heads"])
def test_shard_map(mesh, heads_too, check_vma):
    """shard_map with the call inside: batch over "data" (and heads over "model"), forward and
    grad; with shard_map's default check_vma=True and without."""
    x = _inputs(7, 4, (1, 1, LQ, LK), (1, H, 1, LK))
    q_spec = P("data", None, "model", None) if heads_too else P("data")
    lse_spec = P("data", "model") if heads_too else P("data")
    bias_spec = P(None, "model") if heads_too else P()

    def local(q, k, v, mask, bias):
        return _attention(q, k, v, mask, bias)

    f = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, q_spec, q_spec, P(), bias_spec),
                      out_specs=(q_spec, lse_spec), check_vma=check_vma)

    def loss(q, k, v, bias, mask, w, wl):
        out, lse = f(q, k, v, mask, bias)
        return jnp.sum(out * w) + jnp.sum(lse * wl), (out, lse)

    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "bias", "mask", "w", "wl")]
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(*args)
    ref_out, ref_lse, ref_grads = _f64_reference(x)
    assert_close("out", out, ref_out, TOL)
    assert_close("lse", lse, ref_lse, TOL)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        assert_close(name, g, r, TOL)


def test_pmap(mesh):
    """pmap over a leading axis of 8, mask and bias broadcast (in_axes None); forward and a
    per-device gradient."""
    n = 8
    rng = np.random.default_rng(11)
    shapes = dict(q=(n, 1, 20, 4, 16), k=(n, 1, 24, 2, 16), v=(n, 1, 24, 2, 16),
                  bias=(1, 4, 1, 24), w=(n, 1, 20, 4, 16), wl=(n, 1, 4, 20))
    x = {k: np.asarray(round_to(rng.standard_normal(s), "float32"), np.float32)
         for k, s in shapes.items()}
    x["wl"] *= 0.1
    x["mask"] = (rng.random((1, 1, 20, 24)) < 0.75) | (np.arange(24) == 0)

    def per_device(q, k, v, bias, mask, w, wl):
        return _grad(q, k, v, bias, mask, w, wl), _attention(q, k, v, mask, bias)

    names = ("q", "k", "v", "bias", "mask", "w", "wl")
    in_axes = tuple(None if k in ("bias", "mask") else 0 for k in names)
    grads, (out, lse) = jax.pmap(per_device, in_axes=in_axes)(*(x[k] for k in names))
    for i in range(n):
        one = {k: x[k][i] if in_axes[j] == 0 else x[k] for j, k in enumerate(names)}
        ref_out, ref_lse, ref_grads = _f64_reference(one)
        assert_close(f"out[{i}]", out[i], ref_out, TOL)
        assert_close(f"lse[{i}]", lse[i], ref_lse, TOL)
        for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
            assert_close(f"{name}[{i}]", g[i], r, TOL)


# The compound (kv head, group) factor needs no sub-axis where every order of mesh axes that can
# shard q's heads fills the kv heads exactly before it moves on to the group (2 x 2 x 2 with
# Hk = 4: 2, then 2 x 2 = 4 = Hk, then the group). Such meshes keep the compound factor, so
# k / v replicated over the heads follow q's head sharding and the gradients gather nothing (the
# check on every product of axis sizes, 8 not dividing Hk = 4 here, gave the heads factors of
# their own, and dk / dv were all-gathered).
@pytest.mark.parametrize("hk", [2, 4])
def test_heads_follow_where_every_axis_order_fits(hk):
    mesh3 = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "model", "extra"))
    x = _inputs(7, hk, (1, 1, LQ, LK), (1, H, 1, LK))
    specs = dict(q=HEADS, k=BATCH, v=BATCH, mask=P(), bias=P(), w=HEADS,
                 wl=P("data", "model", None))
    sharded = {n: _shard(mesh3, x[n], specs[n]) for n in x}
    g_order = ("q", "k", "v", "bias", "mask", "w", "wl")
    grad = jax.jit(_grad)
    grad_text = grad.lower(*(sharded[n] for n in g_order)).compile().as_text()
    assert "all-gather" not in grad_text
    grads = grad(*(sharded[n] for n in g_order))
    ref_grads = jax.jit(_grad)(*(jnp.asarray(x[n]) for n in g_order))
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        assert_close(name, g, r, TOL)
