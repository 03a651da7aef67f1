"""Wall-clock timing of jitted JAX calls: median of synchronised calls, or back to back."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def median_ms(fn: Callable, *args, warmup: int = 2, iters: int = 20,
              warmup_s: float = 0.0) -> float:
    """Median milliseconds of ``fn(*args)``, each call waited on with ``block_until_ready``,
    after `warmup` calls and at least `warmup_s` seconds of calls (a GPU idle during compilation
    runs short calls at lower clocks until its clocks ramp up again)."""
    start = time.perf_counter()
    calls = 0
    while calls < warmup or time.perf_counter() - start < warmup_s:
        jax.block_until_ready(fn(*args))
        calls += 1
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def back_to_back_ms(fn: Callable, *args, calls: int = 20, repeats: int = 3,
                    warmup: int = 3) -> float:
    """Milliseconds per call of `calls` calls issued without waiting, then one
    ``block_until_ready``; the best of `repeats` such batches after `warmup` calls
    (DESIGN.md §5)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) * 1e3 / calls)
    return best


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs by DESIGN.md §5: ``4·B·H·Lq·Lk·D``, halved for causal (backward: 2.5×)."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops
