"""Where the GPU time of one jitted call goes: device time per kernel (jax.profiler).

For the forward and the forward+backward (value_and_grad wrt q, k, v and the bias) of one
workload, prints the per-call and back-to-back wall times (as dispatch_overhead.py), the device
time of every kernel of one call after warm-up, and the timeline of a few calls each waited on,
ours and cuDNN's (from the call to its first kernel, its kernels' span, from the last kernel's
end to the return of block_until_ready):

    python benchmarks/gpu_profile.py --workload bias_mask        # [B,H,L,L] bias + mask, causal
    python benchmarks/gpu_profile.py --workload density --density 0.1   # B1 L16k H2 Hk1
"""

from __future__ import annotations

import argparse
import collections
import glob
import tempfile

import jax
import jax.numpy as jnp
from dispatch_overhead import back_to_back_ms
from gpu_suites import block_mask
from jax.profiler import ProfileData

import jax_dmattn
from jax_dmattn._timing import median_ms


def device_events(trace_dir: str) -> tuple[list, list]:
    """(host events, kernels) of a jax.profiler trace: (name, start ns, end ns) each."""
    data = ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
    host, kernels = [], []
    for plane in data.planes:
        on_gpu = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            if on_gpu and "stream" not in line.name.lower():
                continue
            for event in line.events:
                span = (event.name, event.start_ns, event.start_ns + event.duration_ns)
                (kernels if on_gpu else host).append(span)
    return host, kernels


def kernel_times_us(fn, *args) -> collections.Counter:
    """Device microseconds per kernel name of one call of `fn` (warmed up first)."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(fn(*args))
    times: collections.Counter = collections.Counter()
    for name, start, end in device_events(trace_dir)[1]:
        times[name[:100]] += (end - start) / 1e3
    return times


def call_timelines(fn, *args, calls: int = 5) -> list[tuple[float, float, float, float]]:
    """Microseconds of `calls` calls, each waited on: (wall, call to first kernel, kernels' span,
    last kernel's end to the return of block_until_ready)."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for _ in range(calls):
            with jax.profiler.TraceAnnotation("timed_call"):
                jax.block_until_ready(fn(*args))
    host, kernels = device_events(trace_dir)
    rows = []
    for _, start, end in sorted(e for e in host if e[0] == "timed_call"):
        inside = [k for k in kernels if start <= k[1] <= end]
        first, last = min(k[1] for k in inside), max(k[2] for k in inside)
        rows.append(((end - start) / 1e3, (first - start) / 1e3, (last - first) / 1e3,
                     (end - last) / 1e3))
    return rows


def workload(name: str, density: float) -> tuple[dict, bool]:
    """Operands ``q, k, v, mask, bias, dout`` and whether the call is causal."""
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    if name == "bias_mask":
        batch, length, heads, kv_heads = 4, 4096, 16, 16
    else:
        batch, length, heads, kv_heads = 1, 16384, 2, 1

    def normal(key, shape):
        return jax.random.normal(key, shape, jnp.bfloat16)

    ops = {"q": normal(keys[0], (batch, length, heads, 128)),
           "k": normal(keys[1], (batch, length, kv_heads, 128)),
           "v": normal(keys[2], (batch, length, kv_heads, 128)),
           "dout": normal(keys[3], (batch, length, heads, 128))}
    if name == "bias_mask":
        ops["bias"] = normal(keys[4], (batch, heads, length, length))
        ops["mask"] = (jax.random.bernoulli(keys[5], 0.5, (batch, heads, length, length))
                       | jnp.eye(length, dtype=bool))
        return ops, True
    ops["bias"] = None
    ops["mask"] = block_mask(length, density, 128, seed=0)
    return ops, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("bias_mask", "density"), default="bias_mask")
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    ops, causal = workload(args.workload, args.density)
    has_bias = ops["bias"] is not None

    def ours(q, k, v, mask, bias):
        return jax_dmattn.flash_dmattn(q, k, v, mask, bias, is_causal=causal)

    def cudnn(q, k, v, mask, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=causal,
                                            implementation="cudnn")

    def passes(attend) -> dict:
        def loss(q, k, v, mask, bias):
            return jnp.sum(attend(q, k, v, mask, bias).astype(jnp.float32) * ops["dout"])
        return {"fwd": jax.jit(attend),
                "fwd+bwd": jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4) if has_bias
                                                      else (0, 1, 2)))}

    calls, cudnn_calls = passes(ours), passes(cudnn)
    operands = (ops["q"], ops["k"], ops["v"], ops["mask"], ops["bias"])
    what = ("bias + mask [B,H,L,L] B4 L4k H16 D128 causal" if args.workload == "bias_mask"
            else f"block mask {args.density:.0%} [1,1,L,L] B1 L16k H2 Hk1 D128")
    print(f"{what}, bf16, {jax.devices()[0]}, jax {jax.__version__}")
    for name, fn in calls.items():
        per_call = median_ms(fn, *operands, warmup=3, iters=args.iters, warmup_s=0.3)
        back_to_back = back_to_back_ms(fn, *operands, iters=args.iters)
        times = kernel_times_us(fn, *operands)
        print(f"== {name}: per call {per_call:.3f} ms, back to back {back_to_back:.3f} ms, "
              f"device time of one call {sum(times.values()) / 1e3:.3f} ms")
        for kernel, us in times.most_common(12):
            print(f"  {us:9.1f} us  {kernel}")
        for impl, call in (("jax_dmattn", fn), ("cuDNN", cudnn_calls[name])):
            print(f"   timeline of calls each waited on, {impl} (us: wall = to first kernel + "
                  "kernels' span + after last kernel):")
            for wall, to_first, span, after in call_timelines(call, *operands):
                print(f"     {wall:8.1f} = {to_first:6.1f} + {span:8.1f} + {after:6.1f}")


if __name__ == "__main__":
    main()
