"""``save_checkpoint``: every rank writes the rows it holds; the manifest comes last."""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import engine_view
from .agreement import Comm, resolve_comm
from .dcp_adapter import data_files, staged, write_state
from .manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, digest_files, fsync_dir, write_manifest
from .state import (check_optimizer_belongs, merge_optimizer_json, model_state, optimizer_json, optimizer_state,
                    param_names)


def save_checkpoint(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    checkpoint_dir: str,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
    overwrite: bool = False,
    async_save: bool = False,
    extra_metadata: Optional[Dict[str, Any]] = None,
    pieces: Optional[Dict[str, Any]] = None,
):
    """Save the model's main weights (and the optimizer state) into ``checkpoint_dir``.

    Call on every rank of the model's mesh. ``model`` is the module whose
    ``named_parameters()`` name the tensors (usually the root FSDP unit); a plain
    (unwrapped) model is saved by the calling process alone. The manifest is written last,
    so an interrupted save never looks complete. An existing checkpoint in the directory is
    replaced only with ``overwrite=True``.

    ``process_group``: the ranks that take part (default: the model's mesh, or no
    communication for a plain model; a tensor-parallel model needs the whole world).
    ``pieces``: ``{fqn: piece}`` of the parameters that are pieces of global tensors
    (see ``state.py``); they are saved as the global tensors. ``async_save=True`` copies the local pieces to CPU
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
    contexts = engine_view.contexts_of(model)
    comm = resolve_comm(engine_view.unit_meshes(contexts), process_group)
    if async_save and not comm.no_dist and process_group is None:
        raise ValueError(
            "async_save=True writes in a background thread and needs its own process group: pass "
            "process_group=dist.new_group(ranks, backend='gloo') (created once, on every rank)."
        )
    names = check_optimizer_belongs(model, optimizer) if optimizer is not None else param_names(model)

    error = None
    if comm.rank == 0 and os.path.isfile(os.path.join(checkpoint_dir, MANIFEST_NAME)) and not overwrite:
        error = (f"{checkpoint_dir!r} already holds a checkpoint; pass overwrite=True to replace it, "
                 "or save into a new directory.")
    comm.agree(error, ValueError)

    engine_view.reshard_all(contexts)
    engine = engine_view.sharded_parameters(contexts)
    state = model_state(model, engine, pieces)
    saved_optimizer = None
    if optimizer is not None:
        tensors, scalars = optimizer_state(optimizer, engine, names, pieces)
        state.update(tensors)
        # Every rank's parameters: pipeline stages hold different ones.
        saved_optimizer = merge_optimizer_json(comm.all_gather(optimizer_json(optimizer, names, scalars)))
    header = manifest_header(comm.size, comm.union(engine_view.unit_strategies(contexts)), saved_optimizer,
                             extra_metadata)
    if not async_save:
        write_checkpoint(state, checkpoint_dir, comm, header)
        return checkpoint_dir
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsdp-async-save")
    future = executor.submit(write_checkpoint, staged(state), checkpoint_dir, comm, header)
    executor.shutdown(wait=False)
    return future


def manifest_header(world_size: int, strategies: Dict[str, str], optimizer: Optional[Dict[str, Any]],
                    extra_metadata: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The manifest's fields that describe the save (the index and digests come later)."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "torch_version": torch.__version__,
        "world_size": world_size,
        "strategies": strategies,
        "optimizer": optimizer,
        "extra": extra_metadata or {},
    }


def write_checkpoint(state: Dict[str, torch.Tensor], checkpoint_dir: str, comm: Comm, header: Dict[str, Any]) -> str:
    """Write ``state`` with DCP from every rank of ``comm``, then (rank 0) the manifest:
    ``header``, DCP's index, and the size and sha256 of every file (each rank hashes a share)."""
    if comm.rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        manifest_path = os.path.join(checkpoint_dir, MANIFEST_NAME)
        if os.path.exists(manifest_path):
            os.remove(manifest_path)  # from here on the directory is not a complete checkpoint
            fsync_dir(checkpoint_dir)
    comm.barrier()
    dcp_json = write_state(state, checkpoint_dir, group=comm.group, no_dist=comm.no_dist)
    mine = digest_files(checkpoint_dir, data_files(dcp_json)[comm.rank::comm.size])
    gathered = comm.all_gather(mine)
    if comm.rank == 0:
        body = dict(header)
        body["dcp"] = dcp_json
        body["files"] = {name: entry for part in gathered for name, entry in part.items()}
        write_manifest(checkpoint_dir, body)
    comm.barrier()
    return checkpoint_dir
