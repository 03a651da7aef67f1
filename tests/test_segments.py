"""Sequence-packing segment ids (``q_segment_ids`` / ``kv_segment_ids``, issue 24): query ``i``
sees key ``j`` only where their ids are equal, and-ed with every other rule.

The oracle is independent of the library's segment code: the float64 ``xla`` implementation run
on a dense ``[B, H, Lq, Lk]`` mask that holds the segment rule (and the case's own mask). The
CPU and the CUDA kernels read the ids (the GPU tests are marked ``gpu``).
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    FULL,
    Case,
    assert_close,
    cases_ids,
    check_case,
    expand_operand,
    make_inputs,
    reference,
    reference_jit,
    run_case,
    tolerance,
)
from form_checks import require_cuda_kernel
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dmattn
from jax_dmattn import _ffi, dot_product_attention, flash_dmattn

# ---- the oracle: a dense mask holding the segment rule ----------------------------------------


def segment_mask(q_seg: np.ndarray, kv_seg: np.ndarray) -> np.ndarray:
    """bool ``[B|1, 1, Lq, Lk]``: True where the ids are equal."""
    return (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]


def dense_reference(case: Case, inputs: dict) -> dict:
    """out, lse and gradients of `case` from the float64 xla implementation without segment ids,
    on the equivalent dense mask (the case's mask, if any, and-ed in)."""
    full = case.resolve(FULL)
    mask = np.broadcast_to(segment_mask(inputs["q_seg"], inputs["kv_seg"]), full)
    if case.mask is not None:
        mask = mask & expand_operand(case, inputs["mask"], case.mask)
    dense = dataclasses.replace(case, segments=None, mask=FULL, mask_kind="random")
    dense_inputs = {n: x for n, x in inputs.items() if n not in ("q_seg", "kv_seg")}
    dense_inputs["mask"] = np.array(mask)
    return reference(dense, dense_inputs)


# ---- cases ------------------------------------------------------------------------------------

CASES = [
    Case(B=2, Lq=37, Lk=37, H=4, Hk=2, D=16, segments="packed"),
    Case(B=2, Lq=48, Lk=48, H=4, Hk=4, D=16, segments="packed", causal=True),
    Case(B=2, Lq=30, Lk=45, H=4, Hk=2, D=16, segments="packed", causal=True),
    Case(B=2, Lq=40, Lk=56, H=4, Hk=2, D=16, segments="packed", mask=("B", "1", "Lq", "Lk")),
    Case(B=2, Lq=40, Lk=40, H=4, Hk=2, D=16, segments="packed", bias=FULL),
    Case(B=2, Lq=33, Lk=50, H=4, Hk=2, D=32, segments="packed", bias=("1", "H", "1", "Lk"),
         mask=("1", "Hk", "Lq", "Lk"), causal=True),
    Case(B=3, Lq=29, Lk=29, H=4, Hk=1, D=16, segments="packed", bias=("B", "Hk", "Lq", "1")),
    Case(B=2, Lq=41, Lk=41, H=4, Hk=2, D=16, segments="packed", softcap=5.0, bias=FULL),
    Case(B=3, Lq=36, Lk=36, H=4, Hk=2, D=16, segments="shared", causal=True),
    Case(B=2, Lq=35, Lk=44, H=4, Hk=2, D=16, segments="orphans", bias=("B", "H", "Lq", "Lk")),
    Case(B=3, Lq=50, Lk=70, H=4, Hk=2, D=16, segments="packed", front_end="dpa",
         q_lens=(50, 17, 0), kv_lens=(70, 1, 33), bias=("B", "1", "Lq", "Lk")),
    Case(B=2, Lq=48, Lk=48, H=4, Hk=2, D=16, segments="packed", front_end="dpa", causal=True,
         window=(5, 3)),
    Case(B=2, Lq=64, Lk=64, H=4, Hk=2, D=32, dtype="bfloat16", segments="packed", causal=True,
         bias=("1", "H", "Lq", "Lk")),
]


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_xla(case):
    inputs = make_inputs(case)
    check_case(case, "xla", inputs, dense_reference(case, inputs))


@pytest.mark.parametrize("case", CASES, ids=cases_ids(CASES))
def test_cpu(case):
    inputs = make_inputs(case)
    check_case(case, "cpu", inputs, dense_reference(case, inputs))


@pytest.mark.parametrize("case", CASES[:2] + CASES[9:11], ids=cases_ids(CASES[:2] + CASES[9:11]))
def test_default_implementation(case):
    """implementation=None: the primitives, their custom_vjp and lowering to the platform's
    kernels."""
    inputs = make_inputs(case)
    check_case(case, None, inputs, dense_reference(case, inputs))


def test_cases_have_what_they_claim():
    for case in CASES:
        x = make_inputs(case)
        q_seg, kv_seg = x["q_seg"], x["kv_seg"]
        assert q_seg.dtype == kv_seg.dtype == np.int32
        assert q_seg.shape == ((1 if case.segments == "shared" else case.B), case.Lq)
        assert kv_seg.shape[1] == case.Lk
        assert len(np.unique(q_seg)) >= 2, "more than one document"
        lengths = np.diff(np.flatnonzero(np.diff(kv_seg[0], prepend=-99, append=-98)))
        assert lengths.min() == 1, "a document of length 1"
        if case.segments == "orphans":
            assert (~np.isfinite(dense_reference(case, x)["lse"])).any(), case.id()


# ---- dtypes, shapes, front-end forms ----------------------------------------------------------

B, LQ, LK, H, HK, D = 2, 24, 32, 4, 2, 16


def _qkv(seed=0, dtype=np.float32, batch=(B,)):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*batch, LQ, H, D)).astype(dtype)
    k, v = (rng.standard_normal((*batch, LK, HK, D)).astype(dtype) for _ in range(2))
    return q, k, v


def _ids(seed=1, batch=(B,)):
    rng = np.random.default_rng(seed)
    n = int(np.prod(batch))
    q = np.stack([np.sort(rng.integers(0, 3, LQ)) for _ in range(n)]).reshape(*batch, LQ)
    kv = np.stack([np.sort(rng.integers(0, 3, LK)) for _ in range(n)]).reshape(*batch, LK)
    return q.astype(np.int32), kv.astype(np.int32)


def _dense(q, k, v, q_seg, kv_seg, **kw):
    """The float64 oracle for the small calls: the xla implementation on the dense mask."""
    mask = segment_mask(np.asarray(q_seg), np.asarray(kv_seg))
    return flash_dmattn(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), jnp.asarray(mask),
                        return_lse=True, implementation="xla", **kw)


IMPLS = ["xla", None, "cpu"]


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int64, np.uint32])
def test_integer_dtypes_are_cast(dtype):
    q, k, v = _qkv()
    qs, ks = _ids()
    ref = flash_dmattn(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, implementation="xla")
    got = flash_dmattn(q, k, v, q_segment_ids=qs.astype(dtype), kv_segment_ids=ks.astype(dtype),
                       implementation="xla")
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("implementation", IMPLS)
def test_one_side_broadcast_over_batch(implementation):
    """q ids [1, Lq] with kv ids [B, Lk] (and the other way round)."""
    q, k, v = _qkv()
    qs, ks = _ids()
    for q_ids, kv_ids in ((qs[:1], ks), (qs, ks[:1])):
        out, lse = flash_dmattn(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                return_lse=True, implementation=implementation)
        ref_out, ref_lse = _dense(q, k, v, np.broadcast_to(q_ids, (B, LQ)),
                                  np.broadcast_to(kv_ids, (B, LK)))
        assert_close("out", out, ref_out, 1e-5)
        assert_close("lse", lse, ref_lse, 1e-5)


def test_dot_product_attention_3d():
    """3-D inputs take ids ``[T]`` and ``[S]`` (or ``[1, T]``)."""
    q, k, v = _qkv()
    qs, ks = _ids()
    ref = dot_product_attention(q[:1], k[:1], v[:1], q_segment_ids=qs[:1], kv_segment_ids=ks[:1],
                                implementation="xla")
    for q_ids, kv_ids in ((qs[0], ks[0]), (qs[:1], ks[:1])):
        got = dot_product_attention(q[0], k[0], v[0], q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                    implementation="xla")
        np.testing.assert_array_equal(got, ref[0])


def test_no_key_of_its_segment_gives_zeros():
    q, k, v = _qkv()
    qs, ks = _ids()
    qs[0, :5] = 42  # no key has id 42
    for impl in ("xla", None):
        out, lse = flash_dmattn(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, return_lse=True,
                                implementation=impl)
        assert np.all(np.asarray(out)[0, :5] == 0)
        assert np.all(np.asarray(lse)[0, :, :5] == -np.inf)
        assert np.isfinite(np.asarray(lse)[0, :, 5:]).all() and np.isfinite(out).all()

        def loss(q, impl=impl):
            return jnp.sum(flash_dmattn(q, k, v, q_segment_ids=qs, kv_segment_ids=ks,
                                        implementation=impl) ** 2)

        dq = jax.grad(loss)(q)
        assert np.all(np.asarray(dq)[0, :5] == 0) and np.isfinite(dq).all()


# ---- transformations --------------------------------------------------------------------------

V = 3  # the vmapped dim


@pytest.mark.parametrize("implementation", IMPLS)
@pytest.mark.parametrize("mapped", ["both", "neither", "q_only", "kv_only"])
def test_vmap(implementation, mapped):
    """vmap over a leading dim: ids mapped, unmapped, or only one of the two mapped; forward and
    gradients against the per-slice float64 oracle."""
    q, k, v = _qkv(3, batch=(V, B))
    qs, ks = _ids(4, batch=(V, B))
    q_ax = 0 if mapped in ("both", "q_only") else None
    kv_ax = 0 if mapped in ("both", "kv_only") else None
    q_ids = qs if q_ax == 0 else qs[0]
    kv_ids = ks if kv_ax == 0 else ks[0]
    w = np.random.default_rng(5).standard_normal((V, B, LQ, H, D)).astype(np.float32)

    def loss(q, k, v, q_ids, kv_ids, w):
        out, lse = flash_dmattn(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                is_causal=True, return_lse=True, implementation=implementation)
        value = jnp.sum(out.astype(w.dtype) * w) + 0.1 * jnp.sum(jnp.where(
            jnp.isfinite(lse), lse, 0))
        return value, (out, lse)

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, (out, lse)), grads = jax.jit(jax.vmap(fn, in_axes=(0, 0, 0, q_ax, kv_ax, 0)))(
        q, k, v, q_ids, kv_ids, w)
    for i in range(V):
        qi = q_ids[i] if q_ax == 0 else q_ids
        ki = kv_ids[i] if kv_ax == 0 else kv_ids
        mask = jnp.asarray(segment_mask(qi, ki))

        def dense_loss(q, k, v, w, mask=mask):
            out, lse = flash_dmattn(q, k, v, mask, is_causal=True, return_lse=True,
                                    implementation="xla")
            value = jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
            return value, (out, lse)

        (_, (r_out, r_lse)), r_grads = reference_jit(
            jax.value_and_grad(dense_loss, argnums=(0, 1, 2), has_aux=True))(
            *(jnp.asarray(x[i], jnp.float64) for x in (q, k, v, w)))
        assert_close(f"out[{i}]", out[i], r_out, 1e-5)
        assert_close(f"lse[{i}]", lse[i], r_lse, 1e-5)
        for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads, strict=True):
            assert_close(f"{name}[{i}]", g[i], r, 1e-5)


# ---- errors -----------------------------------------------------------------------------------


def _call(**kw):
    q, k, v = _qkv()
    return flash_dmattn(q, k, v, **kw)


@pytest.mark.parametrize("front_end", ["flash", "dpa"])
def test_errors(front_end):
    q, k, v = _qkv()
    qs, ks = _ids()

    def call(q_ids, kv_ids):
        fn = flash_dmattn if front_end == "flash" else dot_product_attention
        return jax.jit(lambda q, k, v: fn(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                          implementation="xla"))(q, k, v)

    for q_ids, kv_ids, words in [
        (qs, None, ("q_segment_ids", "kv_segment_ids", "together")),
        (None, ks, ("q_segment_ids", "kv_segment_ids", "together")),
        (qs[:, :-1], ks, ("q_segment_ids", str((B, LQ - 1)), f"[{B}|1, {LQ}]")),
        (qs, ks[:, :-1], ("kv_segment_ids", str((B, LK - 1)), f"[{B}|1, {LK}]")),
        (qs[0], ks, ("q_segment_ids", f"[{B}|1, {LQ}]")),
        (qs, ks[None], ("kv_segment_ids", f"[{B}|1, {LK}]")),
        (np.zeros((3, LQ), np.int32), ks, ("q_segment_ids", "(3, 24)")),
        (qs.astype(np.float32), ks, ("q_segment_ids", "integer", "float32")),
        (qs, ks.astype(bool), ("kv_segment_ids", "integer", "bool")),
    ]:
        with pytest.raises(ValueError) as info:
            call(q_ids, kv_ids)
        for word in words:
            assert word in str(info.value), (word, str(info.value))


FAKE_BUILD = {"cuda": True, "cuda_head_dims": [16], "cuda_dtypes": "bf16,fp16",
              "cuda_archs": "90a", "xla_ffi_api": [0, 3]}


def test_cuda_lowering_reads_segment_ids(monkeypatch):
    """On the cuda platform a call with segment ids lowers to the CUDA kernels (no reference
    fallback, no warning), implementation="cuda" included: the forward and backward FFI calls
    get the ids after the lengths. Lowered for cuda on this machine with a fake CUDA build."""
    calls = []

    def fake_call(target, operands, results, num_batch, attrs, extra_workspaces=None):
        calls.append((target, [(x.shape, x.dtype) for x in operands], attrs))
        return [jnp.zeros(shape, dtype) for shape, dtype in results]

    monkeypatch.setattr(_ffi, "_call", fake_call)
    monkeypatch.setattr(_ffi, "build_info", lambda: FAKE_BUILD)
    monkeypatch.setattr(_ffi, "local_gpu_compute_capability", lambda: "9.0")
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
    qs, ks = _ids()
    i32 = jnp.dtype(jnp.int32)
    for fn in (flash_dmattn, dot_product_attention):
        for implementation in (None, "cuda"):
            calls.clear()

            def loss(q, k, v, fn=fn, implementation=implementation):
                return jnp.sum(fn(q, k, v, q_segment_ids=qs, kv_segment_ids=ks,
                                  implementation=implementation).astype(jnp.float32))

            with warnings.catch_warnings():
                warnings.simplefilter("error")
                jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
                    lowering_platforms=("cuda",))
            by_target = {target: (operands, attrs) for target, operands, attrs in calls}
            assert set(by_target) == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}, calls
            for operands, attrs in by_target.values():
                assert operands[-2:] == [((B, LQ), i32), ((B, LK), i32)], operands
                assert attrs["has_segments"] is True


def test_ffi_operands_and_attributes(monkeypatch):
    """The operands and attributes handed to the forward and backward FFI calls: segment ids
    int32 ``[*batch, Lq]`` / ``[*batch, Lk]`` after the lengths, ``has_segments`` set."""
    calls = []

    def fake_call(target, operands, results, num_batch, attrs, extra_workspaces=None):
        calls.append((target, [(x.shape, x.dtype) for x in operands], attrs))
        return [jnp.zeros(shape, dtype) for shape, dtype in results]

    real = _ffi.build_info()
    monkeypatch.setattr(_ffi, "_call", fake_call)
    monkeypatch.setattr(_ffi, "build_info", lambda: dict(real, segments=True))
    q, k, v = _qkv()
    qs, ks = _ids()
    lens = np.array([LQ, 5], np.int32)

    def loss(q, k, v):
        out = dot_product_attention(q, k, v, query_seq_lengths=lens, key_value_seq_lengths=lens,
                                    q_segment_ids=qs[:1], kv_segment_ids=ks,
                                    implementation="cpu")
        return jnp.sum(out)

    jax.jit(jax.grad(loss)).lower(q, k, v)
    by_target = {target: (ops_, attrs) for target, ops_, attrs in calls}
    assert set(by_target) == {_ffi.FORWARD_TARGET, _ffi.BACKWARD_TARGET}, calls
    fwd_ops, fwd_attrs = by_target[_ffi.FORWARD_TARGET]
    bwd_ops, bwd_attrs = by_target[_ffi.BACKWARD_TARGET]
    i32 = jnp.dtype(jnp.int32)
    tail = [((B,), i32), ((B,), i32), ((B, LQ), i32), ((B, LK), i32)]
    assert fwd_ops[3:] == tail and len(fwd_ops) == 7
    assert bwd_ops[7:] == tail and len(bwd_ops) == 11
    for attrs in (fwd_attrs, bwd_attrs):
        assert attrs["has_segments"] is True and attrs["has_seqlens"] is True

    # under vmap with only the q ids mapped, the kv ids are broadcast to the same batch pattern
    calls.clear()
    qv, kv, vv = _qkv(batch=(V, B))
    qsv, _ = _ids(batch=(V, B))

    def mapped(q, k, v, q_ids):
        return flash_dmattn(q, k, v, q_segment_ids=q_ids, kv_segment_ids=ks, implementation="cpu")

    jax.jit(jax.vmap(mapped)).lower(qv, kv, vv, qsv)
    (_, operands, attrs), = calls
    assert operands[3:] == [((V, B, LQ), i32), ((V, B, LK), i32)], operands
    assert attrs["has_segments"] is True and attrs["has_seqlens"] is False


# ---- sharding and memory ----------------------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLS)
def test_batch_sharded_jit(implementation):
    """A 1-D mesh of the 8 host devices over the batch: the same results as unsharded, and with
    the kernels no all-gather."""
    n = jax.device_count()
    assert n == 8, "conftest must set --xla_force_host_platform_device_count=8"
    mesh = Mesh(np.array(jax.devices()), ("data",))
    q, k, v = _qkv(6, batch=(n,))
    qs, ks = _ids(7, batch=(n,))
    bias = np.random.default_rng(8).standard_normal((n, H, 1, LK)).astype(np.float32)
    w = np.random.default_rng(9).standard_normal(q.shape).astype(np.float32)

    def loss(q, k, v, bias, qs, ks, w):
        out, lse = flash_dmattn(q, k, v, None, bias, q_segment_ids=qs, kv_segment_ids=ks,
                                is_causal=True, return_lse=True, implementation=implementation)
        return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)), (out, lse)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    args = (q, k, v, bias, qs, ks, w)
    sharded = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in args]
    text = fn.lower(*sharded).compile().as_text()
    if implementation == "cpu":
        assert "all-gather" not in text
    (_, (out, lse)), grads = fn(*sharded)
    (_, (r_out, r_lse)), r_grads = fn(*(jnp.asarray(x) for x in args))
    assert out.sharding.spec[0] == "data"
    assert_close("out", out, r_out, 1e-5)
    assert_close("lse", lse, r_lse, 1e-5)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, r_grads, strict=True):
        assert_close(name, g, r, 1e-5)


def _seq_by_seq_types(text: str, lq: int, lk: int) -> list[str]:
    return re.findall(rf"tensor<(?:\d+x)*(?:{lq}x{lk}|{lk}x{lq})x\w+>", text)


def test_no_lq_by_lk_array():
    """A cpu call with segment ids (forward and backward) holds no [Lq, Lk] array: the kernels
    read the O(L) ids (the xla implementation, which does build one, shows the check works)."""
    lq, lk = 384, 320
    rng = np.random.default_rng(10)
    q = rng.standard_normal((1, lq, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, lk, 2, 16)).astype(np.float32)
    qs = np.sort(rng.integers(0, 4, (1, lq)), axis=1).astype(np.int32)
    ks = np.sort(rng.integers(0, 4, (1, lk)), axis=1).astype(np.int32)

    def loss(q, k, v, implementation):
        return jnp.sum(flash_dmattn(q, k, v, q_segment_ids=qs, kv_segment_ids=ks,
                                    implementation=implementation))

    for impl in ("cpu", "xla"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3).lower(
            q, k, k, impl).as_text()
        found = _seq_by_seq_types(text, lq, lk)
        assert bool(found) == (impl == "xla"), (impl, found[:3])


# issue 24's memory point, for the training step as a whole: value_and_grad of a packed, causal
# call (with a per-key bias and a key mask too) lowered for the cpu backend (StableHLO and the
# compiled HLO) and for cuda (StableHLO, with a fake CUDA build): no array of that program may
# hold Lq·Lk elements or more. Lq = Lk = 1024 with H = 4, D = 16: the largest O(L) arrays (q, out,
# their gradients) hold 2·1024·4·16 = 131072 elements, an eighth of Lq·Lk = 1048576, so only a
# quadratic array can reach the bound.
MEM_B, MEM_L, MEM_H, MEM_HK, MEM_D = 2, 1024, 4, 2, 16
MEM_FAKE_BUILD = dict(FAKE_BUILD, cuda_head_dims=[MEM_D], mask_map_cell=64)
_STABLEHLO_TYPE = re.compile(r"tensor<((?:\d+x)*)[a-z]\w*>")
_HLO_SHAPE = re.compile(r"\b(?:pred|[suf]\d+|bf16|f8\w*|c\d+)\[([\d,]*)\]")


def array_sizes(text: str) -> list[tuple[int, str]]:
    """(elements, type) of every array type in StableHLO text (``tensor<2x1024x4x16xf32>``) or
    HLO text (``f32[2,1024,4,16]{3,2,1,0}``); scalars count 1."""
    sizes = []
    for match in _STABLEHLO_TYPE.finditer(text):
        dims = [int(d) for d in match.group(1).split("x") if d]
        sizes.append((int(np.prod(dims)), match.group(0)))
    for match in _HLO_SHAPE.finditer(text):
        dims = [int(d) for d in match.group(1).split(",") if d]
        sizes.append((int(np.prod(dims)), match.group(0)))
    return sizes


def _training_step_texts(with_bias_mask: bool, platform: str, implementation: str | None,
                         dense_mask: bool = False) -> dict[str, str]:
    """{"stablehlo": …, and on the cpu "compiled": …} of jit(value_and_grad(loss)) of a causal
    flash_dmattn call on 8 packed documents a row (ids ``[B, L]``), gradients wrt q, k, v (and the
    bias). `dense_mask`: the same rule handed over as a bool ``[B, 1, Lq, Lk]`` mask instead of
    segment ids (the control: that program must hold an Lq·Lk array)."""
    rng = np.random.default_rng(11)
    dtype = np.float32 if platform == "cpu" else jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((MEM_B, MEM_L, MEM_H, MEM_D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((MEM_B, MEM_L, MEM_HK, MEM_D)), dtype)
            for _ in range(2))
    cuts = np.sort(rng.choice(np.arange(1, MEM_L), (MEM_B, 7), replace=False), axis=1)
    ids = np.stack([np.searchsorted(c, np.arange(MEM_L), side="right") for c in cuts])
    ids = ids.astype(np.int32)  # 8 documents a row, monotone ids 0..7
    bias = jnp.asarray(rng.standard_normal((1, MEM_H, 1, MEM_L)), dtype) if with_bias_mask \
        else None
    key_mask = jnp.asarray(rng.random((MEM_B, 1, 1, MEM_L)) < 0.9) if with_bias_mask else None
    if dense_mask:
        mask = jnp.asarray(segment_mask(ids, ids))
        mask, ids = (mask if key_mask is None else mask & key_mask), None
    else:
        mask, ids = key_mask, jnp.asarray(ids)

    # mask and ids are arguments of the step (as in training), not constants folded into it
    def loss(q, k, v, bias, mask, ids):
        out = flash_dmattn(q, k, v, mask, bias, q_segment_ids=ids, kv_segment_ids=ids,
                           is_causal=True, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    argnums = (0, 1, 2, 3) if with_bias_mask else (0, 1, 2)
    traced = jax.jit(jax.value_and_grad(loss, argnums=argnums)).trace(q, k, v, bias, mask, ids)
    if platform == "cpu":
        lowered = traced.lower()
        return {"stablehlo": lowered.as_text(), "compiled": lowered.compile().as_text()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the reference would warn
        return {"stablehlo": traced.lower(lowering_platforms=("cuda",)).as_text()}


def fake_cuda_lowering(monkeypatch) -> None:
    """Lowering for cuda on this machine: a CUDA build is faked, and the FFI calls lose only
    their flat uint8 workspaces, whose sizes the (absent) CUDA extension computes."""
    real_call = _ffi._call

    def call(target, operands, results, num_batch, attrs, extra_workspaces=None):
        return real_call(target, operands, results, num_batch, attrs)

    monkeypatch.setattr(_ffi, "_call", call)
    monkeypatch.setattr(_ffi, "build_info", lambda: MEM_FAKE_BUILD)
    monkeypatch.setattr(_ffi, "local_gpu_compute_capability", lambda: "9.0")


MEMORY_CASES = [("cpu", None), ("cuda", None), ("cuda", "cuda")]


@pytest.mark.parametrize("with_bias_mask", [False, True], ids=["plain", "bias_and_key_mask"])
@pytest.mark.parametrize(("platform", "implementation"), MEMORY_CASES,
                         ids=[f"{p}-{i}" for p, i in MEMORY_CASES])
def test_training_step_has_no_lq_by_lk_array(monkeypatch, platform, implementation,
                                             with_bias_mask):
    """jit(value_and_grad) of a packed causal call, with or without a bias ``[1, H, 1, Lk]`` and
    a mask ``[B, 1, 1, Lk]`` broadcast over queries: every array of the lowered program (and of
    the compiled one on the cpu) holds fewer than Lq·Lk elements."""
    if platform == "cuda":
        fake_cuda_lowering(monkeypatch)
    texts = _training_step_texts(with_bias_mask, platform, implementation)
    if platform == "cuda":  # the CUDA kernels ran, not a fallback (which would also be O(L²))
        assert _ffi.FORWARD_TARGET in texts["stablehlo"]
        assert _ffi.BACKWARD_TARGET in texts["stablehlo"]
    for form, text in texts.items():
        sizes = array_sizes(text)
        assert sizes, form  # the parser read this form
        largest = max(sizes)
        assert largest[0] < MEM_L * MEM_L, (form, largest,
                                            sorted(sizes, reverse=True)[:5])


@pytest.mark.parametrize(("platform", "implementation"), MEMORY_CASES[:2],
                         ids=[f"{p}-{i}" for p, i in MEMORY_CASES[:2]])
def test_training_step_check_sees_a_dense_mask(monkeypatch, platform, implementation):
    """The control of the test above: the same step given the rule as a dense ``[B, 1, Lq, Lk]``
    mask instead of segment ids does show an array of Lq·Lk elements or more, in every form."""
    if platform == "cuda":
        fake_cuda_lowering(monkeypatch)
    texts = _training_step_texts(True, platform, implementation, dense_mask=True)
    for form, text in texts.items():
        assert max(array_sizes(text))[0] >= MEM_L * MEM_L, form


def test_available_in_package():
    assert "q_segment_ids" in jax_dmattn.flash_dmattn.__doc__


def test_vmap_one_length_mapped():
    """The batching rule's pairs: vmap with only query_seq_lengths mapped hands the kernels both
    lengths with one batch pattern (the unmapped one broadcast), as for the segment ids."""
    q, k, v = _qkv(12, batch=(V, B))
    q_lens = np.array([[LQ, 3], [7, LQ], [1, 0]], np.int32)
    kv_lens = np.array([LK, 9], np.int32)

    def call(q, k, v, q_lens, implementation):
        return dot_product_attention(q, k, v, query_seq_lengths=q_lens,
                                     key_value_seq_lengths=kv_lens, implementation=implementation)

    got = jax.jit(jax.vmap(lambda *a: call(*a, "cpu")))(q, k, v, q_lens)
    ref = jax.vmap(lambda *a: call(*a, "xla"))(q, k, v, q_lens)
    assert_close("out", got, ref, 1e-5)


# ---- the CUDA kernels (GPU only) ---------------------------------------------------------------

GPU_CASES = [
    # packed documents (monotone ids) over several tiles, causal and not, irregular lengths
    Case(B=2, Lq=300, Lk=300, H=4, Hk=2, D=128, dtype="bfloat16", segments="packed",
         causal=True),
    Case(B=2, Lq=257, Lk=700, H=4, Hk=4, D=64, dtype="float16", segments="packed"),
    Case(B=1, Lq=1100, Lk=1100, H=2, Hk=1, D=128, dtype="bfloat16", segments="packed",
         causal=True, bias=("B", "H", "Lq", "Lk")),
    # with a mask, a per-key bias, GQA; one packing for the whole batch; orphan query ids
    Case(B=2, Lq=190, Lk=230, H=8, Hk=2, D=64, dtype="bfloat16", segments="packed",
         mask=("B", "Hk", "Lq", "Lk"), bias=("B", "H", "1", "Lk")),
    Case(B=3, Lq=129, Lk=129, H=4, Hk=1, D=32, dtype="bfloat16", segments="shared",
         causal=True, bias=("1", "1", "Lq", "Lk")),
    Case(B=2, Lq=170, Lk=200, H=4, Hk=2, D=128, dtype="float16", segments="orphans",
         bias=("B", "H", "Lq", "Lk"), softcap=20.0),
    # sequence lengths and a window (dot_product_attention), and decoding with split keys
    Case(B=3, Lq=150, Lk=400, H=4, Hk=2, D=96, dtype="bfloat16", segments="packed",
         front_end="dpa", q_lens=(150, 77, 0), kv_lens=(400, 120, 33),
         bias=("B", "1", "Lq", "Lk")),
    Case(B=2, Lq=200, Lk=200, H=4, Hk=2, D=256, dtype="bfloat16", segments="packed",
         front_end="dpa", causal=True, window=(40, 10)),
    Case(B=2, Lq=1, Lk=4000, H=8, Hk=2, D=128, dtype="bfloat16", segments="packed"),
]


def _nonmonotone(case: Case, inputs: dict) -> dict:
    """The case's ids permuted over positions: spans of every tile overlap, so no tile is skipped
    and every score is compared."""
    rng = np.random.default_rng(case.seed + 1)
    inputs = dict(inputs)
    for name in ("q_seg", "kv_seg"):
        ids = inputs[name]
        inputs[name] = np.stack([rng.permutation(row) for row in ids]).astype(np.int32)
    return inputs


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=cases_ids(GPU_CASES))
def test_cuda(case):
    """The CUDA kernels (forward and gradients, dbias included) against the float64 reference."""
    inputs = make_inputs(case)
    check_case(case, "cuda", inputs, dense_reference(case, inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[:4], ids=cases_ids(GPU_CASES[:4]))
def test_cuda_nonmonotone_ids(case):
    inputs = _nonmonotone(case, make_inputs(case))
    check_case(case, "cuda", inputs, dense_reference(case, inputs))


# Calls the warp-specialised Hopper backward takes with segment ids (no mask, bias or
# deterministic dQ beside them; head dims 64 and 128): the cases above and a GQA causal one over
# several key blocks, with their ids in order (most tiles one id) and permuted (every tile's
# pairs compared, as the bits the loader writes).
HOPPER_BACKWARD_CASES = [
    GPU_CASES[0],
    GPU_CASES[1],
    Case(B=2, Lq=1000, Lk=1000, H=8, Hk=2, D=128, dtype="bfloat16", segments="packed",
         causal=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "flash2"])
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("case", HOPPER_BACKWARD_CASES, ids=cases_ids(HOPPER_BACKWARD_CASES))
def test_cuda_backward_generations(case, permuted, kernel):
    """Both backward generations ("auto": the warp-specialised one on an sm_90a build) against
    the float64 reference."""
    require_cuda_kernel(case.D, case.dtype)
    inputs = make_inputs(case)
    if permuted:
        inputs = _nonmonotone(case, inputs)
    _ffi.cuda_set_backward_kernel(kernel)
    jax.clear_caches()
    try:
        check_case(case, "cuda", inputs, dense_reference(case, inputs))
    finally:
        _ffi.cuda_set_backward_kernel("auto")
        jax.clear_caches()


@pytest.mark.gpu
def test_cuda_deterministic():
    """deterministic=True: the dq kernel reads the ids too; gradients bitwise equal run to run."""
    case = GPU_CASES[0]
    require_cuda_kernel(case.D, case.dtype)
    inputs = make_inputs(case)
    ref = dense_reference(case, inputs)
    got = [run_case(case, inputs, "cuda", case.dtype, np.isfinite(ref["lse"]),
                    deterministic=True) for _ in range(2)]
    for name in ("dq", "dk", "dv"):
        assert_close(name, got[0][name], ref[name], tolerance(case.dtype, name))
        np.testing.assert_array_equal(got[0][name], got[1][name])


@pytest.mark.gpu
def test_build_info_reports_cuda_segments():
    assert _ffi.build_info()["cuda_segments"] is True
