"""Decoding with a paged KV cache, the layout of serving engines: a small stack of GQA attention
layers (random weights, greedy sampling) extends a batch of sequences of different lengths, their
keys and values kept in 64-key pages of one shared pool per layer, found through a page table
whose pages a free list hands out as the sequences grow. ``paged_attention`` reads the pages in
place (on a GPU, the decode kernel). Prints the decoding rate in tokens per second and checks one
step against attention over the same keys laid out contiguously.

    python examples/paged_decode.py [--batch 8] [--context 8192] [--steps 64]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_dmattn import dot_product_attention, paged_attention
from jax_dmattn.paged import MIN_PAGE_SIZE, gather_pages

PAGE_SIZE = MIN_PAGE_SIZE


class PageTable:
    """Each sequence's pages, handed out from a free list as it grows (host side)."""

    def __init__(self, batch: int, num_pages: int, max_pages: int):
        self.free = list(np.random.default_rng(0).permutation(num_pages))  # any order works
        self.table = np.full((batch, max_pages), -1, np.int32)

    def reserve(self, lengths: np.ndarray) -> bool:
        """Pages for every sequence up to `lengths`; True when the table changed."""
        changed = False
        for b, length in enumerate(lengths):
            for slot in range(-(-int(length) // PAGE_SIZE)):
                if self.table[b, slot] < 0:
                    self.table[b, slot] = self.free.pop()
                    changed = True
        return changed


def init_model(key, layers: int, vocab: int, hidden: int, heads: int, kv_heads: int,
               head_dim: int, dtype):
    def dense(key, fan_in, fan_out):
        return (jax.random.normal(key, (fan_in, fan_out)) / np.sqrt(fan_in)).astype(dtype)

    keys = jax.random.split(key, 3 * layers + 2)
    blocks = [dict(q=dense(keys[3 * i], hidden, heads * head_dim),
                   kv=dense(keys[3 * i + 1], hidden, 2 * kv_heads * head_dim),
                   o=dense(keys[3 * i + 2], heads * head_dim, hidden)) for i in range(layers)]
    embed = jax.random.normal(keys[-2], (vocab, hidden)).astype(dtype)
    return dict(blocks=blocks, embed=embed, unembed=dense(keys[-1], hidden, vocab))


@functools.partial(jax.jit, static_argnames=("heads", "kv_heads"), donate_argnums=(1,))
def decode_step(model, pools, table, lengths, tokens, *, heads: int, kv_heads: int):
    """One token per sequence: its keys and values go into the page slot at its length, then
    every layer attends over the sequence's pages. -> (next tokens [B], pools)."""
    x = model["embed"][tokens]  # [B, hidden]
    pages = table[jnp.arange(tokens.shape[0]), lengths // PAGE_SIZE]
    slots = lengths % PAGE_SIZE
    new_pools = []
    for block, (k_pool, v_pool) in zip(model["blocks"], pools, strict=True):
        head_dim = k_pool.shape[-1]
        q = (x @ block["q"]).reshape(-1, 1, heads, head_dim)
        k, v = jnp.split((x @ block["kv"]).reshape(-1, 2 * kv_heads, head_dim), 2, axis=1)
        k_pool = k_pool.at[pages, slots].set(k)
        v_pool = v_pool.at[pages, slots].set(v)
        out = paged_attention(q, k_pool, v_pool, table, lengths + 1)
        x = x + out.reshape(x.shape[0], -1) @ block["o"]
        new_pools.append((k_pool, v_pool))
    logits = (x @ model["unembed"]).astype(jnp.float32)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), new_pools


def main() -> None:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192 if on_gpu else 512,
                        help="the longest sequence's cached length before decoding")
    parser.add_argument("--steps", type=int, default=64 if on_gpu else 8)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    heads, kv_heads, head_dim, hidden, vocab = 32, 8, 128, 1024, 4096
    dtype = jnp.bfloat16 if on_gpu else jnp.float32

    rng = np.random.default_rng(0)
    lengths = rng.integers(args.context // 4, args.context + 1, args.batch).astype(np.int32)
    max_pages = -(-(args.context + args.steps) // PAGE_SIZE)
    num_pages = args.batch * max_pages + 8
    pages = PageTable(args.batch, num_pages, max_pages)
    pages.reserve(lengths)
    # The cached context: random keys and values in every layer's pool (a prefill would put
    # the prompt's there).
    keys = jax.random.split(jax.random.PRNGKey(1), 2 * args.layers + 1)
    shape = (num_pages, PAGE_SIZE, kv_heads, head_dim)
    pools = [tuple(jax.random.normal(keys[2 * i + j], shape, dtype) for j in range(2))
             for i in range(args.layers)]
    model = init_model(keys[-1], args.layers, vocab, hidden, heads, kv_heads, head_dim, dtype)
    tokens = jnp.asarray(rng.integers(0, vocab, args.batch), jnp.int32)
    step = functools.partial(decode_step, heads=heads, kv_heads=kv_heads)

    table = jnp.asarray(pages.table)
    start, generated = None, []
    for i in range(args.steps):
        if i == 1:  # the first step compiled: time the rest
            jax.block_until_ready(tokens)
            start = time.perf_counter()
        if pages.reserve(lengths + 1):
            table = jnp.asarray(pages.table)
        tokens, pools = step(model, pools, table, jnp.asarray(lengths), tokens)
        lengths = lengths + 1
        generated.append(tokens)
    jax.block_until_ready(tokens)
    elapsed = time.perf_counter() - start if start is not None else float("nan")
    rate = args.batch * (args.steps - 1) / elapsed
    print(f"{jax.devices()[0].device_kind}: {args.layers} layers, batch {args.batch}, cached "
          f"{int(lengths.min()) - args.steps}..{int(lengths.max()) - args.steps} tokens, "
          f"{PAGE_SIZE}-key pages: {rate:,.0f} tokens/s ({elapsed / (args.steps - 1) * 1e3:.2f} "
          "ms a step)")
    print("first sequence's tokens:", [int(t[0]) for t in generated[:8]])

    # The last layer's attention over its pages, against the same keys laid out contiguously.
    k_pool, v_pool = pools[-1]
    q = jax.random.normal(keys[0], (args.batch, 1, heads, head_dim), dtype)
    n = jnp.asarray(lengths)
    paged = paged_attention(q, k_pool, v_pool, table, n)
    contiguous = dot_product_attention(q, gather_pages(k_pool, table), gather_pages(v_pool, table),
                                       key_value_seq_lengths=n)
    error = float(jnp.max(jnp.abs(paged.astype(jnp.float32) - contiguous.astype(jnp.float32))))
    print(f"max |paged - contiguous| = {error:.2e}")


if __name__ == "__main__":
    main()
