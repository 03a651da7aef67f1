"""Sharding rules: kernel calls stay local when inputs are sharded over batch and heads.

Each kernel call is a ``custom_partitioning`` function with a Shardy sharding rule. The partition
callback keeps the batch dims and the head dim of q sharded as they come (k/v heads with them when
the kv heads divide evenly, else replicated), replicates sequence and head-dim axes, and sums
(``psum``) a gradient over the mesh axes its input was replicated over while q was sharded:
dbias for a bias broadcast over batch or heads, dk/dv for kv heads shared by sharded query heads.
Inside a fully manual ``shard_map`` or ``pmap`` the kernel is called directly.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_dmattn import _ffi, ops

# ---- the kernel calls ----------------------------------------------------------------------


def _forward_impl(platform, params, opts, *operands):
    return tuple(_ffi.call_forward(platform, params, opts, *operands))


def _backward_impl(platform, params, opts, *operands):
    q, k, v = operands[:3]
    _, bias, _, _ = opts.split(operands[7:])
    return tuple(_ffi.call_backward(platform, params, opts, *operands,
                                    grad_shapes=_grad_shapes(q, k, v, bias)))


def _grad_shapes(q, k, v, bias) -> list[tuple[int, ...]]:
    shapes = [ops.gradient_shape(x.shape, q.shape, 1) for x in (k, v)]
    if bias is not None:
        shapes.append(ops.gradient_shape(bias.shape, q.shape, 1))
    return shapes


# ---- layout of the operands ----------------------------------------------------------------


class _Layout:
    """Per-operand dim roles, derived from shapes: batch dims, then the operand's own dims."""

    def __init__(self, opts: ops.Optionals, shapes: Sequence[Sequence[int]], backward: bool):
        self.opts = opts
        self.backward = backward
        q = tuple(shapes[0])
        self.num_batch = len(q) - 3
        self.batch = q[:self.num_batch]
        self.seqlen_q, self.heads = q[-3], q[-2]
        self.seqlen_k, self.kv_heads = shapes[1][-3], shapes[1][-2]

    def kinds(self) -> list[str]:
        """Operand kinds in call order."""
        head = ["q", "kv", "kv"] + (["q", "q", "lse", "lse"] if self.backward else [])
        extras = (["mask"] if self.opts.has_mask else []) + (["bias"] if self.opts.has_bias
                                                             else [])
        return head + extras + (["lens", "lens"] if self.opts.has_seqlens else [])


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


def _plan(mesh, layout: _Layout, q_spec: tuple):
    """Mesh axes of q's batch dims and heads, and of the kv heads (None: replicated)."""
    batch_axes = list(q_spec[:layout.num_batch])
    head_axes = q_spec[layout.num_batch + 1]
    n = _shard_count(mesh, head_axes)
    if layout.heads % n or (layout.kv_heads % n and layout.kv_heads != 1):
        head_axes, n = None, 1
    kv_head_axes = head_axes if n > 1 and layout.kv_heads % n == 0 else None
    return batch_axes, head_axes, kv_head_axes


def _operand_spec(kind: str, shape, layout: _Layout, batch_axes, head_axes, kv_head_axes):
    """The PartitionSpec an operand of `kind` gets under the plan."""
    nb = layout.num_batch
    batch = [a if shape[d] == layout.batch[d] else None for d, a in enumerate(batch_axes)]
    if kind == "q":
        return PartitionSpec(*batch, None, head_axes, None)
    if kind == "kv":
        return PartitionSpec(*batch, None, kv_head_axes, None)
    if kind == "lse":
        return PartitionSpec(*batch, head_axes, None)
    if kind == "lens":
        return PartitionSpec(*batch)
    heads = shape[nb]
    if heads == layout.heads:
        axes = head_axes
    elif heads == layout.kv_heads:
        axes = kv_head_axes
    else:
        axes = None
    return PartitionSpec(*batch, axes, None, None)


def _reduced_axes(spec: PartitionSpec, full_spec: PartitionSpec) -> tuple[str, ...]:
    """Mesh axes sharding `full_spec` (q's layout) that `spec` leaves replicated."""
    present = {a for entry in spec for a in _axes_tuple(entry)}
    wanted = [a for entry in full_spec for a in _axes_tuple(entry)]
    return tuple(a for a in wanted if a not in present)


def _partition(backward: bool, platform, params, opts, mesh, arg_infos, result_infos):
    shapes = [info.shape for info in arg_infos]
    layout = _Layout(opts, shapes, backward)
    q_spec = _spec_of(arg_infos[0], len(shapes[0]))
    batch_axes, head_axes, kv_head_axes = _plan(mesh, layout, q_spec)
    arg_specs = [_operand_spec(kind, shape, layout, batch_axes, head_axes, kv_head_axes)
                 for kind, shape in zip(layout.kinds(), shapes, strict=True)]
    q_spec = arg_specs[0]
    if not backward:
        lse_spec = _operand_spec("lse", shapes[0], layout, batch_axes, head_axes, None)
        result_specs = [q_spec, lse_spec]
        lower = functools.partial(_forward_impl, platform, params, opts)
    else:
        nb = layout.num_batch
        grad_specs = [q_spec, _gradient_spec(arg_specs[1], q_spec, nb),
                      _gradient_spec(arg_specs[2], q_spec, nb)]
        if opts.has_bias:
            bias_spec = arg_specs[layout.kinds().index("bias")]
            grad_specs.append(_gradient_spec(bias_spec, q_spec, nb - 1))
        result_specs = grad_specs
        psum_axes = [_reduced_axes(spec, q_spec) for spec in grad_specs]

        def lower(*operands):
            grads = _backward_impl(platform, params, opts, *operands)
            return tuple(jax.lax.psum(g, axes) if axes else g
                         for g, axes in zip(grads, psum_axes, strict=True))

    to_sharding = functools.partial(NamedSharding, mesh)
    return (mesh, lower, tuple(map(to_sharding, result_specs)),
            tuple(map(to_sharding, arg_specs)))


def _gradient_spec(spec: PartitionSpec, q_spec: PartitionSpec, full_dims: int) -> PartitionSpec:
    """A gradient's spec: q's over its first `full_dims` dims (full there), else its input's."""
    return PartitionSpec(*q_spec[:full_dims], *spec[full_dims:])


# ---- Shardy rule ----------------------------------------------------------------------------


def _sharding_rule(backward: bool, platform, params, opts, mesh, value_types, result_types):
    from jax._src.lib.mlir import ir

    shapes = [tuple(ir.RankedTensorType(t).shape) for t in value_types]
    layout = _Layout(opts, shapes, backward)
    names = iter(f"{a}{b}" for a in string.ascii_lowercase for b in string.ascii_lowercase)
    batch = [next(names) for _ in range(layout.num_batch)]
    lq, lk, d = next(names), next(names), next(names)
    # Shardy rejects size-1 factors inside a compound dim, so MQA names the query heads alone.
    group = layout.heads // layout.kv_heads
    if layout.kv_heads == 1:
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
        nb = layout.num_batch
        h = shape[nb]
        head = heads if h == layout.heads else (hk if h == layout.kv_heads else next(names))
        row = lq if shape[nb + 1] == layout.seqlen_q else next(names)
        col = lk if shape[nb + 2] == layout.seqlen_k else next(names)
        return [*bat, head, row, col]

    operands = [dims(kind, shape) for kind, shape in zip(layout.kinds(), shapes, strict=True)]
    if not backward:
        results = [dims("q", shapes[0]), dims("lse", shapes[0])]
    else:
        results = [dims("q", shapes[0]), dims("kv", shapes[1], layout.num_batch),
                   dims("kv", shapes[2], layout.num_batch)]
        if opts.has_bias:
            bias_shape = shapes[layout.kinds().index("bias")]
            results.append(dims("bias", bias_shape, layout.num_batch - 1))
    rule = (", ".join(" ".join(x) for x in operands) + " -> "
            + ", ".join(" ".join(x) for x in results))
    # Shardy wants special factors in the order the rule first names them.
    tokens = rule.replace("(", " ").replace(")", " ").replace(",", " ").split()
    replicated = tuple(sorted((lq, lk, d), key=tokens.index))
    return rule, dict(need_replication_factors=replicated, **factor_sizes)


def _make(backward: bool):
    impl = _backward_impl if backward else _forward_impl
    fn = custom_partitioning(impl, static_argnums=(0, 1, 2))
    fn.def_partition(
        partition=functools.partial(_partition, backward),
        infer_sharding_from_operands=functools.partial(_infer, backward),
        sharding_rule=functools.partial(_sharding_rule, backward))
    return fn


def _infer(backward, platform, params, opts, mesh, arg_infos, result_infos):
    return _partition(backward, platform, params, opts, mesh, arg_infos, result_infos)[2]


_partitioned_forward = _make(backward=False)
_partitioned_backward = _make(backward=True)


def kernel_forward(platform, params, opts, *operands):
    """``[out, lse]`` through the platform's kernel, partitioned over batch and heads."""
    return list(_partitioned_forward(platform, params, opts, *operands))


def kernel_backward(platform, params, opts, *operands):
    """``[dq, dk, dv, (dbias)]`` through the platform's kernel, partitioned likewise."""
    return list(_partitioned_backward(platform, params, opts, *operands))
