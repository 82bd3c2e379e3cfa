"""DTensor operators on row-sharded tensors: a result is either honest or an error.

Why: torch's sharding propagation knows only ``Shard(0)``, whose split is the even
``torch.chunk`` one. Left alone it would label ``p * 2`` of a ``RowShard(rows)`` parameter
``Shard(0)``, and ``(p * 2).full_tensor()`` would gather the wrong rows.

So, once, at import, this module wraps the process-wide sharding propagator: an operator
whose inputs carry a ``RowShard``/``NestedRowShard`` is propagated as if they were plain
``Shard(0)`` (torch's strategies then choose as usual), and its answer is rewritten on new
objects (cached answers are shared, never mutated):

* a result sharded along dim 0 with the rows' dim-0 size (pointwise ops, reductions over
  other dims, ``matmul`` with the sharded operand first, ``_foreach_*``) gets the same
  ``RowShard``; a ``Replicate`` input combined with it is cut at the same rows;
* a result sharded any other way (``p.t()``, ``p.view(-1)``, ``p.unsqueeze(0)``) or averaged
  over the rows (``Partial("avg")``) raises ``NotImplementedError``, and so does meeting another
  row split or a plain ``Shard(0)`` operand, unless the rows are torch's even split, where
  torch's own semantics are true;
* ``NestedRowShard`` (HFSDP optimizer shards) survives same-shape operators only.

Replicated and summed results are left as torch makes them: their values are right (where
torch gathers an input first, e.g. to slice dim 0, the gather uses the true rows).
Propagation runs once per distinct input layout (torch caches the answer, keyed on the
exact placements: see ``RowShard.__eq__``); DTensors without row shards pass through.
The redistribution planner is wrapped too: one row split to another (or to a plain
``Shard(0)``) goes through ``Replicate`` instead of relabelling the local rows.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._sharding_prop import LocalLRUCache
from torch.distributed.tensor.placement_types import _StridedShard

from .row_shard import NestedRowShard, RowShard

# The placement classes this module rewrites. A second copy of the engine in the same
# process (a benchmark's engine at an older revision) finds the propagator already wrapped
# by this copy and has its classes added here (``register_row_types``).
_ROW_SHARDS: Tuple[type, ...] = (RowShard,)
_NESTED: Tuple[type, ...] = (NestedRowShard,)
_ROW_TYPES: Tuple[type, ...] = _ROW_SHARDS + _NESTED


def register_row_types(row_shard: type, nested_row_shard: type) -> None:
    """Let this copy's operator and redistribution wrappers handle another engine copy's
    ``RowShard``/``NestedRowShard`` classes (same semantics, other class objects)."""
    global _ROW_SHARDS, _NESTED, _ROW_TYPES
    if row_shard not in _ROW_SHARDS:
        _ROW_SHARDS += (row_shard,)
    if nested_row_shard not in _NESTED:
        _NESTED += (nested_row_shard,)
    _ROW_TYPES = _ROW_SHARDS + _NESTED
_SUPPORTED = "call full_tensor() first (or redistribute to Replicate())"


def _has_rows(spec) -> bool:
    return isinstance(spec, DTensorSpec) and any(isinstance(p, _ROW_TYPES) for p in spec.placements)


def _specs(tree) -> List[DTensorSpec]:
    if isinstance(tree, DTensorSpec):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [s for item in tree for s in _specs(item)]
    return []


def _map_specs(tree, fn):
    if isinstance(tree, DTensorSpec):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_specs(item, fn) for item in tree)
    return tree


def _with_placements(spec: DTensorSpec, placements) -> DTensorSpec:
    placements = tuple(placements)
    if all(a is b for a, b in zip(placements, spec.placements)):  # (an even RowShard == Shard(0))
        return spec
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta,
                       use_strided_shard_as_shard_order=spec.use_strided_shard_as_shard_order)


def _plain(spec: DTensorSpec) -> DTensorSpec:
    """The spec torch's strategies see: every row shard as a plain Shard(0)."""
    return _with_placements(spec, (Shard(0) if isinstance(p, _ROW_TYPES) else p for p in spec.placements))


def _uneven(p) -> bool:
    return isinstance(p, _ROW_TYPES) and not p.is_even()


def _is_dim0(p) -> bool:
    return type(p) is Shard and p.dim == 0  # a plain Shard(0) (torch's strategies never make ours)


def _sharded(p) -> bool:
    return isinstance(p, (Shard, _StridedShard))


def _refuse(op, placement, why: str):
    raise NotImplementedError(
        f"{op} on an MFSDP v2 row-sharded DTensor ({placement}) {why}; {_SUPPORTED}.")


class _Rewrite:
    """One operator call: inputs (as given and as torch wants them) and outputs, rewritten."""

    def __init__(self, schema: OpSchema, sharding: OutputSharding):
        self.op = schema.op
        self.given = _specs(schema.args_schema)
        wanted = sharding.redistribute_schema.args_schema if sharding.needs_redistribute else schema.args_schema
        self.wanted = [_plain(s) for s in _specs(wanted)]
        self.given += _specs(list(schema.kwargs_schema.values()))
        self.wanted += [_plain(s) for s in _specs(list(schema.kwargs_schema.values()))]
        out = sharding.output_spec
        self.outputs: List[Optional[DTensorSpec]] = list(out) if isinstance(out, (list, tuple)) else [out]

    def groups(self, schema: OpSchema) -> List[Tuple[List[int], List[int]]]:
        """(input indices, output indices) that belong together: per element for _foreach_."""
        everything = [(list(range(len(self.given))), list(range(len(self.outputs))))]
        lists = [a for a in schema.args_schema if isinstance(a, (list, tuple)) and _specs(a)]
        if not str(self.op).startswith("aten._foreach_") or not lists:
            return everything
        starts, i = [], 0
        for arg in schema.args_schema:
            n = len(_specs(arg))
            starts.append((i, n, isinstance(arg, (list, tuple))))
            i += n
        length = len(lists[0])
        out_per_item = len(self.outputs) == length
        return [([start + (j if is_list else 0) for start, n, is_list in starts if n]
                 + list(range(i, len(self.given))), [j] if out_per_item else [])
                for j in range(length)]

    def apply(self, inputs: List[int], outputs: List[int]) -> None:
        mesh_ndim = self.given[inputs[0]].mesh.ndim if inputs else 0
        for d in range(mesh_ndim):
            rows = [self.given[i].placements[d] for i in inputs if isinstance(self.given[i].placements[d], _ROW_TYPES)]
            if any(isinstance(p, _NESTED) for p in rows):
                self._nested(inputs, outputs)
                return
            if rows:
                self._rows(d, inputs, outputs)

    def _set(self, specs: list, index: int, d: int, placement) -> None:
        placements = list(specs[index].placements)
        placements[d] = placement
        specs[index] = _with_placements(specs[index], placements)

    def _rows(self, d: int, inputs: List[int], outputs: List[int]) -> None:
        kept = []
        for i in inputs:
            given, wanted = self.given[i].placements[d], self.wanted[i].placements[d]
            if isinstance(given, _ROW_SHARDS):
                if _is_dim0(wanted):
                    kept.append(given)
                    self._set(self.wanted, i, d, given)  # it stays where it is
                elif _sharded(wanted) and _uneven(given):
                    _refuse(self.op, given, f"would be re-sharded as {wanted}")
        if not kept:
            return  # the rows are gathered first: torch's result is right
        rows = kept[0]
        if not all(r == rows for r in kept):  # never ``!=`` on placements (a kind check)
            if not any(_uneven(r) for r in kept):
                return
            _refuse(self.op, rows, "meets another row split")
        if not _uneven(rows):
            for o in outputs:
                spec = self.outputs[o]
                if spec is not None and _is_dim0(spec.placements[d]) and spec.shape[0] == sum(rows.rows):
                    self._set(self.outputs, o, d, rows)
            return
        for i in inputs:  # plain inputs that torch would cut evenly next to the rows
            given, wanted = self.given[i].placements[d], self.wanted[i].placements[d]
            if isinstance(given, _ROW_SHARDS) or not _sharded(wanted):
                continue
            if _is_dim0(wanted) and self.given[i].shape[0] == sum(rows.rows) and not _sharded(given):
                self._set(self.wanted, i, d, rows)  # Replicate/Partial -> the same rows
            else:
                _refuse(self.op, rows, f"meets an input sharded as {given}")
        for o in outputs:
            spec = self.outputs[o]
            if spec is None:
                continue
            p = spec.placements[d]
            if _is_dim0(p) and spec.shape[0] == sum(rows.rows):
                self._set(self.outputs, o, d, rows)
            elif _sharded(p):
                _refuse(self.op, rows, f"would give a result sharded as {p} (shape {tuple(spec.shape)})")
            elif isinstance(p, Partial) and p.reduce_op == "avg":
                _refuse(self.op, rows, "would average uneven row shards")

    def _nested(self, inputs: List[int], outputs: List[int]) -> None:
        nested = [i for i in inputs if any(isinstance(p, _NESTED) for p in self.given[i].placements)]
        first = self.given[nested[0]]
        dims = [d for d, p in enumerate(first.placements) if isinstance(p, _NESTED)]
        for i in inputs:
            given, wanted = self.given[i], self.wanted[i]
            if i in nested:
                if given.placements != first.placements or given.shape != first.shape:
                    _refuse(self.op, NestedRowShard.MESSAGE, "meets another shard layout")
                if not all(_is_dim0(wanted.placements[d]) for d in dims):
                    raise NotImplementedError(NestedRowShard.MESSAGE)
                self.wanted[i] = given
            elif any(_sharded(wanted.placements[d]) for d in dims):
                _refuse(self.op, first.placements, f"meets an input sharded as {given.placements}")
        for o in outputs:
            spec = self.outputs[o]
            if spec is None:
                continue
            if spec.shape == first.shape and all(_is_dim0(spec.placements[d]) for d in dims):
                placements = list(spec.placements)
                for d in dims:
                    placements[d] = first.placements[d]
                self.outputs[o] = _with_placements(spec, placements)
            elif any(_sharded(spec.placements[d]) or (isinstance(spec.placements[d], Partial)
                     and spec.placements[d].reduce_op == "avg") for d in dims):
                raise NotImplementedError(f"{self.op}: {NestedRowShard.MESSAGE}")

    def result(self, schema: OpSchema, sharding: OutputSharding) -> OutputSharding:
        out = sharding.output_spec
        outputs = type(out)(self.outputs) if isinstance(out, (list, tuple)) else self.outputs[0]
        needs = sharding.use_val_from_redistribute_schema or any(w != g for w, g in zip(self.wanted, self.given))
        redistribute = None
        if needs:
            base = sharding.redistribute_schema if sharding.needs_redistribute else schema
            wanted = iter(self.wanted)
            args = _map_specs(base.args_schema, lambda _: next(wanted))
            redistribute = OpSchema(base.op, args, base.kwargs_schema, schema_info=base.schema_info)
        return OutputSharding(outputs, redistribute, needs_redistribute=needs,
                              use_val_from_redistribute_schema=sharding.use_val_from_redistribute_schema)


def _propagate_with_rows(schema: OpSchema, propagate) -> OutputSharding:
    inputs = _specs(schema.args_schema) + _specs(list(schema.kwargs_schema.values()))
    if not any(_has_rows(s) for s in inputs):
        return propagate(schema)
    uneven = [p for s in inputs for p in s.placements if _uneven(p)]
    plain = OpSchema(schema.op, _map_specs(schema.args_schema, _plain),
                     {k: _map_specs(v, _plain) for k, v in schema.kwargs_schema.items()},
                     schema_info=schema.schema_info)
    try:
        sharding = propagate(plain)
    except Exception as error:  # torch refuses even a plain Shard(0) here
        if not uneven:
            raise
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        _refuse(schema.op, uneven[0], f"is not supported ({reason})")
    if sharding.use_val_from_redistribute_schema and uneven:  # shape arguments made local for an even split
        _refuse(schema.op, uneven[0], "would rewrite its shape arguments for torch's even split")
    rewrite = _Rewrite(schema, sharding)
    for group_inputs, group_outputs in rewrite.groups(schema):
        rewrite.apply(group_inputs, group_outputs)
    return rewrite.result(schema, sharding)


def _install_propagation() -> None:
    propagator = DTensor._op_dispatcher.sharding_propagator
    if getattr(propagator, "_mfsdp_row_shards", False):
        return
    original = propagator.propagate_op_sharding_non_cached

    def propagate_op_sharding_non_cached(schema: OpSchema) -> OutputSharding:
        return _propagate_with_rows(schema, original)

    propagator.propagate_op_sharding_non_cached = propagate_op_sharding_non_cached
    propagator.propagate_op_sharding = LocalLRUCache(propagate_op_sharding_non_cached)
    propagator._mfsdp_row_shards = True


def _through_replicate(src: DTensorSpec, dst: DTensorSpec) -> Optional[list]:
    """Transforms for a row split -> another dim-0 split (which torch would only relabel)."""
    for d, (a, b) in enumerate(zip(src.placements, dst.placements)):
        # (never ``!=``: on placements it is torch's kind check, see RowShard.__eq__)
        if (_uneven(a) or _uneven(b)) and _sharded(a) and _sharded(b) and not a == b:
            if src.mesh.ndim != 1:
                raise NotImplementedError(
                    f"redistributing an MFSDP v2 row-sharded DTensor from {a} to {b} on a "
                    f"{src.mesh.ndim}-D mesh: redistribute to Replicate() first.")
            shape = list(src.shape)
            return [_redistribute._TransformInfo(0, (a, Replicate()), shape),
                    _redistribute._TransformInfo(0, (Replicate(), b), shape)]
    return None


def _install_redistribution() -> None:
    if getattr(_redistribute._gen_transform_infos, "_mfsdp_row_shards", False):
        return
    original = _redistribute._gen_transform_infos

    def _gen_transform_infos(src_spec: DTensorSpec, dst_spec: DTensorSpec, *args, **kwargs):
        if _has_rows(src_spec) or _has_rows(dst_spec):
            rerouted = _through_replicate(src_spec, dst_spec)
            if rerouted is not None:
                return rerouted
        return original(src_spec, dst_spec, *args, **kwargs)

    _gen_transform_infos._mfsdp_row_shards = True
    _gen_transform_infos.cache_clear = original.cache_clear
    _redistribute._gen_transform_infos = _gen_transform_infos


_install_propagation()
_install_redistribution()
