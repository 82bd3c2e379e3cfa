"""MFSDP v2: fully sharded data parallelism with an explicit construction scope.

Public API, source-compatible with upstream Megatron-LM's experimental MFSDP v2::

    with fully_shard_context() as ctx:
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=mesh, placements=Placements.zero3())
        fully_shard(model, mesh=mesh, placements=Placements.zero3())
    optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters()))

See docs/mfsdp_v2.md.
"""

from .context import FsdpContext, current_fully_shard_context, fully_shard_context, microbatch
from .fully_shard import fully_shard
from .mixed_precision import MixedPrecisionPolicy
from .module import FsdpModule
from .optimizer import clip_grad_norm_, fully_shard_optimizer
from .placements import Placements
from .replica import ReplicaReducer

__all__ = [
    "FsdpContext",
    "FsdpModule",
    "MixedPrecisionPolicy",
    "Placements",
    "ReplicaReducer",
    "clip_grad_norm_",
    "current_fully_shard_context",
    "fully_shard",
    "fully_shard_context",
    "fully_shard_optimizer",
    "load_checkpoint",
    "microbatch",
    "save_checkpoint",
]


def __getattr__(name):
    # save_checkpoint / load_checkpoint live in the checkpoint/ package, imported on first
    # use: torch.distributed.checkpoint adds most of a second to every import of the engine.
    if name in ("save_checkpoint", "load_checkpoint"):
        from . import checkpoint  # import cost (see above)

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
