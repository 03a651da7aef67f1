"""The front ends: dot_product_attention as a drop-in for jax.nn.dot_product_attention, the
semantics of flash_dmattn's options, and the trace-time rejection of bad inputs."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import as_f64, assert_close, reference_jit, rel_error

import jax_dmattn
from jax_dmattn import dot_product_attention, flash_dmattn

# ---- drop-in for jax.nn.dot_product_attention ------------------------------------------------


def test_same_signature_as_jax_nn():
    """jax.nn's parameters in its order, then only our keyword-only segment ids, per-kv-head
    window table, gate with its threshold and softmax threshold (default None)."""
    ours = inspect.signature(dot_product_attention).parameters
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    assert list(ours)[:len(theirs)] == list(theirs)
    for name, p in theirs.items():
        assert ours[name].kind == p.kind, name
        assert ours[name].default == p.default, name
    extra = list(ours)[len(theirs):]
    assert extra == ["q_segment_ids", "kv_segment_ids", "window_sizes", "gate",
                     "gate_threshold", "softmax_threshold"], extra
    for name in extra:
        assert ours[name].kind == inspect.Parameter.KEYWORD_ONLY and ours[name].default is None


# (B, T, S, N, K, D, bias shape, mask shape, kwargs); "B", "T", ... in shapes are symbolic.
DROP_IN = [
    (2, 33, 70, 8, 2, 16, None, None, {}),
    (2, 33, 70, 4, 4, 16, ("B", "N", "T", "S"), ("B", 1, "T", "S"), {}),
    (2, 70, 33, 4, 2, 32, (1, "N", 1, "S"), None, dict(is_causal=True)),
    (2, 33, 70, 4, 1, 16, None, (1, 1, "T", "S"), dict(is_causal=True, scale=0.5)),
    (1, 50, 50, 4, 2, 16, ("T", "S"), ("N", "T", "S"), dict(local_window_size=(3, 2))),
    (2, 50, 64, 2, 2, 16, ("B", "N", "T", "S"), None, dict(local_window_size=4, is_causal=True)),
    (2, 33, 70, 4, 2, 16, (1, 1, "T", "S"), None,
     dict(key_value_seq_lengths=np.array([70, 5], np.int32))),
    (2, 33, 70, 4, 2, 16, ("B", "N", "T", "S"), ("B", "N", "T", "S"),
     dict(query_seq_lengths=np.array([33, 10], np.int32),
          key_value_seq_lengths=np.array([70, 20], np.int32))),
    (2, 33, 70, 4, 2, 16, None, None, dict(query_seq_lengths=np.array([12, 33], np.int32))),
    (None, 33, 40, 4, 2, 16, ("T", "S"), ("N", "T", "S"), {}),  # 3-D inputs
    (None, 40, 40, 4, 4, 32, ("N", 1, "S"), None, dict(is_causal=True)),
]


def _drop_in_inputs(seed, B, T, S, N, K, D, bias_shape, mask_shape, kwargs):
    rng = np.random.default_rng(seed)
    lead = () if B is None else (B,)
    sizes = {"B": B or 1, "T": T, "S": S, "N": N}

    def shape(s):
        return tuple(sizes.get(d, d) for d in s)

    q = rng.standard_normal((*lead, T, N, D))
    k = rng.standard_normal((*lead, S, K, D))
    v = rng.standard_normal((*lead, S, K, D))
    bias = None if bias_shape is None else rng.standard_normal(shape(bias_shape))
    mask = None
    if mask_shape is not None:
        mask = rng.random(shape(mask_shape)) < 0.7
        # Every row keeps a visible key under any causal/window rule used here: the diagonal
        # (T <= S) and key 0.
        mask |= np.eye(T, S, dtype=bool) | (np.arange(S) == 0)
    return q, k, v, bias, mask


@pytest.mark.parametrize("spec", DROP_IN, ids=[str(i) for i in range(len(DROP_IN))])
def test_drop_in_equals_jax_nn(spec):
    """Same output, residual and gradients as jax.nn.dot_product_attention(implementation="xla")
    on inputs where no row is fully masked: in float64 our xla path within 1e-6 (jax.nn's softmax
    runs in float32 even then; any semantic difference is orders of magnitude larger), and our cpu
    kernel in float32 within 1e-5 of that."""
    q, k, v, bias, mask = _drop_in_inputs(DROP_IN.index(spec), *spec)
    kwargs = spec[-1]
    q_lens = kwargs.get("query_seq_lengths")
    rng = np.random.default_rng(1)
    w = rng.standard_normal(q.shape)

    def run(fn, dtype, **kw):
        def loss(q, k, v, bias):
            out, res = fn(q, k, v, bias, None if mask is None else jnp.asarray(mask),
                          return_residual=True, **kwargs, **kw)
            return jnp.sum(out * w.astype(dtype)), (out, res)

        args = [jnp.asarray(x, dtype) for x in (q, k, v)]
        args.append(None if bias is None else jnp.asarray(bias, dtype))
        argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
        jit = reference_jit if dtype == jnp.float64 else jax.jit
        (_, (out, res)), grads = jit(jax.value_and_grad(loss, argnums, has_aux=True))(*args)
        return [out, res, *grads]

    theirs64 = run(jax.nn.dot_product_attention, jnp.float64, implementation="xla")
    ours64 = run(dot_product_attention, jnp.float64, implementation="xla")
    ours32 = run(dot_product_attention, jnp.float32, implementation="cpu")
    names = ["out", "residual", "dq", "dk", "dv", "dbias"]
    valid = np.ones(theirs64[1].shape, bool)  # residual [B, T, N] | [T, N]
    if q_lens is not None:  # jax.nn gives padded query rows a finite residual, we give -inf
        valid = np.arange(q.shape[-3])[None, :, None] < q_lens[:, None, None]
        valid = np.broadcast_to(valid, theirs64[1].shape)
        assert np.all(np.asarray(ours32[1])[~valid] == -np.inf)
        assert np.all(np.asarray(ours64[1])[~valid] == -np.inf)
    for name, *results in zip(names, theirs64, ours64, ours32, strict=False):
        a64, b64, b32 = (as_f64(x) for x in results)
        if name == "residual":
            a64, b64, b32 = a64[valid], b64[valid], b32[valid]
        assert a64.shape == b64.shape == b32.shape, name
        assert_close(name + " (float64)", b64, a64, 1e-6)
        assert_close(name + " (cpu, float32)", b32, a64, 1e-5)


def test_optional_outputs():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 2, 8)), jnp.float32)
    out = dot_product_attention(q, q, q, implementation="cpu")
    assert isinstance(out, jax.Array) and out.shape == q.shape
    out3 = dot_product_attention(q[0], q[0], q[0], implementation="cpu")
    assert out3.shape == q.shape[1:]
    np.testing.assert_array_equal(np.asarray(out3), np.asarray(out[0]))
    flash = flash_dmattn(q, q, q, implementation="cpu")
    assert isinstance(flash, jax.Array) and flash.shape == q.shape
    flash_out, lse = flash_dmattn(q, q, q, return_lse=True, implementation="cpu")
    assert lse.shape == (1, 2, 5) and lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(flash), np.asarray(flash_out))


def test_dpa_empty_rows_give_zeros_not_uniform_averages():
    """Where jax.nn gives a fully masked row the mean of V, we give zeros (documented)."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32) for _ in range(3))
    mask = np.ones((1, 1, 6, 6), bool)
    mask[..., 2, :] = False
    out, res = dot_product_attention(q, k, v, mask=jnp.asarray(mask), return_residual=True,
                                     implementation="cpu")
    assert np.all(np.asarray(out)[0, 2] == 0) and np.all(np.asarray(res)[0, 2] == -np.inf)
    theirs = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask), implementation="xla")
    other = np.delete(np.arange(6), 2)
    assert rel_error(np.asarray(out)[0, other], np.asarray(theirs)[0, other]) <= 1e-5


# ---- semantics of flash_dmattn's options, checked through explicit masks ----------------------


def _qkv(seed, B=2, Lq=20, Lk=30, H=4, Hk=2, D=16, dtype=jnp.float64):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((B, Lq, H, D)), dtype),
            jnp.asarray(rng.standard_normal((B, Lk, Hk, D)), dtype),
            jnp.asarray(rng.standard_normal((B, Lk, Hk, D)), dtype))


@pytest.mark.parametrize("impl", ["xla", "cpu"])
@pytest.mark.parametrize("lq,lk", [(20, 30), (30, 20)])
def test_flash_causal_is_bottom_right(impl, lq, lk):
    """is_causal=True equals the explicit mask ``j <= i + (Lk - Lq)``."""
    dtype = jnp.float64 if impl == "xla" else jnp.float32
    q, k, v = _qkv(5, Lq=lq, Lk=lk, dtype=dtype)
    i, j = np.indices((lq, lk))
    explicit = jnp.asarray((j <= i + (lk - lq))[None, None])
    jit = reference_jit if impl == "xla" else jax.jit
    a, la = jit(lambda q, k, v: flash_dmattn(q, k, v, is_causal=True, return_lse=True,
                                             implementation=impl))(q, k, v)
    b, lb = jit(lambda q, k, v, m: flash_dmattn(q, k, v, m, return_lse=True,
                                                implementation=impl))(q, k, v, explicit)
    assert rel_error(a, b) <= 1e-6 and rel_error(la, lb) <= 1e-6
    assert_close("lse", la, lb, 1e-6)  # -inf on the same rows


def test_flash_scale_and_softcap_semantics():
    """scale multiplies the logits and softcap applies ``c·tanh(s/c)`` to scale·qk + bias:
    checked through an equivalent call with the softcapped logits folded into the bias."""
    q, k, v = _qkv(6, Hk=4)
    bias = jnp.asarray(np.random.default_rng(7).standard_normal((2, 4, 20, 30)))
    scale, cap = 0.37, 1.3

    @reference_jit
    def capped_and_folded(q, k, v, bias):
        a = flash_dmattn(q, k, v, bias=bias, scale=scale, softcap=cap, implementation="xla")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale + bias
        folded = cap * jnp.tanh(s / cap)
        return a, flash_dmattn(jnp.zeros_like(q), k, v, bias=folded, implementation="xla")

    a, b = capped_and_folded(q, k, v, bias)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)
    c = flash_dmattn(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                     bias=bias.astype(jnp.float32), scale=scale, softcap=cap,
                     implementation="cpu")
    assert rel_error(c, a) <= 1e-5


# ---- bad inputs: ValueError / TypeError at trace time, naming the argument ------------------

Q = jax.ShapeDtypeStruct((2, 8, 4, 16), jnp.float32)
KV = jax.ShapeDtypeStruct((2, 10, 2, 16), jnp.float32)


def _s(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _flash(q=Q, k=KV, v=KV, mask=None, bias=None, **kw):
    kw.setdefault("implementation", "cpu")
    return lambda: jax.eval_shape(lambda *a: flash_dmattn(*a, **kw), q, k, v, mask, bias)


def _dpa(q=Q, k=KV, v=KV, bias=None, mask=None, **kw):
    kw.setdefault("implementation", "cpu")
    return lambda: jax.eval_shape(lambda *a: dot_product_attention(*a, **kw), q, k, v, bias,
                                  mask)


LENS = np.array([8, 8], np.int32)

BAD_INPUTS = [
    # (id, thunk, exception, substrings of the message)
    ("q-rank3", _flash(q=_s((8, 4, 16))), ValueError, ["query", "(8, 4, 16)"]),
    ("k-rank5", _flash(k=_s((1, 2, 10, 2, 16))), ValueError, ["key", "(1, 2, 10, 2, 16)"]),
    ("v-rank3", _flash(v=_s((10, 2, 16))), ValueError, ["value", "(10, 2, 16)"]),
    ("dpa-q-rank2", _dpa(q=_s((8, 16)), k=_s((10, 16)), v=_s((10, 16))), ValueError, ["query"]),
    ("dpa-q-rank5", _dpa(q=_s((1, 2, 8, 4, 16))), ValueError, ["query"]),
    ("k-batch", _flash(k=_s((3, 10, 2, 16)), v=_s((3, 10, 2, 16))), ValueError,
     ["key", "(3, 10, 2, 16)"]),
    ("k-headdim", _flash(k=_s((2, 10, 2, 8)), v=_s((2, 10, 2, 8))), ValueError,
     ["key", "(2, 10, 2, 8)"]),
    ("v-shape", _flash(v=_s((2, 11, 2, 16))), ValueError, ["value", "(2, 11, 2, 16)"]),
    ("heads-not-multiple", _flash(k=_s((2, 10, 3, 16)), v=_s((2, 10, 3, 16))), ValueError,
     ["H=4", "Hk=3"]),
    ("seqlen-zero", _flash(q=_s((2, 0, 4, 16))), ValueError, ["query", "(2, 0, 4, 16)"]),
    ("mask-int", _flash(mask=_s((2, 4, 8, 10), jnp.int32)), TypeError, ["mask", "int32"]),
    ("mask-float", _flash(mask=_s((1, 1, 8, 10))), TypeError, ["mask", "float32"]),
    ("mask-heads3", _flash(mask=_s((2, 3, 8, 10), bool)), ValueError, ["mask", "(2, 3, 8, 10)"]),
    ("mask-batch3", _flash(mask=_s((3, 1, 8, 10), bool)), ValueError, ["mask", "(3, 1, 8, 10)"]),
    ("mask-rows", _flash(mask=_s((1, 1, 5, 10), bool)), ValueError, ["mask", "(1, 1, 5, 10)"]),
    ("mask-cols", _flash(mask=_s((1, 1, 8, 9), bool)), ValueError, ["mask", "(1, 1, 8, 9)"]),
    ("mask-rank3", _flash(mask=_s((1, 8, 10), bool)), ValueError, ["mask", "(1, 8, 10)"]),
    ("dpa-mask-cols", _dpa(mask=_s((8, 7), bool)), ValueError, ["mask"]),
    ("bias-cols", _flash(bias=_s((1, 1, 8, 7))), ValueError, ["bias", "(1, 1, 8, 7)"]),
    ("bias-heads", _flash(bias=_s((1, 8, 1, 10))), ValueError, ["bias", "(1, 8, 1, 10)"]),
    ("bias-rank5", _flash(bias=_s((1, 1, 1, 8, 10))), ValueError, ["bias"]),
    ("dpa-bias-rows", _dpa(bias=_s((2, 4, 3, 10))), ValueError, ["bias", "(2, 4, 3, 10)"]),
    ("bias-int", _flash(bias=_s((1, 1, 8, 10), jnp.int32)), TypeError, ["bias", "int32"]),
    ("bias-bool", _flash(bias=_s((1, 1, 8, 10), bool)), TypeError, ["bias", "bool"]),
    ("q-float64-cpu", _flash(q=_s(Q.shape, jnp.float64), k=_s(KV.shape, jnp.float64),
                             v=_s(KV.shape, jnp.float64)), TypeError, ["query", "float64"]),
    ("q-int32", _flash(q=_s(Q.shape, jnp.int32), k=_s(KV.shape, jnp.int32),
                       v=_s(KV.shape, jnp.int32)), TypeError, ["query", "int32"]),
    ("k-dtype", _flash(k=_s(KV.shape, jnp.bfloat16)), TypeError, ["key", "bfloat16"]),
    ("v-dtype", _flash(v=_s(KV.shape, jnp.float16)), TypeError, ["value", "float16"]),
    ("softcap-zero", _flash(softcap=0.0), ValueError, ["softcap", "0.0"]),
    ("softcap-negative", _flash(softcap=-2.0), ValueError, ["softcap", "-2.0"]),
    ("softcap-nan", _flash(softcap=float("nan")), ValueError, ["softcap", "nan"]),
    ("scale-inf", _flash(scale=float("inf")), TypeError, ["scale", "inf"]),
    ("impl-unknown", _flash(implementation="triton"), ValueError, ["implementation", "triton"]),
    ("impl-cudnn", _flash(implementation="cudnn"), ValueError, ["implementation", "cudnn"]),
    ("dpa-impl-cudnn", _dpa(implementation="cudnn"), ValueError, ["implementation", "cudnn"]),
    ("dpa-impl-unknown", _dpa(implementation="XLA"), ValueError, ["implementation", "XLA"]),
    ("qlens-int64", _dpa(query_seq_lengths=LENS.astype(np.int64)), ValueError,
     ["query_seq_lengths", "int64"]),
    ("qlens-float", _dpa(query_seq_lengths=LENS.astype(np.float32)), ValueError,
     ["query_seq_lengths", "float32"]),
    ("qlens-shape", _dpa(query_seq_lengths=np.array([8, 8, 8], np.int32)), ValueError,
     ["query_seq_lengths", "(3,)"]),
    ("kvlens-2d", _dpa(key_value_seq_lengths=LENS[:, None]), ValueError,
     ["key_value_seq_lengths", "(2, 1)"]),
    ("kvlens-scalar", _dpa(key_value_seq_lengths=np.int32(10)), ValueError,
     ["key_value_seq_lengths"]),
    ("window-negative", _dpa(local_window_size=-1), ValueError, ["local_window_size", "-1"]),
    ("window-negative-right", _dpa(local_window_size=(2, -3)), ValueError,
     ["local_window_size", "-3"]),
    ("window-triple", _dpa(local_window_size=(1, 2, 3)), ValueError, ["local_window_size"]),
    ("window-string", _dpa(local_window_size="ab"), ValueError, ["local_window_size"]),
]


@pytest.mark.parametrize("thunk,exc,substrings", [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_at_trace_time(thunk, exc, substrings):
    with pytest.raises(exc) as info:
        thunk()
    for s in substrings:
        assert s in str(info.value), f"{s!r} not in {str(info.value)!r}"


def test_bad_inputs_raise_eagerly_too():
    """Concrete arrays (no jit): the same errors, before any kernel runs."""
    q = jnp.ones((2, 8, 4, 16), jnp.float32)
    k = jnp.ones((2, 10, 3, 16), jnp.float32)
    with pytest.raises(ValueError, match="Hk=3"):
        flash_dmattn(q, k, k, implementation="cpu")
    with pytest.raises(TypeError, match="mask"):
        flash_dmattn(q, q, q, mask=jnp.ones((1, 1, 8, 8), jnp.int8), implementation="cpu")


CUDA_BUILT = "cuda" in jax_dmattn.available_implementations()


@pytest.mark.skipif(CUDA_BUILT, reason="this build has the CUDA kernels")
@pytest.mark.parametrize("front_end", [_flash, _dpa])
def test_cuda_without_cuda_build_raises(front_end):
    with pytest.raises(ValueError) as info:
        front_end(implementation="cuda")()
    assert "cuda" in str(info.value)


@pytest.mark.skipif(not CUDA_BUILT, reason="needs a build with the CUDA kernels")
def test_cuda_rejects_float32_and_unknown_head_dims():
    with pytest.raises(TypeError) as info:
        _flash(implementation="cuda")()
    assert "float32" in str(info.value) and "query" in str(info.value)
    dims = jax_dmattn._ffi.cuda_head_dims()
    bad = next(d for d in range(8, 512, 8) if d not in dims)
    q, kv = _s((2, 8, 4, bad), jnp.bfloat16), _s((2, 10, 2, bad), jnp.bfloat16)
    with pytest.raises(ValueError) as info:
        _flash(q, kv, kv, implementation="cuda")()
    assert "head dim" in str(info.value) and str(bad) in str(info.value)


def test_available_implementations():
    impls = jax_dmattn.available_implementations()
    assert "xla" in impls and "cpu" in impls
    assert set(impls) <= {"xla", "cpu", "cuda"}


FAKE_BUILD = {"cuda": True, "cuda_head_dims": [128], "cuda_dtypes": "bf16,fp16",
              "cuda_archs": "90a"}


@pytest.mark.parametrize("build, capability, dtype, head_dim, reason", [
    (dict(FAKE_BUILD, cuda=False, cuda_archs=""), "9.0", jnp.bfloat16, 128, "no CUDA kernels"),
    (dict(FAKE_BUILD, cuda_dtypes="bf16"), "9.0", jnp.float16, 128, "dtype float16"),
    (FAKE_BUILD, "9.0", jnp.bfloat16, 64, "head dim 64"),
    (FAKE_BUILD, "8.0", jnp.bfloat16, 128, r"\(90a\) runs on this GPU \(compute capability 8.0"),
])
def test_gpu_fallback_warns_once(monkeypatch, build, capability, dtype, head_dim, reason):
    """A GPU call that no compiled kernel takes runs the reference: implementation=None warns
    once, naming the reason and the fix; implementation="cuda" raises."""
    from jax_dmattn import _ffi, ops
    from jax_dmattn.params import AttentionParams

    monkeypatch.setattr(_ffi, "build_info", lambda: build)
    monkeypatch.setattr(_ffi, "local_gpu_compute_capability", lambda: capability)
    monkeypatch.setattr(ops, "_warned_fallbacks", set())
    params = AttentionParams(scale=0.1)
    with pytest.warns(RuntimeWarning, match=reason) as record:
        assert not ops.uses_kernel("cuda", params, dtype, head_dim)
    assert "reference" in str(record[0].message) and "implementation='xla'" in str(
        record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ops.uses_kernel("cuda", params, dtype, head_dim)  # once only
    assert ops.uses_kernel("cpu", params, dtype, head_dim)
    with pytest.raises(ValueError, match=reason):
        ops.uses_kernel("cuda", AttentionParams(scale=0.1, implementation="cuda"), dtype,
                        head_dim)
    if build["cuda"] and capability == "9.0":
        assert ops.uses_kernel("cuda", params, jnp.bfloat16, 128)


def test_cuda_arch_matching_and_gpu_summary(monkeypatch):
    from jax_dmattn import __main__ as cli
    from jax_dmattn import _ffi

    monkeypatch.setattr(_ffi, "build_info", lambda: dict(FAKE_BUILD, cuda_archs="80,90a"))
    runs = {c: _ffi.cuda_arch_runs_on(c) for c in ("7.5", "8.0", "8.6", "9.0", "10.0")}
    assert runs == {"7.5": False, "8.0": True, "8.6": True, "9.0": True, "10.0": False}
    monkeypatch.setattr(_ffi, "build_info", lambda: FAKE_BUILD)
    assert not _ffi.cuda_arch_runs_on("8.0") and not _ffi.cuda_arch_runs_on("9.1")
    monkeypatch.setattr(_ffi, "local_gpu_compute_capability", lambda: None)
    assert cli.gpu_summary() is None
    monkeypatch.setattr(_ffi, "local_gpu_compute_capability", lambda: "8.0")
    assert "no compiled arch (90a) runs on it" in cli.gpu_summary()
    monkeypatch.setattr(_ffi, "local_gpu_compute_capability", lambda: "9.0")
    assert cli.gpu_summary().endswith("the CUDA kernels run on it")


@pytest.mark.parametrize("scale", [0.0, -0.3])
def test_scale_not_positive_runs_the_reference_on_a_gpu(monkeypatch, scale):
    """The CUDA kernels carry the bias and the gate in units of 1 / scale and hide scores as
    -inf before scaling them: at scale 0 they would drop the bias and the gate, below 0 turn a
    hidden score into +inf. So on a GPU such a call runs the reference (None warns, "cuda"
    raises); the CPU kernels take it and match the float64 reference with a bias, a gate and
    causality, gradients included."""
    from conftest import fake_cuda_build
    from form_checks import assert_cuda_refuses, qkv

    from jax_dmattn.params import AttentionParams

    fake_cuda_build(monkeypatch, [16, 128])
    assert_cuda_refuses(AttentionParams(scale=scale), "take scale > 0")
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, 2, 17, 23, 4, 2, 16)
    bias = jnp.asarray(rng.standard_normal((2, 4, 17, 23)), jnp.float32)
    alpha = jnp.asarray(rng.standard_normal((2, 17, 4)) * 1.5, jnp.float32)
    delta = jnp.asarray(rng.standard_normal((2, 23, 2)) * 1.5, jnp.float32)

    def loss(implementation):
        def fn(q, k, v, bias, alpha, delta):
            out = flash_dmattn(q, k, v, bias=bias, gate=(alpha, delta), scale=scale,
                               is_causal=True, implementation=implementation)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out
        return jax.value_and_grad(fn, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)

    args = (q, k, v, bias, alpha, delta)
    (_, out), grads = jax.jit(loss("cpu"))(*args)
    (_, want), want_grads = reference_jit(loss("xla"))(*(as_f64(x) for x in args))
    assert_close("out", out, want, 1e-5)
    names = ("dq", "dk", "dv", "dbias", "dalpha", "ddelta")
    for name, g, w in zip(names, grads, want_grads, strict=True):
        if scale == 0.0 and name in ("dq", "dk"):  # q . k has no weight in the logits
            assert np.all(np.asarray(g) == 0), name
        else:
            assert_close(name, g, w, 1e-5)
