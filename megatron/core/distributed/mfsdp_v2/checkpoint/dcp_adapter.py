"""Everything that speaks ``torch.distributed.checkpoint`` (DCP).

* ``ChunkedTensor``: a carrier that tells DCP the true global offsets of this rank's
  pieces. The engine packs whole rows of every tensor into equal flat shards, so a rank's
  slice does not follow torch's even-chunk rule (a rank may hold fewer rows, or none);
  DCP's own DTensor handling would compute the wrong offsets and scramble rows.
  Replicated copies (no_shard, HSDP replicas, 0-d tensors) produce identical write items
  on several ranks, which DCP's planner writes once.
* DCP's index as JSON, both ways: the manifest carries it, so the pickled ``.metadata``
  file is never read.
* ``write_state`` / ``read_state``: one DCP save or load with this package's writer,
  reader and planners (nothing is unpickled except tensor data through
  ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed.checkpoint as dcp
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

from megatron.core.torch_private import set_nested_element, storage_info

from .manifest import dtype_from_name, dtype_name

# --------------------------------------------------------------------------------------
# Telling DCP where each local piece really lies
# --------------------------------------------------------------------------------------


class ChunkedTensor(torch.Tensor):
    """A global tensor of which this rank holds ``chunks``: ``[(offsets, local_tensor)]``.

    Only a carrier for DCP: it has the global shape and dtype, and answers DCP's
    checkpoint protocol (``__create_write_items__`` / ``__create_chunk_list__`` /
    ``__get_tensor_shard__``) with the real offsets of its pieces. Any other operation
    raises. An empty chunk list means this rank holds nothing of the tensor. A load
    writes into the local tensors in place.
    """

    @staticmethod
    def __new__(cls, shape, dtype, device, chunks):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device,
                                                   requires_grad=False)

    def __init__(self, shape, dtype, device, chunks):
        self._chunks: List[Tuple[torch.Size, torch.Tensor]] = [(torch.Size(o), t) for o, t in chunks]

    def __repr__(self):  # the default repr would dispatch ops
        return f"ChunkedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, chunks={len(self._chunks)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"ChunkedTensor only carries checkpoint pieces; {func} is not supported.")

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

    def staged(self) -> "ChunkedTensor":
        """A copy whose pieces live in fresh CPU memory (for asynchronous saving)."""
        copies = [(offsets, local.detach().to("cpu", copy=True)) for offsets, local in self._chunks]
        return ChunkedTensor(self.shape, self.dtype, torch.device("cpu"), copies)


def whole(tensor: torch.Tensor) -> ChunkedTensor:
    """A tensor this rank holds entirely (replicated, or a plain model)."""
    tensor = tensor.detach()
    return ChunkedTensor(tensor.shape, tensor.dtype, tensor.device, [((0,) * tensor.dim(), tensor)])


def staged(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``state`` with every tensor copied to memory that training will not touch."""
    return {k: (v.staged() if isinstance(v, ChunkedTensor) else v.detach().clone()) for k, v in state.items()}


# --------------------------------------------------------------------------------------
# DCP's index as JSON (the checkpoint index is never unpickled)
# --------------------------------------------------------------------------------------


def metadata_to_json(metadata: Metadata) -> Dict[str, Any]:
    tensors = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[key] = {
                "dtype": dtype_name(md.properties.dtype),
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


def metadata_from_json(data: Dict[str, Any]) -> Metadata:
    state_dict_metadata = {}
    for key, md in data["tensors"].items():
        if md.get("bytes"):
            state_dict_metadata[key] = BytesStorageMetadata()
            continue
        state_dict_metadata[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(md["dtype"])),
            size=torch.Size(md["shape"]),
            chunks=[ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in md["chunks"]],
        )
    storage_data = {}
    for entry in data["storage"]:
        index = MetadataIndex(entry["key"], entry["offsets"])
        storage_data[index] = storage_info(
            relative_path=entry["file"], offset=entry["file_offset"], length=entry["length"],
            transform_descriptors=entry.get("transforms"),
        )
    planner_data = {key: (key,) for key in state_dict_metadata}
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data,
                    storage_data=storage_data, storage_meta=StorageMeta(), version=data.get("version"))


def data_files(dcp_json: Dict[str, Any]) -> List[str]:
    """The files a DCP save wrote (data files and its ``.metadata``), sorted."""
    return sorted({entry["file"] for entry in dcp_json["storage"]} | {".metadata"})


class ManifestReader(FileSystemReader):
    """DCP's file reader, with the index taken from the JSON manifest instead of the
    pickled ``.metadata`` file. Tensor data is read by DCP with ``weights_only=True``."""

    def __init__(self, path: str, manifest: Dict[str, Any]):
        super().__init__(path)
        self._manifest = manifest

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = metadata_from_json(self._manifest["dcp"])
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Never unpickles arbitrary objects: non-tensor entries (which this package never
    writes) are read with ``weights_only=True``."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_nested_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# --------------------------------------------------------------------------------------
# One save, one load
# --------------------------------------------------------------------------------------


def write_state(state: Dict[str, torch.Tensor], checkpoint_dir: str, *, group, no_dist: bool) -> Dict[str, Any]:
    """Write ``state`` with DCP (fsync on every file); returns DCP's index as JSON."""
    writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=True, sync_files=True, thread_count=1,
                              overwrite=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
        # Replicated copies are written by the lowest rank holding them: deterministic even if
        # replicas differ in the last bit (e.g. a 0-d parameter reduced in a different order).
        metadata = dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
                            process_group=group, no_dist=no_dist)
    return metadata_to_json(metadata)


def read_state(state: Dict[str, torch.Tensor], checkpoint_dir: str, manifest: Dict[str, Any], *, group,
               no_dist: bool) -> None:
    """Fill ``state`` (in place) from the checkpoint that ``manifest`` indexes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, storage_reader=ManifestReader(checkpoint_dir, manifest), planner=SafeLoadPlanner(),
                 process_group=group, no_dist=no_dist)
