"""The compiled extension: FFI target registration and build facts."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_dmattn.params import SKIP_BLOCK_K, SKIP_BLOCK_Q, AttentionParams, gate_cut

FORWARD_TARGET = "dmattn_fwd"
BACKWARD_TARGET = "dmattn_bwd"
MASK_MAP_TARGET = "dmattn_mask_map"
TOPK_LEAVE_TARGET = "dmattn_topk_leave"
RANGE_MASK_TARGET = "dmattn_range_mask"
SUM_LISTED_KEYS_TARGET = "dmattn_sum_listed_keys"


@functools.cache
def _extension() -> Any:
    from jax_dmattn import _dmattn  # the nanobind module built by CMake

    return _dmattn


def installed_ffi_api() -> tuple[int, int] | None:
    """The XLA FFI API version of the installed jaxlib (from its C API header), None if its
    headers cannot be read."""
    header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
    try:
        text = header.read_text()
    except OSError:
        return None
    found = [re.search(rf"#define XLA_FFI_API_{part} (\d+)", text) for part in ("MAJOR", "MINOR")]
    if not all(found):
        return None
    return int(found[0].group(1)), int(found[1].group(1))


def check_ffi_api(compiled: tuple[int, int], installed: tuple[int, int] | None) -> None:
    """Raises where the handlers were compiled against a newer XLA FFI API than the installed
    jaxlib's, which would refuse them at the first call with no word on the fix."""
    if installed is not None and tuple(compiled) > tuple(installed):
        raise RuntimeError(
            f"this jax_dmattn build was compiled against XLA FFI API "
            f"{compiled[0]}.{compiled[1]}, newer than the installed jaxlib's "
            f"{installed[0]}.{installed[1]} (jax {jax.__version__}), which refuses its kernels. "
            "Reinstall jax_dmattn (its build takes the FFI headers of jax 0.10), or build it "
            "against this jax: pip install --no-build-isolation .")


@functools.cache
def register_targets() -> frozenset[str]:
    """Registers the handlers with XLA once; returns the platforms that have kernels."""
    check_ffi_api(tuple(_extension().build_info()["xla_ffi_api"]), installed_ffi_api())
    platforms = _extension().registrations()
    for platform, targets in platforms.items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return frozenset(p.lower() for p in platforms)


@functools.cache
def build_info() -> dict[str, Any]:
    """Facts about the compiled kernels: CUDA presence, head dims, archs, dtypes."""
    return dict(_extension().build_info())


def has_cuda_kernels() -> bool:
    return bool(build_info()["cuda"])


def cuda_head_dims() -> tuple[int, ...]:
    return tuple(build_info()["cuda_head_dims"])


def cuda_dtypes() -> tuple[str, ...]:
    names = {"bf16": "bfloat16", "fp16": "float16"}
    return tuple(names[d] for d in build_info()["cuda_dtypes"].split(",") if d)


def cuda_arch_runs_on(compute_capability: str) -> bool:
    """Whether a CUDA arch compiled into this build runs on a GPU of this compute capability
    (``"9.0"``): code for sm_XY runs on X.Y and later minors of X, code for sm_XYa on X.Y only."""
    major, minor = (int(x) for x in compute_capability.split(".")[:2])
    for arch in filter(None, build_info()["cuda_archs"].split(",")):
        digits = arch.rstrip("a")
        arch_major, arch_minor = int(digits[:-1]), int(digits[-1])
        if arch_major == major and (arch_minor == minor if arch.endswith("a")
                                    else arch_minor <= minor):
            return True
    return False


@functools.cache
def local_gpu_compute_capability() -> str | None:
    """The compute capability of this process's first GPU (``"9.0"``), None without one."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    capability = getattr(gpus[0], "compute_capability", None) if gpus else None
    return str(capability) if capability else None


# ---- calls ----------------------------------------------------------------------------------
# Operand order and workspaces mirror csrc/ffi/decode.h: the fixed operands, then [mask], [bias],
# [q_lens, kv_lens], [q_segments, kv_segments], [key_start, key_end], [row_start, row_end],
# [block_indices], [alpha, delta], (backward) [drop_map], then (CUDA) the mask's map and bits. Every
# operand has the same number of leading batch dims (size 1 where it broadcasts); the kernels take
# at most MAX_BATCH_DIMS of them, so neighbouring dims that every operand treats alike are merged
# first (a free reshape). A CUDA call with a mask also takes the mask's block map, made by its own
# call (``call_mask_map``): one jit holding a forward and its backward computes it once (XLA merges
# the identical calls).

MAX_BATCH_DIMS = 4


def _batch_groups(batch_shapes: list[tuple[int, ...]], full: tuple[int, ...]) -> list[list[int]]:
    """Groups of neighbouring non-trivial batch dims with one broadcast pattern across operands."""
    groups: list[list[int]] = []
    last_pattern = None
    for d, size in enumerate(full):
        if size == 1:
            continue
        pattern = tuple(shape[d] == size for shape in batch_shapes)
        if groups and pattern == last_pattern and groups[-1][-1] == d - 1:
            groups[-1].append(d)
        else:
            groups.append([d])
        last_pattern = pattern
    if len(groups) > MAX_BATCH_DIMS:
        raise NotImplementedError(
            f"jax_dmattn: batch dims {full} broadcast in more than {MAX_BATCH_DIMS} different "
            "ways across operands (deeply nested vmap); broadcast some operands explicitly")
    return groups


def _merged(shape: tuple[int, ...], num_batch: int, groups: list[list[int]]) -> tuple[int, ...]:
    merged = [int(np.prod([shape[d] for d in g])) for g in groups]
    return (*merged, *shape[num_batch:])


def _call(target: str, operands: list, results: list[tuple[tuple[int, ...], object]],
          num_batch: int, attrs: dict, extra_workspaces=None,
          unbatched: frozenset[int] = frozenset()) -> list:
    """Calls `target` with batch dims merged; returns `results` in their unmerged shapes.

    ``extra_workspaces(merged operand shapes, merged result shapes)`` may add results (flat
    workspaces whose size depends on what the kernel sees); they are dropped on return.
    `unbatched`: positions of operands without batch dims (a paged cache's pools), passed as
    they are.
    """
    full = tuple(operands[0].shape[:num_batch])
    batched = [x for i, x in enumerate(operands) if i not in unbatched]
    batch_shapes = [tuple(x.shape[:num_batch]) for x in batched]
    batch_shapes += [tuple(shape[:num_batch]) for shape, _ in results]
    groups = _batch_groups(batch_shapes, full)
    args = [x if i in unbatched else x.reshape(_merged(x.shape, num_batch, groups))
            for i, x in enumerate(operands)]
    result_types = [jax.ShapeDtypeStruct(_merged(shape, num_batch, groups), dtype)
                    for shape, dtype in results]
    if extra_workspaces is not None:
        result_types += [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in extra_workspaces(
            [a.shape for a in args], [r.shape for r in result_types])]
    outs = jax.ffi.ffi_call(target, result_types)(*args, **attrs)
    return [o.reshape(shape) for o, (shape, _) in zip(outs, results, strict=False)]


def call_forward(platform: str, params, opts, q, k, v, *extras) -> list:
    """``[out, lse, (drop_map)]`` from the platform's forward kernel."""
    register_targets()
    *batch, seqlen_q, heads, _ = q.shape
    results = [(q.shape, opts.out_dtype(q.dtype)), ((*batch, heads, seqlen_q), np.float32)]
    if opts.returns_drop_map:
        results.append((_drop_map_shape(q.shape, k.shape[-3]), np.uint8))
    workspaces = None
    if platform == "cuda":
        extras = _with_mask_map(params, opts.split(extras)[0], extras, seqlen_q, k.shape[-3])
        workspaces = _cuda_forward_workspaces(params, opts)
    return _call(FORWARD_TARGET, [q, k, v, *extras], results, q.ndim - 3,
                 opts.ffi_attributes(params), workspaces)


def call_paged_forward(platform: str, params, q, k_pages, v_pages, page_table, q_lens, kv_lens,
                       mask=None, bias=None) -> list:
    """``[out, lse]`` from the platform's forward kernel reading a paged cache in place: q
    ``[*B, Lq, H, D]``, pools ``[P, page_size, Hk, D]``, page_table int32 ``[*B|1, max_pages]``,
    the lengths int32 ``[*B|1]``, mask and bias ``[*B|1, H|Hk|1, Lq|1, Lk|1]`` with
    ``Lk = max_pages * page_size``. On ``cuda`` only calls that the decode forward takes
    (:func:`cuda_forward_kernel`)."""
    register_targets()
    *batch, seqlen_q, heads, head_dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    seqlen_k = page_table.shape[-1] * page_size
    results = [(q.shape, q.dtype), ((*batch, heads, seqlen_q), np.float32)]
    extras = (*(x for x in (mask, bias) if x is not None), q_lens, kv_lens)
    workspaces = None
    if platform == "cuda":
        extras = _with_mask_map(params, mask, extras, seqlen_q, seqlen_k)

        def workspaces(arg_shapes, result_shapes):
            keys = (*arg_shapes[0][:-3], seqlen_k, kv_heads, head_dim)  # the merged batch
            return [((max(_extension().cuda_forward_workspace_bytes(arg_shapes[0], keys), 1),),
                     np.uint8)]

    attrs = params.ffi_attributes(has_mask=mask is not None, has_bias=bias is not None,
                                  has_seqlens=True, page_size=page_size)
    return _call(FORWARD_TARGET, [q, k_pages, v_pages, page_table, *extras], results, q.ndim - 3,
                 attrs, workspaces, unbatched=frozenset({1, 2}))


def _drop_map_shape(q_shape, seqlen_k: int) -> tuple[int, ...]:
    *batch, seqlen_q, heads, _ = q_shape
    return (*batch, heads, -(-seqlen_q // SKIP_BLOCK_Q), -(-seqlen_k // SKIP_BLOCK_K))


def call_backward(platform: str, params, opts, q, k, v, out, dout, lse, dlse, *extras,
                  grad_shapes) -> list:
    """``[dq, dk, dv, (dbias), (dalpha, ddelta)]`` from the platform's backward kernel.

    ``grad_shapes``: the shapes of dk, dv (and dbias), which differ from the inputs' under vmap;
    dalpha and ddelta (float32) have the gate's shapes.
    """
    register_targets()
    grads = [(q.shape, q.dtype)] + [(shape, q.dtype) for shape in grad_shapes]
    if opts.has_gate:
        grads += [(x.shape, np.float32) for x in opts.split(extras)[-2:]]
    workspaces = [(lse.shape, np.float32)]  # softmax_d
    extra = None
    if platform == "cuda":
        extras = _with_mask_map(params, opts.split(extras)[0], extras, q.shape[-3],
                                 k.shape[-3])
        workspaces.append((q.shape, np.float32))  # dq accumulator
        extra = _cuda_backward_workspaces(params, opts)
    outs = _call(BACKWARD_TARGET, [q, k, v, out, dout, lse, dlse, *extras], grads + workspaces,
                 q.ndim - 3, opts.ffi_attributes(params), extra)
    return outs[:len(grads)]


def call_mask_map(mask, params: AttentionParams | None = None) -> tuple[jax.Array, jax.Array]:
    """The CUDA kernels' mask summaries (csrc/cuda/attention.h) of a bool ``[..., R, C]`` mask:
    its block map, uint8 ``[..., ceil(R / cell), ceil(C / cell)]`` (one byte of flags per cell),
    and its bits, uint8 ``[..., R, ceil(C / 128) * 16]`` (key j in bit j % 8 of byte j // 8).

    With `params` (only for a mask whose R and C are the query and key positions), the cells that
    its causal / window rule hides from every query are left unread (their bits are zero)."""
    register_targets()
    cell = build_info()["mask_map_cell"]
    *lead, rows, cols = mask.shape
    results = (jax.ShapeDtypeStruct((*lead, -(-rows // cell), -(-cols // cell)), np.uint8),
               jax.ShapeDtypeStruct((*lead, rows, -(-cols // 128) * 16), np.uint8))
    rule = params or AttentionParams(scale=1.0)
    cells, bits = jax.ffi.ffi_call(MASK_MAP_TARGET, results)(
        mask, diagonal_offset=np.int64(rule.diagonal_offset),
        window_left=np.int64(rule.window_left), window_right=np.int64(rule.window_right))
    return cells, bits


def _with_mask_map(params: AttentionParams, mask, extras: tuple, seqlen_q: int,
                   seqlen_k: int) -> tuple:
    """The CUDA kernels' extra operands: `mask`'s block map and bits after the others."""
    if mask is None:
        return extras
    full = mask.shape[-2:] == (seqlen_q, seqlen_k)  # neither queries nor keys broadcast
    return (*extras, *call_mask_map(mask, params if full else None))


def call_topk_leave(key, window: int):
    """The CUDA dynamic-mask kernel (csrc/cuda/dynamic.h): int32 ``[n, Lk]`` order keys
    -> int32 ``[n, Lk]`` leave positions."""
    register_targets()
    result = jax.ShapeDtypeStruct(key.shape, np.int32)
    return jax.ffi.ffi_call(TOPK_LEAVE_TARGET, result)(key, window=np.int64(window))


def call_range_mask(first, end, block: int):
    """The CUDA per-block range mask (csrc/cuda/dynamic.h): int32 ``[..., nb, U]`` row ranges ->
    bool ``[..., nb, block, U]``."""
    register_targets()
    result = jax.ShapeDtypeStruct((*first.shape[:-1], block, first.shape[-1]), np.bool_)
    return jax.ffi.ffi_call(RANGE_MASK_TARGET, result)(first, end, block=np.int64(block))


def call_sum_listed_keys(grad, slots, spans):
    """The listed-keys gradient sum (csrc/common/params.h, ListedKeysShape): grad
    ``[*B, nb, U, C, D]``, slots ``[*B, Cc, nb, Lk]``, spans ``[*B, Cc, 2, Lk]`` ->
    ``[*B, Lk, C, D]`` in grad's dtype."""
    register_targets()
    *lead, _, _, channels, dim = grad.shape
    result = jax.ShapeDtypeStruct((*lead, spans.shape[-1], channels, dim), grad.dtype)
    return jax.ffi.ffi_call(SUM_LISTED_KEYS_TARGET, result)(grad, slots, spans)


# CUDA workspaces sized by the kernels' own rules (the extension decodes the merged shapes). The
# slots are fixed (forward: index-mask summaries, query-block order and split-KV partials;
# backward: dq accumulator, then index-mask summaries, key-block order and dbias accumulator), so an
# unused one still takes a single element.


def _index_mask_shapes(params: AttentionParams, opts, extra_shapes: Sequence[tuple[int, ...]]
                       ) -> dict[str, Any]:
    """The extension's workspace-size keywords for the index masks and the gate of a CUDA call:
    the merged shapes of ``q_segments``, ``kv_segments``, ``key_ranges`` (key_start's ``[*B,
    H|Hk|1, 1, Lk]``), ``row_ranges`` (row_start's ``[*B, H|Hk|1, Lq, 1]``), ``block_indices``
    (``[*B, H|Hk|1, nQB, K]``, with ``block_q`` and ``block_k``), ``alpha`` and ``delta`` (with
    ``gate_cut``: a threshold's bounds take workspace), None where absent.

    ``extra_shapes``: the shapes of the call's optional operands (after q, k, v, and for the
    backward out, dout, lse, dlse), the mask's map and bits last where it has a mask."""
    extra_shapes = list(extra_shapes)
    if opts.has_mask:
        del extra_shapes[-2:]  # the mask map and bits (_with_mask_map) follow every operand
    (_, _, _, _, q_segments, kv_segments, key_start, _, row_start, _, block_indices, alpha,
     delta) = opts.split(extra_shapes)
    shapes = dict(q_segments=q_segments, kv_segments=kv_segments, key_ranges=key_start,
                  row_ranges=row_start, block_indices=block_indices, alpha=alpha, delta=delta)
    if block_indices is not None:
        shapes.update(block_q=params.block_q, block_k=params.block_k)
    if alpha is not None:
        shapes.update(gate_cut=gate_cut(params.gate_threshold))
    return shapes


def _cuda_forward_workspaces(params: AttentionParams, opts):
    def workspaces(arg_shapes, result_shapes):
        n = _extension().cuda_forward_workspace_bytes(
            arg_shapes[0], arg_shapes[1], **_index_mask_shapes(params, opts, arg_shapes[3:]))
        return [((max(n, 1),), np.uint8)]

    return workspaces


def cuda_forward_splits(q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> int:
    """Key splits the CUDA forward runs for q ``[B, Lq, H, D]`` and k ``[B, Lk, Hk, D]`` on the
    current device (1: none)."""
    return int(_extension().cuda_forward_splits(tuple(q_shape), tuple(k_shape)))


def cuda_forward_kernel(q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                        mask_shape: tuple[int, ...] | None = None,
                        bias_shape: tuple[int, ...] | None = None, *,
                        q_segments: tuple[int, ...] | None = None,
                        kv_segments: tuple[int, ...] | None = None,
                        key_ranges: tuple[int, ...] | None = None,
                        row_ranges: tuple[int, ...] | None = None,
                        block_indices: tuple[int, ...] | None = None,
                        block_q: int = 0, block_k: int = 0,
                        gate: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                        gate_threshold: float | None = None,
                        softcap: float | None = None,
                        softmax_threshold: float | None = None) -> str:
    """The CUDA forward kernel that a call with these shapes (q ``[B, Lq, H, D]``, k ``[B, Lk, Hk,
    D]``, mask and bias ``[B|1, H|Hk|1, Lq|1, Lk|1]`` or None) runs on the current device:
    ``"decode"`` (at most 16 query rows: the query heads of a kv head share one tile),
    ``"hopper"`` (the warp-specialised sm_90a kernel), ``"flash2"`` or ``"flash2_split"`` (the
    FlashAttention-2-class kernel, keys split for small grids). A debugging aid.

    The index masks by their shapes as the kernels see them: segment ids ``[B|1, Lq]`` and
    ``[B|1, Lk]``, key ranges ``[B|1, H|Hk|1, 1, Lk]``, row ranges ``[B|1, H|Hk|1, Lq, 1]``, block
    indices ``[B|1, H|Hk|1, nQB, K]`` of ``block_q`` x ``block_k`` blocks (calls with the O(L)
    mask forms run the FlashAttention-2-class forward, but for block indices alone whose block
    sizes are multiples of 64 at D <= 128, which the Hopper forward takes); the gate by the
    shapes of alpha ``[B, Lq, H]`` and delta ``[B, Lk, Hk]``, with its threshold (gated calls at
    D = 256 or with a mask, bias, segment ids, window table or softcap run the
    FlashAttention-2-class forward); with a softmax threshold, ``"hopper"``, ``"flash2"`` or
    ``"none"`` (no kernel applies it)."""
    def dims(shape):
        return None if shape is None else tuple(shape)
    alpha, delta = gate if gate is not None else (None, None)
    return str(_extension().cuda_forward_kernel(
        tuple(q_shape), tuple(k_shape), dims(mask_shape), dims(bias_shape),
        q_segments=dims(q_segments), kv_segments=dims(kv_segments), key_ranges=dims(key_ranges),
        row_ranges=dims(row_ranges), block_indices=dims(block_indices), block_q=block_q,
        block_k=block_k, alpha=dims(alpha), delta=dims(delta),
        gate_cut=gate_cut(gate_threshold), softcap=float(softcap or 0.0),
        softmax_threshold=float(softmax_threshold or 0.0)))


def cuda_set_forward_kernel(name: str) -> None:
    """``"auto"`` (the dispatcher's choice, the default) or ``"flash2"`` (the FlashAttention-2-class
    forward for every call of this process, decoding included), for side-by-side measurements and
    tests. Applies to executables compiled after it: call ``jax.clear_caches()`` too, since XLA
    may have captured an executable's kernels in a CUDA graph, which cannot change kernels
    between calls."""
    _extension().cuda_set_forward_kernel(name)


def cuda_set_backward_kernel(name: str) -> None:
    """``"auto"`` (the dispatcher's choice, the default: on a Hopper GPU the warp-specialised
    backward where it takes the call, i.e. head dims 64 and 128 without a window table or softcap,
    with segment ids, the gate or block indices of multiples of 64 rows x 128 keys only alone (no
    other O(L) mask form), with a mask or a bias only when not deterministic, and a dbias only when
    it is full-size without sequence lengths) or ``"flash2"`` (the FlashAttention-2-class backward
    for every call), for the whole process, like :func:`cuda_set_forward_kernel` (call
    ``jax.clear_caches()`` too)."""
    _extension().cuda_set_backward_kernel(name)


def _cuda_backward_workspaces(params: AttentionParams, opts):
    def workspaces(arg_shapes, result_shapes):
        q, k, dk = arg_shapes[0], arg_shapes[1], result_shapes[1]
        bias, dbias = [], []
        if opts.has_bias:
            bias = arg_shapes[7 + int(opts.has_mask)]
            dbias = result_shapes[3]
        n = _extension().cuda_backward_workspace_bytes(
            q, k, dk, bias, dbias, **_index_mask_shapes(params, opts, arg_shapes[7:]),
            deterministic=params.deterministic)
        return [((max(n, 1),), np.uint8)]

    return workspaces
