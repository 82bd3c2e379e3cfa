"""Sharded, reshardable checkpoints with ``torch.distributed.checkpoint`` (DCP).

``save_checkpoint(model, optimizer, checkpoint_dir)`` writes, from every rank, the rows of
the main (fp32) weights and of the optimizer state that the rank holds, each described to
DCP by its true global offset and size; ``load_checkpoint`` reads any checkpoint written
this way into any layout: another world size, another strategy (ZeRO-1/2/3, HSDP, HFSDP,
no_shard) or a plain unsharded model in one process.

Directory contents (see docs/checkpointing.md)::

    __0_0.distcp, __1_0.distcp, ...   tensor data, one file per writing rank (DCP format)
    .metadata                         DCP's own index (pickle; written for other DCP tools,
                                      never read by this module)
    mfsdp_manifest.json               written last: format version, the DCP index as JSON,
                                      optimizer hyper-parameters, size and sha256 of every
                                      data file, and a checksum of itself

Keys: ``model.<fqn>`` for parameters and persistent buffers (the first name of a tied
parameter), ``optimizer.state.<fqn>.<name>`` for optimizer state tensors (``exp_avg``,
``step``, ...). A tensor is stored in the dtype the rank holds it in: the main weights
and optimizer state of an MFSDP model (fp32 by default), the parameter dtype of a plain
model.

Why not DCP's DTensor support: the engine packs whole rows of every tensor into equal flat
shards, so a rank's slice of a tensor does not follow torch's even-chunk rule (a rank may
hold fewer rows, or none). ``DTensor.full_tensor()`` and DCP's default DTensor handling
would compute the wrong offsets and silently scramble rows. Each local piece is therefore
wrapped in ``_ChunkedTensor``, which tells DCP its real offsets through DCP's
``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__`` protocol.
Replicated copies (no_shard, HSDP replicas, 0-d tensors) produce identical write items on
several ranks, which DCP's planner writes once.

Safety: nothing is unpickled from a checkpoint except tensor data through
``torch.load(weights_only=True)``; the index is read from the JSON manifest. Before a
load touches the model every rank checks the manifest, the sizes and sha256 of the data
files (each rank hashes a share) and every key and shape against the model; the ranks
agree on the outcome, so a bad checkpoint raises the same error everywhere instead of
hanging or half-loading.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import time
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

MANIFEST_NAME = "mfsdp_manifest.json"
FORMAT_NAME = "mfsdp_v2.dcp"
FORMAT_VERSION = 1
MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer.state."

_DTYPES = {
    str(dtype).replace("torch.", ""): dtype
    for dtype in (
        torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}
_HASH_BLOCK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model / optimizer it is loaded into."""


class OptimizerMismatchError(CheckpointMismatchError):
    """The checkpoint's optimizer state does not fit the optimizer (the model does)."""


# --------------------------------------------------------------------------------------
# Telling DCP where each local piece really lies
# --------------------------------------------------------------------------------------


class _ChunkedTensor(torch.Tensor):
    """A global tensor of which this rank holds ``chunks``: ``[(offsets, local_tensor)]``.

    Only a carrier for DCP: it has the global shape and dtype, and answers DCP's
    checkpoint protocol with the real offsets of its pieces. Any other operation raises.
    An empty chunk list means this rank holds nothing of the tensor.
    """

    @staticmethod
    def __new__(cls, shape, dtype, device, chunks):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device,
                                                   requires_grad=False)

    def __init__(self, shape, dtype, device, chunks):
        self._chunks: List[Tuple[torch.Size, torch.Tensor]] = [(torch.Size(o), t) for o, t in chunks]

    def __repr__(self):  # the default repr would dispatch ops
        return f"_ChunkedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, chunks={len(self._chunks)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"_ChunkedTensor only carries checkpoint pieces; {func} is not supported.")

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=local.shape),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
            for offsets, local in self._chunks
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=local.shape) for offsets, local in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self._chunks):
            offsets, local = self._chunks[index.index]
            if offsets == index.offset:
                return local
        for offsets, local in self._chunks:
            if offsets == index.offset:
                return local
        raise ValueError(f"no local piece of '{index.fqn}' at offset {tuple(index.offset or ())}")

    def staged(self) -> "_ChunkedTensor":
        """A copy whose pieces live in fresh CPU memory (for asynchronous saving)."""
        copies = [(offsets, local.detach().to("cpu", copy=True)) for offsets, local in self._chunks]
        return _ChunkedTensor(self.shape, self.dtype, torch.device("cpu"), copies)


def _whole(tensor: torch.Tensor) -> _ChunkedTensor:
    """A tensor this rank holds entirely (replicated, or a plain model)."""
    tensor = tensor.detach()
    return _ChunkedTensor(tensor.shape, tensor.dtype, tensor.device, [((0,) * tensor.dim(), tensor)])


# --------------------------------------------------------------------------------------
# Which rows of which tensor this rank holds
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Sharded:
    """An engine-managed parameter: its group, its FsdpParameter and the global rows
    ``[row_start, row_end)`` of its optimizer-placement local view (None for 0-d)."""

    group: Any
    fsdp_param: Any
    row_start: int
    row_end: int


def _contexts_of(model: nn.Module) -> list:
    contexts = []
    for p in model.parameters():
        ctx = getattr(p, "_mfsdp_context", None)
        if ctx is not None and all(ctx is not c for c in contexts):
            contexts.append(ctx)
    return contexts


def _engine_params(contexts) -> Dict[int, _Sharded]:
    found: Dict[int, _Sharded] = {}
    for ctx in contexts:
        for unit in ctx.units:
            for group in unit.parameter_groups:
                for fp in group.fsdp_parameters:
                    start, end = _optimizer_rows(group, fp)
                    found[id(fp.sharded_param)] = _Sharded(group, fp, start, end)
    return found


def _optimizer_rows(group, fp) -> Tuple[int, int]:
    """Global dim-0 rows of ``fp`` held in this rank's optimizer placement (main_weight)."""
    shape = fp.shape
    if len(shape) == 0:
        return 0, 1
    rows = shape[0]
    if not group.strategy.optim_sharded:
        return 0, rows
    start, end, _ = group.layout.local_piece(fp.index, group.shard_index)
    outer = getattr(group, "outer_layout", None)
    if outer is None:
        return start, end
    j = group._outer_index.get(fp.index)
    if j is None:
        return start, start
    outer_start, outer_end, _ = outer.local_piece(j, group.outer_rank)
    return start + outer_start, start + outer_end


def _pieces_like(info: _Sharded, local: torch.Tensor, what: str) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
    """The chunk list of a tensor laid out like parameter ``info`` (its main weight view,
    or an optimizer state of the same layout)."""
    shape = info.fsdp_param.shape
    if len(shape) == 0:
        return [((), local.reshape(()))] if local.numel() == 1 else []
    rows = info.row_end - info.row_start
    expected = (rows,) + tuple(shape[1:])
    if tuple(local.shape) != expected:
        raise RuntimeError(
            f"internal error: the local piece of {what} has shape {tuple(local.shape)} but the engine's "
            f"layout says rows [{info.row_start}, {info.row_end}) of {tuple(shape)}; please report this."
        )
    if rows == 0:
        return []
    return [((info.row_start,) + (0,) * (len(shape) - 1), local)]


def _named_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor, bool]]:
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


# --------------------------------------------------------------------------------------
# Building the state to save / load
# --------------------------------------------------------------------------------------


def _model_state(model: nn.Module, engine: Dict[int, _Sharded]) -> Dict[str, torch.Tensor]:
    state: Dict[str, torch.Tensor] = {}
    for fqn, tensor, _ in _named_tensors(model):
        info = engine.get(id(tensor))
        if info is not None:
            local = tensor.to_local().detach()
            state[MODEL_PREFIX + fqn] = _ChunkedTensor(
                info.fsdp_param.shape, local.dtype, local.device, _pieces_like(info, local, f"'{fqn}'")
            )
        elif isinstance(tensor, DTensor):
            state[MODEL_PREFIX + fqn] = tensor.detach()  # not ours: torch's even sharding is right
        else:
            state[MODEL_PREFIX + fqn] = _whole(tensor)
    return state


def _param_names(model: nn.Module) -> Dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _check_optimizer_belongs(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[int, str]:
    names = _param_names(model)
    for index, p in enumerate(_optimizer_params(optimizer)):
        if id(p) not in names:
            raise ValueError(
                f"optimizer parameter #{index} (shape {tuple(p.shape)}) is not a parameter of the model; "
                "pass the optimizer built over this model's parameters (after fully_shard)."
            )
    return names


def _optimizer_state(model, optimizer, engine, names) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Tensor state as DCP entries, plus JSON-able scalar state per fqn."""
    tensors: Dict[str, torch.Tensor] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    for p in _optimizer_params(optimizer):
        state = optimizer.state.get(p)
        if not state:
            continue
        fqn = names[id(p)]
        info = engine.get(id(p))
        for key, value in state.items():
            name = f"{OPTIMIZER_PREFIX}{fqn}.{key}"
            if isinstance(value, DTensor) and info is not None and tuple(value.shape) == tuple(p.shape):
                local = value.to_local().detach()
                tensors[name] = _ChunkedTensor(p.shape, local.dtype, local.device,
                                               _pieces_like(info, local, f"optimizer state '{fqn}.{key}'"))
            elif isinstance(value, DTensor):
                tensors[name] = value.detach()
            elif isinstance(value, torch.Tensor):
                # A plain tensor is the same on every rank (e.g. Adam's `step`), or the whole
                # state of a plain model's parameter.
                tensors[name] = _whole(value)
            else:
                scalars.setdefault(fqn, {})[key] = _to_json(value, f"optimizer state '{fqn}.{key}'")
    return tensors, scalars


def _param_groups_json(optimizer, names) -> List[Dict[str, Any]]:
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        entry = {"params": [names[id(p)] for p in group["params"]]}
        for key, value in group.items():
            if key == "params":
                continue
            try:
                entry[key] = _to_json(value, f"param_groups[{index}]['{key}']")
            except TypeError as e:
                warnings.warn(f"{e}; it is not saved in the checkpoint.", stacklevel=3)
        groups.append(entry)
    return groups


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
        return {"__tensor__": value.item(), "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).replace("torch.", "")}
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
            return torch.tensor(value["__tensor__"], dtype=_dtype(value["dtype"]))
        if "__dtype__" in value:
            return _dtype(value["__dtype__"])
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return _DTYPES[name]


# --------------------------------------------------------------------------------------
# Metadata as JSON (the checkpoint index is never unpickled)
# --------------------------------------------------------------------------------------


def _metadata_to_json(metadata: Metadata) -> Dict[str, Any]:
    tensors = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[key] = {
                "dtype": str(md.properties.dtype).replace("torch.", ""),
                "shape": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        else:
            tensors[key] = {"bytes": True}
    storage = []
    for index, info in (metadata.storage_data or {}).items():
        storage.append({
            "key": index.fqn,
            "offsets": None if index.offset is None else list(index.offset),
            "file": info.relative_path,
            "file_offset": info.offset,
            "length": info.length,
            "transforms": list(info.transform_descriptors) if info.transform_descriptors else None,
        })
    # planner_data (DCP's flattening map) is omitted: keys are flat already.
    return {"tensors": tensors, "storage": storage, "version": metadata.version}


def _metadata_from_json(data: Dict[str, Any]) -> Metadata:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    state_dict_metadata = {}
    for key, md in data["tensors"].items():
        if md.get("bytes"):
            state_dict_metadata[key] = BytesStorageMetadata()
            continue
        state_dict_metadata[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=_dtype(md["dtype"])),
            size=torch.Size(md["shape"]),
            chunks=[ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in md["chunks"]],
        )
    storage_data = {}
    for entry in data["storage"]:
        index = MetadataIndex(entry["key"], entry["offsets"])
        storage_data[index] = _StorageInfo(
            relative_path=entry["file"], offset=entry["file_offset"], length=entry["length"],
            transform_descriptors=entry.get("transforms"),
        )
    planner_data = {key: (key,) for key in state_dict_metadata}
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data,
                    storage_data=storage_data, storage_meta=StorageMeta(), version=data.get("version"))


class _ManifestReader(FileSystemReader):
    """DCP's file reader, with the index taken from the JSON manifest instead of the
    pickled ``.metadata`` file. Tensor data is read by DCP with ``weights_only=True``."""

    def __init__(self, path: str, manifest: Dict[str, Any]):
        super().__init__(path)
        self._manifest = manifest

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = _metadata_from_json(self._manifest["dcp"])
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Never unpickles arbitrary objects: non-tensor entries (which this module never
    writes) are read with ``weights_only=True``."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# --------------------------------------------------------------------------------------
# Manifest and file integrity
# --------------------------------------------------------------------------------------


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to ``path`` through a temporary file, fsync, rename, fsync the directory."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_manifest(checkpoint_dir: str) -> Dict[str, Any]:
    """The parsed manifest of an MFSDP checkpoint directory, checked against its own
    checksum. Raises CheckpointError naming the problem."""
    path = os.path.join(checkpoint_dir, MANIFEST_NAME)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint directory {checkpoint_dir!r} does not exist; check the path.")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} is missing: {checkpoint_dir!r} is not a complete MFSDP checkpoint (the save did not "
            "finish, or the path points at the wrong directory)."
        )
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt or truncated ({e}); restore the checkpoint or use an older one.") from None
    if not isinstance(data, dict) or "manifest_sha256" not in data:
        raise CheckpointError(f"{path} is not an MFSDP checkpoint manifest (no manifest_sha256 field).")
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    if hashlib.sha256(_canonical(body)).hexdigest() != data["manifest_sha256"]:
        raise CheckpointError(f"{path} is corrupt: its content does not match its checksum; restore the checkpoint.")
    if body.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} has format {body.get('format')!r}, expected {FORMAT_NAME!r}.")
    if int(body.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer version (format {body['format_version']} > {FORMAT_VERSION}); "
            "upgrade this code to load it."
        )
    return body


def _file_digest(path: str) -> Tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_HASH_BLOCK)
            if not block:
                break
            size += len(block)
            digest.update(block)
    return size, digest.hexdigest()


def _check_file(checkpoint_dir: str, name: str, expected: Dict[str, Any]) -> Optional[str]:
    path = os.path.join(checkpoint_dir, name)
    if not os.path.isfile(path):
        return f"checkpoint file {path} is missing; the checkpoint is incomplete."
    actual_size = os.path.getsize(path)
    if actual_size != expected["bytes"]:
        return (f"checkpoint file {path} has {actual_size} bytes but {expected['bytes']} were written "
                "(truncated or overwritten); restore it or load an older checkpoint.")
    size, digest = _file_digest(path)
    if digest != expected["sha256"]:
        return f"checkpoint file {path} is corrupt (sha256 mismatch); restore it or load an older checkpoint."
    return None


def verify_files(checkpoint_dir: str, manifest: Dict[str, Any], *, share: Tuple[int, int] = (0, 1)) -> List[str]:
    """Check size and sha256 of the manifest's files (``share=(i, n)``: every n-th from i).
    Returns the error messages (empty when all is well)."""
    index, count = share
    names = sorted(manifest["files"])
    errors = []
    for name in names[index::count]:
        message = _check_file(checkpoint_dir, name, manifest["files"][name])
        if message:
            errors.append(message)
    return errors


# --------------------------------------------------------------------------------------
# Process groups and agreement
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Comm:
    """How this call communicates: ``no_dist`` (one process) or over ``group``."""

    no_dist: bool
    group: Any = None

    @property
    def rank(self) -> int:
        return 0 if self.no_dist else dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return 1 if self.no_dist else dist.get_world_size(self.group)

    def all_gather(self, obj: Any) -> List[Any]:
        if self.no_dist:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if not self.no_dist:
            dist.barrier(group=self.group)

    def agree(self, error: Optional[str], exc_type=CheckpointError) -> None:
        """Raise ``error`` (or another rank's) on every rank if any rank has one."""
        errors = self.all_gather(error)
        for rank, message in enumerate(errors):
            if message:
                prefix = "" if self.size == 1 or rank == self.rank else f"(rank {rank} of the checkpoint group) "
                raise exc_type(prefix + message)


def _resolve_comm(contexts, process_group) -> _Comm:
    if process_group is not None:
        return _Comm(no_dist=False, group=process_group)
    if not contexts:
        # A plain model: the calling process reads / writes everything by itself.
        return _Comm(no_dist=True)
    ranks = None
    meshes = []
    for ctx in contexts:
        for unit in ctx.units:
            mesh = unit._fsdp_state.mesh
            mesh_ranks = sorted(mesh.mesh.flatten().tolist())
            if ranks is None:
                ranks = mesh_ranks
            elif mesh_ranks != ranks:
                raise ValueError(
                    "the model's FSDP units live on different sets of ranks; pass process_group= covering "
                    "all of them to save_checkpoint / load_checkpoint."
                )
            meshes.append(mesh)
    if ranks == list(range(dist.get_world_size())):
        return _Comm(no_dist=False, group=None)
    if meshes[0].ndim == 1:
        return _Comm(no_dist=False, group=meshes[0].get_group(0))
    raise ValueError(
        f"the model's mesh covers ranks {ranks}, not the whole world; pass process_group= (a group of exactly "
        "these ranks, e.g. dist.new_group(ranks)) to save_checkpoint / load_checkpoint."
    )


def _reshard_all(contexts) -> None:
    for ctx in contexts:
        ctx.check_finalized()
        ctx.reshard_all()


# --------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------


def _describe_strategies(contexts) -> Dict[str, str]:
    out = {}
    for ctx in contexts:
        for unit in ctx.units:
            out[unit.name or "<root>"] = unit._fsdp_state.strategy.name
    return out


def save_checkpoint(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    checkpoint_dir: str,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    overwrite: bool = False,
    async_save: bool = False,
    extra_metadata: Optional[Dict[str, Any]] = None,
):
    """Save the model's main weights (and the optimizer state) into ``checkpoint_dir``.

    Call on every rank of the model's mesh. ``model`` is the module whose
    ``named_parameters()`` name the tensors (usually the root FSDP unit); a plain
    (unwrapped) model is saved by the calling process alone. The manifest is written last,
    so an interrupted save never looks complete. An existing checkpoint in the directory is
    replaced only with ``overwrite=True``.

    ``process_group``: the ranks that take part (default: the model's mesh, or no
    communication for a plain model). ``async_save=True`` copies the local pieces to CPU
    memory, then writes them in a background thread and returns a
    ``concurrent.futures.Future`` (its result is the checkpoint directory); it needs a
    ``process_group`` that no other thread uses meanwhile (e.g. a dedicated
    ``dist.new_group(backend="gloo")``). Returns the directory otherwise.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_checkpoint expects an nn.Module, got {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}.")
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError("checkpoint_dir must be a path.")
    checkpoint_dir = os.fspath(checkpoint_dir)
    contexts = _contexts_of(model)
    comm = _resolve_comm(contexts, process_group)
    if async_save and not comm.no_dist and process_group is None:
        raise ValueError(
            "async_save=True writes in a background thread and needs its own process group: pass "
            "process_group=dist.new_group(ranks, backend='gloo') (created once, on every rank)."
        )
    names = _check_optimizer_belongs(model, optimizer) if optimizer is not None else _param_names(model)

    error = None
    if comm.rank == 0 and os.path.isfile(os.path.join(checkpoint_dir, MANIFEST_NAME)) and not overwrite:
        error = (f"{checkpoint_dir!r} already holds a checkpoint; pass overwrite=True to replace it, "
                 "or save into a new directory.")
    comm.agree(error, ValueError)

    _reshard_all(contexts)
    engine = _engine_params(contexts)
    state = _model_state(model, engine)
    optimizer_json = None
    if optimizer is not None:
        tensors, scalars = _optimizer_state(model, optimizer, engine, names)
        state.update(tensors)
        optimizer_json = {
            "class": type(optimizer).__name__,
            "param_groups": _param_groups_json(optimizer, names),
            "scalar_state": scalars,
        }
    info = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "torch_version": torch.__version__,
        "world_size": comm.size,
        "strategies": _describe_strategies(contexts),
        "optimizer": optimizer_json,
        "extra": extra_metadata or {},
    }
    if not async_save:
        _write(state, checkpoint_dir, comm, info)
        return checkpoint_dir
    staged = {k: (v.staged() if isinstance(v, _ChunkedTensor) else v.detach().clone()) for k, v in state.items()}
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsdp-async-save")
    future = executor.submit(_write, staged, checkpoint_dir, comm, info)
    executor.shutdown(wait=False)
    return future


def _write(state: Dict[str, torch.Tensor], checkpoint_dir: str, comm: _Comm, info: Dict[str, Any]) -> str:
    manifest_path = os.path.join(checkpoint_dir, MANIFEST_NAME)
    if comm.rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        if os.path.exists(manifest_path):
            os.remove(manifest_path)  # from here on the directory is not a complete checkpoint
            _fsync_dir(checkpoint_dir)
    comm.barrier()
    writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=True, sync_files=True, thread_count=1,
                              overwrite=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        # Replicated copies are written by the lowest rank holding them: deterministic even if
        # replicas differ in the last bit (e.g. a 0-d parameter reduced in a different order).
        metadata = dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                            process_group=comm.group, no_dist=comm.no_dist)
    dcp_json = _metadata_to_json(metadata)
    files = sorted({entry["file"] for entry in dcp_json["storage"]} | {".metadata"})
    mine = {}
    for name in files[comm.rank::comm.size]:
        size, digest = _file_digest(os.path.join(checkpoint_dir, name))
        mine[name] = {"bytes": size, "sha256": digest}
    gathered = comm.all_gather(mine)
    if comm.rank == 0:
        body = dict(info)
        body["dcp"] = dcp_json
        body["files"] = {name: entry for part in gathered for name, entry in part.items()}
        write_json_atomic(manifest_path, dict(body, manifest_sha256=hashlib.sha256(_canonical(body)).hexdigest()))
    comm.barrier()
    return checkpoint_dir


# --------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------


def checkpoint_tensors(manifest: Dict[str, Any]) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of every tensor in a checkpoint."""
    return {
        key: (tuple(md["shape"]), _dtype(md["dtype"]))
        for key, md in manifest["dcp"]["tensors"].items() if not md.get("bytes")
    }


def _fmt_list(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _compare(saved: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], wanted: Dict[str, Tuple[int, ...]],
             prefix: str, what: str) -> Optional[str]:
    """A message describing missing / unexpected / differently shaped tensors, or None."""
    saved_keys = {k for k in saved if k.startswith(prefix)}
    missing = sorted(set(wanted) - saved_keys)
    unexpected = sorted(saved_keys - set(wanted))
    shapes = [
        f"tensor '{key[len(prefix):]}' has shape {tuple(saved[key][0])} in the checkpoint but "
        f"{tuple(wanted[key])} in the {what}"
        for key in sorted(set(wanted) & saved_keys) if tuple(saved[key][0]) != tuple(wanted[key])
    ]
    problems = []
    if missing:
        problems.append(f"the checkpoint lacks: {_fmt_list([m[len(prefix):] for m in missing])}")
    if unexpected:
        problems.append(f"the {what} lacks: {_fmt_list([u[len(prefix):] for u in unexpected])}")
    if shapes:
        problems.append("; ".join(shapes[:3]) + (f" (and {len(shapes) - 3} more)" if len(shapes) > 3 else ""))
    if not problems:
        return None
    return (f"the checkpoint does not match the {what}: " + "; ".join(problems)
            + f". Build the {what} with the configuration the checkpoint was saved with.")


def _initialize_optimizer_state(optimizer: torch.optim.Optimizer, names: Dict[int, str], with_state: set) -> None:
    """Create the state tensors (zeros) of the parameters named in ``with_state`` that have
    none yet, without changing any parameter: one step with zero gradients at learning
    rate 0, through the optimizer class's own step (not the engine's weight-sync wrapper)."""
    params = [p for p in _optimizer_params(optimizer)
              if p.requires_grad and not optimizer.state.get(p) and names[id(p)] in with_state]
    if not params:
        return
    saved_grads = {id(p): p.grad for p in params}
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            type(optimizer).step(optimizer)
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
        for p in params:
            p.grad = saved_grads[id(p)]


def _optimizer_keys_after_init(optimizer, names, saved) -> Dict[str, Tuple[int, ...]]:
    """The optimizer tensor keys the load will fill, predicted from the checkpoint for
    parameters whose state is not initialized yet."""
    wanted = {}
    for p in _optimizer_params(optimizer):
        fqn = names[id(p)]
        state = optimizer.state.get(p)
        if state:
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    wanted[f"{OPTIMIZER_PREFIX}{fqn}.{key}"] = tuple(value.shape)
            continue
        prefix = f"{OPTIMIZER_PREFIX}{fqn}."
        for key, (shape, _) in saved.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                wanted[key] = tuple(shape)
    return wanted


def load_checkpoint(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    checkpoint_dir: str,
    *,
    sync_model_weights: bool = True,
    process_group: Optional[dist.ProcessGroup] = None,
    verify: bool = True,
) -> Dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` (any world size, any strategy)
    into ``model`` (and ``optimizer`` unless None), in place.

    Every check happens before anything is modified: the manifest, the size and sha256 of
    every data file (``verify=False`` skips the hashing, not the size check), every tensor
    name and shape against the model and optimizer. The optimizer's state is created if it
    has none yet. With ``sync_model_weights`` the compute weights are refreshed from the
    loaded main weights (collective for ZeRO-1/2 and HFSDP). Returns the manifest's
    ``extra`` metadata.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_checkpoint expects an nn.Module, got {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}.")
    checkpoint_dir = os.fspath(checkpoint_dir)
    contexts = _contexts_of(model)
    comm = _resolve_comm(contexts, process_group)
    names = _check_optimizer_belongs(model, optimizer) if optimizer is not None else _param_names(model)

    # 1. The manifest (every rank reads it; all must succeed).
    manifest, error = None, None
    try:
        manifest = read_manifest(checkpoint_dir)
    except CheckpointError as e:
        error = str(e)
    comm.agree(error)

    # 2. Names and shapes, model and optimizer.
    saved = checkpoint_tensors(manifest)
    wanted_model = {MODEL_PREFIX + fqn: tuple(t.shape) for fqn, t, _ in _named_tensors(model)}
    comm.agree(_compare(saved, wanted_model, MODEL_PREFIX, "model"), CheckpointMismatchError)
    error = None
    if optimizer is not None:
        saved_optimizer = manifest.get("optimizer")
        if saved_optimizer is None:
            error = "the checkpoint holds no optimizer state; load it with optimizer=None (model weights only)."
        elif saved_optimizer["class"] != type(optimizer).__name__:
            error = (f"the checkpoint holds {saved_optimizer['class']} state but the optimizer is "
                     f"{type(optimizer).__name__}; use the same optimizer class or load without the optimizer.")
        else:
            error = _check_param_groups(saved_optimizer["param_groups"], optimizer, names)
            if error is None:
                wanted = _optimizer_keys_after_init(optimizer, names, saved)
                in_optimizer = {names[id(p)] for p in _optimizer_params(optimizer)}
                error = _compare({k: v for k, v in saved.items() if k.startswith(OPTIMIZER_PREFIX)
                                  and k[len(OPTIMIZER_PREFIX):].rsplit(".", 1)[0] in in_optimizer},
                                 wanted, OPTIMIZER_PREFIX, "optimizer")
    comm.agree(error, OptimizerMismatchError)

    # 3. File integrity: each rank checks a share of the files, then all agree.
    if verify:
        errors = verify_files(checkpoint_dir, manifest, share=(comm.rank, comm.size))
    else:
        errors = []
        for name, expected in manifest["files"].items():
            path = os.path.join(checkpoint_dir, name)
            if not os.path.isfile(path) or os.path.getsize(path) != expected["bytes"]:
                errors.append(f"checkpoint file {path} is missing or truncated; restore it or load an older checkpoint.")
    comm.agree(errors[0] if errors else None)

    # 4. Load in place.
    _reshard_all(contexts)
    if optimizer is not None:
        with_state = {k[len(OPTIMIZER_PREFIX):].rsplit(".", 1)[0] for k in saved if k.startswith(OPTIMIZER_PREFIX)}
        with_state |= set(manifest["optimizer"].get("scalar_state", {}))
        _initialize_optimizer_state(optimizer, names, with_state)
    engine = _engine_params(contexts)
    state = _model_state(model, engine)
    if optimizer is not None:
        tensors, _ = _optimizer_state(model, optimizer, engine, names)
        state.update({k: v for k, v in tensors.items() if k in saved})
    reader = _ManifestReader(checkpoint_dir, manifest)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner(), process_group=comm.group,
                 no_dist=comm.no_dist)
    if optimizer is not None:
        _restore_optimizer_json(optimizer, names, manifest["optimizer"])
    if sync_model_weights:
        sync_compute_weights(model)
    return manifest.get("extra", {})


def _check_param_groups(saved_groups, optimizer, names) -> Optional[str]:
    if len(saved_groups) != len(optimizer.param_groups):
        return (f"the checkpoint's optimizer has {len(saved_groups)} parameter groups but this one has "
                f"{len(optimizer.param_groups)}; build the optimizer the same way as when saving.")
    for index, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        current = [names[id(p)] for p in group["params"]]
        if sorted(saved["params"]) != sorted(current):
            diff = sorted(set(saved["params"]) ^ set(current))
            return (f"optimizer parameter group {index} holds different parameters than in the checkpoint "
                    f"(differing: {_fmt_list(diff)}); build the optimizer the same way as when saving.")
    return None


def _restore_optimizer_json(optimizer, names, saved_optimizer) -> None:
    for saved, group in zip(saved_optimizer["param_groups"], optimizer.param_groups):
        for key, value in saved.items():
            if key == "params":
                continue
            value = _from_json(value)
            if isinstance(group.get(key), torch.Tensor) and not isinstance(value, torch.Tensor):
                group[key].fill_(value)
            else:
                group[key] = value
    by_name = {names[id(p)]: p for p in _optimizer_params(optimizer)}
    for fqn, entries in saved_optimizer.get("scalar_state", {}).items():
        p = by_name.get(fqn)
        if p is not None:
            optimizer.state[p].update({k: _from_json(v) for k, v in entries.items()})


def sync_compute_weights(model: nn.Module) -> None:
    """Refresh every unit's compute weights from its main weights (after writing them)."""
    works = []
    for ctx in _contexts_of(model):
        for unit in ctx.units:
            for group in unit.parameter_groups:
                works.extend(group.sync_model_weight())
    for work in works:
        work.wait()


# --------------------------------------------------------------------------------------
# Single-process helpers for tools (consolidation, conversion, inspection)
# --------------------------------------------------------------------------------------


def load_tensors(checkpoint_dir: str, keys: Iterable[str], *, manifest: Optional[Dict[str, Any]] = None,
                 verify: bool = False) -> Dict[str, torch.Tensor]:
    """Read whole tensors (any saved sharding) in this process. ``verify`` checks the
    files' checksums first."""
    manifest = manifest or read_manifest(checkpoint_dir)
    if verify:
        errors = verify_files(checkpoint_dir, manifest)
        if errors:
            raise CheckpointError(errors[0])
    saved = checkpoint_tensors(manifest)
    out = {}
    for key in keys:
        if key not in saved:
            raise KeyError(f"{key!r} is not in the checkpoint {checkpoint_dir!r}.")
        shape, dtype = saved[key]
        out[key] = torch.empty(shape, dtype=dtype)
    if out:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(dict(out), storage_reader=_ManifestReader(checkpoint_dir, manifest),
                     planner=_SafeLoadPlanner(), no_dist=True)
    return out


def save_tensors(tensors: Dict[str, torch.Tensor], checkpoint_dir: str, *, optimizer: Optional[Dict] = None,
                 extra_metadata: Optional[Dict[str, Any]] = None, overwrite: bool = False) -> str:
    """Write whole tensors (keys with their ``model.`` / ``optimizer.state.`` prefix) as an
    MFSDP checkpoint from this process alone (e.g. a converted Hugging Face model)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if os.path.isfile(os.path.join(checkpoint_dir, MANIFEST_NAME)) and not overwrite:
        raise ValueError(f"{checkpoint_dir!r} already holds a checkpoint; pass overwrite=True to replace it.")
    info = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "torch_version": torch.__version__, "world_size": 1, "strategies": {}, "optimizer": optimizer,
        "extra": extra_metadata or {},
    }
    _write({k: _whole(v) for k, v in tensors.items()}, checkpoint_dir, _Comm(no_dist=True), info)
    return checkpoint_dir
