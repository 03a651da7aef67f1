"""Flax front ends: an ``attention_fn`` for Flax's attention modules, and the Dynamic Mask
Attention layer for Flax NNX (with a KV cache) and Flax Linen.

    from flax import nnx
    import jax_dmattn.flax

    mha = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
                                 attention_fn=jax_dmattn.flax.attention_fn)
    dma = jax_dmattn.flax.DynamicMaskAttention(512, 8, num_kv_heads=2, window=256,
                                               rngs=nnx.Rngs(0))
    y = dma(x)  # x [B, L, 512] -> [B, L, 512]
    y = dma(x, segment_ids=ids)  # packed rows: ids [B, L], one document per run of equal ids
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx

from jax_dmattn.attention import dot_product_attention
from jax_dmattn.layers import common

__all__ = ["DynamicMaskAttention", "DynamicMaskAttentionLinen", "attention_fn"]


def _fold_batch(x: jax.Array | None, batch: tuple[int, ...]) -> jax.Array | None:
    """A mask or bias broadcastable to ``[*batch, H, Lq, Lk]`` as ``[prod(batch)|1, H|1, Lq|1,
    Lk|1]`` (batch dims that are all 1 stay 1, i.e. broadcast)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    nb = len(batch)
    if x.ndim > nb + 3:
        raise ValueError(f"mask/bias of shape {x.shape} has more dims than [*{batch}, H, Lq, Lk]")
    x = x.reshape((1,) * (nb + 3 - x.ndim) + x.shape)
    if all(d == 1 for d in x.shape[:nb]):
        return x.reshape((1, *x.shape[nb:]))
    x = jnp.broadcast_to(x, batch + x.shape[nb:])
    return x.reshape((math.prod(batch), *x.shape[nb:]))


def _fold_segment_ids(ids: jax.Array | None, batch: tuple[int, ...], length: int,
                      name: str) -> jax.Array | None:
    """Segment ids broadcastable to ``[*batch, length]`` as int32 ``[prod(batch), length]``."""
    if ids is None:
        return None
    ids = jnp.asarray(ids)
    expected = f"[{', '.join(map(str, (*batch, length)))}]"
    lead = (1,) * (len(batch) + 1 - ids.ndim) + ids.shape[:-1]  # leading dims, right-aligned
    if (ids.ndim > len(batch) + 1 or ids.ndim < 1 or ids.shape[-1] != length
            or any(d not in (1, b) for d, b in zip(lead, batch, strict=True))):
        raise ValueError(f"{name} must be an integer array broadcastable to {expected} "
                         f"([*batch, L]), got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array {expected}, got dtype "
                        f"{ids.dtype.name}")
    ids = jnp.broadcast_to(ids.astype(jnp.int32), (*batch, length))
    return ids.reshape(math.prod(batch), length)


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    is_causal: bool = False,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
    """``flax.nnx.dot_product_attention`` / ``flax.linen.dot_product_attention`` on the fused
    kernels: pass it as ``attention_fn=`` to ``nnx.MultiHeadAttention`` or
    ``linen.MultiHeadDotProductAttention``.

    Args:
      query: ``[*batch, Lq, H, D]`` (any number of batch dims, including none).
      key, value: ``[*batch, Lk, Hk, D]``, ``H % Hk == 0``.
      bias: optional, broadcastable to ``[*batch, H, Lq, Lk]`` (each dim full or 1).
      mask: optional, broadcastable to ``[*batch, H, Lq, Lk]``; nonzero / True = attend.
      broadcast_dropout, dropout_rng: unused (no dropout; see ``dropout_rate``).
      dropout_rate: must be 0 unless ``deterministic``: attention dropout is not implemented
        (the probabilities are never materialised), so it raises ``NotImplementedError``.
      deterministic: True disables dropout.
      dtype: computation dtype of q, k, v (default: their promoted dtype).
      precision: ignored: the kernels always accumulate in float32.
      module: must be None: sowing attention weights (``sow_weights=True``) needs the
        probabilities, which are never materialised (``NotImplementedError``).
      is_causal: top-left aligned causal mask (query ``i`` sees keys ``j <= i``), like Flax.
      q_segment_ids, kv_segment_ids: optional integer, broadcastable to ``[*batch, Lq]`` and
        ``[*batch, Lk]``, both or neither (not Flax's own arguments): query ``i`` sees key ``j``
        only where their ids are equal (sequence packing), without an ``[Lq, Lk]`` mask. Flax's
        attention modules do not pass extra arguments to their ``attention_fn``; call this
        function directly, or bind the ids with ``functools.partial`` (or give those modules
        the equivalent ``mask=nnx.make_attention_mask(q_ids, kv_ids, jnp.equal)``).

    Returns:
      ``[*batch, Lq, H, D]``. Same result as Flax's default, except that a query row with no
      visible key gives zeros (Flax averages over all keys there).
    """
    del broadcast_dropout, dropout_rng, precision
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(
            "jax_dmattn.flax.attention_fn does not implement attention dropout (got dropout_rate="
            f"{dropout_rate} with deterministic=False); use dropout_rate=0 or deterministic=True")
    if module is not None:
        raise NotImplementedError(
            "jax_dmattn.flax.attention_fn cannot sow attention weights (sow_weights=True): the "
            "fused kernels never materialise them")
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"query, key and value batch dims differ: {query.shape}, {key.shape}, "
                         f"{value.shape}")
    q, k, v = (x.reshape((math.prod(batch), *x.shape[-3:])) for x in (query, key, value))
    mask = _fold_batch(mask, batch)
    out = dot_product_attention(
        q, k, v, _fold_batch(bias, batch), None if mask is None else mask.astype(jnp.bool_),
        is_causal=is_causal,
        q_segment_ids=_fold_segment_ids(q_segment_ids, batch, q.shape[1], "q_segment_ids"),
        kv_segment_ids=_fold_segment_ids(kv_segment_ids, batch, k.shape[1], "kv_segment_ids"))
    return out.reshape(batch + out.shape[1:])


class DynamicMaskAttention(nnx.Module):
    """Dynamic Mask Attention (Flax NNX): GQA projections, RoPE, a per-key dynamic bias from the
    values and a causal top-``window`` mask of it, on the fused kernels (see
    ``jax_dmattn.layers.common``).

    Parameters: ``q_proj`` (hidden → H·D), ``k_proj``, ``v_proj`` (hidden → Hk·D), ``dt_proj``
    (Hk·D → Hk, on the values), ``o_proj`` (H·D → hidden), all without bias, and ``A [Hk]``,
    initialised to ones (upstream uses zeros, which makes the bias, and so the mask's choice of
    keys, uninformative until ``A`` has moved; with ones it ranks keys from the first step).

    With ``gated=True``, ``a_proj`` (hidden → H) and ``d_proj`` (hidden → Hk), without bias, give
    the gate ``(alpha, delta)`` of gated attention from the layer input (see
    ``jax_dmattn.layers.common``); such a layer has no KV cache. ``softmax_threshold`` is
    ``flash_dmattn``'s (tile skipping; no KV cache either).

    ``layer(x [B, L, hidden], positions=None, segment_ids=None) -> [B, L, hidden]``. After
    ``layer.init_cache(batch, max_length)``, calls decode: each call appends its tokens' keys,
    values, scores (and segment ids) to the cache and attends over the filled prefix, giving
    the rows that a full-sequence call would give for those positions.

    Packed rows: ``segment_ids [B, L]`` makes each run of equal ids a document attended as if
    alone (its own keys only, the top-``window`` of its own causal prefix, RoPE positions from
    0); see ``jax_dmattn.layers.common`` for the cost (a dense ``[B, Hk, L, L]`` mask).
    """

    def __init__(self, hidden_size: int, num_heads: int, *, window: int,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 rope: bool = True, rope_theta: float = 10000.0, dtype: Any = None,
                 param_dtype: Any = jnp.float32, implementation: str | None = None,
                 gated: bool = False, softmax_threshold: float | None = None,
                 rngs: nnx.Rngs):
        """Args:
          hidden_size: model width (input and output features).
          num_heads: query heads ``H``.
          window: keys kept per query row by the dynamic mask.
          num_kv_heads: key/value heads ``Hk`` (default ``H``), ``H % Hk == 0``.
          head_dim: ``D`` (default ``hidden_size // H``).
          rope: rotary position embeddings on q and k; rope_theta: their base.
          dtype: computation dtype (default: inferred from inputs and params).
          param_dtype: parameter dtype.
          implementation: ``flash_dmattn``'s (None: the best for the platform).
          gated: add the gate projections ``a_proj`` and ``d_proj`` (gated attention).
          softmax_threshold: ``flash_dmattn``'s (None: exact attention).
          rngs: initialisation randomness.
        """
        self.num_kv_heads, self.head_dim = common.check_config(
            hidden_size, num_heads, num_kv_heads, head_dim, window, rope)
        self.hidden_size, self.num_heads, self.window = hidden_size, num_heads, window
        self.rope_theta = rope_theta if rope else None
        self.dtype, self.implementation = dtype, implementation
        kv = self.num_kv_heads * self.head_dim

        def linear(fan_in: int, fan_out: int) -> nnx.Linear:
            return nnx.Linear(fan_in, fan_out, use_bias=False, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)

        self.q_proj = linear(hidden_size, num_heads * self.head_dim)
        self.k_proj = linear(hidden_size, kv)
        self.v_proj = linear(hidden_size, kv)
        self.dt_proj = linear(kv, self.num_kv_heads)
        self.o_proj = linear(num_heads * self.head_dim, hidden_size)
        self.A = nnx.Param(jnp.ones((self.num_kv_heads,), param_dtype))
        self.gated = gated
        self.softmax_threshold = softmax_threshold
        if gated:
            self.a_proj = linear(hidden_size, num_heads)
            self.d_proj = linear(hidden_size, self.num_kv_heads)
        else:
            self.a_proj: nnx.Linear | None = nnx.data(None)
            self.d_proj: nnx.Linear | None = nnx.data(None)
        self.cached_key: nnx.Cache | None = nnx.data(None)
        self.cached_value: nnx.Cache | None = nnx.data(None)
        self.cached_bias: nnx.Cache | None = nnx.data(None)
        self.cached_segment_ids: nnx.Cache | None = nnx.data(None)
        self.cache_index: nnx.Cache | None = nnx.data(None)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> None:
        """Allocates an empty KV cache: keys and values ``[batch_size, max_length, Hk, D]`` in
        `dtype` (default: the layer's dtype, else float32), scores ``[batch_size, Hk, 1,
        max_length]`` float32, segment ids ``[batch_size, max_length]`` int32 (0: tokens cached
        without ids count as segment 0) and the fill index. Later calls decode; together they
        may append at most ``max_length`` tokens. Not for a gated layer or one with a softmax
        threshold."""
        if self.gated:
            raise NotImplementedError("a gated DynamicMaskAttention has no KV cache yet (its "
                                      "deltas would need one too); decode with gated=False")
        if self.softmax_threshold is not None:
            raise NotImplementedError("a DynamicMaskAttention with a softmax_threshold has no KV "
                                      "cache (a decoding call would see other positions of the "
                                      "threshold's fixed grid); decode with "
                                      "softmax_threshold=None")
        dtype = dtype or self.dtype or jnp.float32
        shape = (batch_size, max_length, self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_bias = nnx.Cache(
            jnp.zeros((batch_size, self.num_kv_heads, 1, max_length), jnp.float32))
        self.cached_segment_ids = nnx.Cache(jnp.zeros((batch_size, max_length), jnp.int32))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(self, x: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Args:
          x: ``[B, L, hidden]`` (with a cache: the ``L`` tokens that follow the cached ones).
          positions: int ``[B, L]`` or ``[L]`` for RoPE; default ``arange(L)``, or with a cache
            the slots the tokens fill (``index .. index + L - 1``); with `segment_ids`, each
            token's index within its document (over the cache too: a document continued from
            earlier calls goes on counting).
          segment_ids: optional integer ``[B, L]`` (or ``[1, L]``), the document of each token
            of a packed row (each run of equal ids is one document): a token sees only earlier
            tokens of its document. With a cache they are stored beside the keys, so a
            decoding call gives the new tokens' ids and sees the cached tokens of the same
            document; a call without them attends over every filled slot.

        Returns:
          ``[B, L, hidden]``.
        """
        batch, length = x.shape[0], x.shape[1]
        segment_ids = common.check_segment_ids(segment_ids, batch, length)
        if self.cache_index is None:
            q, k, v, bias = common.project(
                x, positions, q_proj=self.q_proj, k_proj=self.k_proj, v_proj=self.v_proj,
                dt_proj=self.dt_proj, a=self.A[...], num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                rope_theta=self.rope_theta, segment_ids=segment_ids)
            gate = (common.gate_values(x, self.a_proj, self.d_proj) if self.gated else None)
            return self.o_proj(common.attend(q, k, v, bias, self.window, self.implementation,
                                             segment_ids, gate, self.softmax_threshold))
        start = self.cache_index[...]
        zero = jnp.zeros((), jnp.int32)
        kv_segment_ids = None
        if segment_ids is not None:
            # Stored first: a document that began in an earlier call sets these tokens'
            # positions.
            cached_ids = jax.lax.dynamic_update_slice(self.cached_segment_ids[...],
                                                      segment_ids, (zero, start))
            self.cached_segment_ids[...] = kv_segment_ids = cached_ids
            if positions is None:
                positions = jax.lax.dynamic_slice_in_dim(
                    common.segment_positions(cached_ids), start, length, axis=1)
        q, k, v, bias = common.project(
            x, positions, q_proj=self.q_proj, k_proj=self.k_proj, v_proj=self.v_proj,
            dt_proj=self.dt_proj, a=self.A[...], num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
            offset=start)
        cache_dtype = self.cached_key[...].dtype
        for cache, new in ((self.cached_key, k), (self.cached_value, v)):
            cache[...] = jax.lax.dynamic_update_slice(
                cache[...], new.astype(cache_dtype), (zero, start, zero, zero))
        self.cached_bias[...] = jax.lax.dynamic_update_slice(
            self.cached_bias[...], bias, (zero, zero, zero, start))
        end = start + x.shape[1]
        self.cache_index[...] = end
        out = common.attend_cached(q.astype(cache_dtype), self.cached_key[...],
                                   self.cached_value[...], self.cached_bias[...], end,
                                   self.window, self.implementation, segment_ids,
                                   kv_segment_ids)
        return self.o_proj(out)


class DynamicMaskAttentionLinen(linen.Module):
    """The Flax Linen twin of :class:`DynamicMaskAttention` (same parameters under the same
    names: ``q_proj``, ``k_proj``, ``v_proj``, ``dt_proj``, ``o_proj`` Dense kernels without
    bias, and ``A [Hk]`` initialised to ones; no KV cache).

    ``layer.apply(variables, x [B, L, hidden], positions=None, segment_ids=None) -> [B, L,
    hidden]``; ``segment_ids [B, L]`` as in :class:`DynamicMaskAttention` (packed rows).

    Attributes:
      hidden_size: model width (output features).
      num_heads: query heads ``H``.
      window: keys kept per query row by the dynamic mask.
      num_kv_heads: key/value heads ``Hk`` (default ``H``).
      head_dim: ``D`` (default ``hidden_size // H``).
      rope, rope_theta: rotary position embeddings on q and k, and their base.
      dtype, param_dtype: computation and parameter dtypes.
      implementation: ``flash_dmattn``'s (None: the best for the platform).
      gated: add the gate projections ``a_proj`` (→ H) and ``d_proj`` (→ Hk) of gated
        attention, as in :class:`DynamicMaskAttention`.
      softmax_threshold: ``flash_dmattn``'s (None: exact attention).
    """

    hidden_size: int
    num_heads: int
    window: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope: bool = True
    rope_theta: float = 10000.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    implementation: str | None = None
    gated: bool = False
    softmax_threshold: float | None = None

    @linen.compact
    def __call__(self, x: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """x: ``[B, L, hidden]``; positions: int ``[B, L]`` or ``[L]`` (default ``arange(L)``,
        with segment ids each token's index within its document); segment_ids: optional
        integer ``[B, L]`` (or ``[1, L]``), one document per run of equal ids, each attended as
        if alone. Returns ``[B, L, hidden]``."""
        num_kv_heads, head_dim = common.check_config(
            self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.window,
            self.rope)
        segment_ids = common.check_segment_ids(segment_ids, x.shape[0], x.shape[1])

        def dense(features: int, name: str) -> linen.Dense:
            return linen.Dense(features, use_bias=False, dtype=self.dtype,
                               param_dtype=self.param_dtype, name=name)

        a = self.param("A", linen.initializers.ones, (num_kv_heads,), self.param_dtype)
        q, k, v, bias = common.project(
            x, positions, q_proj=dense(self.num_heads * head_dim, "q_proj"),
            k_proj=dense(num_kv_heads * head_dim, "k_proj"),
            v_proj=dense(num_kv_heads * head_dim, "v_proj"),
            dt_proj=dense(num_kv_heads, "dt_proj"), a=a, num_heads=self.num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim,
            rope_theta=self.rope_theta if self.rope else None, segment_ids=segment_ids)
        gate = (common.gate_values(x, dense(self.num_heads, "a_proj"),
                                   dense(num_kv_heads, "d_proj")) if self.gated else None)
        out = common.attend(q, k, v, bias, self.window, self.implementation, segment_ids, gate,
                            self.softmax_threshold)
        return dense(self.hidden_size, "o_proj")(out)
