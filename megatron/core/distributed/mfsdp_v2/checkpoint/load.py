"""``load_checkpoint``: check everything on every rank, agree, then load in place.

A load asks DCP, for each tensor, for exactly the rows the loading rank holds in its own
layout, so any checkpoint loads into any world size and strategy, or a plain model.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from . import engine_view
from .agreement import Comm, resolve_comm
from .dcp_adapter import read_state
from .errors import CheckpointError, CheckpointMismatchError, OptimizerMismatchError
from .manifest import check_sizes, checkpoint_tensors, read_manifest, verify_files
from .state import (
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    check_optimizer_belongs,
    group_key,
    model_state,
    named_tensors,
    optimizer_params,
    optimizer_state,
    param_names,
    restore_optimizer_json,
    saved_shape,
)
from .strictness import OnMismatch, log_absent


def load_checkpoint(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    checkpoint_dir: str,
    *,
    sync_model_weights: bool = True,
    process_group: Optional[dist.ProcessGroup] = None,
    verify: bool = True,
    pieces: Optional[Dict[str, Any]] = None,
    absent_from_checkpoint: OnMismatch = OnMismatch.RAISE,
    absent_from_model: OnMismatch = OnMismatch.RAISE,
) -> Dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` (any world size, any strategy)
    into ``model`` (and ``optimizer`` unless None), in place.

    Every check happens before anything is modified: the manifest, the size and sha256 of
    every data file (``verify=False`` skips the hashing, not the size check), every tensor
    name and shape against the model and optimizer. The optimizer's state is created if it
    has none yet. With ``sync_model_weights`` the compute weights are refreshed from the
    loaded main weights (collective for ZeRO-1/2 and HFSDP). Returns the manifest's
    ``extra`` metadata. ``pieces``: as for ``save_checkpoint`` (each rank reads its piece
    of the global tensors).

    ``absent_from_checkpoint`` / ``absent_from_model`` (``OnMismatch``): what to do with a
    model tensor the checkpoint lacks (it keeps its current value; its parameter keeps its
    current optimizer state, none for a fresh optimizer, so it starts like a new one) and
    with a checkpoint tensor the model lacks (not read). RAISE (the default) fails before
    anything changes; LOG warns once, from rank 0, naming them; IGNORE says nothing. A
    tensor both have with different shapes, and a parameter whose optimizer state differs
    from the checkpoint's, always raise.
    """
    for policy in (absent_from_checkpoint, absent_from_model):
        if not isinstance(policy, OnMismatch):
            raise TypeError(f"absent_from_checkpoint / absent_from_model must be OnMismatch members, got {policy!r}.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_checkpoint expects an nn.Module, got {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}.")
    checkpoint_dir = os.fspath(checkpoint_dir)
    contexts = engine_view.contexts_of(model)
    comm = resolve_comm(engine_view.unit_meshes(contexts), process_group)
    names = check_optimizer_belongs(model, optimizer) if optimizer is not None else param_names(model)
    pieces = pieces or {}

    # 1. The manifest (every rank reads it; all must succeed).
    manifest, error = None, None
    try:
        manifest = read_manifest(checkpoint_dir)
    except CheckpointError as e:
        error = str(e)
    comm.agree(error)

    # 2. Names and shapes, model and optimizer.
    saved = checkpoint_tensors(manifest)
    # The model is what the ranks hold together (pipeline stages hold different layers).
    wanted_model = comm.union({MODEL_PREFIX + fqn: saved_shape(fqn, t.shape, pieces)
                               for fqn, t, _ in named_tensors(model)})
    # Tolerated absences (the same on every rank: the names are global) leave the comparison.
    only_model = sorted(k[len(MODEL_PREFIX):] for k in wanted_model if k not in saved) \
        if absent_from_checkpoint is not OnMismatch.RAISE else []
    only_saved = sorted(k[len(MODEL_PREFIX):] for k in saved if k.startswith(MODEL_PREFIX) and k not in wanted_model) \
        if absent_from_model is not OnMismatch.RAISE else []
    skipped = set(only_model) | set(only_saved)
    comm.agree(_compare({k: v for k, v in saved.items() if k[len(MODEL_PREFIX):] not in skipped},
                        {k: v for k, v in wanted_model.items() if k[len(MODEL_PREFIX):] not in skipped},
                        MODEL_PREFIX, "model"), CheckpointMismatchError)
    error = None if optimizer is None else _optimizer_mismatch(manifest.get("optimizer"), optimizer, names, saved,
                                                               pieces, skipped, comm)
    comm.agree(error, OptimizerMismatchError)

    # 3. File integrity: each rank checks a share of the files, then all agree.
    if verify:
        errors = verify_files(checkpoint_dir, manifest, share=(comm.rank, comm.size))
    else:
        errors = check_sizes(checkpoint_dir, manifest)
    comm.agree(errors[0] if errors else None)

    if comm.rank == 0:
        log_absent(checkpoint_dir, only_model if absent_from_checkpoint is OnMismatch.LOG else [],
                   only_saved if absent_from_model is OnMismatch.LOG else [])

    # 4. Load in place.
    engine_view.reshard_all(contexts)
    if optimizer is not None:
        with_state = {k[len(OPTIMIZER_PREFIX):].rsplit(".", 1)[0] for k in saved if k.startswith(OPTIMIZER_PREFIX)}
        with_state |= set(manifest["optimizer"].get("scalar_state", {}))
        _initialize_optimizer_state(optimizer, names, with_state)
    engine = engine_view.sharded_parameters(contexts)
    state = {k: v for k, v in model_state(model, engine, pieces).items() if k in saved}
    if optimizer is not None:
        tensors, _ = optimizer_state(optimizer, engine, names, pieces)
        state.update({k: v for k, v in tensors.items() if k in saved})
    read_state(state, checkpoint_dir, manifest, group=comm.group, no_dist=comm.no_dist)
    if optimizer is not None:
        restore_optimizer_json(optimizer, names, manifest["optimizer"])
    if sync_model_weights:
        sync_compute_weights(model)
    return manifest.get("extra", {})


def sync_compute_weights(model: nn.Module) -> None:
    """Refresh every unit's compute weights from its main weights (after writing them)."""
    engine_view.sync_compute_weights(engine_view.contexts_of(model))


# --------------------------------------------------------------------------------------
# Checks (each returns a message, or None)
# --------------------------------------------------------------------------------------


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


def _optimizer_mismatch(saved_optimizer, optimizer, names, saved, pieces, skipped=frozenset(),
                        comm: Optional[Comm] = None) -> Optional[str]:
    """Why the checkpoint's optimizer state does not fit ``optimizer`` (with the other
    ranks' of ``comm``: together they hold the model), or None. ``skipped``: parameters
    only one side has, tolerated (their state is neither read nor required)."""
    comm = comm or Comm(no_dist=True)
    if saved_optimizer is None:
        return "the checkpoint holds no optimizer state; load it with optimizer=None (model weights only)."
    if saved_optimizer["class"] != type(optimizer).__name__:
        return (f"the checkpoint holds {saved_optimizer['class']} state but the optimizer is "
                f"{type(optimizer).__name__}; use the same optimizer class or load without the optimizer.")
    groups: Dict[Any, set] = {}  # group_key -> the parameter names all ranks hold in it
    for rank_groups in comm.all_gather([(group_key(g, i), [names[id(p)] for p in g["params"]])
                                        for i, g in enumerate(optimizer.param_groups)]):
        for key, group_names in rank_groups:
            groups.setdefault(key, set()).update(group_names)
    error = _check_param_groups(saved_optimizer["param_groups"], groups, skipped)
    if error is not None:
        return error
    wanted = {k: v for k, v in comm.union(_optimizer_keys_after_init(optimizer, names, saved, pieces)).items()
              if k[len(OPTIMIZER_PREFIX):].rsplit(".", 1)[0] not in skipped}
    in_optimizer = set().union(*groups.values()) - set(skipped)
    return _compare({k: v for k, v in saved.items() if k.startswith(OPTIMIZER_PREFIX)
                     and k[len(OPTIMIZER_PREFIX):].rsplit(".", 1)[0] in in_optimizer},
                    wanted, OPTIMIZER_PREFIX, "optimizer")


def _check_param_groups(saved_groups, groups: Dict[Any, set], skipped=frozenset()) -> Optional[str]:
    """``groups``: group_key -> the parameter names the ranks hold in that group together."""
    if len(saved_groups) != len(groups) or {group_key(g, i) for i, g in enumerate(saved_groups)} != set(groups):
        return (f"the checkpoint's optimizer has {len(saved_groups)} parameter groups but this one has "
                f"{len(groups)}; build the optimizer the same way as when saving.")
    for index, saved in enumerate(saved_groups):
        current = sorted(n for n in groups[group_key(saved, index)] if n not in skipped)
        if sorted(n for n in saved["params"] if n not in skipped) != current:
            diff = sorted(set(saved["params"]) ^ set(current))
            return (f"optimizer parameter group {index} holds different parameters than in the checkpoint "
                    f"(differing: {_fmt_list(diff)}); build the optimizer the same way as when saving.")
    return None


def _optimizer_keys_after_init(optimizer, names, saved, pieces) -> Dict[str, Tuple[int, ...]]:
    """The optimizer tensor keys the load will fill, predicted from the checkpoint for
    parameters whose state is not initialized yet."""
    wanted = {}
    for p in optimizer_params(optimizer):
        fqn = names[id(p)]
        state = optimizer.state.get(p)
        if state:
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    shape = saved_shape(fqn, value.shape, pieces) if value.dim() > 0 else ()
                    wanted[f"{OPTIMIZER_PREFIX}{fqn}.{key}"] = shape
            continue
        prefix = f"{OPTIMIZER_PREFIX}{fqn}."
        for key, (shape, _) in saved.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                wanted[key] = tuple(shape)
    return wanted


# --------------------------------------------------------------------------------------
# Optimizer state to load into
# --------------------------------------------------------------------------------------


def _initialize_optimizer_state(optimizer: torch.optim.Optimizer, names: Dict[int, str], with_state: set) -> None:
    """Create the state tensors (zeros) of the parameters named in ``with_state`` that have
    none yet, without changing any parameter: one step with zero gradients at learning
    rate 0."""
    create_optimizer_state(optimizer, [p for p in optimizer_params(optimizer)
                                       if p.requires_grad and names[id(p)] in with_state])


def create_optimizer_state(optimizer: torch.optim.Optimizer, params: List[torch.Tensor]) -> None:
    """Create the (zero) state of those ``params`` that have none yet, without changing any
    parameter: one step with zero gradients at learning rate 0 (a load, a torchft recovery)."""
    params = [p for p in params if not optimizer.state.get(p)]
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
            engine_view.step_at_zero_lr(optimizer)
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
        for p in params:
            p.grad = saved_grads[id(p)]
