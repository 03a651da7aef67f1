"""Attention over a paged KV cache, the layout of serving engines (vLLM, FlashInfer): the keys and
values of every sequence live in fixed-size pages of one shared pool, found through a page table.
"""

from __future__ import annotations

import jax
import numpy as np

from jax_dmattn import reference, validation
from jax_dmattn._primitives import batching, core  # noqa: F401  (batching registers vmap rules)
from jax_dmattn._primitives.paged import gather_pages, paged_forward
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
        new queries of each sequence. Every query row sees every visible key: the rows of a
        multi-token step that must not see each other's keys need a ``mask``.
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
    q_lens = np.full(kv_lens.shape, dims.seqlen_q, np.int32)  # a constant: no kernel
    if implementation == "xla":
        out, lse = reference.attention(params, q, gather_pages(k, table), gather_pages(v, table),
                                       mask, bias, q_lens, kv_lens)
    else:
        out, lse = paged_forward(params, *core.vary_alike(q, k, v, table, q_lens, kv_lens, mask,
                                                          bias))
    return (out, lse) if return_lse else out
