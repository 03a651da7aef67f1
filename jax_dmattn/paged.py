"""Attention over a paged KV cache, the layout of serving engines (vLLM, FlashInfer): the keys and
values of every sequence live in fixed-size pages of one shared pool, found through a page table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dmattn import validation
from jax_dmattn._primitives import batching, core  # noqa: F401  (batching registers vmap rules)
from jax_dmattn._primitives.paged import gather_pages, paged_forward, reference_forward
from jax_dmattn.params import MIN_PAGE_SIZE, AttentionParams

__all__ = ["MIN_PAGE_SIZE", "gather_pages", "paged_attention"]


def paged_attention(
    query: jax.Array,
    key_pages: jax.Array,
    value_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of new queries to a paged KV cache: ``softmax(scale · Q Kᵀ + bias, masked) V``
    where sequence ``b``'s key ``j`` is row ``j % page_size`` of page ``page_table[b, j //
    page_size]`` of the pools, and only its first ``kv_lens[b]`` keys are visible.

    The CPU kernels and the CUDA decode forward (at most 16 query rows, every query head of a kv
    head in one tile) read the pages in place; other CUDA calls (more rows, e.g. a prefill
    against the cache) gather the sequences' pages into a contiguous cache first. Forward only.

    Args:
      query: ``[B, Lq, H, D]``, float16 or bfloat16 (float32 too on ``cpu`` and ``xla``); the
        new queries of each sequence (without ``is_causal`` every row sees every visible key).
      key_pages, value_pages: pools ``[num_pages, page_size, Hk, D]`` of query's dtype,
        ``H % Hk == 0``, page_size a power of two, at least ``MIN_PAGE_SIZE`` (64).
      page_table: int32 ``[B, max_pages]``; ``Lk = max_pages * page_size``. The entries that
        ``kv_lens`` reaches must name pages of the pool (checked when the table is concrete;
        under ``jit`` an entry outside ``[0, num_pages)`` is clamped into it); the others are
        never read.
      kv_lens: int32 ``[B]``, each in ``[0, Lk]``: the sequences' cached lengths.
      mask: optional bool ``[B|1, H|Hk|1, Lq|1, Lk|1]``, True = attend (key positions are the
        sequences' own, ``j < Lk``).
      bias: optional floating ``[B|1, H|Hk|1, Lq|1, Lk|1]``, added to the logits.
      scale: the logits' scale; ``1 / sqrt(D)`` by default.
      is_causal: the query rows are the last ``Lq`` tokens of each sequence, their keys cached
        (counted in ``kv_lens``): row ``i`` of sequence ``b`` sees keys
        ``j <= kv_lens[b] - Lq + i``, causality aligned to each sequence's own length (a
        multi-token step: speculative decoding, a chunk of a prefill). Applied as a bool mask
        ``[B, 1, Lq, Lk]`` and-ed with ``mask``.
      softcap: optional ``softcap · tanh(logits / softcap)``, after the bias.
      return_lse: also return the log-sum-exp ``[B, H, Lq]`` (float32; ``-inf`` for rows with no
        visible key, whose output is zeros).
      implementation: None (the platform's kernels), ``"cuda"``, ``"cpu"`` or ``"xla"`` (the
        pure-JAX reference over gathered pages).

    Returns:
      ``[B, Lq, H, D]`` in query's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    validation.check_implementation(implementation)
    (q, k, v, table, kv_lens), dims = validation.check_paged_cache(
        query, key_pages, value_pages, page_table, kv_lens, implementation)
    mask = validation.check_mask(mask, dims)
    bias = validation.check_bias(bias, dims, q.dtype)
    params = AttentionParams(scale=validation.check_scale(scale, dims.head_dim),
                             softcap=validation.check_softcap(softcap),
                             implementation=implementation)
    if is_causal:
        causal = _causal_rows(kv_lens, dims.seqlen_q, dims.seqlen_k)
        mask = causal if mask is None else mask & causal
    q_lens = np.full(kv_lens.shape, dims.seqlen_q, np.int32)  # a constant: no kernel
    if implementation == "xla":
        out, lse = reference_forward(params, q, k, v, table, q_lens, kv_lens, mask, bias)
    else:
        out, lse = paged_forward(params, *core.vary_alike(q, k, v, table, q_lens, kv_lens, mask,
                                                          bias))
    return (out, lse) if return_lse else out


def _causal_rows(kv_lens: jax.Array, seqlen_q: int, seqlen_k: int) -> jax.Array:
    """Bool ``[B, 1, Lq, Lk]``: row ``i`` of sequence ``b``, its ``kv_lens[b] - Lq + i``-th
    token, sees keys ``j <= kv_lens[b] - Lq + i``."""
    rows = jnp.arange(seqlen_q)[:, None]
    keys = jnp.arange(seqlen_k)[None, :]
    return (keys <= kv_lens[:, None, None] - seqlen_q + rows)[:, None]

