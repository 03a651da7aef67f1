"""``python -m jax_dmattn``: what this install can do, a self-check and a quick timing table."""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_dmattn
from jax_dmattn._primitives import _ffi
from jax_dmattn._timing import attention_flops, median_ms


def _say(message: str) -> None:
    print(message, flush=True)


def _platform_implementation() -> tuple[str, str]:
    """(implementation, dtype name) that this platform runs by default."""
    capability = _ffi.local_gpu_compute_capability()
    if (jax.default_backend() == "gpu" and "cuda" in jax_dmattn.available_implementations()
            and capability is not None and _ffi.cuda_arch_runs_on(capability)):
        return "cuda", "bfloat16"
    return "cpu", "float32"


def gpu_summary() -> str | None:
    """One line on this process's GPU: its compute capability and whether the CUDA kernels of
    this build run on it (None without a GPU)."""
    capability = _ffi.local_gpu_compute_capability()
    if capability is None:
        return None
    info = _ffi.build_info()
    if not info["cuda"]:
        verdict = ("this build has no CUDA kernels, so calls on it run the pure-JAX reference "
                   "(reinstall with JAX_DMATTN_CUDA_WHEELS=13 pip install .: README, Building the "
                   "CUDA kernels)")
    elif not _ffi.cuda_arch_runs_on(capability):
        verdict = (f"no compiled arch ({info['cuda_archs']}) runs on it, so calls on it run the "
                   "pure-JAX reference (rebuild with JAX_DMATTN_CUDA_ARCHS naming it)")
    else:
        verdict = "the CUDA kernels run on it"
    return f"GPU: compute capability {capability}: {verdict}"


def _inputs(seed: int, batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(keys[0], (batch, seqlen_q, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seqlen_k, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seqlen_k, kv_heads, head_dim), dtype)
    mask = jax.random.bernoulli(keys[3], 0.8, (1, kv_heads, seqlen_q, seqlen_k))
    bias = jax.random.normal(keys[4], (batch, kv_heads, 1, seqlen_k), dtype)
    return q, k, v, mask, bias


def _rel_error(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def self_check(implementation: str, dtype_name: str) -> bool:
    """Forward and gradients against the float32 reference on a few irregular shapes."""
    dtype = jnp.dtype(dtype_name)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    cases = [  # (B, Lq, Lk, H, Hk, D, causal, softcap)
        (2, 17, 129, 4, 2, 64, True, None),
        (1, 130, 70, 4, 1, 32, True, 5.0),
        (2, 64, 64, 2, 2, 128, False, None),
    ]
    ok = True
    for n, (b, lq, lk, h, hk, d, causal, softcap) in enumerate(cases):
        if implementation == "cuda" and d not in _ffi.cuda_head_dims():
            continue
        q, k, v, mask, bias = _inputs(n, b, lq, lk, h, hk, d, dtype)

        def loss(q, k, v, bias, impl, mask=mask, causal=causal, softcap=softcap):
            out = jax_dmattn.flash_dmattn(q, k, v, mask, bias, is_causal=causal, softcap=softcap,
                                          implementation=impl)
            return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(
                out.shape))), out

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True), static_argnums=4)
        (*grads, out) = jax.tree.leaves(grad(q, k, v, bias, implementation))
        f32 = [x.astype(jnp.float32) for x in (q, k, v, bias)]
        (*ref_grads, ref_out) = jax.tree.leaves(grad(*f32, "xla"))
        errors = [_rel_error(x, r) for x, r in zip([out, *grads], [ref_out, *ref_grads],
                                                    strict=True)]
        finite = all(bool(jnp.all(jnp.isfinite(x))) for x in [out, *grads])
        passed = finite and max(errors) <= tolerance
        ok &= passed
        _say(f"  case B={b} Lq={lq} Lk={lk} H={h}/{hk} D={d} causal={causal} softcap={softcap}: "
             f"max rel error {max(errors):.2e} (out, dq, dk, dv, dbias) "
             f"{'PASS' if passed else 'FAIL'}")
    return ok


def timing_table(implementation: str, dtype_name: str, lengths: list[int]) -> None:
    """Our forward and forward+backward against jax.nn.dot_product_attention, side by side."""
    dtype = jnp.dtype(dtype_name)
    batch, heads, head_dim = 1, 4, 64
    baselines = ["xla"] + (["cudnn"] if implementation == "cuda" else [])
    _say(f"  {'L':>6} {'causal':>6} {'pass':>8} | {'jax_dmattn':>12} | "
         + " | ".join(f"{'jax.nn ' + b:>14}" for b in baselines))
    for seqlen in lengths:
        for causal in (False, True):
            q, k, v, _, _ = _inputs(seqlen, batch, seqlen, seqlen, heads, heads, head_dim, dtype)

            def ours(q, k, v, causal=causal):
                return jax_dmattn.flash_dmattn(q, k, v, is_causal=causal,
                                               implementation=implementation)

            fns = {"jax_dmattn": ours}
            for b in baselines:
                fns[b] = (lambda q, k, v, b=b, causal=causal: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation=b))
            flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
            for name, scale in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                cells = []
                for fn in fns.values():
                    if name == "fwd":
                        run = jax.jit(fn)
                    else:
                        run = jax.jit(jax.grad(
                            lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                            argnums=(0, 1, 2)))
                    ms = median_ms(run, q, k, v, warmup=1, iters=5)
                    cells.append(f"{ms:7.2f} ms {flops * scale / ms / 1e9:5.1f} TF/s"
                                 if implementation == "cuda" else f"{ms:9.2f} ms")
                _say(f"  {seqlen:>6} {causal!s:>6} {name:>8} | " + " | ".join(
                    f"{c:>14}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_dmattn", description=__doc__)
    parser.add_argument("--no-timing", action="store_true", help="skip the timing table")
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="sequence lengths of the timing table")
    args = parser.parse_args(argv)

    implementation, dtype_name = _platform_implementation()
    info = _ffi.build_info()
    _say(f"jax_dmattn {jax_dmattn.__version__} (jax {jax.__version__})")
    _say(f"platform: {jax.default_backend()}, devices: {[str(d) for d in jax.devices()]}")
    _say(f"implementations: {', '.join(jax_dmattn.available_implementations())}")
    _say("CUDA kernels: " + (f"sm {info['cuda_archs']}, head dims {info['cuda_head_dims']}, "
                             f"{info['cuda_dtypes']}" if info["cuda"] else "not built"))
    if (gpu := gpu_summary()) is not None:
        _say(gpu)
    _say(f"\n[1/2] self-check of implementation={implementation!r} ({dtype_name}) "
         "against the reference")
    passed = self_check(implementation, dtype_name)
    _say(f"self-check: {'PASSED' if passed else 'FAILED'}")
    if not args.no_timing:
        lengths = args.lengths or ([1024, 4096] if implementation == "cuda" else [512, 1024])
        _say(f"\n[2/2] timing (median ms; B=1, H=4, D=64, {dtype_name}) against "
             "jax.nn.dot_product_attention")
        timing_table(implementation, dtype_name, lengths)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
