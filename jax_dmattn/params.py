"""The static description of one attention call (mirrors csrc/common/params.h)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

IMPLEMENTATIONS = ("cuda", "cpu", "xla")

# The fixed grid of the gate threshold (csrc/common/params.h: kGateBlockQ, kGateBlockK): blocks of
# GATE_BLOCK_Q query rows × GATE_BLOCK_K keys from position 0, per (batch, query head).
GATE_BLOCK_Q = 128
GATE_BLOCK_K = 128
# Softmax-threshold tile skipping decides on a grid of its own (csrc/common/params.h: kSkipBlockQ,
# kSkipBlockK): 64 query rows, one consumer warpgroup's rows in the Hopper kernels, so that each
# warpgroup decides alone.
SKIP_BLOCK_Q = 64
SKIP_BLOCK_K = 128
# A paged KV cache's page size is a power of two, at least this (csrc/common/params.h:
# kMinPageSize): every kernel's key tile then lies in one page.
MIN_PAGE_SIZE = 64


def gate_cut(threshold: float | None) -> float:
    """The product ``alpha * delta`` whose logsigmoid is `threshold` (< 0): ``logsigmoid(x) <
    threshold`` iff ``x < gate_cut(threshold)``, since logsigmoid increases. ``-inf`` for None
    (nothing is dropped). ``logit(e^t) = t - log(1 - e^t)``, in float64."""
    if threshold is None:
        return -math.inf
    return threshold - math.log(-math.expm1(threshold))


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """Everything about a call that is not an array; hashable, so it can be a static argument.

    Key ``j`` is visible to query ``i`` iff
    ``i + diagonal_offset - window_left <= j <= i + diagonal_offset + window_right``
    (a bound < 0 is unbounded; causal is ``window_right = 0``), ``j`` is below the key length and
    ``i`` below the query length of its batch entry, query ``i`` and key ``j`` have the same
    segment id (sequence packing, where segment ids are given), ``key_start[j] <= i <
    key_end[j]`` (where key ranges are given), ``row_start[i] <= j < row_end[i]`` (where row
    ranges are given), ``j // block_k`` is among ``block_indices[i // block_q, :]`` (where block
    indices are given: ``block_q`` and ``block_k`` are their block sizes, 0 without them),
    the kv head's window allows it (where ``window_sizes`` is given: row ``g = h // (H // Hk)``,
    ``(sink, left, right)``, allows ``j < sink`` or
    ``i + diagonal_offset - left <= j <= i + diagonal_offset + right``, a bound < 0 unbounded;
    and-ed with the rules above, so causality hides a sink's future keys too), and the mask (if
    any) is True there.

    With a gate (operands alpha ``[B, Lq, H]`` and delta ``[B, Lk, Hk]``) the logits gain
    ``logsigmoid(alpha[i, h] * delta[j, h // (H // Hk)])``; with ``gate_threshold`` (< 0) the
    pairs of every ``GATE_BLOCK_Q × GATE_BLOCK_K`` block (from position 0, per batch entry and
    query head) whose gate is below it at every pair are hidden too (see :func:`gate_cut`).

    With ``softmax_threshold`` (> 0) the ``SKIP_BLOCK_Q × SKIP_BLOCK_K`` blocks (from position 0)
    whose scores are all negligible against the row's running log-sum-exp are dropped in a fixed
    order (see ``reference.softmax_skip_blocks``); the forward returns which (the drop map) and
    the backward skips exactly those.
    """

    scale: float
    softcap: float = 0.0
    diagonal_offset: int = 0
    window_left: int = -1
    window_right: int = -1
    deterministic: bool = False
    implementation: str | None = None
    block_q: int = 0
    block_k: int = 0
    # Per-kv-head windows with sinks: Hk rows (sink, left, right), or None.
    window_sizes: tuple[tuple[int, int, int], ...] | None = None
    # The gate's threshold on logsigmoid(alpha * delta) (< 0), or None (exact: nothing dropped).
    gate_threshold: float | None = None
    # Softmax-threshold tile skipping (> 0), or None (exact: nothing dropped).
    softmax_threshold: float | None = None

    def ffi_attributes(self, *, has_mask: bool, has_bias: bool, has_seqlens: bool,
                       has_segments: bool = False, has_key_ranges: bool = False,
                       has_row_ranges: bool = False, has_block_indices: bool = False,
                       has_gate: bool = False, page_size: int = 0) -> dict:
        """The attribute dictionary the C++ handlers decode (csrc/ffi/decode.h); `page_size`:
        a paged cache's (0: contiguous k and v)."""
        return dict(
            scale=np.float32(self.scale),
            softcap=np.float32(self.softcap),
            diagonal_offset=np.int64(self.diagonal_offset),
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            # [Hk, 3] row-major; empty without per-head windows.
            window_sizes=np.asarray(self.window_sizes or (), np.int64).reshape(-1),
            has_mask=has_mask,
            has_bias=has_bias,
            has_seqlens=has_seqlens,
            has_segments=has_segments,
            has_key_ranges=has_key_ranges,
            has_row_ranges=has_row_ranges,
            has_block_indices=has_block_indices,
            block_q=np.int64(self.block_q),
            block_k=np.int64(self.block_k),
            deterministic=self.deterministic,
            has_gate=has_gate,
            gate_cut=np.float64(gate_cut(self.gate_threshold)),
            softmax_threshold=np.float64(self.softmax_threshold or 0.0),
            page_size=np.int64(page_size),
        )
