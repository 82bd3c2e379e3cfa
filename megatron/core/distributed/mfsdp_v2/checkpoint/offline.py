"""Checkpoints in one process, without a model: the tools' way in (consolidation,
conversion, inspection)."""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional

import torch

from .agreement import Comm
from .dcp_adapter import read_state, whole
from .errors import CheckpointError
from .manifest import MANIFEST_NAME, checkpoint_tensors, read_manifest, verify_files
from .save import manifest_header, write_checkpoint


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
        read_state(dict(out), checkpoint_dir, manifest, group=None, no_dist=True)
    return out


def save_tensors(tensors: Dict[str, torch.Tensor], checkpoint_dir: str, *, optimizer: Optional[Dict] = None,
                 extra_metadata: Optional[Dict[str, Any]] = None, overwrite: bool = False) -> str:
    """Write whole tensors (keys with their ``model.`` / ``optimizer.state.`` prefix) as an
    MFSDP checkpoint from this process alone (e.g. a converted Hugging Face model)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if os.path.isfile(os.path.join(checkpoint_dir, MANIFEST_NAME)) and not overwrite:
        raise ValueError(f"{checkpoint_dir!r} already holds a checkpoint; pass overwrite=True to replace it.")
    header = manifest_header(1, {}, optimizer, extra_metadata)
    write_checkpoint({k: whole(v) for k, v in tensors.items()}, checkpoint_dir, Comm(no_dist=True), header)
    return checkpoint_dir
