"""The forward and backward attention primitives: shapes, and lowering to a kernel per platform;
and the gradient of dynamic attention's key gathers (:func:`sum_listed_keys`).

Operands (leading batch dims ``*B``: the API batch last, one more in front per vmap level):
  forward  ``q, k, v, [mask], [bias], [q_lens, kv_lens], [q_segments, kv_segments],
           [key_start, key_end], [row_start, row_end], [block_indices], [alpha, delta]``
           -> ``out, lse, [drop_map]``
  backward ``q, k, v, out, dout, lse, dlse, [mask], [bias], [q_lens, kv_lens],
           [q_segments, kv_segments], [key_start, key_end], [row_start, row_end],
           [block_indices], [alpha, delta], [drop_map]`` -> ``dq, dk, dv, [dbias],
           [dalpha, ddelta]``
(with ``params.softmax_threshold``, the forward's drop map uint8 ``[*B, H, ceil(Lq / 64),
ceil(Lk / 128)]``, 1 where it dropped a block, and the backward reads it, full over every batch
dim);
(the lengths int32 ``[*B]``, the segment ids int32 ``[*B, Lq]`` and ``[*B, Lk]``, the key ranges
int32 ``[*B, H|Hk|1, 1, Lk]``: a mask broadcast over rows, the row ranges int32
``[*B, H|Hk|1, Lq, 1]``: a mask broadcast over columns, the block indices int32
``[*B, H|Hk|1, ceil(Lq / block_q), K]`` with the block sizes in the params, the gate float32
alpha ``[*B, Lq, H]`` and delta ``[*B, Lk, Hk]``, full over every batch dim). k, v, mask, bias,
the lengths, the segment ids, the ranges and the block indices may have size 1 on any batch dim
(read with stride 0, never copied);
the two lengths, like the two segment id arrays and each pair of range arrays, share one batch
pattern. Gradients are
per example over the vmap dims and summed over the API broadcast dims, so dk/dv have the full
batch dims and dbias has the bias's shape with full vmap dims.

Lowering picks the C++ kernels (``cpu`` platform), the CUDA kernels (``cuda`` platform, float16 /
bfloat16 with a compiled head dim; both read every mask form) or, for ``implementation=None``
where no kernel fits, the pure-JAX reference (also for calls with a gate or a softmax threshold on
a GPU: the CUDA kernels do not take them yet). The kernel calls are ``sharding``'s, partitioned
so that sharded inputs stay sharded; sharding builds on this module, so it hands them over
(:func:`register_lowerings`) when it is imported, which the package's ``__init__`` does.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec

from jax_dmattn import reference
from jax_dmattn._primitives import _ffi
from jax_dmattn.params import SKIP_BLOCK_K, SKIP_BLOCK_Q, AttentionParams

forward_p = Primitive("dmattn_fwd")
forward_p.multiple_results = True
backward_p = Primitive("dmattn_bwd")
backward_p.multiple_results = True


class Optionals(NamedTuple):
    """Which optional operands a call carries, and whether the forward's out is float32 (static).

    A float32 out is what the backward needs from a half-precision forward: its
    ``D_i = dout_i . out_i`` cancels against ``sum_j P_ij dP_ij`` for a sharp softmax, so the
    rounding of a bf16/fp16 out would dominate dq.
    """

    has_mask: bool
    has_bias: bool
    has_seqlens: bool
    has_segments: bool = False
    has_key_ranges: bool = False
    has_row_ranges: bool = False
    has_block_indices: bool = False
    has_gate: bool = False
    # Softmax-threshold skipping: the forward returns its drop map, which the backward takes as
    # its last operand.
    returns_drop_map: bool = False
    has_drop_map: bool = False
    float32_out: bool = False

    @classmethod
    def of(cls, mask, bias, q_lens, q_segments=None, key_start=None, row_start=None,
           block_indices=None, alpha=None) -> Optionals:
        return cls(mask is not None, bias is not None, q_lens is not None, q_segments is not None,
                   key_start is not None, row_start is not None, block_indices is not None,
                   alpha is not None)

    def split(self, extras: Sequence) -> tuple:
        """``[mask], [bias], [q_lens, kv_lens], [q_segments, kv_segments], [key_start, key_end],
        [row_start, row_end], [block_indices], [alpha, delta]`` -> ``(mask, bias, q_lens,
        kv_lens, q_segments, kv_segments, key_start, key_end, row_start, row_end, block_indices,
        alpha, delta)`` with Nones; the backward's drop map (last) is left out: :meth:`drop_map`."""
        extras = list(extras)
        if self.has_drop_map:
            extras.pop()
        mask = extras.pop(0) if self.has_mask else None
        bias = extras.pop(0) if self.has_bias else None
        q_lens, kv_lens = (extras.pop(0), extras.pop(0)) if self.has_seqlens else (None, None)
        q_segments, kv_segments = ((extras.pop(0), extras.pop(0)) if self.has_segments
                                   else (None, None))
        key_start, key_end = ((extras.pop(0), extras.pop(0)) if self.has_key_ranges
                              else (None, None))
        row_start, row_end = ((extras.pop(0), extras.pop(0)) if self.has_row_ranges
                              else (None, None))
        block_indices = extras.pop(0) if self.has_block_indices else None
        alpha, delta = (extras.pop(0), extras.pop(0)) if self.has_gate else (None, None)
        assert not extras
        return (mask, bias, q_lens, kv_lens, q_segments, kv_segments, key_start, key_end,
                row_start, row_end, block_indices, alpha, delta)

    def drop_map(self, extras: Sequence):
        """The backward's drop map operand (last), or None."""
        return extras[-1] if self.has_drop_map else None

    def out_dtype(self, q_dtype):
        return jnp.float32 if self.float32_out else q_dtype

    def ffi_attributes(self, params: AttentionParams) -> dict:
        return params.ffi_attributes(has_mask=self.has_mask, has_bias=self.has_bias,
                                     has_seqlens=self.has_seqlens, has_segments=self.has_segments,
                                     has_key_ranges=self.has_key_ranges,
                                     has_row_ranges=self.has_row_ranges,
                                     has_block_indices=self.has_block_indices,
                                     has_gate=self.has_gate)



def drop_map_shape(q_shape: Sequence[int], seqlen_k: int) -> tuple[int, ...]:
    """``[*B, H, ceil(Lq / SKIP_BLOCK_Q), ceil(Lk / SKIP_BLOCK_K)]``."""
    *batch, seqlen_q, heads, _ = q_shape
    return (*batch, heads, -(-seqlen_q // SKIP_BLOCK_Q), -(-seqlen_k // SKIP_BLOCK_K))


def _present(*xs):
    return [x for x in xs if x is not None]


def forward(params: AttentionParams, q, k, v, mask=None, bias=None, q_lens=None, kv_lens=None,
            q_segments=None, kv_segments=None, key_start=None, key_end=None, row_start=None,
            row_end=None, block_indices=None, alpha=None, delta=None, float32_out: bool = False):
    """``[out [*B, Lq, H, D], lse [*B, H, Lq] float32]``; out in q's dtype, or float32; with
    ``params.softmax_threshold`` also the drop map (uint8, :func:`drop_map_shape`)."""
    opts = Optionals.of(mask, bias, q_lens, q_segments, key_start, row_start,
                        block_indices, alpha)._replace(
        float32_out=float32_out, returns_drop_map=params.softmax_threshold is not None)
    return forward_p.bind(q, k, v, *_present(mask, bias, q_lens, kv_lens, q_segments, kv_segments,
                                             key_start, key_end, row_start, row_end,
                                             block_indices, alpha, delta),
                          params=params, opts=opts)


def backward(params: AttentionParams, q, k, v, out, dout, lse, dlse, mask=None, bias=None,
             q_lens=None, kv_lens=None, q_segments=None, kv_segments=None, key_start=None,
             key_end=None, row_start=None, row_end=None, block_indices=None, alpha=None,
             delta=None, drop_map=None):
    """``(dq, dk, dv, dbias, dalpha, ddelta)``; dbias is None without a bias, dalpha and ddelta
    None without a gate. ``drop_map``: the forward's, where ``params.softmax_threshold`` is
    set."""
    if (drop_map is None) != (params.softmax_threshold is None):
        raise ValueError("ops.backward: a drop_map goes with params.softmax_threshold, and only "
                         "with it")
    opts = Optionals.of(mask, bias, q_lens, q_segments, key_start, row_start, block_indices,
                        alpha)._replace(has_drop_map=drop_map is not None)
    grads = list(backward_p.bind(q, k, v, out, dout, lse, dlse,
                                 *_present(mask, bias, q_lens, kv_lens, q_segments, kv_segments,
                                           key_start, key_end, row_start, row_end,
                                           block_indices, alpha, delta, drop_map),
                                 params=params, opts=opts))
    dbias = grads.pop(3) if opts.has_bias else None
    dalpha, ddelta = grads[3:] if opts.has_gate else (None, None)
    return (*grads[:3], dbias, dalpha, ddelta)


# ---- shapes ---------------------------------------------------------------------------------

def lse_shape(q_shape: Sequence[int]) -> tuple[int, ...]:
    *batch, seqlen_q, heads, _ = q_shape
    return (*batch, heads, seqlen_q)


def gradient_shape(x_shape: Sequence[int], q_shape: Sequence[int], api_batch_dims: int) -> tuple:
    """A gradient's shape: full over the vmap batch dims, the input's own dims elsewhere."""
    vmap_dims = len(q_shape) - 3 - api_batch_dims
    return (*q_shape[:vmap_dims], *x_shape[vmap_dims:])


def _like(q, shape, dtype):
    """An aval of `shape` that varies over q's manual mesh axes (shard_map's check_vma)."""
    if tuple(shape) == q.shape:
        return q.update(dtype=dtype, weak_type=False)
    return q.update(shape=shape, dtype=dtype, weak_type=False,
                    sharding=q.sharding.update(spec=PartitionSpec()))


def _forward_abstract_eval(q, k, v, *extras, params, opts):
    outs = [_like(q, q.shape, opts.out_dtype(q.dtype)), _like(q, lse_shape(q.shape), jnp.float32)]
    if opts.returns_drop_map:
        outs.append(_like(q, drop_map_shape(q.shape, k.shape[-3]), jnp.uint8))
    return outs


def _backward_abstract_eval(q, k, v, out, dout, lse, dlse, *extras, params, opts):
    split = opts.split(extras)
    bias, alpha, delta = split[1], split[-2], split[-1]
    grads = [_like(q, q.shape, q.dtype),
             _like(q, gradient_shape(k.shape, q.shape, 1), k.dtype),
             _like(q, gradient_shape(v.shape, q.shape, 1), v.dtype)]
    if bias is not None:
        grads.append(_like(q, gradient_shape(bias.shape, q.shape, 1), bias.dtype))
    if alpha is not None:
        grads += [_like(q, x.shape, x.dtype) for x in (alpha, delta)]
    return grads


# Lowering goes through custom_partitioning, which needs the device assignment (as in
# TransformerEngine and JAX's cuDNN attention; there is no public spelling of this yet).
dispatch.prim_requires_devices_during_lowering.update({forward_p, backward_p})
forward_p.def_abstract_eval(_forward_abstract_eval)
backward_p.def_abstract_eval(_backward_abstract_eval)


def _eager(primitive):
    """Eager calls run through jit, which lowers with the platform's rule."""

    def impl(*args, **params):
        return jax.jit(functools.partial(primitive.bind, **params))(*args)

    return impl


forward_p.def_impl(_eager(forward_p))
backward_p.def_impl(_eager(backward_p))


# ---- which implementation runs --------------------------------------------------------------

# Reasons already warned about: a GPU call that falls back to the reference says so once.
_warned_fallbacks: set[str] = set()


def _missing_cuda_kernel(dtype, head_dim: int) -> tuple[str, str] | None:
    """Why this build has no CUDA kernel for the call on this GPU, and the fix; None when it
    has one."""
    if not _ffi.has_cuda_kernels():
        return ("this jax_dmattn build has no CUDA kernels",
                "Reinstall it with JAX_DMATTN_CUDA_WHEELS=13 pip install . (nvcc from the "
                "registry), or where nvcc is found (README: Building the CUDA kernels).")
    capability = _ffi.local_gpu_compute_capability()
    if capability is not None and not _ffi.cuda_arch_runs_on(capability):
        archs = _ffi.build_info()["cuda_archs"]
        return (f"no CUDA arch of this build ({archs}) runs on this GPU (compute capability "
                f"{capability})",
                "Rebuild with JAX_DMATTN_CUDA_ARCHS naming it (README: Building the CUDA kernels).")
    name = jnp.dtype(dtype).name
    if name not in _ffi.cuda_dtypes():
        return (f"no CUDA kernel for dtype {name} (compiled: {', '.join(_ffi.cuda_dtypes())})",
                "Cast the inputs to a compiled dtype, or rebuild with JAX_DMATTN_DTYPES.")
    if head_dim not in _ffi.cuda_head_dims():
        return (f"no CUDA kernel for head dim {head_dim} (compiled: {_ffi.cuda_head_dims()})",
                "Rebuild with that head dim in JAX_DMATTN_HEAD_DIMS.")
    return None


def _missing_threshold_kernel(params: AttentionParams, opts: Optionals | None,
                              head_dim: int) -> tuple[str, str] | None:
    """Why the CUDA kernels cannot apply the call's softmax threshold, and the fix; None when
    they can (csrc/cuda/launch.h: ThresholdTakes): head dims 64 and 128, without a gate
    threshold; the forward applies it (the Hopper kernels where they take the call, else the
    FlashAttention-2-class ones, which also take segment ids, the O(L) mask forms, window tables
    and the gate), every backward skips its blocks."""
    fix = "Such calls run on the CPU kernels and the reference."
    if head_dim not in (64, 128):
        return ("the CUDA kernels take softmax_threshold (tile skipping) at head dims 64 and "
                f"128, not {head_dim}", fix)
    if opts is not None and opts.has_gate and params.gate_threshold is not None:
        return ("the CUDA kernels do not take softmax_threshold (tile skipping) with a gate "
                "threshold", fix)
    return None


def uses_kernel(platform: str, params: AttentionParams, dtype, head_dim: int,
                opts: Optionals | None = None) -> bool:
    """True to lower to this platform's kernels, False to lower to the reference. On a GPU
    without a kernel for the call (or with a softmax threshold the CUDA kernels cannot apply,
    :func:`_missing_threshold_kernel` with the call's operands ``opts``, a window table of too
    many kv heads, or a scale <= 0, which the CUDA kernels do not take:
    the first of them missing is the reason), implementation="cuda" raises and None warns once
    per reason (then runs the pure-JAX reference). Every mask form (a bool mask, key ranges, row
    ranges, block indices and their tuples), segment ids and the gate run on the CUDA
    kernels."""
    requested = params.implementation
    if requested is not None and requested != "xla" and requested != platform:
        raise ValueError(
            f"jax_dmattn: implementation={requested!r} cannot run on platform {platform!r}; "
            f"use implementation=None or {platform!r} there")
    if platform == "cpu":
        return True
    if platform != "cuda":
        return False
    missing = _missing_cuda_kernel(dtype, head_dim)
    if missing is None and params.window_sizes is not None:
        most = _ffi.build_info()["cuda_window_heads"]
        if len(params.window_sizes) > most:
            missing = (f"the CUDA kernels take window tables (window_sizes) of at most {most} kv "
                       f"heads, not {len(params.window_sizes)}",
                       "A table of one window without sink for every kv head runs on the CUDA "
                       "kernels at any head count.")
    if missing is None and params.scale <= 0.0:
        missing = ("the CUDA kernels take scale > 0 (they carry the bias and the gate in "
                   "units of 1 / scale and hide scores as -inf before scaling them: at 0 they "
                   "would drop the bias and gate, below 0 turn hidden scores into +inf)",
                   "A scale <= 0 runs on the CPU kernels and the reference.")
    if missing is None and params.softmax_threshold is not None:
        missing = _missing_threshold_kernel(params, opts, head_dim)
    if missing is not None:
        reason, fix = missing
        if requested == "cuda":
            raise ValueError(f"jax_dmattn: {reason}. {fix}")
        if reason not in _warned_fallbacks:
            _warned_fallbacks.add(reason)
            warnings.warn(
                f"jax_dmattn: {reason}; such calls on the GPU run the pure-JAX reference "
                f"(O(L^2) memory, slow). {fix} implementation='xla' asks for the reference "
                "without this warning.", RuntimeWarning, stacklevel=2)
    return missing is None


def _reference_forward(params, opts, q, k, v, *extras):
    if opts.returns_drop_map:
        out, lse, drops = reference.attention(params, q, k, v, *opts.split(extras),
                                              return_drop_map=True)
        return out.astype(opts.out_dtype(q.dtype)), lse, drops
    out, lse = reference.attention(params, q, k, v, *opts.split(extras))
    return out.astype(opts.out_dtype(q.dtype)), lse


def _reference_backward(params, opts, q, k, v, out, dout, lse, dlse, *extras):
    (mask, bias, q_lens, kv_lens, q_segments, kv_segments, key_start, key_end, row_start,
     row_end, block_indices, alpha, delta) = opts.split(extras)
    drop_map = opts.drop_map(extras)  # the forward's: the same blocks stay dropped

    def fn(q, k, v, bias, alpha, delta):
        return reference.attention(params, q, k, v, mask, bias, q_lens, kv_lens, q_segments,
                                   kv_segments, key_start, key_end, row_start, row_end,
                                   block_indices, alpha, delta, drop_map=drop_map)

    _, vjp = jax.vjp(fn, q, k, v, bias, alpha, delta)
    return _present(*vjp((dout, dlse.astype(lse.dtype))))


def _lowering(platform: str, kernel_fn, reference_fn):
    def rule(ctx, *args, params, opts):
        q_aval = ctx.avals_in[0]
        if uses_kernel(platform, params, q_aval.dtype, q_aval.shape[-1], opts):
            fn = functools.partial(kernel_fn, platform, params, opts)
        else:
            fn = functools.partial(reference_fn, params, opts)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    return rule


# ---- the gradient of dynamic attention's key gathers -------------------------------------------

sum_listed_keys_p = Primitive("dmattn_sum_listed_keys")


def sum_listed_keys(grad, slots, spans):
    """The cotangent of dynamic attention's per-block gathers, summed back onto the keys.

    ``out[*b, j, c] = sum(grad[*b, n, slots[*b, cc, n, j], c] for n in range(spans[*b, cc, 0, j],
    spans[*b, cc, 1, j]))``, ``cc = c`` or 0 when the key lists are shared by the channels: the
    blocks that list key ``j`` and its slot in each (slots outside ``[0, U)`` add nothing). grad
    ``[*B, nb, U, C, D]``, slots ``[*B, Cc, nb, Lk]`` and spans ``[*B, Cc, 2, Lk]`` int32 ->
    ``[*B, Lk, C, D]`` in grad's dtype, summed in float32 in a fixed order, without atomics.
    """
    return sum_listed_keys_p.bind(grad, slots, spans)


def _sum_listed_keys_xla(grad, slots, spans):
    *lead, blocks, size, channels, dim = grad.shape
    key_channels, seqlen_k = slots.shape[-3], slots.shape[-1]
    grad = grad.reshape(-1, blocks, size, channels, dim)
    slots = slots.reshape(-1, key_channels, blocks, seqlen_k)
    spans = spans.reshape(-1, key_channels, 2, seqlen_k)

    def add_block(n, out):  # one block at a time: no [nb, Lk, C, D] temporary
        slot = slots[:, :, n].transpose(0, 2, 1)  # [B, Lk, Cc]
        listed = ((spans[:, :, 0] <= n) & (n < spans[:, :, 1])).transpose(0, 2, 1)
        listed &= (slot >= 0) & (slot < size)
        rows = jnp.take_along_axis(grad[:, n], jnp.clip(slot, 0, size - 1)[..., None], axis=1)
        return out + jnp.where(listed[..., None], rows.astype(jnp.float32), 0)

    out = jnp.zeros((grad.shape[0], seqlen_k, channels, dim), jnp.float32)
    out = jax.lax.fori_loop(0, blocks, add_block, out)
    return out.astype(grad.dtype).reshape(*lead, seqlen_k, channels, dim)


def _sum_listed_keys_abstract_eval(grad, slots, spans):
    *lead, _, _, channels, dim = grad.shape
    return _like(grad, (*lead, spans.shape[-1], channels, dim), grad.dtype)


def _sum_listed_keys_lowering(platform: str, kernel_fn):
    def rule(ctx, grad, slots, spans):
        kernel = platform == "cpu" or (platform == "cuda" and _ffi.has_cuda_kernels())
        if kernel and jnp.dtype(ctx.avals_in[0].dtype).name in ("float32", "float16",
                                                                  "bfloat16"):
            fn = kernel_fn
        else:
            fn = _sum_listed_keys_xla
        return mlir.lower_fun(fn, multiple_results=False)(ctx, grad, slots, spans)

    return rule


dispatch.prim_requires_devices_during_lowering.add(sum_listed_keys_p)
sum_listed_keys_p.def_abstract_eval(_sum_listed_keys_abstract_eval)
sum_listed_keys_p.def_impl(_eager(sum_listed_keys_p))


# ---- lowering rules ---------------------------------------------------------------------------


class KernelCalls(NamedTuple):
    """The kernels' calls the primitives lower to on ``cpu`` and ``cuda``, each taking the
    primitive's operands: ``forward(platform, params, opts, *operands) -> [out, lse]``,
    ``backward(platform, params, opts, *operands) -> [dq, dk, dv, (dbias), (dalpha, ddelta)]``
    and
    ``sum_listed_keys(grad, slots, spans)``."""

    forward: Callable
    backward: Callable
    sum_listed_keys: Callable


def register_lowerings(kernels: KernelCalls) -> None:
    """Lowers the primitives to `kernels` on ``cpu`` and ``cuda`` (where a kernel fits the call,
    else to the reference) and to the reference on any other platform (ROCm, TPU; a kernel asked
    for explicitly raises there). Until then the primitives have no lowering at all, so that a
    missing registration fails instead of silently running the reference."""
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(
            forward_p, _lowering(platform, kernels.forward, _reference_forward),
            platform=platform)
        mlir.register_lowering(
            backward_p, _lowering(platform, kernels.backward, _reference_backward),
            platform=platform)
        mlir.register_lowering(
            sum_listed_keys_p, _sum_listed_keys_lowering(platform, kernels.sum_listed_keys),
            platform=platform)
    mlir.register_lowering(forward_p, _lowering("other", None, _reference_forward))
    mlir.register_lowering(backward_p, _lowering("other", None, _reference_backward))
    mlir.register_lowering(sum_listed_keys_p, _sum_listed_keys_lowering("other", None))
