"""Multi-GPU runs of issue 5: sharded results equal one device's, data-parallel training scaling,
and context parallelism at long sequences. Writes a markdown report.

    python benchmarks/multi_gpu.py --out benchmarks/results/multi_gpu.md        # all parts
    python benchmarks/multi_gpu.py --parts equality,cp --cp-length 131072

Parts (each prints a table; the report lists the command, device and JAX version):
  equality  B=4, L=4096, H=8, Hk=4, D=128, bf16, causal, per-key bias [B, Hk, 1, L] and its
            top-512 dynamic mask: out and every gradient of sharded jit (batch, heads, sequence),
            of the kernels under shard_map and pmap (batch) and of ``ring_attention`` under
            shard_map (zig-zag) against the same call on one device (relative L2; bf16 rounding
            of a different summation order is ~1e-3).
  dp        examples/train_dma_lm.py with a larger model: tokens/s on 1 GPU vs all GPUs at the
            same per-GPU batch (subprocesses, CUDA_VISIBLE_DEVICES).
  cp        B=1, H=2, Hk=1, D=128, causal, per-key bias, dynamic mask W=2048 (generated on each
            device for its own query rows, in zig-zag order): mask generation + forward +
            backward on 1 GPU vs ``ring_attention`` over all GPUs; the ring's output on the last
            query rows vs one device's attention of those rows.
Without GPUs: ``XLA_FLAGS=--xla_force_host_platform_device_count=4 python
benchmarks/multi_gpu.py --quick`` smoke-tests it on host devices (float32, small shapes).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _command import recorded_command
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dmattn
from jax_dmattn import masks
from jax_dmattn._timing import median_ms
from jax_dmattn.context_parallel import ring_attention, to_zigzag

REPO = Path(__file__).resolve().parents[1]
ON_GPU = jax.default_backend() == "gpu"
DTYPE = jnp.bfloat16 if ON_GPU else jnp.float32
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def normal(seed: int, shape, dtype=DTYPE) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def compare_row(label: str, got, ref, tol: float) -> bool:
    """One table row of relative L2 errors of `got` against `ref`; True when all are <= tol."""
    errs = [rel(g, r) for g, r in zip(got, ref, strict=True)]
    ok = max(errs) <= tol
    say(f"| {label} | " + " | ".join(f"{e:.1e}" for e in errs) + f" | {ok} |")
    return ok


def loss_grads(attend, argnums=(0, 1, 2, 4)):
    """jit(value_and_grad) of sum(out * w) for attend(q, k, v, mask, bias) -> out."""

    def loss(q, k, v, mask, bias, w):
        return jnp.sum(attend(q, k, v, mask, bias).astype(jnp.float32) * w)

    return jax.jit(jax.grad(loss, argnums=argnums))


# ---- equality -------------------------------------------------------------------------------


def part_equality(quick: bool) -> bool:
    n = jax.device_count()
    batch, length, heads, kv_heads, dim, window = (4, 256, 8, 4, 32, 32) if quick else (
        4, 4096, 8, 4, 128, 512)
    q = normal(0, (batch, length, heads, dim))
    k, v = normal(1, (batch, length, kv_heads, dim)), normal(2, (batch, length, kv_heads, dim))
    bias = normal(3, (batch, kv_heads, 1, length))
    w = normal(4, (batch, length, heads, dim), jnp.float32)
    mask = masks.topk_mask(bias, window)

    def attend(q, k, v, mask, bias):
        return jax_dmattn.flash_dmattn(q, k, v, mask, bias, is_causal=True)

    fwd, grads = jax.jit(attend), loss_grads(attend)
    ref = [fwd(q, k, v, mask, bias), *grads(q, k, v, mask, bias, w)]
    names = ("out", "dq", "dk", "dv", "dbias")
    say(f"### Sharded results vs one device ({n} devices; B={batch} L={length} H={heads} "
        f"Hk={kv_heads} D={dim} {jnp.dtype(DTYPE).name}, causal, per-key bias, top-{window} mask)")
    say()
    say("| layout | " + " | ".join(names) + " | ok |")
    say("|---|" + "---|" * (len(names) + 1))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    layouts = {
        "batch (jit)": (P("x"), P("x"), P("x"), P("x")),
        "heads (jit)": (P(None, None, "x"), P(None, None, "x"), P(None, "x"), P(None, "x")),
        "sequence (jit, ring)": (P(None, "x"), P(None, "x"), P(None, None, "x"), P()),
    }
    tol = 2e-2 if ON_GPU else 1e-5
    all_ok = True
    for label, (q_spec, kv_spec, mask_spec, bias_spec) in layouts.items():
        if {"batch": batch % n, "heads": kv_heads % n}.get(label.split()[0], 0):
            continue  # that dim does not split evenly over the devices
        put = [NamedSharding(mesh, s) for s in (q_spec, kv_spec, kv_spec, mask_spec, bias_spec,
                                                q_spec)]
        args = [jax.device_put(x, s) for x, s in zip((q, k, v, mask, bias, w), put, strict=True)]
        all_ok &= compare_row(label, [fwd(*args[:5]), *grads(*args)], ref, tol)

    if batch % n == 0:  # the kernels called directly inside shard_map and pmap, batch split
        def by_batch(x):
            return x.reshape(n, batch // n, *x.shape[1:])

        specs = (P("x"),) * 5
        mapped = {
            "batch (shard_map)": jax.shard_map(attend, mesh=mesh, in_specs=specs,
                                               out_specs=P("x")),
            "batch (pmap)": lambda *xs: jax.pmap(attend)(*map(by_batch, xs)).reshape(q.shape),
        }
        for label, fn in mapped.items():
            got = [jax.jit(fn)(q, k, v, mask, bias), *loss_grads(fn)(q, k, v, mask, bias, w)]
            all_ok &= compare_row(label, got, ref, tol)

    # shard_map + ring_attention, zig-zag: inputs and mask in zig-zag order on both axes.
    def local(q, k, v, mask, bias):
        return ring_attention(q, k, v, mask, bias, axis_name="x", is_causal=True,
                              layout="zigzag")

    ring = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "x"),) * 3 + (P(None, None, "x"),
                                                                           P()),
                         out_specs=P(None, "x"))
    zq, zk, zv, zw = (to_zigzag(x, n) for x in (q, k, v, w))
    zmask = to_zigzag(to_zigzag(mask, n, axis=2), n, axis=3)
    zbias = to_zigzag(bias, n, axis=3)
    zref = [to_zigzag(ref[0], n), to_zigzag(ref[1], n), to_zigzag(ref[2], n),
            to_zigzag(ref[3], n), to_zigzag(ref[4], n, axis=3)]
    got = [jax.jit(ring)(zq, zk, zv, zmask, zbias), *loss_grads(ring)(zq, zk, zv, zmask, zbias,
                                                                       zw)]
    all_ok &= compare_row("sequence (shard_map ring_attention, zig-zag)", got, zref, tol)
    say()
    return all_ok


# ---- data-parallel training -----------------------------------------------------------------


def part_dp(quick: bool) -> None:
    n = jax.device_count()
    per_gpu = 2 if quick else 16
    flags = (["--steps", "30", "--log-every", "10"] if quick else
             ["--steps", "60", "--log-every", "20", "--width", "512", "--layers", "4",
              "--heads", "8", "--kv-heads", "2", "--seq-len", "1024", "--window", "256"])
    results = {}
    for devices in (1, n):
        env = dict(os.environ)
        if ON_GPU:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(devices))
        else:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        cmd = [sys.executable, "-P", str(REPO / "examples" / "train_dma_lm.py"), "--batch",
               str(per_gpu * devices), *flags]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        rate = re.search(r"([\d,]+) tokens/s", out)
        results[devices] = float(rate.group(1).replace(",", "")) if rate else float("nan")
        example = Path(cmd[2]).relative_to(REPO)
        say(f"    {' '.join([str(example), *cmd[3:]])} ({devices} device(s)): "
            f"{out.strip().splitlines()[-1]}")
    say()
    say(f"### Data-parallel training, {per_gpu} sequences per device")
    say()
    say("| devices | tokens/s | scaling |")
    say("|---|---|---|")
    for devices, rate in results.items():
        say(f"| {devices} | {rate:,.0f} | {rate / results[1]:.2f}x |")
    say()


# ---- context parallelism --------------------------------------------------------------------


def part_cp(quick: bool, length: int, window: int, iters: int) -> None:
    n = jax.device_count()
    heads, kv_heads, dim = (2, 1, 32) if quick else (2, 1, 128)
    q = normal(10, (1, length, heads, dim))
    k, v = normal(11, (1, length, kv_heads, dim)), normal(12, (1, length, kv_heads, dim))
    bias = normal(13, (1, kv_heads, 1, length))
    w = normal(14, (1, length, heads, dim))
    say(f"### Context parallelism: B=1 L={length} H={heads} Hk={kv_heads} D={dim} "
        f"{jnp.dtype(DTYPE).name}, causal, dynamic mask W={window} (mask generation + fwd + bwd)")
    say()

    def one_device(q, k, v, bias, w):
        def loss(q, k, v, bias):
            mask = masks.topk_mask(bias, window)
            out = jax_dmattn.flash_dmattn(q, k, v, mask, bias, is_causal=True)
            return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)

    mesh = Mesh(np.array(jax.devices()), ("x",))
    zig = np.asarray(to_zigzag(np.arange(length), n, axis=0))  # zig-zag position -> index

    def local(q, k, v, bias, w):
        # This device's query rows of the dynamic mask from the O(L) key ranges (computed in the
        # original key order, on which top-k depends), in zig-zag coordinates on both axes.
        first, end = (jnp.take(x, zig, axis=-1) for x in masks.topk_key_ranges(bias, window))
        me = jax.lax.axis_index("x")
        rows = jax.lax.dynamic_slice_in_dim(jnp.asarray(zig, jnp.int32), me * (length // n),
                                            length // n)[:, None]
        mask = (first <= rows) & (rows < end)

        def loss(q, k, v, bias):
            out = ring_attention(q, k, v, mask, jnp.take(bias, zig, axis=-1), axis_name="x",
                                 is_causal=True, layout="zigzag")
            return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out
        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)

    seq = P(None, "x")
    ring = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P(), seq),
                                 out_specs=((seq, seq, seq, P()), seq)))
    zq, zk, zv, zw = (to_zigzag(x, n) for x in (q, k, v, w))
    single = jax.jit(one_device)
    try:
        single_ms = median_ms(single, q, k, v, bias, w, warmup=1, iters=iters)
        (_, ref_out) = single(q, k, v, bias, w)
    except Exception as error:  # the single device may run out of memory at long L
        single_ms, ref_out = float("nan"), None
        say(f"one device: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    ring_ms = median_ms(ring, zq, zk, zv, bias, zw, warmup=1, iters=iters)
    (_, ring_out) = ring(zq, zk, zv, bias, zw)
    unit = "GPU" if ON_GPU else "device"
    say("| run | ms | time / 1 device |")
    say("|---|---|---|")
    say(f"| 1 {unit} | {single_ms:.2f} | 1.000 |")
    say(f"| {n} {unit}s, ring (zig-zag) | {ring_ms:.2f} | {ring_ms / single_ms:.3f} |")
    # A slice: the last `tail` query rows, attended on one device from the global K/V.
    tail = min(1024, length // 4)
    ring_tail = np.asarray(jax.jit(lambda o: jnp.take(o, np.argsort(zig)[-tail:], axis=1))(
        ring_out))
    first, end = masks.topk_key_ranges(bias, window)
    tail_rows = jnp.arange(length - tail, length)[:, None]
    tail_mask = (first <= tail_rows) & (tail_rows < end)
    tail_ref = jax_dmattn.flash_dmattn(q[:, -tail:], k, v, tail_mask, bias)
    say()
    say(f"ring output on the last {tail} query rows vs one device's attention of those rows: "
        f"relative L2 {rel(ring_tail, tail_ref):.1e}"
        + ("" if ref_out is None else
           f"; vs the full one-device run: {rel(ring_tail, ref_out[:, -tail:]):.1e}"))
    say()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="equality,dp,cp")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cp-length", type=int, default=131072)
    parser.add_argument("--cp-window", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    devices = jax.devices()
    say(f"# Multi-device runs: {len(devices)} x {devices[0].device_kind}")
    say()
    say(f"- command: `{recorded_command()}`")
    say(f"- jax {jax.__version__}, jax_dmattn {jax_dmattn.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    say()
    parts = args.parts.split(",")
    ok = True
    if "equality" in parts:
        ok = part_equality(args.quick)
    if "dp" in parts:
        part_dp(args.quick)
    if "cp" in parts:
        length = 512 if args.quick else args.cp_length
        part_cp(args.quick, length, 32 if args.quick else args.cp_window, args.iters)
    if args.out:
        args.out.write_text("\n".join(LINES) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
