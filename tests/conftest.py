"""Shared fixtures and helpers of the jax_dmattn test suite.

* 8 host devices (``XLA_FLAGS``) for the sharding tests, set before jax is imported;
* ``jax_enable_x64``: the oracle is the pure-JAX ``xla`` implementation run in float64;
* the ``gpu`` marker: such tests run only on a GPU backend with the CUDA kernels compiled;
* :class:`Case`, :func:`make_inputs`, :func:`run_case` and :func:`check_case`: the conformance
  machinery (random inputs per case, float64 reference, relative L2 errors against the tolerances
  of DESIGN.md §4), shared by the CPU tests and the GPU tests.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax_dmattn  # noqa: E402

# ---- the gpu marker ---------------------------------------------------------------------------


def gpu_available() -> bool:
    """True where tests marked ``gpu`` run: a GPU backend and the CUDA kernels compiled."""
    return (jax.default_backend() == "gpu"
            and "cuda" in jax_dmattn.available_implementations())


def hopper_kernels_built() -> bool:
    """The local GPU is a Hopper and this build has its sm_90a kernels."""
    from jax_dmattn import _ffi

    return ((_ffi.local_gpu_compute_capability() or "").startswith("9.")
            and "90a" in _ffi.build_info()["cuda_archs"])


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs an NVIDIA GPU and the CUDA kernels; skipped unless "
        "jax.default_backend() == 'gpu' and 'cuda' in jax_dmattn.available_implementations()")


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        _skip_uncompiled(items)
        return
    skip = pytest.mark.skip(reason="needs jax.default_backend() == 'gpu' and the CUDA kernels")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _skip_uncompiled(items) -> None:
    """GPU cases of a head dim or dtype a partial build (``JAX_DMATTN_HEAD_DIMS``,
    ``JAX_DMATTN_DTYPES``) has no kernels for are skipped, naming what is missing."""
    from jax_dmattn import _ffi

    dims, dtypes = _ffi.cuda_head_dims(), _ffi.cuda_dtypes()
    for item in items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        # any case with a head dim and a dtype (Case, test_dynamic's DynCase, ...)
        head_dim, dtype = getattr(case, "D", None), getattr(case, "dtype", None)
        if "gpu" not in item.keywords or head_dim is None or dtype is None:
            continue
        if head_dim not in dims or (dtype in HALF_DTYPES and dtype not in dtypes):
            item.add_marker(pytest.mark.skip(
                reason=f"this build has no CUDA kernel for head dim {head_dim} / {dtype}"))


# ---- a CUDA build seen from a machine without one ---------------------------------------------


def fake_cuda_build(monkeypatch, head_dims: list[int], **extra) -> None:
    """Makes jax_dmattn see a CUDA build with bf16 / fp16 kernels of `head_dims` for sm_90a on an
    sm_90 GPU (`extra`: more build_info entries), its fallback warnings not yet given."""
    from jax_dmattn import _ffi, ops

    build = {"cuda": True, "cuda_head_dims": list(head_dims), "cuda_dtypes": "bf16,fp16",
             "cuda_archs": "90a", "xla_ffi_api": [0, 3], "cuda_window_heads": 64, **extra}
    monkeypatch.setattr(_ffi, "build_info", lambda: build)
    monkeypatch.setattr(_ffi, "local_gpu_compute_capability", lambda: "9.0")
    monkeypatch.setattr(ops, "_warned_fallbacks", set())


def record_ffi_calls(monkeypatch) -> list[tuple[str, list[tuple], dict]]:
    """Replaces the FFI custom call by one that records (target, [(shape, dtype) of each
    operand], attributes) and gives zeros of the results' shapes: lowering without kernels."""
    from jax_dmattn import _ffi

    calls = []

    def fake_call(target, operands, results, num_batch, attrs, extra_workspaces=None):
        calls.append((target, [(x.shape, x.dtype) for x in operands], attrs))
        return [jnp.zeros(shape, dtype) for shape, dtype in results]

    monkeypatch.setattr(_ffi, "_call", fake_call)
    return calls


# ---- tolerances (DESIGN.md §4) ---------------------------------------------------------------

HALF_DTYPES = ("float16", "bfloat16")
TOL_FP32 = 1e-5
TOL_HALF_OUT = 1e-2
TOL_HALF_GRAD = 2e-2
BASELINE_FACTOR = 2.0  # half precision: no worse than 2x the xla implementation in that dtype


def tolerance(dtype: str, quantity: str) -> float:
    """The relative L2 tolerance of `quantity` ("out", "lse" or a gradient) in `dtype`."""
    if dtype not in HALF_DTYPES:
        return TOL_FP32
    return TOL_HALF_OUT if quantity in ("out", "lse") else TOL_HALF_GRAD


# XLA:CPU compiles the float64 reference (a few hundred HLO ops with their gradients) 5-10x
# faster without LLVM optimisation and fusion emitters; float64 results agree to ~1e-16. Used only
# for float64 oracles, never for code under test or for the same-dtype xla baselines.
REFERENCE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                              "xla_cpu_use_fusion_emitters": False}


def reference_jit(fn, **kwargs):
    """jax.jit for float64 oracles (fast compile; see REFERENCE_COMPILER_OPTIONS)."""
    options = REFERENCE_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    return jax.jit(fn, compiler_options=options, **kwargs)


# ---- errors and assertions --------------------------------------------------------------------


def as_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def rel_error(x, ref) -> float:
    """``‖x − ref‖ / ‖ref‖`` over the entries where `ref` is finite (0/0 counts as 0)."""
    x, ref = as_f64(x), as_f64(ref)
    assert x.shape == ref.shape, f"shape {x.shape} != reference shape {ref.shape}"
    finite = np.isfinite(ref)
    diff = np.linalg.norm(x[finite] - ref[finite])
    norm = np.linalg.norm(ref[finite])
    if norm == 0:
        return 0.0 if diff == 0 else float("inf")
    return float(diff / norm)


def assert_finite_like(name: str, x, ref) -> None:
    """No NaN/Inf in `x`, except exactly where `ref` holds the same infinity (lse's -inf)."""
    x, ref = as_f64(x), as_f64(ref)
    assert not np.isnan(x).any(), f"{name}: {int(np.isnan(x).sum())} NaN entries"
    ref_inf = ~np.isfinite(ref)
    bad = ~np.isfinite(x) & ~ref_inf
    assert not bad.any(), f"{name}: {int(bad.sum())} infinite entries where the reference is finite"
    assert np.array_equal(x[ref_inf], ref[ref_inf]), (
        f"{name}: entries where the reference is {ref[ref_inf][:4]} hold {x[ref_inf][:4]}")


def assert_close(name: str, x, ref, tol: float, baseline=None) -> float:
    """Relative L2 error within `tol`; with `baseline` (the xla implementation run in x's dtype)
    also no worse than ``BASELINE_FACTOR`` times the baseline's error."""
    assert_finite_like(name, x, ref)
    err = rel_error(x, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"
    if baseline is not None:
        base = rel_error(baseline, ref)
        assert err <= BASELINE_FACTOR * base, (
            f"{name}: relative error {err:.3e} > {BASELINE_FACTOR}x the xla implementation's "
            f"{base:.3e} in the same dtype")
    return err


# ---- cases and inputs -------------------------------------------------------------------------

# A broadcast pattern names each dim of a mask or bias: "1", "B", "H", "Hk", "Lq" or "Lk".
Pattern = tuple[str, ...]

BROADCAST_PATTERNS: tuple[Pattern, ...] = tuple(
    (b, h, r, c) for b in ("1", "B") for h in ("1", "Hk", "H") for r in ("1", "Lq")
    for c in ("1", "Lk"))
FULL: Pattern = ("B", "H", "Lq", "Lk")


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call. `mask`/`bias` are broadcast patterns (None: absent).

    mask_kind: "random" (75 % True), "rows" (random, plus whole query rows False) or "blocks"
    (64x64 blocks wholly False, incl. a whole row block and a whole column block).
    front_end: "flash" (flash_dmattn) or "dpa" (dot_product_attention, where `causal` is top-left
    and `window`, `q_lens`, `kv_lens`, `unbatched` apply).
    segments: sequence-packing segment ids (None: absent): "packed" (per batch entry, sorted
    random document boundaries, some documents of length 1, queries and keys packed alike),
    "shared" (one packing ``[1, L]`` for the whole batch) or "orphans" (packed, plus query
    segments that no key has: rows with no visible key).
    """

    B: int = 2
    Lq: int = 17
    Lk: int = 33
    H: int = 4
    Hk: int = 2
    D: int = 16
    dtype: str = "float32"
    mask: Pattern | None = None
    mask_kind: str = "random"
    bias: Pattern | None = None
    causal: bool = False
    softcap: float | None = None
    scale: float | None = None
    front_end: str = "flash"
    window: int | tuple[int, int] | None = None
    q_lens: tuple[int, ...] | None = None
    kv_lens: tuple[int, ...] | None = None
    unbatched: bool = False
    segments: str | None = None

    def id(self) -> str:
        parts = [f"B{self.B}", f"q{self.Lq}", f"k{self.Lk}", f"h{self.H}kv{self.Hk}",
                 f"d{self.D}", self.dtype]
        if self.mask:
            parts.append("m" + ".".join(self.mask) + ("" if self.mask_kind == "random"
                                                      else f"-{self.mask_kind}"))
        if self.bias:
            parts.append("b" + ".".join(self.bias))
        for flag, label in ((self.causal, "causal"), (self.softcap, f"cap{self.softcap}"),
                            (self.scale, f"scale{self.scale}"),
                            (self.front_end != "flash", self.front_end),
                            (self.window is not None, f"win{self.window}"),
                            (self.q_lens, f"ql{self.q_lens}"), (self.kv_lens, f"kl{self.kv_lens}"),
                            (self.unbatched, "3d"),
                            (self.segments, f"seg-{self.segments}")):
            if flag:
                parts.append(label)
        label = "-".join(parts)
        for a, b in ((" ", ""), ("(", ""), (")", ""), (",", ".")):
            label = label.replace(a, b)
        return label

    @property
    def seed(self) -> int:
        return zlib.crc32(self.id().encode())

    def resolve(self, pattern: Pattern) -> tuple[int, ...]:
        sizes = {"1": 1, "B": self.B, "H": self.H, "Hk": self.Hk, "Lq": self.Lq, "Lk": self.Lk}
        return tuple(sizes[p] for p in pattern)

    @property
    def q_shape(self):
        return (self.B, self.Lq, self.H, self.D)

    @property
    def kv_shape(self):
        return (self.B, self.Lk, self.Hk, self.D)


def cases_ids(cases) -> list[str]:
    return [c.id() for c in cases]


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """`x` rounded to `dtype` and back to float64: the exact values a `dtype` run sees."""
    return np.asarray(jnp.asarray(x, jnp.dtype(dtype)).astype(jnp.float64))


def make_mask(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if kind == "random":
        mask = rng.random(shape) < 0.75
        if all(s == 1 for s in shape):
            mask[...] = True
        return mask
    if kind == "rows":  # whole query rows False, at fixed and at random places
        mask = rng.random(shape) < 0.8
        lq = shape[-2]
        flat = mask.reshape(-1, *shape[-2:])  # a view
        flat[0, [0, lq // 2, lq - 1], :] = False
        flat[-1, rng.integers(0, lq, size=max(1, lq // 4)), :] = False
        return mask
    if kind == "blocks":  # whole 64x64 tiles False, incl. a full row block and column block
        blk = 64
        lq, lk = shape[-2:]
        nq, nk = -(-lq // blk), -(-lk // blk)
        blocks = rng.random((*shape[:-2], nq, nk)) < 0.5
        blocks[..., min(1, nq - 1), :] = False  # every tile of this row block is skipped
        blocks[..., :, 0] = False
        blocks[..., 0, min(1, nk - 1)] = True
        dense = np.repeat(np.repeat(blocks, blk, axis=-2), blk, axis=-1)[..., :lq, :lk]
        return dense & (rng.random(shape) < 0.9)
    raise ValueError(kind)


def _packing(rng: np.random.Generator, length: int, docs: int) -> np.ndarray:
    """Segment ids ``0..docs-1`` of `length` positions, sorted, at random boundaries; the first
    document has length 1 when `length` allows it."""
    if length < docs:
        return np.sort(rng.integers(0, docs, length))
    cuts = np.sort(rng.choice(np.arange(2, length), size=docs - 2, replace=False)) if docs > 2 \
        else np.array([], int)
    bounds = np.concatenate([[1], cuts]) if length > 1 and docs > 1 else cuts
    return np.searchsorted(bounds, np.arange(length), side="right")


def make_segments(rng: np.random.Generator, case: Case) -> tuple[np.ndarray, np.ndarray]:
    """int32 ``q_seg [B|1, Lq]`` and ``kv_seg [B|1, Lk]`` of the case's segments kind."""
    rows = 1 if case.segments == "shared" else case.B
    docs = [int(rng.integers(2, 6)) for _ in range(rows)]
    q = np.stack([_packing(rng, case.Lq, n) for n in docs])
    kv = np.stack([_packing(rng, case.Lk, n) for n in docs])
    if case.segments == "orphans":  # ids that no key has, on whole documents and single rows
        q[:, : max(1, case.Lq // 5)] = 100 + np.arange(rows)[:, None]
        q[:, -1] = -7
    assert case.segments in ("packed", "shared", "orphans"), case.segments
    return q.astype(np.int32), kv.astype(np.int32)


def make_inputs(case: Case) -> dict[str, np.ndarray]:
    """Fresh random inputs for `case` (seeded by it), as float64 values exactly representable in
    the case's dtype: q, k, v, [mask], [bias], w (out cotangent), wl (lse cotangent), and the
    segment ids q_seg, kv_seg of a case with segments."""
    rng = np.random.default_rng(case.seed)
    out = {
        "q": rng.standard_normal(case.q_shape),
        "k": rng.standard_normal(case.kv_shape),
        "v": rng.standard_normal(case.kv_shape),
        "w": rng.standard_normal(case.q_shape),
        "wl": 0.1 * rng.standard_normal((case.B, case.H, case.Lq)),
    }
    if case.bias is not None:
        out["bias"] = rng.standard_normal(case.resolve(case.bias))
    if case.mask is not None:
        out["mask"] = make_mask(rng, case.resolve(case.mask), case.mask_kind)
    for name in ("q", "k", "v", "w", "bias"):
        if name in out:
            out[name] = round_to(out[name], case.dtype)
    if case.segments is not None:
        out["q_seg"], out["kv_seg"] = make_segments(rng, case)
    return out


def infinite_bias_elements(rng: np.random.Generator, bias: np.ndarray) -> np.ndarray:
    """A copy of `bias` with a third of its elements and every key of its first row set to -inf:
    keys the bias alone hides, as a mask would (rows of that bias row see no key; under a softcap
    the score is -softcap instead)."""
    bias = bias.copy()
    bias[rng.random(bias.shape) < 1 / 3] = -np.inf
    bias[(0,) * (bias.ndim - 1)] = -np.inf
    return bias


def with_infinite_bias(case: Case, inputs: dict) -> dict[str, np.ndarray]:
    """`inputs` with infinite_bias_elements in the bias."""
    rng = np.random.default_rng(case.seed + 1)
    return {**inputs, "bias": infinite_bias_elements(rng, inputs["bias"])}


# ---- running a case ---------------------------------------------------------------------------

GRAD_NAMES = ("dq", "dk", "dv", "dbias")


def call_front_end(case: Case, implementation: str | None, q, k, v, mask, bias, segments=None,
                   **overrides):
    """The case's front end called on (q, k, v, mask, bias) and the segment ids
    ``(q_seg, kv_seg)`` or None, returning ``(out, lse)`` normalised to ``out [B, Lq, H, D]`` and
    ``lse [B, H, Lq]``."""
    kw = dict(scale=case.scale, implementation=implementation, **overrides)
    if segments is not None:
        kw.update(q_segment_ids=segments[0], kv_segment_ids=segments[1])
    if case.front_end == "flash":
        return jax_dmattn.flash_dmattn(q, k, v, mask, bias, is_causal=case.causal,
                                       softcap=case.softcap, return_lse=True, **kw)
    assert case.front_end == "dpa" and case.softcap is None
    q_lens = None if case.q_lens is None else jnp.asarray(case.q_lens, jnp.int32)
    kv_lens = None if case.kv_lens is None else jnp.asarray(case.kv_lens, jnp.int32)
    if case.unbatched:
        q, k, v = q[0], k[0], v[0]
    out, res = jax_dmattn.dot_product_attention(
        q, k, v, bias, mask, is_causal=case.causal, query_seq_lengths=q_lens,
        key_value_seq_lengths=kv_lens, local_window_size=case.window, return_residual=True, **kw)
    if case.unbatched:
        assert out.ndim == 3 and res.shape == (case.Lq, case.H), (out.shape, res.shape)
        out, res = out[None], res[None]
    assert res.shape == (case.B, case.Lq, case.H), res.shape
    return out, jnp.swapaxes(res, -1, -2)


def _dpa_operand(case: Case, x):
    """dot_product_attention with 3-D inputs takes masks/biases without the batch dim."""
    if x is None or not case.unbatched:
        return x
    assert x.shape[0] == 1
    return x[0]


@functools.cache
def _compiled(case: Case, implementation: str | None, dtype: str, overrides):
    """jit(value_and_grad) of the case's loss, for operands of `dtype`."""
    ct = jnp.float64 if dtype == "float64" else jnp.float32
    overrides = dict(overrides)

    def loss(q, k, v, bias, mask, segments, w, wl, lse_finite):
        out, lse = call_front_end(case, implementation, q, k, v, _dpa_operand(case, mask),
                                  _dpa_operand(case, bias), segments, **overrides)
        value = jnp.sum(out.astype(ct) * w) + jnp.sum(jnp.where(lse_finite, lse, 0) * wl)
        return value, (out, lse)

    argnums = (0, 1, 2, 3) if case.bias is not None else (0, 1, 2)
    jit = reference_jit if dtype == "float64" else jax.jit
    return jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def run_case(case: Case, inputs: dict, implementation: str | None, dtype: str,
             lse_finite: np.ndarray | None = None, **overrides) -> dict[str, np.ndarray]:
    """out, lse, dq, dk, dv, [dbias] of `case` on `inputs` cast to `dtype`.

    The loss is ``sum(out * w) + sum(lse * wl)`` over the finite entries of the reference lse
    (`lse_finite`; all when None), so gradients see a random cotangent for out and lse.
    """
    ct = jnp.float64 if dtype == "float64" else jnp.float32
    if lse_finite is None:
        lse_finite = np.ones((case.B, case.H, case.Lq), bool)
    cast = {n: jnp.asarray(inputs[n], jnp.dtype(dtype)) for n in ("q", "k", "v")}
    bias = None if case.bias is None else jnp.asarray(inputs["bias"], jnp.dtype(dtype))
    mask = None if case.mask is None else jnp.asarray(inputs["mask"])
    segments = (None if case.segments is None
                else (jnp.asarray(inputs["q_seg"]), jnp.asarray(inputs["kv_seg"])))
    fn = _compiled(case, implementation, dtype, tuple(sorted(overrides.items())))
    (_, (out, lse)), grads = fn(cast["q"], cast["k"], cast["v"], bias, mask, segments,
                                jnp.asarray(inputs["w"], ct), jnp.asarray(inputs["wl"], ct),
                                jnp.asarray(lse_finite))
    result = {"out": np.asarray(out), "lse": np.asarray(lse)}
    result.update({name: np.asarray(g) for name, g in zip(GRAD_NAMES, grads, strict=False)})
    assert result["out"].dtype == jnp.dtype(dtype), result["out"].dtype
    if dtype != "float64":
        assert result["lse"].dtype == np.float32, result["lse"].dtype
    return result


def expand_operand(case: Case, x: np.ndarray, pattern: Pattern) -> np.ndarray:
    """A mask or bias broadcast to ``[B, H, Lq, Lk]``; a head dim of Hk maps like k and v
    (query head h reads entry ``h // (H // Hk)``)."""
    if pattern[1] == "Hk":
        x = np.repeat(x, case.H // case.Hk, axis=1)
    return np.array(np.broadcast_to(x, case.resolve(FULL)))


def reduce_gradient(case: Case, g: np.ndarray, pattern: Pattern) -> np.ndarray:
    """The gradient of a ``[B, H, Lq, Lk]`` operand summed back to `pattern`'s shape."""
    if pattern[1] == "Hk":
        g = g.reshape(case.B, case.Hk, case.H // case.Hk, case.Lq, case.Lk).sum(axis=2)
    axes = tuple(i for i, p in enumerate(pattern) if p == "1")
    return g.sum(axis=axes, keepdims=True)


def reference(case: Case, inputs: dict, expand: bool = False) -> dict[str, np.ndarray]:
    """The oracle: the case through implementation="xla" in float64.

    With `expand`, mask and bias are first broadcast to ``[B, H, Lq, Lk]`` (and dbias summed
    back in numpy), so that cases differing only in broadcast patterns share one compiled
    reference, and the broadcast semantics are checked independently of the library."""
    if expand and (case.mask or case.bias):
        full = dataclasses.replace(case, mask=case.mask and FULL, bias=case.bias and FULL,
                                   mask_kind="random")
        inputs = dict(inputs)
        for name, pattern in (("mask", case.mask), ("bias", case.bias)):
            if pattern:
                inputs[name] = expand_operand(case, inputs[name], pattern)
        ref = reference(full, inputs)
        if case.bias:
            ref["dbias"] = reduce_gradient(case, ref["dbias"], case.bias)
        return ref
    first = run_case(case, inputs, "xla", "float64")
    lse_finite = np.isfinite(first["lse"])
    if lse_finite.all():
        return first
    return run_case(case, inputs, "xla", "float64", lse_finite)


def check_case(case: Case, implementation: str | None, inputs: dict | None = None,
               ref: dict | None = None, expand_reference: bool = False) -> dict[str, float]:
    """Runs `case` with `implementation` and checks out, lse and every gradient against the
    float64 reference (DESIGN.md §4), plus exact zeros for rows with no visible key.

    `expand_reference`: see :func:`reference`. Returns the relative errors (for diagnostics)."""
    inputs = make_inputs(case) if inputs is None else inputs
    ref = reference(case, inputs, expand_reference) if ref is None else ref
    lse_finite = np.isfinite(ref["lse"])
    got = run_case(case, inputs, implementation, case.dtype, lse_finite)
    baseline = (run_case(case, inputs, "xla", case.dtype, lse_finite)
                if case.dtype in HALF_DTYPES else {})
    assert set(got) == set(ref), (set(got), set(ref))
    errors = {}
    for name in ref:
        # DESIGN.md §4 applies the 2x-of-xla rule to out and the gradients; lse is float32 for
        # every input dtype and is held to its tolerance alone.
        base = None if name == "lse" else baseline.get(name)
        errors[name] = assert_close(name, got[name], ref[name], tolerance(case.dtype, name), base)
    assert_empty_rows(case, got, ref)
    if "dbias" in got:
        assert got["dbias"].shape == case.resolve(case.bias), got["dbias"].shape
    return errors


def assert_empty_rows(case: Case, got: dict, ref: dict) -> None:
    """Rows with no visible key (reference lse -inf): out exactly 0, lse -inf, dq exactly 0, and
    dbias exactly 0 there when the bias is not summed over batch, heads or rows."""
    empty = ~np.isfinite(ref["lse"])  # [B, H, Lq]
    if not empty.any():
        return
    rows = np.swapaxes(empty, 1, 2)  # [B, Lq, H]
    assert np.all(got["lse"][empty] == -np.inf), "lse of an empty row is not -inf"
    assert np.all(as_f64(got["out"])[rows] == 0), "out of an empty row is not exactly 0"
    assert np.all(as_f64(got["dq"])[rows] == 0), "dq of an empty row is not exactly 0"
    if "dbias" in got and case.resolve(case.bias)[:3] == (case.B, case.H, case.Lq):
        assert np.all(as_f64(got["dbias"])[empty] == 0), "dbias of an empty row is not 0"
