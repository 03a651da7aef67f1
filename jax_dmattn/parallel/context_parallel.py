"""Context parallelism: attention over a sequence sharded across mesh devices, as a ring over K/V.

Each of the ``n`` devices of the ring holds ``L / n`` query rows and the matching key/value chunk.
The forward passes the K/V chunks around the ring (``ppermute``); at each step a device attends
its query rows to the chunk it holds and merges the chunk's ``(out, lse)`` into its running result
in float32. The backward passes K/V around again: P is recomputed from the global lse, so each
chunk's contributions to the gradients simply add up; dq and dbias accumulate where they are,
while dk/dv travel with their chunk and arrive home after the last step. The full sequence is
never gathered on one device.

A mask or bias keeps its local query rows and all key columns (``[.., L/n|1, L|1]``); each step
slices the key columns of the chunk it holds, without communication.

Causality (``is_causal`` with ``Lq == Lk``) skips chunks that lie entirely in a device's future.
``layout="contiguous"`` gives device ``i`` chunk ``i`` of ``n``, so device 0 does one block and
device ``n - 1`` does ``n``; ``layout="zigzag"`` splits the sequence into ``2n`` chunks and gives
device ``i`` chunks ``i`` and ``2n - 1 - i`` (see :func:`to_zigzag`), so that every step after the
first costs every device exactly half a block.

Both :func:`ring_attention` (inside ``shard_map``) and the sharding rule of the kernels for
sequence-sharded ``jit`` inputs (``sharding.py``) run :func:`ring_forward` and
:func:`ring_backward`; they differ only in the per-chunk step functions (:class:`StepFns`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dmattn import reference, validation
from jax_dmattn._primitives import core, ops
from jax_dmattn.params import AttentionParams

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")
AxisName = str | tuple[str, ...]


class StepFns(NamedTuple):
    """Attention of the local query rows to one K/V chunk (no sequence lengths).

    ``forward(params, q, k, v, mask, bias) -> (out, lse)``: out zeros and lse ``-inf`` on rows with
    no visible key in the chunk. ``backward(params, q, k, v, out, dout, lse, dlse, mask, bias) ->
    (dq, dk, dv, dbias)``: the chunk's contributions, with P recomputed from the global ``lse``
    (``out``, ``dout``, ``dlse`` global too); dbias is None without a bias.
    """

    forward: Callable
    backward: Callable


def _reference_backward(params: AttentionParams, q, k, v, out, dout, lse, dlse, mask, bias):
    """A chunk's gradient contributions in pure JAX, P recomputed from the global lse.

    The reference's own vjp would renormalise over the chunk. Instead this differentiates the
    surrogate ``Σ_i w_i (dO_i · o_i + dlse_i − dO_i · O_i)`` with ``w_i = exp(lse_chunk_i − lse_i)``
    and ``o`` the chunk's output: it equals ``Σ_ij P_ij (dO_i · v_j + dlse_i − D_i)`` with the
    global ``P``, whose logit derivative is the ``dS`` of the kernels.
    """
    ct = lse.dtype

    def row_dot(a, b):  # [*B, Lq, H, D] x 2 -> [*B, H, Lq]
        return jnp.swapaxes(jnp.sum(a.astype(ct) * b.astype(ct), -1), -1, -2)

    row_terms = dlse.astype(ct) - row_dot(dout, out)
    safe_lse = jnp.where(jnp.isfinite(lse), lse, 0)

    def surrogate(q, k, v, bias):
        chunk_out, chunk_lse = reference.attention(params, q, k, v, mask, bias)
        share = jnp.exp(chunk_lse - safe_lse)  # 0 on rows with no visible key in the chunk
        return jnp.sum(share * (row_dot(dout, chunk_out) + row_terms))

    if bias is None:
        return (*jax.grad(surrogate, (0, 1, 2))(q, k, v, None), None)
    return jax.grad(surrogate, (0, 1, 2, 3))(q, k, v, bias)


def _reference_forward(params: AttentionParams, q, k, v, mask, bias):
    return reference.attention(params, q, k, v, mask, bias)


def _kernel_backward(*args):
    """``ops.backward``'s dq, dk, dv and dbias (a ring step takes no gate)."""
    return ops.backward(*args)[:4]


# The chunks' outputs in float32: the merged out is the backward's residual (ops.Optionals).
KERNEL_STEPS = StepFns(functools.partial(ops.forward, float32_out=True), _kernel_backward)
REFERENCE_STEPS = StepFns(_reference_forward, _reference_backward)


# ---- which calls ring -----------------------------------------------------------------------


def ring_candidate(params: AttentionParams, has_seqlens: bool, seqlen_q: int,
                   seqlen_k: int, has_segments: bool = False) -> bool:
    """True when a call's visibility rule can run as a ring over sequence chunks: no sequence
    lengths, no segment ids, key or row ranges or block indices (`has_segments` stands for all:
    their rules name absolute positions), no window (a per-kv-head table's sinks are absolute
    positions too), and causality only on the main diagonal of a square score matrix (the ring
    then needs three kinds of step: past, diagonal, future)."""
    if (has_seqlens or has_segments or params.window_left >= 0
            or params.window_right not in (-1, 0) or params.window_sizes is not None):
        return False
    return params.window_right == -1 or (params.diagonal_offset == 0 and seqlen_q == seqlen_k)


def ring_supported(params: AttentionParams, has_seqlens: bool, seqlen_q: int, seqlen_k: int,
                   num_shards: int, has_segments: bool = False) -> bool:
    """:func:`ring_candidate`, and both sequences split evenly into ``num_shards`` chunks."""
    return (ring_candidate(params, has_seqlens, seqlen_q, seqlen_k, has_segments)
            and seqlen_q % num_shards == 0 and seqlen_k % num_shards == 0)


# ---- zig-zag order --------------------------------------------------------------------------


def zigzag_order(num_shards: int) -> np.ndarray:
    """Chunk indices of the zig-zag order: ``[0, 2n-1, 1, 2n-2, ...]`` for ``n = num_shards``."""
    first = np.arange(num_shards)
    return np.stack([first, 2 * num_shards - 1 - first], axis=1).reshape(-1)


def _permute_chunks(x: jax.Array, order: np.ndarray, axis: int) -> jax.Array:
    axis = axis % x.ndim
    size = x.shape[axis]
    if size % len(order):
        raise ValueError(f"axis {axis} of shape {x.shape} does not split into {len(order)} chunks"
                         f" (zig-zag over {len(order) // 2} shards)")
    chunks = x.reshape(*x.shape[:axis], len(order), size // len(order), *x.shape[axis + 1:])
    return jnp.take(chunks, order, axis=axis).reshape(x.shape)


def to_zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """``x`` with `axis` (a global sequence, length divisible by ``2 * num_shards``) reordered so
    that sharding it evenly over ``num_shards`` devices gives device ``i`` chunks ``i`` and
    ``2 * num_shards - 1 - i``. Apply it to q, k, v (axis 1) and to a mask or bias (axes 2 and 3
    where they are full), shard, call :func:`ring_attention` with ``layout="zigzag"``, and undo it
    on the output with :func:`from_zigzag`."""
    return _permute_chunks(x, zigzag_order(num_shards), axis)


def from_zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """The inverse of :func:`to_zigzag`: `axis` back in sequence order."""
    return _permute_chunks(x, np.argsort(zigzag_order(num_shards)), axis)


# ---- what one ring step computes --------------------------------------------------------------


class _Block(NamedTuple):
    """The part of a step a device computes: a half (0 or 1; None: all) of its query rows and of
    the K/V chunk it holds, and whether the causal diagonal runs through that block."""

    q_half: int | None
    kv_half: int | None
    causal: bool


_FULL = _Block(None, None, False)
_DIAGONAL = _Block(None, None, True)
_SKIP = None  # the chunk lies entirely in the device's future


def _step_plan(layout: str, causal: bool, step: int, me: jax.Array):
    """``(blocks, index)``: the blocks a device may compute at ring `step`, and which one it does
    (None when there is a single choice).

    At step ``t > 0`` device ``me`` holds the chunk of device ``me - t`` (mod n), which lies in its
    past when ``me >= t`` and in its future otherwise. Contiguous: a past chunk is fully visible,
    a future one is skipped. Zig-zag: device ``me`` holds sequence chunks ``me`` and ``2n-1-me``;
    from a past device, both its query chunks see the kv chunk's first half and neither its second;
    from a future device, its second query chunk sees all of the kv chunk and its first none.
    Step 0 (its own chunk) is causal over the whole local block in both layouts."""
    if not causal:
        return (_FULL,), None
    if step == 0:
        return (_DIAGONAL,), None
    from_future = (me < step).astype(jnp.int32)
    if layout == "contiguous":
        return (_FULL, _SKIP), from_future
    return (_Block(None, 0, False), _Block(1, None, False)), from_future


def _half(x: jax.Array, axis: int, half: int | None, full: int) -> jax.Array:
    """Half `half` of `axis` when it has the full size `full` (not broadcast)."""
    if half is None or x.shape[axis] != full:
        return x
    size = full // 2
    return jax.lax.slice_in_dim(x, half * size, (half + 1) * size, axis=axis % x.ndim)


def _unhalf(x: jax.Array, axis: int, half: int | None, fill: float) -> jax.Array:
    """`x`, half `half` of an operand along `axis`, padded with `fill` to the operand's size."""
    if half is None:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis % x.ndim] = (half * x.shape[axis], (1 - half) * x.shape[axis])
    return jnp.pad(x, pad, constant_values=fill)


def _key_columns(x: jax.Array, start: jax.Array, width: int, seqlen_k: int) -> jax.Array:
    """The key columns ``[start, start + width)`` of a mask or bias whose last dim is the whole
    key sequence (broadcast columns stay as they are)."""
    if x.shape[-1] != seqlen_k:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, width, axis=x.ndim - 1)


class _Ring(NamedTuple):
    """Static facts of one ring call."""

    axis_name: AxisName
    size: int
    layout: str
    causal: bool
    chunk_q: int  # local query rows
    chunk_k: int  # local K/V rows

    @classmethod
    def of(cls, params: AttentionParams, q, k, axis_name: AxisName, layout: str) -> _Ring:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        causal = params.window_right == 0
        ring = cls(axis_name, jax.lax.axis_size(axis_name), layout, causal, q.shape[-3],
                   k.shape[-3])
        # The step plans know three relations of a chunk (past, diagonal, future) and, for the
        # zig-zag order, two halves per device.
        if not ring_candidate(params, False, ring.chunk_q, ring.chunk_k):
            raise ValueError(f"a ring needs no window and causality only for Lq == Lk, got "
                             f"{params} for local q {q.shape}, k {k.shape}")
        if causal and layout == "zigzag" and ring.chunk_q % 2:
            raise ValueError(f"layout='zigzag' needs an even local sequence length, got {q.shape}")
        return ring

    @property
    def seqlen_k(self) -> int:
        return self.size * self.chunk_k

    def sends(self) -> list[tuple[int, int]]:
        return [(i, (i + 1) % self.size) for i in range(self.size)]

    def operands(self, block: _Block, src: jax.Array, q_like, kv_like, lse_like, columns):
        """The block's slices of query-row operands (``[*B, Lq, H, D]``), of K/V, of lse-shaped
        operands (``[*B, H, Lq]``) and of masks/biases (local rows, all key columns)."""
        q_like = [_half(x, -3, block.q_half, self.chunk_q) for x in q_like]
        kv_like = [_half(x, -3, block.kv_half, self.chunk_k) for x in kv_like]
        lse_like = [_half(x, -1, block.q_half, self.chunk_q) for x in lse_like]
        width = self.chunk_k // (1 if block.kv_half is None else 2)
        start = src * self.chunk_k + (block.kv_half or 0) * width
        columns = [None if x is None else _half(_key_columns(x, start, width, self.seqlen_k), -2,
                                                block.q_half, self.chunk_q) for x in columns]
        return q_like, kv_like, lse_like, columns


def _step_params(params: AttentionParams, block: _Block) -> AttentionParams:
    # Off the diagonal a block is fully visible: only the mask (if any) hides keys there.
    return params if block.causal else dataclasses.replace(params, window_right=-1)


def _run_step(ring: _Ring, step: int, me: jax.Array, branch: Callable, skip: Callable):
    """The step's one block, or a switch over the blocks it may compute (`branch(block)` computes
    one, `skip()` stands for a skipped one)."""
    blocks, index = _step_plan(ring.layout, ring.causal, step, me)
    fns = [skip if b is _SKIP else functools.partial(branch, b) for b in blocks]
    return fns[0]() if index is None else jax.lax.switch(index, fns)


# ---- forward --------------------------------------------------------------------------------


def _rows(w: jax.Array) -> jax.Array:
    """``[*B, H, Lq]`` -> ``[*B, Lq, H, 1]``, to scale an output."""
    return jnp.swapaxes(w, -1, -2)[..., None]


def _merge(out: jax.Array, lse: jax.Array, step_out: jax.Array, step_lse: jax.Array):
    """Merges a chunk's ``(out, lse)`` into the running ones (float32). Rows that have seen no
    visible key yet keep lse ``-inf`` and out 0, with no NaN."""
    new_lse = jnp.logaddexp(lse, step_lse)
    safe = jnp.where(jnp.isfinite(new_lse), new_lse, 0)
    out = _rows(jnp.exp(lse - safe)) * out + _rows(jnp.exp(step_lse - safe)) * step_out
    return out, new_lse


def ring_forward(steps: StepFns, params: AttentionParams, q: jax.Array, k: jax.Array,
                 v: jax.Array, mask: jax.Array | None, bias: jax.Array | None, *,
                 axis_name: AxisName, layout: str = "contiguous",
                 out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """``(out [*B, Lq/n, H, D], lse [*B, H, Lq/n])`` of the local query rows over the whole ring;
    out in `out_dtype` (default q's; float32 keeps the merge's precision for the backward).

    Runs where `axis_name` is bound (``shard_map``, a partitioned lowering). q, k, v are the local
    chunks ``[*B, L/n, H|Hk, D]``; mask and bias ``[*B|1, H|Hk|1, L/n|1, L|1]``; `params` is the
    call's visibility rule (:func:`ring_candidate`), causal on the global sequence.
    """
    ring = _Ring.of(params, q, k, axis_name, layout)
    me = jax.lax.axis_index(axis_name)
    acc_dtype = jnp.promote_types(q.dtype, jnp.float32)

    def skip():
        return (jnp.zeros_like(q, dtype=acc_dtype),
                jnp.full_like(q, -jnp.inf, shape=ops.lse_shape(q.shape), dtype=acc_dtype))

    out = lse = None
    kv = (k, v)
    for step in range(ring.size):
        # Send the chunk on before computing with it, so the transfer overlaps the kernel.
        next_kv = jax.lax.ppermute(kv, axis_name, ring.sends()) if step + 1 < ring.size else None
        src = (me - step) % ring.size

        def block_forward(block: _Block, kv=kv, src=src):
            (qb,), kvb, _, (maskb, biasb) = ring.operands(block, src, [q], kv, [], [mask, bias])
            o, lse_b = steps.forward(_step_params(params, block), qb, *kvb, maskb, biasb)
            return (_unhalf(o.astype(acc_dtype), -3, block.q_half, 0),
                    _unhalf(lse_b.astype(acc_dtype), -1, block.q_half, -jnp.inf))

        step_out, step_lse = _run_step(ring, step, me, block_forward, skip)
        if out is None:
            out, lse = step_out, step_lse
        else:
            out, lse = _merge(out, lse, step_out, step_lse)
        kv = next_kv
    return out.astype(out_dtype or q.dtype), lse


# ---- backward -------------------------------------------------------------------------------


def ring_backward(steps: StepFns, params: AttentionParams, q: jax.Array, k: jax.Array,
                  v: jax.Array, out: jax.Array, dout: jax.Array, lse: jax.Array,
                  dlse: jax.Array, mask: jax.Array | None, bias: jax.Array | None, *,
                  axis_name: AxisName, layout: str = "contiguous",
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """``(dq, dk, dv, dbias)`` of the local chunks (dbias None without a bias), given the global
    ``out``, ``lse`` of :func:`ring_forward` and their cotangents for the local rows.

    Shapes as in :func:`ring_forward`; dk and dv are full over any vmap batch dims (as the
    backward primitive's), dbias has the local bias's shape there too. dbias is this device's
    share: for a bias broadcast over query rows (or heads, batch) the caller sums it over the
    devices that share the bias, as for any replicated operand.
    """
    ring = _Ring.of(params, q, k, axis_name, layout)
    me = jax.lax.axis_index(axis_name)
    acc_dtype = jnp.promote_types(q.dtype, jnp.float32)
    dk_shape = ops.gradient_shape(k.shape, q.shape, 1)

    def skip():
        grads = [jnp.zeros_like(q), jnp.zeros_like(q, shape=dk_shape),
                 jnp.zeros_like(q, shape=dk_shape)]
        if bias is not None:  # the bias's key columns of one chunk
            columns = ring.chunk_k if bias.shape[-1] == ring.seqlen_k else 1
            shape = ops.gradient_shape((*bias.shape[:-1], columns), q.shape, 1)
            grads.append(jnp.zeros_like(q, shape=shape, dtype=bias.dtype))
        return tuple(grads)

    dq = jnp.zeros_like(q, dtype=acc_dtype)
    dkv = (jnp.zeros_like(q, shape=dk_shape, dtype=acc_dtype),) * 2
    dbias = None if bias is None else jnp.zeros_like(
        q, shape=ops.gradient_shape(bias.shape, q.shape, 1), dtype=acc_dtype)
    kv = (k, v)
    for step in range(ring.size):
        next_kv = jax.lax.ppermute(kv, axis_name, ring.sends()) if step + 1 < ring.size else None
        src = (me - step) % ring.size

        def block_backward(block: _Block, kv=kv, src=src):
            (qb, ob, dob), kvb, (lb, dlb), (maskb, biasb) = ring.operands(
                block, src, [q, out, dout], kv, [lse, dlse], [mask, bias])
            dqb, dkb, dvb, dbb = steps.backward(_step_params(params, block), qb, *kvb, ob, dob,
                                                lb, dlb, maskb, biasb)
            padded = [_unhalf(dqb, -3, block.q_half, 0), _unhalf(dkb, -3, block.kv_half, 0),
                      _unhalf(dvb, -3, block.kv_half, 0)]
            if dbb is not None:  # padded where the bias has full rows / columns (not broadcast)
                dbb = _unhalf(dbb, -2, block.q_half if bias.shape[-2] == ring.chunk_q else None, 0)
                padded.append(_unhalf(dbb, -1, block.kv_half if bias.shape[-1] == ring.seqlen_k
                                      else None, 0))
            return tuple(padded)

        grads = _run_step(ring, step, me, block_backward, skip)
        dq = dq + grads[0].astype(acc_dtype)
        dk, dv = (acc + g.astype(acc_dtype) for acc, g in zip(dkv, grads[1:3], strict=True))
        if bias is not None:
            dbias = _add_columns(dbias, grads[3].astype(acc_dtype), src * ring.chunk_k,
                                 ring.seqlen_k)
        # dk/dv follow their chunk around the ring: after the last step's send they are home.
        dkv = jax.lax.ppermute((dk, dv), axis_name, ring.sends())
        kv = next_kv
    dk, dv = dkv
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None if bias is None else dbias.astype(bias.dtype))


def _add_columns(acc: jax.Array, update: jax.Array, start: jax.Array, seqlen_k: int):
    """``acc`` plus `update` at key columns ``[start, ...)`` (everywhere for broadcast columns)."""
    if acc.shape[-1] != seqlen_k:
        return acc + update
    axis = acc.ndim - 1
    current = jax.lax.dynamic_slice_in_dim(acc, start, update.shape[-1], axis=axis)
    return jax.lax.dynamic_update_slice_in_dim(acc, current + update, start, axis=axis)


# ---- the public function --------------------------------------------------------------------


class _Config(NamedTuple):
    steps: StepFns
    params: AttentionParams
    axis_name: AxisName
    layout: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(config: _Config, q, k, v, mask, bias):
    return ring_forward(config.steps, config.params, q, k, v, mask, bias,
                        axis_name=config.axis_name, layout=config.layout)


def _ring_attention_fwd(config: _Config, q, k, v, mask, bias):
    # The residual out stays float32 (see ops.Optionals); the caller gets q's dtype.
    out, lse = ring_forward(config.steps, config.params, q, k, v, mask, bias,
                            axis_name=config.axis_name, layout=config.layout,
                            out_dtype=jnp.float32)
    return (out.astype(q.dtype), lse), (q, k, v, mask, bias, out, lse)


def _ring_attention_bwd(config: _Config, residuals, cotangents):
    q, k, v, mask, bias, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv, dbias = ring_backward(config.steps, config.params, q, k, v, out, dout, lse, dlse,
                                      mask, bias, axis_name=config.axis_name,
                                      layout=config.layout)
    return dq, dk, dv, None, dbias


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def _steps_for(params: AttentionParams, dtype, head_dim: int) -> StepFns:
    """The kernels, or the pure-JAX steps for ``implementation="xla"`` and where the default
    backend has no kernel for this dtype/head dim (the primitives would fall back to a reference
    whose backward renormalises over the chunk)."""
    if params.implementation == "xla":
        return REFERENCE_STEPS
    if params.implementation is not None:
        return KERNEL_STEPS
    backend = jax.default_backend()
    platform = "cuda" if backend == "gpu" else backend
    return KERNEL_STEPS if ops.uses_kernel(platform, params, dtype, head_dim) else REFERENCE_STEPS


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    axis_name: AxisName,
    is_causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    layout: Layout = "contiguous",
    deterministic: bool = False,
    return_lse: bool = False,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``flash_dmattn`` over a sequence sharded on mesh axis `axis_name`, as a ring over K/V.

    Call it inside ``shard_map`` (or ``pmap``) with the local shards of a sequence split evenly
    over the ``n`` devices of `axis_name`: K/V chunks travel around the ring (``ppermute``) and
    nothing is all-gathered. Same semantics as ``flash_dmattn`` on the global arrays; causal is
    on the global sequence (bottom-right and top-left agree for ``Lq == Lk``).

    Args:
      query: local rows ``[B, Lq/n, H, D]``.
      key, value: local chunks ``[B, Lk/n, Hk, D]``, ``H % Hk == 0``.
      mask: optional bool ``[B|1, H|Hk|1, Lq/n|1, Lk|1]``: the local query rows, all key columns
        (each step slices the columns of the chunk it holds, without communication).
      bias: optional floating array of the mask's shape rule; differentiable. Its gradient is
        this device's share where the bias is shared over devices (a per-key bias
        ``[B, Hk, 1, Lk]``): ``shard_map`` sums it for an input replicated over `axis_name`.
      axis_name: the mesh axis (or tuple of axes) the sequence is sharded over.
      is_causal: causal on the global sequence; needs ``Lq == Lk``. Chunks that lie entirely in a
        device's future are skipped.
      scale, softcap, deterministic, implementation: as in ``flash_dmattn``.
      layout: ``"contiguous"`` (device ``i`` holds chunk ``i`` of ``n``) or ``"zigzag"`` (chunks
        ``i`` and ``2n-1-i`` of ``2n``, balancing causal work; see :func:`to_zigzag`, which the
        mask and bias columns must follow as well). Without ``is_causal`` the two are the same.
      return_lse: also return ``lse [B, H, Lq/n]`` float32 (global over keys).

    Returns:
      ``out [B, Lq/n, H, D]`` (and ``lse``), the local rows of the global result.
    """
    validation.check_implementation(implementation)
    q, k, v = validation.check_qkv(query, key, value, implementation)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    local = validation.dims_of(q, k)
    num_shards = jax.lax.axis_size(axis_name)
    dims = local._replace(seqlen_k=num_shards * local.seqlen_k)
    if is_causal and local.seqlen_q != local.seqlen_k:
        raise ValueError(f"ring_attention with is_causal needs Lq == Lk, got local query {q.shape}"
                         f" and key {k.shape}")
    params = AttentionParams(
        scale=validation.check_scale(scale, local.head_dim),
        softcap=validation.check_softcap(softcap),
        window_right=0 if is_causal else -1,
        deterministic=bool(deterministic),
        implementation=implementation,
    )
    mask = validation.check_mask(mask, dims)
    bias = validation.check_bias(bias, dims, q.dtype)
    config = _Config(_steps_for(params, q.dtype, local.head_dim), params, axis_name,
                     layout if is_causal else "contiguous")
    # pcast as core.attention does: an invariant bias then gets its dbias summed over the ring.
    out, lse = _ring_attention(config, *core.vary_alike(q, k, v, mask, bias))
    return (out, lse) if return_lse else out
