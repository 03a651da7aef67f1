"""Equinox front end: the Dynamic Mask Attention layer as an ``eqx.Module``.

    import jax_dmattn.equinox

    dma = jax_dmattn.equinox.DynamicMaskAttention(512, 8, num_kv_heads=2, window=256,
                                                  key=jax.random.PRNGKey(0))
    y = dma(x)  # x [B, L, 512] -> [B, L, 512], or [L, 512] -> [L, 512] (e.g. under jax.vmap)
    y = dma(x, segment_ids=ids)  # packed rows: ids [B, L] (or [L]), a document per run of ids
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jax_dmattn.layers import common

__all__ = ["DynamicMaskAttention"]


def _tokenwise(linear: eqx.nn.Linear) -> common.Projection:
    """An ``eqx.nn.Linear`` (``[in] -> [out]``) applied to ``[B, L, in]``."""
    return jax.vmap(jax.vmap(linear))


class DynamicMaskAttention(eqx.Module):
    """Dynamic Mask Attention (Equinox), the twin of ``jax_dmattn.flax.DynamicMaskAttention``:
    GQA projections, RoPE, a per-key dynamic bias ``A · softplus(dt_proj(v))`` and a causal
    top-``window`` mask of it, on the fused kernels (see ``jax_dmattn.layers.common``).

    Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``dt_proj``, ``o_proj`` (``eqx.nn.Linear``
    without bias; weights ``[out, in]``, the transpose of the Flax kernels) and ``A [Hk]``,
    initialised to ones (upstream: zeros; ones make the mask's choice of keys informative from
    the first step). No KV cache. With ``segment_ids`` (packed rows) each run of equal ids is
    a document attended as if alone (see ``jax_dmattn.layers.common``). With ``gated=True``,
    ``a_proj`` (hidden → H) and ``d_proj`` (hidden → Hk) give the gate of gated attention from
    the layer input (None otherwise). ``softmax_threshold`` is ``flash_dmattn``'s.
    """

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    dt_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    A: jax.Array
    a_proj: eqx.nn.Linear | None
    d_proj: eqx.nn.Linear | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    window: int = eqx.field(static=True)
    rope_theta: float | None = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)
    softmax_threshold: float | None = eqx.field(static=True)

    def __init__(self, hidden_size: int, num_heads: int, *, window: int,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 rope: bool = True, rope_theta: float = 10000.0, dtype: Any = None,
                 implementation: str | None = None, gated: bool = False,
                 softmax_threshold: float | None = None, key: jax.Array):
        """Args:
          hidden_size: model width (input and output features).
          num_heads: query heads ``H``.
          window: keys kept per query row by the dynamic mask.
          num_kv_heads: key/value heads ``Hk`` (default ``H``), ``H % Hk == 0``.
          head_dim: ``D`` (default ``hidden_size // H``).
          rope: rotary position embeddings on q and k; rope_theta: their base.
          dtype: parameter dtype (Equinox's default floating dtype when None).
          implementation: ``flash_dmattn``'s (None: the best for the platform).
          gated: add the gate projections ``a_proj`` and ``d_proj`` (gated attention).
          softmax_threshold: ``flash_dmattn``'s (None: exact attention).
          key: initialisation PRNG key.
        """
        self.num_kv_heads, self.head_dim = common.check_config(
            hidden_size, num_heads, num_kv_heads, head_dim, window, rope)
        self.num_heads, self.window = num_heads, window
        self.rope_theta = rope_theta if rope else None
        self.implementation = implementation
        self.softmax_threshold = softmax_threshold
        kv = self.num_kv_heads * self.head_dim
        keys = iter(jax.random.split(key, 5))

        def linear(fan_in: int, fan_out: int) -> eqx.nn.Linear:
            return eqx.nn.Linear(fan_in, fan_out, use_bias=False, dtype=dtype, key=next(keys))

        self.q_proj = linear(hidden_size, num_heads * self.head_dim)
        self.k_proj = linear(hidden_size, kv)
        self.v_proj = linear(hidden_size, kv)
        self.dt_proj = linear(kv, self.num_kv_heads)
        self.o_proj = linear(num_heads * self.head_dim, hidden_size)
        self.A = jnp.ones((self.num_kv_heads,), self.q_proj.weight.dtype)
        # The gate's keys apart, so that a layer's other parameters do not depend on `gated`.
        keys = iter(jax.random.split(jax.random.fold_in(key, 1), 2))
        self.a_proj = linear(hidden_size, num_heads) if gated else None
        self.d_proj = linear(hidden_size, self.num_kv_heads) if gated else None

    def __call__(self, x: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Args:
          x: ``[B, L, hidden]``, or ``[L, hidden]`` for one sequence.
          positions: int ``[B, L]`` or ``[L]`` for RoPE (default ``arange(L)``; with
            `segment_ids`, each token's index within its document).
          segment_ids: optional integer ``[B, L]`` (or ``[1, L]``), ``[L]`` for one sequence:
            the document of each token of a packed row (one document per run of equal ids); a
            token sees only earlier tokens of its document, its top-``window`` chosen among
            them.

        Returns:
          the output of x's shape.
        """
        unbatched = x.ndim == 2
        if unbatched:
            x = x[None]
            if segment_ids is not None and jnp.ndim(segment_ids) != 1:
                raise ValueError(
                    f"segment_ids for one sequence x [L, hidden] = {x.shape[1:]} must be 1-D "
                    f"[L] = [{x.shape[1]}], got shape {jnp.shape(segment_ids)}")
            segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)[None]
        segment_ids = common.check_segment_ids(segment_ids, x.shape[0], x.shape[1])
        q, k, v, bias = common.project(
            x, positions, q_proj=_tokenwise(self.q_proj), k_proj=_tokenwise(self.k_proj),
            v_proj=_tokenwise(self.v_proj), dt_proj=_tokenwise(self.dt_proj), a=self.A,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta, segment_ids=segment_ids)
        gate = None
        if self.a_proj is not None:
            gate = common.gate_values(x, _tokenwise(self.a_proj), _tokenwise(self.d_proj))
        out = common.attend(q, k, v, bias, self.window, self.implementation, segment_ids, gate,
                            self.softmax_threshold)
        out = _tokenwise(self.o_proj)(out)
        return out[0] if unbatched else out
