"""``RowShardedTensor``: the DTensor the engine hands out where its rows are not torch's split.

Why: torch's DTensor strategies know one dim-0 split, ``Shard(0)`` = ``torch.chunk``'s. The
engine cuts parameter groups at whole rows (layout.py), so a parameter's rows per rank are
usually another split: ``RowShard(rows)`` (row_shard.py) describes it, and its collectives
(``full_tensor()``, ``redistribute()``, the local shape and offset DCP reads) use the true
rows. An *operator* on such a DTensor, though, would be planned by torch as if it were
``Shard(0)``: ``p.view(-1)`` would be labelled wrongly and ``p + replicated`` would cut the
replicated operand at torch's rows, not ours.

So every DTensor whose placements torch cannot describe (an uneven ``RowShard``, HFSDP's
``NestedRowShard``) is an instance of this subclass, and its ``__torch_dispatch__``, the
extension point DTensor offers its subclasses, sees every operator on it first. Nothing of
torch is replaced; DTensors with torch's own placements (an even split is handed out as a
plain ``Shard(0)`` DTensor) never come here.

* Elementwise operators (``Tag.pointwise``, ``_foreach_*`` but the norms, the fused
  optimizers, copies, ``*_like``) run on the local rows when every DTensor operand has the
  same layout, or is replicated and either broadcasts without reaching dim 0 or is cut at
  the same rows; the result keeps the layout. This is the optimizer's path: no planning.
* Any other operator is planned by torch itself, asked (read only) what it would do with
  the rows relabelled as a plain ``Shard(0)``: an input torch wants gathered is gathered
  over the true rows first, a replicated one torch wants cut along dim 0 is cut at our
  rows; a result split along dim 0 with the rows' size gets the rows back. What torch
  would re-shard any other way, a result sharded otherwise, or averaged over the rows,
  raises a one-line ``NotImplementedError`` before anything runs.
* HFSDP's nested shards allow elementwise operators only; everything else raises.

Limit: the placements themselves are not guarded. A plain DTensor that a user builds with a
``RowShard`` placement (``DTensor.from_local`` or ``redistribute`` of a plain DTensor to
one) is planned by torch as a ``Shard(0)``; the engine never hands such a tensor out, and
``redistribute`` of a ``RowShardedTensor`` returns a ``RowShardedTensor``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial

from megatron.core.torch_private import (
    DTensorSpec, StridedShard, TensorMeta, contiguous_strides, dtensor_local, dtensor_spec, sharding_propagator,
    unwrap_to_op_info)

from .row_shard import NestedRowShard, RowShard

_SUPPORTED = "call full_tensor() first (or redistribute to Replicate())"

# Not tagged pointwise in aten, but elementwise all the same (same shape in and out).
_ELEMENTWISE = frozenset({
    "copy_", "zero_", "fill_", "detach", "clone", "alias", "_to_copy", "empty_like", "zeros_like",
    "ones_like", "full_like", "rand_like", "randn_like",
})
_FOREACH_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})


def _is_rows(p) -> bool:
    """A placement torch's strategies cannot describe: uneven rows, or a nested split."""
    return isinstance(p, NestedRowShard) or (isinstance(p, RowShard) and not p.is_even())


def needs_guard(placements: Sequence) -> bool:
    return any(_is_rows(p) for p in placements)


def make_dtensor(local: torch.Tensor, mesh, placements: Sequence, shape, stride) -> DTensor:
    """The engine's DTensor for ``local``: a plain DTensor where torch's placements are true
    (an even RowShard is handed out as ``Shard(0)``), else a ``RowShardedTensor``."""
    placements = tuple(Shard(0) if isinstance(p, RowShard) and p.is_even() else p for p in placements)
    if not needs_guard(placements):
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return RowShardedTensor(local, _guarded_spec(mesh, placements, meta), requires_grad=False)


def _refuse(op, placement, why: str):
    raise NotImplementedError(f"{op} on an MFSDP v2 row-sharded DTensor ({placement}) {why}; {_SUPPORTED}.")


def _refuse_nested(op):
    raise NotImplementedError(f"{op}: {NestedRowShard.MESSAGE}")


def _is_dim0(p) -> bool:
    return type(p) is Shard and p.dim == 0


def _sharded(p) -> bool:
    return isinstance(p, (Shard, StridedShard))


def _guarded(t) -> bool:
    return isinstance(t, DTensor) and needs_guard(t.placements)


def _nested(t) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, NestedRowShard) for p in t.placements)


def _wrap(local: torch.Tensor, mesh, placements, shape) -> "RowShardedTensor":
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), local.dtype)
    if local.dim() and not local.is_contiguous():
        meta = TensorMeta(torch.Size(shape), _global_stride(local, shape), local.dtype)
    return RowShardedTensor(local, _guarded_spec(mesh, placements, meta), requires_grad=False)


def _global_stride(local: torch.Tensor, shape) -> Tuple[int, ...]:
    """A dim-0 split keeps the order of the dims: the global strides follow the local order."""
    order = sorted(range(local.dim()), key=lambda d: local.stride(d))
    stride, step = [0] * local.dim(), 1
    for d in order:
        stride[d] = step
        step *= shape[d]
    return tuple(stride)


# --------------------------------------------------------------------------------------
# Elementwise operators: on the local rows
# --------------------------------------------------------------------------------------

_KIND_OF: Dict[object, bool] = {}  # operator -> elementwise? (asked once per operator)


def _is_elementwise(func) -> bool:
    kind = _KIND_OF.get(func)
    if kind is None:
        name = func._schema.name.split("::")[-1]
        if name.startswith("_foreach_"):
            kind = name not in _FOREACH_REDUCTIONS
        else:
            kind = name.startswith("_fused_") or name in _ELEMENTWISE or torch.Tag.pointwise in func.tags
        _KIND_OF[func] = kind
    return kind


def _local_operand(func, t, ref: DTensor):
    """``t``'s local tensor, lined up with the rows of ``ref`` (a guarded DTensor)."""
    if not isinstance(t, DTensor):
        if isinstance(t, torch.Tensor) and t.numel() > 1:
            raise RuntimeError(f"{func}: got mixed torch.Tensor and DTensor operands; "
                               "convert the torch.Tensor to a DTensor first.")
        return t
    if t.device_mesh != ref.device_mesh:
        _refuse(func, ref.placements, f"meets a DTensor on another mesh ({t.device_mesh})")
    if t.placements == ref.placements and t.dim() == ref.dim() and (
            t.shape[0] == ref.shape[0] if t.dim() else True) and (not _nested(ref) or t.shape == ref.shape):
        return dtensor_local(t)
    if all(p.is_replicate() for p in t.placements):
        if t.dim() < ref.dim() or (t.dim() == ref.dim() and t.shape[0] == 1):
            return dtensor_local(t)  # it broadcasts over the rows: any rows will do
        if t.dim() == ref.dim() and t.shape[0] == ref.shape[0] and not _nested(ref):
            return dtensor_local(t).narrow(0, _local_offset(ref), dtensor_local(ref).shape[0])
    if _nested(ref):
        _refuse_nested(func)
    _refuse(func, ref.placements, f"meets an input placed as {tuple(t.placements)}")


def _local_offset(ref: DTensor) -> int:
    """The first global row of ``ref``'s local rows."""
    offset = 0
    for d, p in enumerate(ref.placements):
        if isinstance(p, RowShard):
            offset += p.starts[ref.device_mesh.get_local_rank(d)]
        elif _sharded(p):
            _refuse("a replicated operand", ref.placements, "cannot be cut at rows split twice")
    return offset


_WRITTEN: Dict[tuple, frozenset] = {}


def _written_positions(func, keys: list, num_args: int) -> frozenset:
    """Positions (args, then kwargs in ``keys`` order) of the operands ``func`` writes."""
    key = (func, tuple(keys), num_args)
    written = _WRITTEN.get(key)
    if written is None:
        found = set()
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                if index < num_args:
                    found.add(index)
                elif argument.name in keys:
                    found.add(num_args + keys.index(argument.name))
        written = _WRITTEN[key] = frozenset(found)
    return written


def _elementwise(func, args: tuple, kwargs: dict):
    keys = list(kwargs)
    values = list(args) + [kwargs[k] for k in keys]
    is_list = [isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v) for v in values]
    n = len(next(v for v, listed in zip(values, is_list) if listed)) if any(is_list) else 1
    per_item = [listed or (any(is_list) and isinstance(v, (list, tuple)) and len(v) == n)
                for v, listed in zip(values, is_list)]

    def item(v, j, listed):
        return v[j] if listed else v

    refs: Dict[int, DTensor] = {}
    for j in range(n):
        tensors = [item(v, j, listed) for v, listed in zip(values, per_item)]
        guarded = [t for t in tensors if _guarded(t)]
        if guarded:
            refs[j] = guarded[0]
    rows_items = sorted(refs)
    plain_items = [j for j in range(n) if j not in refs]

    def call(items, operand):
        sub = []
        for position, (v, listed) in enumerate(zip(values, per_item)):
            if listed:
                sub.append(type(v)(operand(position, v[j], j) for j in items))
            else:
                sub.append(operand(position, v, items[0]) if isinstance(v, torch.Tensor) else v)
        return func(*sub[:len(args)], **dict(zip(keys, sub[len(args):])))

    # Every operand is checked (and lined up with its item's rows) before the operator runs
    # on any of them; one it writes must have the rows' layout itself (a replicated one
    # would change on these rows only).
    written = _written_positions(func, keys, len(args))
    local_for: Dict[tuple, object] = {}  # (position, item) -> the local operand
    local_of: Dict[int, torch.Tensor] = {}  # id(local) -> its DTensor, for in-place results
    for j in rows_items:
        ref = refs[j]
        for position, (v, listed) in enumerate(zip(values, per_item)):
            t = item(v, j, listed)
            if not isinstance(t, torch.Tensor):
                continue
            local = _local_operand(func, t, ref)
            if position in written and not (isinstance(t, DTensor) and t.placements == ref.placements):
                _refuse(func, ref.placements, f"would write an operand placed as {getattr(t, 'placements', 'a torch.Tensor')}")
            local_for[position, j] = local
            if isinstance(t, DTensor):
                local_of[id(local)] = t
    plain_out = call(plain_items, lambda position, t, j: t) if plain_items else None
    rows_out = call(rows_items, lambda position, t, j: local_for.get((position, j), t))

    def back(out, j):
        if isinstance(out, torch.Tensor):
            if id(out) in local_of:  # in place: the operand itself
                return local_of[id(out)]
            ref = refs[j]
            shape = ref.shape if _nested(ref) else (ref.shape[0],) + tuple(out.shape[1:])
            return _wrap(out, ref.device_mesh, ref.placements, shape)
        return out

    if not any(is_list):
        if isinstance(rows_out, (list, tuple)):
            return type(rows_out)(back(o, 0) for o in rows_out)
        return back(rows_out, 0)
    if not isinstance(rows_out, (list, tuple)) or len(rows_out) != len(rows_items):
        return rows_out  # in place (None) or nothing per item
    merged: List[Optional[torch.Tensor]] = [None] * n
    for j, o in zip(rows_items, rows_out):
        merged[j] = back(o, j)
    for j, o in zip(plain_items, plain_out or ()):
        merged[j] = o
    return merged


# --------------------------------------------------------------------------------------
# Any other operator: torch's own plan, with the rows kept true
# --------------------------------------------------------------------------------------

def _specs(tree) -> List[DTensorSpec]:
    if isinstance(tree, DTensorSpec):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [s for item in tree for s in _specs(item)]
    return []


def _tree_replace(tree, mapping: Dict[int, object]):
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_replace(x, mapping) for x in tree)
    if isinstance(tree, dict):
        return {k: _tree_replace(v, mapping) for k, v in tree.items()}
    return mapping.get(id(tree), tree)


def _tree_leaves(tree) -> list:
    if isinstance(tree, (list, tuple)):
        return [leaf for x in tree for leaf in _tree_leaves(x)]
    return [tree]


def _plain(t: DTensor) -> DTensor:
    """The same local rows under torch's placement: every RowShard as a plain Shard(0)."""
    placements = tuple(Shard(0) if isinstance(p, RowShard) else p for p in t.placements)
    return DTensor(dtensor_local(t), DTensorSpec(t.device_mesh, placements, tensor_meta=dtensor_spec(t).tensor_meta),
                   requires_grad=False)


class _Plan:
    """One operator call as torch would plan it with the rows relabelled ``Shard(0)``."""

    def __init__(self, func, args: tuple, kwargs: dict):
        self.func = func
        tensors = [t for t in _tree_leaves((args, kwargs)) if isinstance(t, DTensor)]
        self.guarded = [t for t in tensors if _guarded(t)]
        self.plain_of = {id(t): _plain(t) for t in self.guarded}
        self.args = _tree_replace(args, self.plain_of)
        self.kwargs = _tree_replace(kwargs, self.plain_of)
        op_info = unwrap_to_op_info(func, self.args, self.kwargs)
        try:
            sharding_propagator().propagate(op_info)
        except Exception as error:  # torch refuses even a plain Shard(0) here
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            _refuse(func, self.guarded[0].placements, f"is not supported ({reason})")
        self.sharding = op_info.output_sharding
        schema = op_info.schema
        wanted = self.sharding.redistribute_schema if self.sharding.needs_redistribute else schema
        self.given = _specs(schema.args_schema) + _specs(list(schema.kwargs_schema.values()))
        self.wanted = _specs(wanted.args_schema) + _specs(list(wanted.kwargs_schema.values()))
        # Which operand each spec in torch's schema is (it keeps the DTensors' own specs).
        by_spec = {id(dtensor_spec(self.plain_of[id(t)])): t for t in self.guarded}
        by_spec.update({id(dtensor_spec(t)): t for t in tensors if not _guarded(t)})
        self.operands = [by_spec.get(id(s)) for s in self.given]
        self.rows: Dict[int, RowShard] = {}  # mesh axis -> the row split on it
        for t in self.guarded:
            for d, p in enumerate(t.placements):
                if isinstance(p, RowShard):
                    if d in self.rows and not self.rows[d] == p:
                        _refuse(func, p, f"meets another row split ({self.rows[d]})")
                    self.rows[d] = p

    def prepared_operands(self, args: tuple, kwargs: dict):
        """Operands made what torch wants without relabelling rows: gathered over the true
        rows, or replicated ones cut at our rows. None when nothing needs to change."""
        replace: Dict[int, DTensor] = {}
        for operand, given, wanted in zip(self.operands, self.given, self.wanted):
            if operand is None:
                continue
            for d, (mine, want) in enumerate(zip(operand.placements, wanted.placements)):
                if _is_rows(mine):
                    if _is_dim0(want):
                        continue
                    if want.is_replicate():
                        target = list(operand.placements)
                        target[d] = Replicate()
                        replace[id(operand)] = operand.redistribute(operand.device_mesh, target)
                        break
                    _refuse(self.func, mine, f"would be re-sharded as {want}")
                elif d in self.rows and _sharded(want):
                    rows = self.rows[d]
                    if (_is_dim0(want) and mine.is_replicate() and operand.dim() and operand.shape[0] == sum(rows.rows)
                            and sum(1 for p in operand.placements if _sharded(p)) == 0):
                        replace[id(operand)] = _cut_at_rows(operand, d, rows)
                        break
                    _refuse(self.func, rows, f"meets an input placed as {tuple(operand.placements)}")
        if not replace:
            return None
        return _tree_replace(args, replace), _tree_replace(kwargs, replace)

    def check_outputs(self) -> list:
        """The placements each output gets (rows put back), or a refusal before anything runs."""
        if self.sharding.use_val_from_redistribute_schema:
            _refuse(self.func, next(iter(self.rows.values()), "rows"),
                    "would rewrite its shape arguments for torch's even split")
        out = self.sharding.output_spec
        specs = list(out) if isinstance(out, (list, tuple)) else [out]
        placements = []
        for spec in specs:
            if spec is None:
                placements.append(None)
                continue
            new = list(spec.placements)
            for d, rows in self.rows.items():
                p = spec.placements[d]
                if _is_dim0(p) and spec.shape[0] == sum(rows.rows):
                    new[d] = rows
                elif _sharded(p):
                    _refuse(self.func, rows, f"would give a result sharded as {p} (shape {tuple(spec.shape)})")
                elif isinstance(p, Partial) and p.reduce_op == "avg":
                    _refuse(self.func, rows, "would average uneven row shards")
            placements.append(tuple(new))
        return placements

    def run(self, placements: list):
        out = self.func(*self.args, **self.kwargs)
        original = {id(self.plain_of[id(t)]): t for t in self.guarded}
        leaves = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (list, tuple)) else [out]
        result = []
        for o, new in zip(leaves, placements + [None] * (len(leaves) - len(placements))):
            if isinstance(o, DTensor) and id(o) in original:  # in place: the operand itself
                result.append(original[id(o)])
            elif isinstance(o, DTensor) and new is not None and needs_guard(new):
                result.append(_wrap(dtensor_local(o), o.device_mesh, new, o.shape))
            else:
                result.append(o)
        if isinstance(out, (list, tuple)):
            return type(out)(result)
        return result[0]


def _cut_at_rows(t: DTensor, d: int, rows: RowShard) -> "RowShardedTensor":
    index = t.device_mesh.get_local_rank(d)
    local = dtensor_local(t).narrow(0, rows.starts[index], rows.rows[index])
    placements = list(t.placements)
    placements[d] = rows
    return _wrap(local, t.device_mesh, placements, t.shape)


def _through_torch(func, args: tuple, kwargs: dict):
    for _ in range(3):  # each round fixes operands; torch then plans the new ones
        plan = _Plan(func, args, kwargs)
        prepared = plan.prepared_operands(args, kwargs)
        if prepared is None:
            return plan.run(plan.check_outputs())
        args, kwargs = prepared
    _refuse(func, next(iter(plan.rows.values()), "rows"), "has no plan that keeps the rows")


def _guarded_spec(mesh, placements, meta: TensorMeta) -> DTensorSpec:
    """A spec with rows torch cannot describe. torch builds its specs with a shard order it
    checks against ``Shard(dim)``, which an uneven RowShard is not (``!=``): so torch refuses
    to build one (a user's ``from_local``/``redistribute`` to such rows raises). Ours says
    that the placements, left to right, are the shard order (true: one split per dim)."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta, use_strided_shard_as_shard_order=True)


def _gather_rows(t: DTensor) -> DTensor:
    """Rows -> Replicate on every axis with rows, by the placement's own collective."""
    local, placements = dtensor_local(t), list(t.placements)
    for d in reversed(range(len(placements))):
        if _is_rows(placements[d]):
            local = placements[d]._to_replicate_tensor(local, t.device_mesh, d, None)
            placements[d] = Replicate()
    return DTensor(local, DTensorSpec(t.device_mesh, tuple(placements), tensor_meta=dtensor_spec(t).tensor_meta),
                   requires_grad=False)


def _cut_rows(t: DTensor, target: tuple) -> "RowShardedTensor":
    """Replicate -> this rank's rows on every axis where ``target`` has rows."""
    local = dtensor_local(t)
    for d, p in enumerate(target):
        if _is_rows(p):
            local = p._replicate_to_shard(local, t.device_mesh, d, t.device_mesh.get_local_rank(d))
    return RowShardedTensor(local, _guarded_spec(t.device_mesh, target, dtensor_spec(t).tensor_meta),
                            requires_grad=False)


class _FromRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: DTensor):
        ctx.placements = t.placements
        return _gather_rows(t)

    @staticmethod
    def backward(ctx, grad):
        return _cut_rows(grad, ctx.placements)


class _ToRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: DTensor, target: tuple):
        return _cut_rows(t, target)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad), None


class _AsRowSharded(torch.autograd.Function):
    """The same DTensor (same storage and spec) as a RowShardedTensor."""

    @staticmethod
    def forward(ctx, t: DTensor):
        return RowShardedTensor(dtensor_local(t), dtensor_spec(t), requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        return grad


class RowShardedTensor(DTensor):
    """A DTensor with an uneven ``RowShard`` or a ``NestedRowShard``: operators on it are
    computed on the true rows or refused (see the module docstring)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _tree_leaves((args, kwargs))
        if not any(_guarded(t) for t in leaves):
            return super().__torch_dispatch__(func, types, args, kwargs)
        if _is_elementwise(func):
            return _elementwise(func, args, kwargs)
        if any(_nested(t) for t in leaves):
            _refuse_nested(func)
        return _through_torch(func, args, kwargs)

    def redistribute(self, device_mesh=None, placements=None, **kwargs) -> DTensor:
        """Rows are gathered and cut here, by the placement's own collectives (torch's
        planner cannot describe them, see ``_guarded_spec``); torch does the rest."""
        mesh = self.device_mesh if device_mesh is None else device_mesh
        target = tuple(self.placements if placements is None else placements)
        if mesh != self.device_mesh or len(target) != mesh.ndim:
            raise ValueError("redistribute an MFSDP v2 row-sharded DTensor on its own mesh, one placement per axis.")
        if target == self.placements:
            return self
        if any(isinstance(p, NestedRowShard) for p in target):
            _refuse_nested("redistribute")
        rows_axes = [d for d, p in enumerate(target) if _is_rows(p)]
        via = tuple(Replicate() if d in rows_axes else p for d, p in enumerate(target))
        result = DTensor.redistribute(_FromRows.apply(self), mesh, via, **kwargs)
        if rows_axes:
            return _ToRows.apply(result, target)
        # Stays this class, so that it can come back to rows (torch cannot plan that).
        return _AsRowSharded.apply(result)
