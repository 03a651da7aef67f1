"""Context parallelism on 8 host devices, implementation="cpu", float32 against the float64 xla
reference: ring_attention inside shard_map (contiguous and zig-zag layouts) and sequence-sharded
jit of flash_dmattn (the sharding rule's ring), for out, lse and every gradient; compiled HLO
has collective-permutes and no all-gather; calls the ring does not support still gather."""

from __future__ import annotations

import functools
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, reference_jit, round_to
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dmattn import dot_product_attention, flash_dmattn
from jax_dmattn.context_parallel import from_zigzag, ring_attention, to_zigzag, zigzag_order

B, L, H, D = 2, 64, 4, 16
TOL = 1e-5
GRADS = ("dq", "dk", "dv", "dbias")


class Topology(NamedTuple):
    """A mesh and which of its axes shard batch, sequence and heads (None: not sharded)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    batch: str | None
    seq: str | tuple[str, ...]
    heads: str | None


TOPOLOGIES = {
    "seq2": Topology((2,), ("s",), None, "s", None),
    "seq4": Topology((4,), ("s",), None, "s", None),
    "seq8": Topology((8,), ("s",), None, "s", None),
    "batch2xseq4": Topology((2, 4), ("b", "s"), "b", "s", None),
    "heads2xseq4": Topology((2, 4), ("h", "s"), None, "s", "h"),
    "seq2x4": Topology((2, 4), ("a", "s"), None, ("a", "s"), None),  # one ring over both axes
}


@functools.cache
def _mesh(name: str) -> Mesh:
    assert jax.device_count() == 8, "conftest must set --xla_force_host_platform_device_count=8"
    topo = TOPOLOGIES[name]
    count = int(np.prod(topo.shape))
    return Mesh(np.array(jax.devices()[:count]).reshape(topo.shape), topo.names)


class Case(NamedTuple):
    """One call: mask/bias shapes are resolved from "B", "H", "Hk", "L" or "1" per dim."""

    topology: str
    hk: int = 2
    mask: tuple[str, ...] | None = None
    bias: tuple[str, ...] | None = None
    causal: bool = False
    layout: str = "contiguous"
    softcap: float | None = None
    implementation: str = "cpu"
    check_vma: bool = True
    lk: int = L  # key length (sharded-jit fallback cases only)

    def resolve(self, pattern) -> tuple[int, ...]:
        sizes = {"B": B, "H": H, "Hk": self.hk, "1": 1, "L": L, "Lk": self.lk}
        return tuple(sizes[p] for p in pattern)

    def id(self) -> str:
        parts = [self.topology, f"hk{self.hk}"]
        if self.mask:
            parts.append("m" + ".".join(self.mask))
        if self.bias:
            parts.append("b" + ".".join(self.bias))
        for flag, label in ((self.causal, "causal"), (self.layout == "zigzag", "zigzag"),
                            (self.softcap, f"cap{self.softcap}"),
                            (self.implementation != "cpu", self.implementation),
                            (not self.check_vma, "no_check_vma"), (self.lk != L, f"lk{self.lk}")):
            if flag:
                parts.append(label)
        return "-".join(parts)


def _inputs(case: Case) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(case.id().encode()))
    shapes = dict(q=(B, L, H, D), k=(B, case.lk, case.hk, D), v=(B, case.lk, case.hk, D),
                  w=(B, L, H, D))
    x = {n: np.asarray(round_to(rng.standard_normal(s), "float32"), np.float32)
         for n, s in shapes.items()}
    x["wl"] = np.asarray(round_to(0.1 * rng.standard_normal((B, H, L)), "float32"), np.float32)
    x["bias"] = (None if case.bias is None else np.asarray(
        round_to(rng.standard_normal(case.resolve(case.bias)), "float32"), np.float32))
    mask = None
    if case.mask is not None:
        mask = rng.random(case.resolve(case.mask)) < 0.7
        if mask.shape[-2] == L:
            # rows with no visible key at all, and rows whose keys all lie in the last chunk
            mask[..., 3, :] = False
            mask[..., L // 2 + 1, : -L // 8] = False
    x["mask"] = mask
    return x


def _loss(attention, q, k, v, bias, mask, w, wl):
    out, lse = attention(q, k, v, mask, bias)
    # lse is -inf on rows with no visible key; those rows take no lse cotangent.
    return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * wl), (out, lse)


def _value_and_grad(attention, has_bias: bool):
    return jax.value_and_grad(functools.partial(_loss, attention), (0, 1, 2, 3) if has_bias
                              else (0, 1, 2), has_aux=True)


@functools.cache
def _reference_fn(causal: bool, softcap: float | None, has_bias: bool):
    def attention(q, k, v, mask, bias):
        return flash_dmattn(q, k, v, mask, bias, is_causal=causal, softcap=softcap,
                            return_lse=True, implementation="xla")

    return reference_jit(_value_and_grad(attention, has_bias))


def _reference(case: Case, x: dict) -> dict[str, np.ndarray]:
    """out, lse and gradients of the unsharded call, float64 through implementation="xla"."""
    f64 = {n: None if x[n] is None else jnp.asarray(x[n], jnp.float64)
           for n in ("q", "k", "v", "bias", "w", "wl")}
    fn = _reference_fn(case.causal, case.softcap, case.bias is not None)
    (_, (out, lse)), grads = fn(f64["q"], f64["k"], f64["v"], f64["bias"], x["mask"], f64["w"],
                                f64["wl"])
    return dict(out=out, lse=lse, **dict(zip(GRADS, grads, strict=False)))


def _check(got: dict, ref: dict) -> None:
    """Every quantity within the float32 tolerance, -inf exactly where the reference has it, and
    exact zeros (out, dq) on rows with no visible key."""
    for name in ref:
        assert got[name].shape == ref[name].shape, (name, got[name].shape, ref[name].shape)
        assert_close(name, got[name], ref[name], TOL)
    empty = np.swapaxes(~np.isfinite(np.asarray(ref["lse"])), 1, 2)  # [B, L, H]
    for name in ("out", "dq"):
        assert np.all(np.asarray(got[name])[empty] == 0), f"{name} of an empty row is not 0"


def _results(out, lse, grads) -> dict:
    return dict(out=out, lse=lse, **dict(zip(GRADS, grads, strict=False)))


# ---- specs ----------------------------------------------------------------------------------


def _specs(case: Case, x: dict, seq_of_kv: bool = True) -> dict[str, P]:
    """Sequence over the topology's seq axis; batch and heads where it shards them; masks and
    biases keep their query rows with q's and all key columns."""
    topo = TOPOLOGIES[case.topology]
    kv_heads = topo.heads if case.hk % 2 == 0 else None
    seq = topo.seq
    specs = dict(q=P(topo.batch, seq, topo.heads), k=P(topo.batch, seq if seq_of_kv else None,
                                                        kv_heads),
                 w=P(topo.batch, seq, topo.heads), wl=P(topo.batch, topo.heads, seq))
    specs["v"] = specs["k"]
    for name in ("mask", "bias"):
        if x[name] is not None:
            b, h, rows, _ = x[name].shape
            head_axis = {H: topo.heads, case.hk: kv_heads}.get(h) if h > 1 else None
            specs[name] = P(topo.batch if b == B else None, head_axis, seq if rows == L else None)
    return specs


# ---- ring_attention inside shard_map --------------------------------------------------------

PER_KEY = ("B", "Hk", "1", "L")
SHARD_MAP_CASES = [
    Case("seq2", hk=4),
    Case("seq2", mask=("B", "1", "L", "L"), bias=PER_KEY, causal=True, layout="zigzag"),
    Case("seq4", bias=PER_KEY, causal=True),
    Case("seq4", hk=1, mask=("1", "1", "L", "L"), bias=("B", "H", "L", "L"), causal=True,
         layout="zigzag"),
    Case("seq4", mask=("B", "Hk", "L", "L"), softcap=5.0),
    Case("seq4", mask=("B", "1", "L", "Lk"), bias=("B", "Hk", "1", "Lk"), lk=2 * L),
    Case("seq4", mask=("1", "1", "L", "L"), bias=PER_KEY, causal=True, layout="zigzag",
         check_vma=False),
    Case("seq4", mask=("B", "1", "L", "L"), bias=PER_KEY, causal=True, layout="zigzag",
         implementation="xla"),
    Case("seq8", mask=("B", "1", "L", "L"), bias=PER_KEY, causal=True),
    Case("seq8", mask=("B", "Hk", "L", "L"), bias=("1", "1", "L", "1"), causal=True,
         layout="zigzag"),
    Case("batch2xseq4", mask=("B", "1", "L", "L"), bias=PER_KEY, causal=True, layout="zigzag"),
    Case("heads2xseq4", mask=("1", "H", "L", "L"), bias=("B", "H", "1", "L"), causal=True),
    Case("heads2xseq4", hk=1, bias=PER_KEY, causal=True, layout="zigzag"),
    Case("seq2x4", mask=("B", "1", "L", "L"), causal=True, layout="zigzag"),
]


@pytest.mark.parametrize("case", SHARD_MAP_CASES, ids=[c.id() for c in SHARD_MAP_CASES])
def test_ring_attention_shard_map(case: Case):
    """shard_map + ring_attention equals the unsharded call (out, lse, dq, dk, dv, dbias); the
    contiguous layout's HLO has collective-permutes and no all-gather."""
    x = _inputs(case)
    mesh = _mesh(case.topology)
    topo = TOPOLOGIES[case.topology]
    n = int(np.prod([mesh.shape[a] for a in np.atleast_1d(topo.seq)]))
    specs = _specs(case, x)
    zigzag = case.layout == "zigzag"

    def local(q, k, v, mask, bias):
        return ring_attention(q, k, v, mask, bias, axis_name=topo.seq, is_causal=case.causal,
                              softcap=case.softcap, layout=case.layout, return_lse=True,
                              implementation=case.implementation)

    sharded = jax.shard_map(
        local, mesh=mesh, check_vma=case.check_vma,
        in_specs=tuple(specs.get(name) for name in ("q", "k", "v", "mask", "bias")),
        out_specs=(specs["q"], specs["wl"]))

    def attention(q, k, v, mask, bias):
        if zigzag:  # sequence axes into zig-zag order: rows of everything, key columns too
            q, k, v = (to_zigzag(t, n, axis=1) for t in (q, k, v))
            mask, bias = (t if t is None else _zigzag_rows_columns(t, n) for t in (mask, bias))
        out, lse = sharded(q, k, v, mask, bias)
        if zigzag:
            out, lse = from_zigzag(out, n, axis=1), from_zigzag(lse, n, axis=2)
        return out, lse

    args = [x[name] for name in ("q", "k", "v", "bias", "mask", "w", "wl")]
    fn = jax.jit(_value_and_grad(attention, case.bias is not None))
    compiled = fn.lower(*args).compile()
    (_, (out, lse)), grads = compiled(*args)
    _check(_results(out, lse, grads), _reference(case, x))
    text = compiled.as_text()
    assert "collective-permute" in text
    if not zigzag:  # (the zig-zag permutation of the global arrays may move data as it likes)
        assert "all-gather" not in text


def _zigzag_rows_columns(x: jax.Array, n: int) -> jax.Array:
    for axis in (2, 3):
        if x.shape[axis] == L:
            x = to_zigzag(x, n, axis=axis)
    return x


# ---- sharded jit of flash_dmattn: the sharding rule's ring ------------------------------------

JIT_CASES = [
    Case("seq8", mask=("B", "1", "L", "L"), bias=PER_KEY, causal=True),
    Case("seq2", hk=1, causal=True),
    Case("seq4", mask=("1", "1", "L", "L"), bias=("B", "H", "L", "L"), softcap=5.0),
    Case("seq4", hk=4, mask=("B", "1", "L", "Lk"), bias=("1", "1", "1", "Lk"), lk=2 * L),
    Case("batch2xseq4", hk=4, mask=("B", "1", "L", "L"), bias=("B", "H", "L", "L"), causal=True),
    Case("heads2xseq4", mask=("1", "Hk", "L", "L"), bias=PER_KEY, causal=True),
    Case("heads2xseq4", hk=1, bias=("1", "H", "1", "L")),
    Case("seq2x4", mask=("B", "1", "L", "L"), bias=PER_KEY, causal=True),
]


def _jit_attention(case: Case, dpa: dict | None = None):
    def attention(q, k, v, mask, bias):
        if dpa is not None:
            out, res = dot_product_attention(q, k, v, bias, mask, is_causal=case.causal,
                                             implementation="cpu", return_residual=True, **dpa)
            return out, jnp.swapaxes(res, 1, 2)
        return flash_dmattn(q, k, v, mask, bias, is_causal=case.causal, softcap=case.softcap,
                            return_lse=True, implementation="cpu")

    return attention


def _run_sharded_jit(case: Case, x: dict, attention, seq_of_kv: bool = True):
    mesh = _mesh(case.topology)
    specs = _specs(case, x, seq_of_kv)
    names = ("q", "k", "v", "bias", "mask", "w", "wl")
    args = [None if x[n] is None else jax.device_put(x[n], NamedSharding(mesh, specs[n]))
            for n in names]
    compiled = jax.jit(_value_and_grad(attention, case.bias is not None)).lower(*args).compile()
    (_, (out, lse)), grads = compiled(*args)
    return compiled.as_text(), specs, _results(out, lse, grads)


@pytest.mark.parametrize("case", JIT_CASES, ids=[c.id() for c in JIT_CASES])
def test_sharded_jit_ring(case: Case):
    """jit of flash_dmattn with q/k/v sharded over the sequence runs the ring: collective-permutes,
    no all-gather, out/lse/dq/dk/dv keep the sequence sharding, results equal the unsharded
    ones."""
    x = _inputs(case)
    text, specs, got = _run_sharded_jit(case, x, _jit_attention(case))
    assert "all-gather" not in text
    assert "collective-permute" in text
    mesh = _mesh(case.topology)
    for name, spec in (("out", "q"), ("lse", "wl"), ("dq", "q"), ("dk", "k"), ("dv", "v")):
        assert got[name].sharding.is_equivalent_to(NamedSharding(mesh, specs[spec]), 4), (
            name, got[name].sharding)
    _check(got, _reference(case, x))


FALLBACK_CASES = [
    ("window", Case("seq4", mask=("B", "1", "L", "L"), bias=PER_KEY), dict(local_window_size=8)),
    ("seq_lengths", Case("seq4", bias=PER_KEY),
     dict(query_seq_lengths=np.array([L, 40], np.int32),
          key_value_seq_lengths=np.array([50, L], np.int32))),
    ("causal_lq_ne_lk", Case("seq4", mask=("1", "1", "L", "Lk"), causal=True, lk=2 * L), None),
]


@pytest.mark.parametrize("label,case,dpa", FALLBACK_CASES, ids=[c[0] for c in FALLBACK_CASES])
def test_sharded_jit_gathers_what_the_ring_does_not_support(label, case: Case, dpa):
    """A window, sequence lengths or causal Lq != Lk with a sharded sequence: gathered as before
    (all-gather, no collective-permute), with correct results."""
    x = _inputs(case)
    # k/v sequence replicated where its length differs from q's (it cannot shard alike)
    text, _, got = _run_sharded_jit(case, x, _jit_attention(case, dpa), seq_of_kv=case.lk == L)
    assert "all-gather" in text
    assert "collective-permute" not in text
    if dpa is None:
        ref = _reference(case, x)
    else:
        ref = _dpa_reference(case, x, dpa)
    _check(got, ref)


def _dpa_reference(case: Case, x: dict, dpa: dict) -> dict:
    def attention(q, k, v, mask, bias):
        out, res = dot_product_attention(q, k, v, bias, mask, is_causal=case.causal,
                                         implementation="xla", return_residual=True, **dpa)
        return out, jnp.swapaxes(res, 1, 2)

    names = ("q", "k", "v", "bias", "mask", "w", "wl")
    args = [x[n] if n == "mask" or x[n] is None else jnp.asarray(x[n], jnp.float64)
            for n in names]
    (_, (out, lse)), grads = reference_jit(_value_and_grad(attention, x["bias"] is not None))(
        *args)
    return _results(out, lse, grads)


# ---- zig-zag helpers and argument checks -----------------------------------------------------


def test_zigzag_order_round_trip():
    """Device i of n gets chunks i and 2n-1-i; from_zigzag undoes to_zigzag on any axis."""
    assert zigzag_order(2).tolist() == [0, 3, 1, 2]
    assert zigzag_order(4).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    n = 4
    x = np.arange(2 * 3 * 16).reshape(2, 16, 3)
    z = np.asarray(to_zigzag(x, n, axis=1))
    shards = z.reshape(2, n, 4, 3)  # 4 positions per device: two chunks of 2
    for i in range(n):
        expected = np.concatenate([x[:, 2 * i:2 * i + 2], x[:, 2 * (2 * n - 1 - i):][:, :2]], 1)
        np.testing.assert_array_equal(shards[:, i], expected)
    np.testing.assert_array_equal(np.asarray(from_zigzag(z, n, axis=1)), x)
    last = np.swapaxes(x, 1, 2)  # the sequence on a negative axis
    np.testing.assert_array_equal(np.asarray(from_zigzag(to_zigzag(last, 2, -1), 2, -1)), last)
    with pytest.raises(ValueError, match="does not split into 8 chunks"):
        to_zigzag(np.zeros((1, 12)), 4, axis=1)


def _trace_ring(q_len: int, k_len: int, mask_cols: int | None = None, **kwargs):
    mesh = _mesh("seq4")
    mask = None if mask_cols is None else jnp.ones((1, 1, 4 * q_len, mask_cols), bool)

    def local(q, k, v, mask):
        return ring_attention(q, k, v, mask, axis_name="s", implementation="cpu", **kwargs)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "s"),) * 3 + (P(None, None, "s"),),
                       out_specs=P(None, "s"))
    q = jnp.zeros((1, 4 * q_len, 2, 16), jnp.float32)
    kv = jnp.zeros((1, 4 * k_len, 2, 16), jnp.float32)
    return jax.eval_shape(fn, q, kv, kv, mask)


def test_ring_attention_rejects_bad_arguments():
    """Errors at trace time name the argument; a well-formed call traces to the local shape."""
    assert _trace_ring(8, 8, mask_cols=32, is_causal=True).shape == (1, 32, 2, 16)
    with pytest.raises(ValueError, match="layout must be one of"):
        _trace_ring(8, 8, layout="striped")
    with pytest.raises(ValueError, match="is_causal needs Lq == Lk"):
        _trace_ring(8, 16, is_causal=True)
    with pytest.raises(ValueError, match="zigzag' needs an even"):
        _trace_ring(5, 5, is_causal=True, layout="zigzag")
    with pytest.raises(ValueError, match="mask shape"):  # local key columns instead of all
        _trace_ring(8, 8, mask_cols=8)
