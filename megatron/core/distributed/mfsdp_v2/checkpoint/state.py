"""A model and its optimizer as one flat state: DCP entries plus JSON, and back.

Keys: ``model.<fqn>`` for parameters and persistent buffers (the first name of a tied
parameter), ``optimizer.state.<fqn>.<name>`` for optimizer state tensors (``exp_avg``,
``step``, ...). A tensor is stored in the dtype the rank holds it in: the main weights
and optimizer state of an MFSDP model (fp32 by default), the parameter dtype of a plain
model. Non-tensor optimizer state and the parameter groups' hyper-parameters are JSON in
the manifest.

The entries are ``ChunkedTensor`` views of the live tensors, so the same state serves a
save (DCP reads them) and a load (DCP writes into them).

``pieces`` (optional, ``{fqn: piece}``) names the parameters that are a rank's piece of a
larger global tensor (tensor or expert parallelism): ``piece.global_shape`` and the
``(start, stop)`` ``piece.ranges`` along ``piece.dim`` that the local tensor concatenates,
or, when ``piece.inner`` is set, that the inner piece is cut from
(``megatron.core.global_slices.GlobalSlice`` has this shape). Their entries, and those of
optimizer state laid out like them, are the global tensors with the local data at its
true offsets, so a checkpoint does not depend on the tensor-parallel layout either.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .dcp_adapter import ChunkedTensor, whole
from .engine_view import ShardedRows, local_rows
from .manifest import dtype_from_name, dtype_name

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer.state."


# --------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------


def named_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor, bool]]:
    """(fqn, tensor, is_parameter): parameters under their first name, then persistent buffers."""
    out = [(name, p, True) for name, p in model.named_parameters()]
    seen = {id(p) for _, p, _ in out}
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{module_name}.{name}" if module_name else name, buf, False))
    return out


def param_names(model: nn.Module) -> Dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def check_optimizer_belongs(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[int, str]:
    """The model's parameter names; raises if the optimizer steps a tensor the model lacks."""
    names = param_names(model)
    for index, p in enumerate(optimizer_params(optimizer)):
        if id(p) not in names:
            raise ValueError(
                f"optimizer parameter #{index} (shape {tuple(p.shape)}) is not a parameter of the model; "
                "pass the optimizer built over this model's parameters (after fully_shard)."
            )
    return names


# --------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------


def _pieces_like(rows: ShardedRows, local: torch.Tensor, what: str) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
    """The chunk list of a tensor laid out like the parameter ``rows`` describes (its main
    weight view, or an optimizer state of the same layout)."""
    shape = rows.shape
    if len(shape) == 0:
        return [((), local.reshape(()))] if local.numel() == 1 else []
    count = rows.row_end - rows.row_start
    expected = (count,) + tuple(shape[1:])
    if tuple(local.shape) != expected:
        raise RuntimeError(
            f"internal error: the local piece of {what} has shape {tuple(local.shape)} but the engine's "
            f"layout says rows [{rows.row_start}, {rows.row_end}) of {tuple(shape)}; please report this."
        )
    if count == 0:
        return []
    return [((rows.row_start,) + (0,) * (len(shape) - 1), local)]


def _sharded(rows: ShardedRows, tensor, what: str, piece=None) -> ChunkedTensor:
    local = local_rows(tensor)
    return _in_global(ChunkedTensor(rows.shape, local.dtype, local.device, _pieces_like(rows, local, what)), piece)


def _in_global(entry: ChunkedTensor, piece) -> ChunkedTensor:
    """``entry`` (in the coordinates of this rank's piece) in the global tensor's coordinates.
    A piece with an ``inner`` piece (cut along two dims) maps through the inner one first."""
    if piece is None:
        return entry
    if getattr(piece, "inner", None) is not None:
        entry = _in_global(entry, piece.inner)
    dim, chunks = piece.dim, []
    for offsets, local in entry._chunks:
        start, end = offsets[dim], offsets[dim] + local.shape[dim]
        cursor = 0  # where the current range begins in the piece
        for global_start, global_stop in piece.ranges:
            lo, hi = max(start, cursor), min(end, cursor + global_stop - global_start)
            if lo < hi:
                moved = list(offsets)
                moved[dim] = global_start + lo - cursor
                chunks.append((tuple(moved), local.narrow(dim, lo - start, hi - lo)))
            cursor += global_stop - global_start
    return ChunkedTensor(piece.global_shape, entry.dtype, entry.device, chunks)


def _torch_sharded(tensor: DTensor, what: str, piece=None):
    """A DTensor sharded by torch (FSDP2's ``fully_shard``), not by the engine: as it is
    (DCP reads torch's layout), or, when it is a rank's piece of a larger tensor (tensor
    parallelism under FSDP2), its rows placed in the global tensor."""
    if piece is None:
        return tensor.detach()
    if tensor.device_mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        raise NotImplementedError(
            f"{what} is a piece of a tensor-parallel weight sharded as {tuple(tensor.placements)} over a "
            f"{tensor.device_mesh.ndim}-D mesh; checkpoints take such pieces sharded on dim 0 over one mesh axis.")
    rows = tensor.shape[0] if tensor.dim() else 1
    chunk = -(-rows // tensor.device_mesh.size())  # torch's Shard(0): ceil-sized chunks, in rank order
    start = min(tensor.device_mesh.get_local_rank() * chunk, rows)
    local = tensor.to_local()
    return _sharded(ShardedRows(tensor.shape, start, start + (local.shape[0] if local.dim() else 1)), tensor, what,
                    piece)


def saved_shape(fqn: str, shape, pieces) -> Tuple[int, ...]:
    """The shape under which a tensor of ``shape`` laid out like parameter ``fqn`` is saved."""
    piece = pieces.get(fqn)
    if piece is not None and tuple(shape) == tuple(piece.local_shape):
        return tuple(piece.global_shape)
    return tuple(shape)


def model_state(model: nn.Module, engine: Dict[int, ShardedRows], pieces=None) -> Dict[str, torch.Tensor]:
    """DCP entries of every parameter and persistent buffer (``engine``: the managed ones)."""
    pieces = pieces or {}
    state: Dict[str, torch.Tensor] = {}
    for fqn, tensor, _ in named_tensors(model):
        rows = engine.get(id(tensor))
        if rows is not None:
            state[MODEL_PREFIX + fqn] = _sharded(rows, tensor, f"'{fqn}'", pieces.get(fqn))
        elif isinstance(tensor, DTensor):
            state[MODEL_PREFIX + fqn] = _torch_sharded(tensor, f"'{fqn}'", pieces.get(fqn))
        else:
            state[MODEL_PREFIX + fqn] = _in_global(whole(tensor), pieces.get(fqn))
    return state


def optimizer_state(optimizer, engine: Dict[int, ShardedRows], names: Dict[int, str],
                    pieces=None) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, Any]]]:
    """Tensor state as DCP entries, plus JSON-able scalar state per fqn."""
    pieces = pieces or {}
    tensors: Dict[str, torch.Tensor] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    for p in optimizer_params(optimizer):
        state = optimizer.state.get(p)
        if not state:
            continue
        fqn = names[id(p)]
        rows = engine.get(id(p))
        for key, value in state.items():
            name = f"{OPTIMIZER_PREFIX}{fqn}.{key}"
            like_param = isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(p.shape)
            piece = pieces.get(fqn) if like_param else None
            if isinstance(value, DTensor) and rows is not None and like_param:
                tensors[name] = _sharded(rows, value, f"optimizer state '{fqn}.{key}'", piece)
            elif isinstance(value, DTensor):
                tensors[name] = _torch_sharded(value, f"optimizer state '{fqn}.{key}'", piece)
            elif isinstance(value, torch.Tensor):
                # A plain tensor is the same on every rank (e.g. Adam's `step`), or the whole
                # state of a plain model's parameter.
                tensors[name] = _in_global(whole(value), piece)
            else:
                scalars.setdefault(fqn, {})[key] = _to_json(value, f"optimizer state '{fqn}.{key}'")
    return tensors, scalars


# --------------------------------------------------------------------------------------
# JSON: parameter groups and non-tensor state
# --------------------------------------------------------------------------------------


def optimizer_json(optimizer, names: Dict[int, str], scalars: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The manifest's ``optimizer`` entry: class, parameter groups, non-tensor state."""
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        entry = {"params": [names[id(p)] for p in group["params"]]}
        for key, value in group.items():
            if key == "params":
                continue
            try:
                entry[key] = _to_json(value, f"param_groups[{index}]['{key}']")
            except TypeError as e:
                warnings.warn(f"{e}; it is not saved in the checkpoint.", stacklevel=3)  # the caller of save_checkpoint
        groups.append(entry)
    return {"class": type(optimizer).__name__, "param_groups": groups, "scalar_state": scalars}


def group_key(group: Dict[str, Any], index: int) -> Any:
    """Which parameter group this is across ranks: its ``name`` where it has one (a
    pipeline stage may lack some of the model's groups, e.g. the embedding's), else its index."""
    return group.get("name", index)


def merge_optimizer_json(entries: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One ``optimizer`` entry from every rank's: groups matched by ``group_key``, each
    with the union of the ranks' parameters in rank order (pipeline stages hold different
    parameters; data-parallel ranks the same) and its first holder's hyper-parameters;
    the scalar state of every parameter."""
    groups: Dict[Any, Dict[str, Any]] = {}
    for entry in entries:
        for index, group in enumerate(entry["param_groups"]):
            merged_group = groups.setdefault(group_key(group, index), dict(group, params=[]))
            merged_group["params"] += [n for n in group["params"] if n not in merged_group["params"]]
    scalars: Dict[str, Any] = {}
    for entry in entries:
        for fqn, state in entry.get("scalar_state", {}).items():
            scalars.setdefault(fqn, state)
    return {"class": entries[0]["class"], "param_groups": list(groups.values()), "scalar_state": scalars}


def restore_optimizer_json(optimizer, names: Dict[int, str], saved_optimizer: Dict[str, Any]) -> None:
    """Put the manifest's hyper-parameters and non-tensor state back into ``optimizer``."""
    saved_groups = {group_key(g, i): g for i, g in enumerate(saved_optimizer["param_groups"])}
    for index, group in enumerate(optimizer.param_groups):
        saved = saved_groups[group_key(group, index)]
        for key, value in saved.items():
            if key == "params":
                continue
            value = _from_json(value)
            if isinstance(group.get(key), torch.Tensor) and not isinstance(value, torch.Tensor):
                group[key].fill_(value)
            else:
                group[key] = value
    by_name = {names[id(p)]: p for p in optimizer_params(optimizer)}
    for fqn, entries in saved_optimizer.get("scalar_state", {}).items():
        p = by_name.get(fqn)
        if p is not None:
            optimizer.state[p].update({k: _from_json(v) for k, v in entries.items()})


def _to_json(value: Any, what: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"__float__": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [_to_json(v, what) for v in value]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not isinstance(value, DTensor):
        return {"__tensor__": value.item(), "dtype": dtype_name(value.dtype)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    raise TypeError(f"{what} has a value of type {type(value).__name__} that cannot be stored as JSON")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=dtype_from_name(value["dtype"]))
        if "__dtype__" in value:
            return dtype_from_name(value["__dtype__"])
        return {k: _from_json(v) for k, v in value.items()}
    return value
