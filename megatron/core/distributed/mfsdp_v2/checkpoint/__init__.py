"""Sharded, reshardable checkpoints with ``torch.distributed.checkpoint`` (DCP).

``save_checkpoint(model, optimizer, checkpoint_dir)`` writes, from every rank, the rows of
the main (fp32) weights and of the optimizer state that the rank holds, each described to
DCP by its true global offset and size; ``load_checkpoint`` reads any checkpoint written
this way into any layout: another world size, another strategy (ZeRO-1/2/3, HSDP, HFSDP,
no_shard) or a plain unsharded model in one process.

Directory contents (see docs/checkpointing.md)::

    __0_0.distcp, __1_0.distcp, ...   tensor data, one file per writing rank (DCP format)
    .metadata                         DCP's own index (pickle; written for other DCP tools,
                                      never read by this package)
    mfsdp_manifest.json               written last: format version, the DCP index as JSON,
                                      optimizer hyper-parameters, size and sha256 of every
                                      data file, and a checksum of itself

Modules (each imports only the ones above it)::

    errors       CheckpointError, CheckpointMismatchError, OptimizerMismatchError
    strictness   OnMismatch: raise, log or ignore tensors only one side has
    manifest     the manifest; atomic writes, fsync, digests, file checks (public: the
                 trainer and tools use it for their own files)
    agreement    which ranks take part; every rank raises the same error
    engine_view  the only reader of engine internals
    dcp_adapter  ChunkedTensor (true offsets for DCP), DCP's index as JSON, safe reads
    state        model + optimizer <-> flat DCP entries and JSON
    save, load   save_checkpoint, load_checkpoint
    offline      load_tensors / save_tensors in one process, without a model
"""

from .errors import CheckpointError, CheckpointMismatchError, OptimizerMismatchError
from .load import load_checkpoint, sync_compute_weights
from .manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    checkpoint_tensors,
    read_manifest,
    verify_files,
    write_json_atomic,
)
from .offline import load_tensors, save_tensors
from .save import save_checkpoint
from .strictness import OnMismatch
from .state import MODEL_PREFIX, OPTIMIZER_PREFIX

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MODEL_PREFIX",
    "OPTIMIZER_PREFIX",
    "OnMismatch",
    "OptimizerMismatchError",
    "checkpoint_tensors",
    "load_checkpoint",
    "load_tensors",
    "read_manifest",
    "save_checkpoint",
    "save_tensors",
    "sync_compute_weights",
    "verify_files",
    "write_json_atomic",
]
