"""Sharding rules: kernel calls stay local when inputs are sharded over batch and heads, and run
as a ring (context parallelism) when the sequence is sharded.

Each kernel call is a ``custom_partitioning`` function with a Shardy sharding rule. The partition
callback keeps the batch dims and the head dim of q sharded as they come (k/v heads with them when
the kv heads divide evenly, else replicated), replicates the head dim, and sums (``psum``) a
gradient over the mesh axes its input was replicated over while q was sharded: dbias for a bias
broadcast over batch, heads or query rows, dk/dv for kv heads shared by sharded query heads.

A sharded query sequence keeps its sharding when the call can run as a ring
(``context_parallel.ring_supported``: no window, no sequence lengths or segment ids, causal
only with ``Lq == Lk``, both lengths divisible by the shard count): k/v get the same sequence
sharding, a mask or bias keeps its query rows sharded and its key columns replicated, and the
lowering runs ``context_parallel.ring_forward`` / ``ring_backward`` over those mesh axes with
the kernels as steps. Any other sequence sharding is replicated (gathered) as before. A call
whose mask is a tuple gives each member its own operand and rule, and the strictest holds for the
call: one member whose rule names absolute positions (key or row ranges, block indices) keeps the
sequence replicated, never a ring, whatever the others allow.
The gate (``gate=(alpha, delta)``) shards alpha ``[B, Lq, H]`` with q's batch and heads and
delta ``[B, Lk, Hk]`` with the batch and the kv heads (their sequences replicated); its
threshold's block grid names absolute positions, so a gated call never runs as a ring either,
and ddelta is summed over the head axes the kv heads are not sharded over, like dk / dv.
A per-kv-head window table (``window_sizes``) names absolute positions too (its sinks), so such
a call never runs as a ring; with the kv heads sharded each shard runs the rows of its own kv
heads. Inside a fully manual ``shard_map`` or ``pmap`` the kernel is called directly (there the
call's table is that of the local kv heads, like its k and v).
The paged forward (``paged.paged_forward_p``, reading its pages in place) is partitioned the same
way: q, the page table, the lengths, mask and bias keep q's batch sharding, the pools
``[P, page_size, Hk, D]`` their kv heads with q's heads (pages and slots replicated, never a
ring).

Importing this module makes these calls the primitives' lowerings (``ops.register_lowerings``,
``paged.register_lowerings``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import string
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_dmattn._primitives import _ffi, ops, paged
from jax_dmattn.parallel import context_parallel

# ---- the kernel calls ----------------------------------------------------------------------


def _forward_impl(platform, params, opts, *operands):
    return tuple(_ffi.call_forward(platform, params, opts, *operands))


def _paged_impl(platform, params, opts, q, k_pages, v_pages, page_table, q_lens, kv_lens,
                *extras):
    mask, bias = paged.split_extras(extras, opts.has_mask, opts.has_bias)
    return tuple(_ffi.call_paged_forward(platform, params, q, k_pages, v_pages, page_table,
                                         q_lens, kv_lens, mask, bias))


def _backward_impl(platform, params, opts, *operands):
    q, k, v = operands[:3]
    bias = opts.split(operands[7:])[1]  # dalpha, ddelta: call_backward adds their shapes
    return tuple(_ffi.call_backward(platform, params, opts, *operands,
                                    grad_shapes=_grad_shapes(q, k, v, bias)))


def _grad_shapes(q, k, v, bias) -> list[tuple[int, ...]]:
    shapes = [ops.gradient_shape(x.shape, q.shape, 1) for x in (k, v)]
    if bias is not None:
        shapes.append(ops.gradient_shape(bias.shape, q.shape, 1))
    return shapes


def _kernel_steps(platform: str) -> context_parallel.StepFns:
    """The ring's per-chunk steps: the platform's kernels, called directly (this is already the
    per-device lowering)."""

    def forward(params, q, k, v, mask, bias):  # float32 out, as context_parallel.KERNEL_STEPS
        opts = ops.Optionals.of(mask, bias, None)._replace(float32_out=True)
        return _forward_impl(platform, params, opts, q, k, v,
                             *(x for x in (mask, bias) if x is not None))

    def backward(params, q, k, v, out, dout, lse, dlse, mask, bias):
        opts = ops.Optionals.of(mask, bias, None)
        grads = _backward_impl(platform, params, opts, q, k, v, out, dout, lse, dlse,
                               *(x for x in (mask, bias) if x is not None))
        return grads if bias is not None else (*grads, None)

    return context_parallel.StepFns(forward, backward)


# ---- layout of the operands ----------------------------------------------------------------


class _Layout:
    """Per-operand dim roles, derived from shapes: batch dims, then the operand's own dims."""

    def __init__(self, opts: ops.Optionals, shapes: Sequence[Sequence[int]], backward: bool,
                 paged: bool = False):
        self.opts = opts
        self.backward = backward
        self.paged = paged  # the paged forward: pools [P, page_size, Hk, D] and a page table
        q = tuple(shapes[0])
        self.num_batch = len(q) - 3
        self.batch = q[:self.num_batch]
        self.seqlen_q, self.heads = q[-3], q[-2]
        if paged:
            self.seqlen_k, self.kv_heads = shapes[3][-1] * shapes[1][1], shapes[1][2]
        else:
            self.seqlen_k, self.kv_heads = shapes[1][-3], shapes[1][-2]

    def kinds(self) -> list[str]:
        """Operand kinds in call order."""
        if self.paged:
            return (["q", "pool", "pool", "table", "lens", "lens"]
                    + (["mask"] if self.opts.has_mask else [])
                    + (["bias"] if self.opts.has_bias else []))
        head = ["q", "kv", "kv"] + (["q", "q", "lse", "lse"] if self.backward else [])
        extras = (["mask"] if self.opts.has_mask else []) + (["bias"] if self.opts.has_bias
                                                             else [])
        return (head + extras + (["lens", "lens"] if self.opts.has_seqlens else [])
                + (["qseg", "kvseg"] if self.opts.has_segments else [])
                # Key (row) ranges are laid out as a mask broadcast over rows (columns), and
                # sharded as one.
                + (["ranges", "ranges"] if self.opts.has_key_ranges else [])
                + (["ranges", "ranges"] if self.opts.has_row_ranges else [])
                + (["blocks"] if self.opts.has_block_indices else [])
                + (["alpha", "delta"] if self.opts.has_gate else [])
                + (["drops"] if self.opts.has_drop_map else []))

    def absolute_positions(self) -> bool:
        """Whether an operand's rule names absolute sequence positions (segment ids, ranges,
        block indices, the gate threshold's block grid, the softmax threshold's grid and its
        walk in increasing key order), which a ring over sequence chunks cannot shift (the ring
        steps take no gate and no threshold either)."""
        return (self.paged or self.opts.has_segments or self.opts.has_key_ranges
                or self.opts.has_row_ranges
                or self.opts.has_block_indices or self.opts.has_gate
                or self.opts.returns_drop_map or self.opts.has_drop_map)


def _shard_count(mesh, axes) -> int:
    return functools.reduce(lambda n, a: n * mesh.shape[a], _axes_tuple(axes), 1)


def _axes_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _spec_of(info, ndim: int) -> tuple:
    sharding = getattr(info, "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (ndim - len(spec))


Axes = str | tuple[str, ...] | None  # one PartitionSpec entry


class _Plan(NamedTuple):
    """Mesh axes of q's batch dims, of its heads, of the kv heads and of the sequence (the ring's
    axes; None: replicated)."""

    batch: list[Axes]
    heads: Axes
    kv_heads: Axes
    seq: Axes


def _plan(mesh, layout: _Layout, params, q_spec: tuple) -> _Plan:
    """What stays sharded of q's spec: batch dims; heads where they divide evenly; the sequence
    where the call runs as a ring over it."""
    batch_axes = list(q_spec[:layout.num_batch])
    head_axes = q_spec[layout.num_batch + 1]
    n = _shard_count(mesh, head_axes)
    if layout.heads % n or (layout.kv_heads % n and layout.kv_heads != 1):
        head_axes, n = None, 1
    kv_head_axes = head_axes if n > 1 and layout.kv_heads % n == 0 else None
    seq_axes = q_spec[layout.num_batch]
    seq_shards = _shard_count(mesh, seq_axes)
    opts = layout.opts
    if seq_shards == 1 or not context_parallel.ring_supported(
            params, opts.has_seqlens, layout.seqlen_q, layout.seqlen_k, seq_shards,
            layout.absolute_positions()):
        seq_axes = None
    return _Plan(batch_axes, head_axes, kv_head_axes, seq_axes)


def _operand_spec(kind: str, shape, layout: _Layout, plan: _Plan):
    """The PartitionSpec an operand of `kind` gets under the plan."""
    nb = layout.num_batch
    batch = [a if shape[d] == layout.batch[d] else None for d, a in enumerate(plan.batch)]
    if kind == "q":
        return PartitionSpec(*batch, plan.seq, plan.heads, None)
    if kind == "kv":
        return PartitionSpec(*batch, plan.seq, plan.kv_heads, None)
    if kind == "lse":
        return PartitionSpec(*batch, plan.heads, plan.seq)
    if kind == "lens":
        return PartitionSpec(*batch)
    if kind == "pool":  # [P, page_size, Hk, D]: no batch dims, pages and slots replicated
        return PartitionSpec(None, None, plan.kv_heads, None)
    if kind == "table":  # [*B, max_pages]
        return PartitionSpec(*batch, None)
    if kind in ("qseg", "kvseg"):  # batch dims as q's, the sequence replicated (never a ring)
        return PartitionSpec(*batch, None)
    if kind == "alpha":  # [*B, Lq, H]: the sequence replicated (never a ring)
        return PartitionSpec(*batch, None, plan.heads)
    if kind == "delta":  # [*B, Lk, Hk]
        return PartitionSpec(*batch, None, plan.kv_heads)
    if kind == "drops":  # [*B, H, nQB, nKB] (full batch): the blocks replicated (never a ring)
        return PartitionSpec(*batch, plan.heads, None, None)
    heads = shape[nb]
    if heads == layout.heads:
        axes = plan.heads
    elif heads == layout.kv_heads:
        axes = plan.kv_heads
    else:
        axes = None
    if kind == "blocks":  # query blocks and their slots replicated (never a ring)
        return PartitionSpec(*batch, axes, None, None)
    # A mask/bias keeps its query rows with q's; each ring step slices its key columns locally.
    rows = plan.seq if shape[nb + 1] == layout.seqlen_q else None
    return PartitionSpec(*batch, axes, rows, None)


def _reduced_axes(spec: PartitionSpec, full_spec: PartitionSpec) -> tuple[str, ...]:
    """Mesh axes sharding `full_spec` (q's layout) that `spec` leaves replicated."""
    present = {a for entry in spec for a in _axes_tuple(entry)}
    wanted = [a for entry in full_spec for a in _axes_tuple(entry)]
    return tuple(a for a in wanted if a not in present)


def _partition(backward: bool, platform, params, opts, mesh, arg_infos, result_infos,
               paged: bool = False):
    shapes = [info.shape for info in arg_infos]
    layout = _Layout(opts, shapes, backward, paged)
    plan = _plan(mesh, layout, params, _spec_of(arg_infos[0], len(shapes[0])))
    arg_specs = [_operand_spec(kind, shape, layout, plan)
                 for kind, shape in zip(layout.kinds(), shapes, strict=True)]
    q_spec = arg_specs[0]
    if not backward:
        result_specs = [q_spec, _operand_spec("lse", shapes[0], layout, plan)]
        if opts.returns_drop_map:
            result_specs.append(_operand_spec("drops", shapes[0], layout, plan))
        lower = _local_call(_paged_impl if paged else _forward_impl, platform, params, opts, mesh,
                            plan)
        if plan.seq is not None:
            lower = functools.partial(_ring_forward, platform, params, opts, plan.seq)
    else:
        nb = layout.num_batch
        grad_specs = [q_spec, _gradient_spec(arg_specs[1], q_spec, nb),
                      _gradient_spec(arg_specs[2], q_spec, nb)]
        if opts.has_bias:
            bias_spec = arg_specs[layout.kinds().index("bias")]
            grad_specs.append(_gradient_spec(bias_spec, q_spec, nb - 1))
        if opts.has_gate:
            grad_specs += [arg_specs[layout.kinds().index(kind)] for kind in ("alpha", "delta")]
        result_specs = grad_specs
        psum_axes = [_reduced_axes(spec, q_spec) for spec in grad_specs]
        impl = _local_call(_backward_impl, platform, params, opts, mesh, plan)
        if plan.seq is not None:
            impl = functools.partial(_ring_backward, platform, params, opts, plan.seq)

        def lower(*operands):
            grads = impl(*operands)
            return tuple(jax.lax.psum(g, axes) if axes else g
                         for g, axes in zip(grads, psum_axes, strict=True))

    to_sharding = functools.partial(NamedSharding, mesh)
    return (mesh, lower, tuple(map(to_sharding, result_specs)),
            tuple(map(to_sharding, arg_specs)))


def _local_call(impl, platform, params, opts, mesh, plan: _Plan):
    """`impl` (``_forward_impl`` or ``_backward_impl``) on one shard's operands. A per-kv-head
    window table (``params.window_sizes``) is cut to the shard's kv heads where they are
    sharded: one call where every shard's cut is the same, else a ``lax.switch`` over the
    shard's index with a call per distinct cut (the table is a static attribute)."""
    table = params.window_sizes
    if table is None or plan.kv_heads is None:
        return functools.partial(impl, platform, params, opts)
    size = len(table) // _shard_count(mesh, plan.kv_heads)
    cuts = [table[s:s + size] for s in range(0, len(table), size)]
    distinct = list(dict.fromkeys(cuts))
    branches = [functools.partial(impl, platform, dataclasses.replace(params, window_sizes=cut),
                                  opts) for cut in distinct]
    if len(branches) == 1:
        return branches[0]
    which = np.asarray([distinct.index(cut) for cut in cuts], np.int32)

    def call(*operands):
        shard = jax.lax.axis_index(_axes_tuple(plan.kv_heads))
        return jax.lax.switch(jnp.asarray(which)[shard], branches, *operands)

    return call


def _ring_forward(platform, params, opts, axis_name, q, k, v, *extras):
    mask, bias = opts.split(extras)[:2]
    return context_parallel.ring_forward(_kernel_steps(platform), params, q, k, v, mask, bias,
                                         axis_name=axis_name,
                                         out_dtype=opts.out_dtype(q.dtype))


def _ring_backward(platform, params, opts, axis_name, q, k, v, out, dout, lse, dlse, *extras):
    mask, bias = opts.split(extras)[:2]
    grads = context_parallel.ring_backward(_kernel_steps(platform), params, q, k, v, out, dout,
                                           lse, dlse, mask, bias, axis_name=axis_name)
    return grads[:3] if bias is None else grads


def _gradient_spec(spec: PartitionSpec, q_spec: PartitionSpec, full_dims: int) -> PartitionSpec:
    """A gradient's spec: q's over its first `full_dims` dims (full there), else its input's."""
    return PartitionSpec(*q_spec[:full_dims], *spec[full_dims:])


# ---- Shardy rule ----------------------------------------------------------------------------


def _kv_heads_follow(mesh, layout: _Layout) -> bool:
    """Whether Shardy can put any head sharding of q on the compound (kv head, group) factor
    with whole mesh axes. It gives the axes of q's heads, major to minor, to the kv heads until
    they hold Hk, then to the group; an axis that would overfill the kv heads (Hk not a multiple
    of the product so far) is split into sub-axes, which custom partitioning cannot take
    (IndivisibleError). The rule does not see q's sharding, so every order of mesh axes whose
    product divides the query heads must fit."""
    sizes = list(mesh.shape.values())
    for count in range(1, len(sizes) + 1):
        for axes in itertools.permutations(sizes, count):
            if layout.heads % math.prod(axes):
                continue
            done = 1
            for n in axes:
                if done == layout.kv_heads:
                    break
                if layout.kv_heads % (done * n):
                    return False
                done *= n
    return True


def _sharding_rule(backward: bool, platform, params, opts, mesh, value_types, result_types,
                   paged: bool = False):
    from jax._src.lib.mlir import ir

    shapes = [tuple(ir.RankedTensorType(t).shape) for t in value_types]
    layout = _Layout(opts, shapes, backward, paged)
    names = iter(f"{a}{b}" for a in string.ascii_lowercase for b in string.ascii_lowercase)
    batch = [next(names) for _ in range(layout.num_batch)]
    # Mask/bias key columns get a factor of their own (kc): always replicated, while lk (k/v's
    # sequence) may be sharded for the ring.
    lq, lk, d, kc = next(names), next(names), next(names), next(names)
    block_rows, block_cols = next(names), next(names)  # the softmax threshold's drop map
    pages, slots, entries = next(names), next(names), next(names)  # a paged cache's, replicated
    # q's heads are the compound (kv head, group) factor, so that a head sharding propagates
    # between q and k / v, only where every set of mesh axes that can shard q's heads also
    # shards the kv heads evenly; else they are factors of their own. Shardy rejects size-1
    # factors inside a compound dim, so MQA names the query heads alone.
    group = layout.heads // layout.kv_heads
    if layout.kv_heads == 1 or (group > 1 and not _kv_heads_follow(mesh, layout)):
        heads, hk, factor_sizes = next(names), next(names), {}
    elif group == 1:
        heads = hk = next(names)
        factor_sizes = {}
    else:
        hk, g = next(names), next(names)
        heads, factor_sizes = f"({hk} {g})", {g: group}

    def batch_of(shape, full_over=0):
        return [b if (shape[i] == layout.batch[i] or i < full_over) else next(names)
                for i, b in enumerate(batch)]

    def dims(kind, shape, full_over=0):
        bat = batch_of(shape, full_over)
        if kind == "q":
            return [*bat, lq, heads, d]
        if kind == "kv":
            return [*bat, lk, hk, d]
        if kind == "lse":
            return [*bat, heads, lq]
        if kind == "lens":
            return bat
        if kind == "pool":
            return [pages, slots, hk, d]
        if kind == "table":
            return [*bat, entries]
        # The segment ids' sequence dims are q's and k's: replicated, since such a call is no
        # ring candidate.
        if kind == "qseg":
            return [*bat, lq]
        if kind == "kvseg":
            return [*bat, lk]
        if kind == "alpha":  # [*B, Lq, H] (full batch)
            return [*bat, lq, heads]
        if kind == "delta":  # [*B, Lk, Hk]
            return [*bat, lk, hk]
        if kind == "drops":  # [*B, H, nQB, nKB] (full batch): the blocks replicated
            return [*bat, heads, block_rows, block_cols]
        nb = layout.num_batch
        h = shape[nb]
        head = heads if h == layout.heads else (hk if h == layout.kv_heads else next(names))
        if kind == "blocks":  # query blocks and slots: factors of their own, replicated
            return [*bat, head, next(names), next(names)]
        row = lq if shape[nb + 1] == layout.seqlen_q else next(names)
        col = kc if shape[nb + 2] == layout.seqlen_k else next(names)
        return [*bat, head, row, col]

    operands = [dims(kind, shape) for kind, shape in zip(layout.kinds(), shapes, strict=True)]
    if not backward:
        results = [dims("q", shapes[0]), dims("lse", shapes[0])]
        if opts.returns_drop_map:
            results.append(dims("drops", shapes[0]))
    else:
        results = [dims("q", shapes[0]), dims("kv", shapes[1], layout.num_batch),
                   dims("kv", shapes[2], layout.num_batch)]
        if opts.has_bias:
            bias_shape = shapes[layout.kinds().index("bias")]
            results.append(dims("bias", bias_shape, layout.num_batch - 1))
        if opts.has_gate:
            results += [dims(kind, shapes[layout.kinds().index(kind)])
                        for kind in ("alpha", "delta")]
    rule = (", ".join(" ".join(x) for x in operands) + " -> "
            + ", ".join(" ".join(x) for x in results))
    # Shardy wants special factors in the order the rule first names them.
    tokens = rule.replace("(", " ").replace(")", " ").replace(",", " ").split()
    # The sequences may stay sharded where the partition callback can run the call as a ring
    # (it replicates them itself where the shard count does not divide them).
    ringable = context_parallel.ring_candidate(params, opts.has_seqlens, layout.seqlen_q,
                                               layout.seqlen_k, layout.absolute_positions())
    factors = (d, kc, block_rows, block_cols, pages, slots, entries)
    if not ringable:
        factors = (lq, lk, *factors)
    replicated = tuple(sorted((f for f in factors if f in tokens), key=tokens.index))
    return rule, dict(need_replication_factors=replicated, **factor_sizes)


def _make(backward: bool, paged: bool = False):
    impl = _backward_impl if backward else (_paged_impl if paged else _forward_impl)
    fn = custom_partitioning(impl, static_argnums=(0, 1, 2))
    fn.def_partition(
        partition=functools.partial(_partition, backward, paged=paged),
        infer_sharding_from_operands=functools.partial(_infer, backward, paged),
        sharding_rule=functools.partial(_sharding_rule, backward, paged=paged))
    return fn


def _infer(backward, paged, platform, params, opts, mesh, arg_infos, result_infos):
    return _partition(backward, platform, params, opts, mesh, arg_infos, result_infos,
                      paged)[2]


_partitioned_forward = _make(backward=False)
_partitioned_backward = _make(backward=True)
_partitioned_paged_forward = _make(backward=False, paged=True)


def kernel_forward(platform, params, opts, *operands):
    """``[out, lse]`` through the platform's kernel, partitioned over batch and heads."""
    return list(_partitioned_forward(platform, params, opts, *operands))


def kernel_paged_forward(platform, params, opts, *operands):
    """``[out, lse]`` of the paged forward through the platform's kernel reading the pages in
    place (operands as ``paged.paged_forward_p``'s; `opts`: ``ops.Optionals`` of its mask and
    bias), partitioned over batch and heads."""
    return list(_partitioned_paged_forward(platform, params, opts, *operands))


def kernel_backward(platform, params, opts, *operands):
    """``[dq, dk, dv, (dbias), (dalpha, ddelta)]`` through the platform's kernel, partitioned
    likewise."""
    return list(_partitioned_backward(platform, params, opts, *operands))


# ---- batch-parallel calls ---------------------------------------------------------------------


def _listed_keys_lead(slots_ndim: int) -> int:
    return slots_ndim - 3  # slots [*B, Cc, nb, Lk]


def _listed_keys_partition(mesh, arg_infos, result_infos):
    lead = _listed_keys_lead(len(arg_infos[1].shape))
    batch = _spec_of(arg_infos[0], len(arg_infos[0].shape))[:lead]

    def spec(ndim: int) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(*batch, *([None] * (ndim - lead))))

    arg_shardings = tuple(spec(len(info.shape)) for info in arg_infos)
    return mesh, _ffi.call_sum_listed_keys, spec(lead + 3), arg_shardings


def _listed_keys_rule(mesh, value_types, result_types):
    from jax._src.lib.mlir import ir

    grad, slots, _ = (tuple(ir.RankedTensorType(t).shape) for t in value_types)
    lead = _listed_keys_lead(len(slots))
    batch = " ".join(f"b{i}" for i in range(lead))
    shared = "c" if slots[lead] == grad[lead + 2] else "s"  # key lists per channel, or shared
    rule = (f"{batch} n u c d, {batch} {shared} n k, {batch} {shared} t k -> {batch} k c d")
    # (in the order the rule first names them, as Shardy wants)
    return rule, dict(need_replication_factors=tuple(dict.fromkeys(
        ("n", "u", "c", "d", shared, "k", "t"))))


_partitioned_sum_listed_keys = custom_partitioning(_ffi.call_sum_listed_keys)
_partitioned_sum_listed_keys.def_partition(
    partition=_listed_keys_partition,
    infer_sharding_from_operands=lambda mesh, args, results: _listed_keys_partition(
        mesh, args, results)[2],
    sharding_rule=_listed_keys_rule)


def kernel_sum_listed_keys(grad, slots, spans):
    """:func:`ops.sum_listed_keys` through the platform's kernel, partitioned over the leading
    (batch) dims, which every operand shares; the other dims are replicated."""
    return _partitioned_sum_listed_keys(grad, slots, spans)


ops.register_lowerings(ops.KernelCalls(kernel_forward, kernel_backward, kernel_sum_listed_keys))
paged.register_lowerings(kernel_paged_forward)
