"""``--check-weight-hash-across-dp-replicas-interval``: are the data-parallel replicas' weights equal?

What is compared: each rank hashes (SHA-256 of the raw bytes) the piece of every model
parameter it holds, and the hashes are compared among the ranks of the data-parallel x
context-parallel group that hold *the same piece*. A piece is named by the parameter, which
copy it is (the registered parameter, or MFSDP's compute copy), its tensor/expert-parallel
slice (``global_slices``) and, for an MFSDP DTensor, its shard index on each mesh axis that
shards it (a replicating axis does not enter the name). So:

* DDP and MFSDP no_shard: every parameter is compared across all data-parallel (and
  context-parallel) ranks;
* MFSDP ZeRO-1/2: the registered parameters are the ranks' own optimizer shards (unique),
  but the compute copies the forward uses are replicated and are compared;
* ZeRO-3 over the whole data-parallel mesh: every shard is unique, nothing is replicated and
  nothing can be compared (the log says so, not an error);
* HSDP/HFSDP: each inner shard is compared across the outer replicas that hold it;
* TP and PP ranks are never compared with each other (they hold different pieces): the
  group is per TP/PP position.

Optimizer state is not hashed. On a mismatch every rank reaches the same verdict from the same
gathered hashes; a hash held by a strict majority of a piece's holders is taken as right and
the others are named; with no majority (e.g. two replicas) all holders are named.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from megatron.core.global_slices import global_slices_by_name

Piece = Tuple[str, str, str, Tuple]  # (parameter name, which copy, its TP/EP slice, its DTensor shard index)


class WeightHashMismatch(RuntimeError):
    """Data-parallel replicas hold different weights (the message names the rank(s))."""


def _shard_index(param: torch.Tensor) -> Tuple:
    """Which shard of a DTensor this rank holds: its mesh coordinate on every sharding axis."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return ()
    coordinate = param.device_mesh.get_coordinate() or ()
    return tuple((axis, coordinate[axis]) for axis, p in enumerate(placements) if p.is_shard())


def _local_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _sha256(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().reshape(-1).cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


def replicated_compute_copies(context) -> Dict[int, torch.Tensor]:
    """id(registered MFSDP parameter) -> its full compute copy, where the compute weights
    stay unsharded at rest (no_shard, ZeRO-1/2); {} without MFSDP."""
    copies = {}
    for unit in getattr(context, "units", ()):
        for group in unit.parameter_groups:
            if group.strategy.param_sharded or not group.is_unsharded:
                continue
            for p in group.fsdp_parameters:
                copies[id(p.sharded_param)] = p.unsharded_param
    return copies


def local_weight_hashes(model: nn.Module, context=None) -> Dict[Piece, str]:
    """This rank's pieces of ``model``'s parameters (and of MFSDP's replicated compute
    copies, given its ``context``), each with the hash of its bytes."""
    slices = global_slices_by_name(model)
    compute = replicated_compute_copies(context)
    hashes = {}
    for name, param in model.named_parameters():
        where = repr(slices.get(name))
        hashes[(name, "parameter", where, _shard_index(param))] = _sha256(_local_tensor(param))
        if id(param) in compute:
            hashes[(name, "compute copy", where, ())] = _sha256(compute[id(param)])
    return hashes


def _diverging_holders(holders: List[Tuple[int, str]]) -> List[int]:
    """The ranks whose hash differs from the majority's (all holders when there is none)."""
    counts = Counter(h for _, h in holders)
    top, top_count = counts.most_common(1)[0]
    if top_count * 2 > len(holders):
        return [r for r, h in holders if h != top]
    return [r for r, _ in holders]


def compare_weight_hashes(gathered: List[Dict[Piece, str]], ranks: List[int]) -> Tuple[int, Optional[str]]:
    """(pieces compared, None or the mismatch line) from every group rank's hashes."""
    holders = defaultdict(list)
    for rank, hashes in zip(ranks, gathered):
        for piece, digest in hashes.items():
            holders[piece].append((rank, digest))
    shared = {piece: hs for piece, hs in holders.items() if len(hs) > 1}
    bad = {piece: hs for piece, hs in shared.items() if len({h for _, h in hs}) > 1}
    if not bad:
        return len(shared), None
    diverging = sorted({r for hs in bad.values() for r in _diverging_holders(hs)})
    first_piece, first_holders = sorted(bad.items())[0]
    others = sorted(r for r, _ in first_holders if r not in diverging)
    who = f"rank{'s' if len(diverging) > 1 else ''} {', '.join(map(str, diverging))}"
    against = (f"differ{'s' if len(diverging) == 1 else ''} from rank{'s' if len(others) > 1 else ''} "
               f"{', '.join(map(str, others))}" if others else "disagree with no majority")
    copy = "" if first_piece[1] == "parameter" else f" ({first_piece[1]})"
    return len(shared), (f"{who} {against} in parameter {first_piece[0]}{copy}"
                         f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}")


def check_weight_hashes_across_dp_replicas(model: nn.Module, group, context=None) -> int:
    """Raise :class:`WeightHashMismatch` (on every rank of ``group``) when replicas of a
    parameter piece differ; return how many pieces were compared. A collective."""
    hashes = local_weight_hashes(model, context)
    size = dist.get_world_size(group)
    gathered = [None] * size
    dist.all_gather_object(gathered, hashes, group=group)
    compared, mismatch = compare_weight_hashes(gathered, dist.get_process_group_ranks(group))
    if mismatch:
        raise WeightHashMismatch(f"weight hashes differ across data-parallel replicas: {mismatch}")
    return compared
