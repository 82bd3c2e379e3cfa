"""Trainer side of checkpointing, in Megatron's directory layout (docs/checkpointing.md).

    <save>/latest_checkpointed_iteration.txt     "100"; replaced atomically, and only after
                                                 the iteration directory is complete
    <save>/iter_0000100/
        __0_0.distcp ... , .metadata             model + optimizer (the engine's sharded,
        mfsdp_manifest.json                      reshardable DCP format, any world size)
        common.json                              iteration, consumed samples (the data
                                                 position), LR scheduler, arguments, the
                                                 checksums of the RNG files; self-checksummed
        rng/rank_00000.pt ...                    each rank's RNG states (tensors and lists;
                                                 read with weights_only=True)
        rerun/rank_00000.pt ...                  each rank's part of the re-run state machine
                                                 (--rerun-mode not disabled; its common part,
                                                 mode, state and iteration, is in common.json)

A save writes everything into ``iter_0000100.tmp``, renames it into place, then updates the
tracker: a process killed at any point leaves the previous checkpoint intact and tracked.
A load checks every file (checksums, names, shapes) on every rank before the model is
touched. MFSDP, DDP and single-rank models write the same format (DDP / single rank as
whole tensors), so checkpoints move freely between them and across world sizes.

``--async-save`` copies the state to CPU memory and writes it in a background thread
(over a dedicated gloo group); the previous asynchronous save is completed before the
next one starts and before the trainer exits. ``--exit-signal-handler``: on SIGTERM the
trainer finishes its step, saves, and exits with status 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import signal
import sys
import time
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.mfsdp_v2 import FsdpModule
from megatron.core.distributed.mfsdp_v2 import checkpoint as engine
from megatron.core.distributed.mfsdp_v2.checkpoint import manifest
from megatron.core.distributed.mfsdp_v2.checkpoint.agreement import Comm
from megatron.core.distributed.ranks import any_rank
from megatron.core.distributed.ranks import rank as _rank
from megatron.core.distributed.ranks import world_size as _world
from megatron.core.global_slices import global_slices_by_name
from megatron.training.checkpoint_retention import prune_after_commit
from megatron.training.log_utils import print_rank_0
from megatron.training.model_builder import ACTIVATION_FLAGS, activation_from_args
from megatron.training.tokenizer_record import record_tokenizer

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
COMMON_FILENAME = "common.json"
RNG_DIRNAME = "rng"
RERUN_DIRNAME = "rerun"
CHECKPOINT_VERSION = 2
# Test hook: "SECONDS" or "SECONDS@ITERATION" to wait (on rank 0) after a checkpoint is
# fully written and before it is renamed into place; lets tests kill a run in the middle of
# a save deterministically.
COMMIT_DELAY_ENV = "MEGATRON_TEST_CHECKPOINT_COMMIT_DELAY_S"


# ----------------------------------------------------------------------------------------
# Paths, tracker, common.json
# ----------------------------------------------------------------------------------------


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The iteration named by ``latest_checkpointed_iteration.txt``, or None if absent."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(
            f"{path} holds {text!r}, not an iteration number; point --load at a directory written "
            "by --save or by tools/checkpoint/convert.py (release checkpoints are not supported)."
        ) from None


def write_tracker(root: str, iteration: int) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``iteration`` (atomically)."""
    manifest.write_text_atomic(os.path.join(root, TRACKER_FILENAME), str(iteration))


def encode_args(value: Any) -> Any:
    """Arguments -> JSON (dtypes and tuples survive the round trip; other objects become strings)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if np.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).replace("torch.", "")}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_args(v) for v in value]}
    if isinstance(value, list):
        return [encode_args(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_args(v) for k, v in value.items()}
    return {"__repr__": repr(value)}


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        if "__repr__" in value:
            return value["__repr__"]
        return {k: _decode(v) for k, v in value.items()}
    return value


def write_common(path: str, content: Dict[str, Any]) -> None:
    """Write ``common.json`` (``content`` and its checksum), atomically."""
    manifest.write_json_atomic(path, {"content": content, "sha256": manifest.json_digest(content)})


def _read_common(path: str) -> Dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode())
        content, digest = data["content"], data["sha256"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"{path} is corrupt or truncated ({type(e).__name__}: {e}); "
                           "restore it or load an older checkpoint.") from None
    if manifest.json_digest(content) != digest:
        raise RuntimeError(f"{path} is corrupt: its content does not match its checksum; "
                           "restore it or load an older checkpoint.")
    return content


def _resolve_load_path(load_dir: str, iteration: Optional[int]) -> str:
    if iteration is None and os.path.isfile(os.path.join(load_dir, COMMON_FILENAME)):
        return load_dir  # --load points at an iteration directory itself
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            raise RuntimeError(
                f"no {TRACKER_FILENAME} in {load_dir!r}; point --load at a directory written by --save."
            )
    path = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        # Killed between moving an older copy of this iteration aside and renaming the new one in.
        path = path + ".old"
    if not os.path.isdir(path):
        raise RuntimeError(
            f"{path} is missing: the tracker names iteration {iteration} but its directory is gone, so the "
            "checkpoint is incomplete; restore it or point the tracker at an older iteration."
        )
    return path


def load_common(load_dir: str, iteration: Optional[int] = None) -> Tuple[str, Dict[str, Any]]:
    """(checkpoint path, common.json contents with the arguments decoded) of the tracked
    (or given) iteration."""
    path = _resolve_load_path(load_dir, iteration)
    common_path = os.path.join(path, COMMON_FILENAME)
    if not os.path.isfile(common_path):
        raise RuntimeError(f"{common_path} is missing; the checkpoint at {path} is incomplete.")
    common = _read_common(common_path)
    common["args"] = _decode(common.get("args", {}))
    return path, common


# ----------------------------------------------------------------------------------------
# RNG states (tensors, lists and numbers only: loadable with weights_only=True)
# ----------------------------------------------------------------------------------------


def rng_state() -> Dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "random": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_filename(rank: int) -> str:
    return os.path.join(RNG_DIRNAME, f"rank_{rank:05d}.pt")


def _rerun_filename(rank: int) -> str:
    return os.path.join(RERUN_DIRNAME, f"rank_{rank:05d}.pt")


def _write_rank_file(tmp: str, name: str, content: Any) -> Dict[str, Dict[str, Any]]:
    """Write one rank's file of the checkpoint (fsynced); its entry for common.json."""
    path = os.path.join(tmp, name)
    with open(path, "wb") as f:
        torch.save(content, f)
        f.flush()
        os.fsync(f.fileno())
    return {name: dict(zip(("bytes", "sha256"), manifest.file_digest(path)))}


def _read_rank_file(path: str, name: str, expected: Optional[Dict[str, Any]], flag: str) -> Tuple[Any, Optional[str]]:
    """(content, None) or (None, error) for one rank's file, checked against its entry."""
    if expected is None:
        return None, None
    message = manifest.check_file(path, name, expected)
    if message:
        return None, message
    try:
        return torch.load(os.path.join(path, name), map_location="cpu", weights_only=True), None
    except Exception as e:  # a file that matches its checksum but does not parse
        return None, f"{os.path.join(path, name)} cannot be read ({e}); load with {flag}."


# ----------------------------------------------------------------------------------------
# Distributed helpers
# ----------------------------------------------------------------------------------------


def _comm(group=None) -> Comm:
    """The engine's agree helper (checkpoint errors) over ``group`` (None: the world), or a
    process of its own when there is no process group."""
    return Comm(no_dist=not dist.is_initialized(), group=group)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameter names the checkpoint uses (no DDP ``module.`` prefix)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _is_mfsdp(model) -> bool:
    return any(isinstance(m, FsdpModule) for m in model.modules())


def _engine_group(model, async_group=None):
    """Process group for the engine: the mesh's for MFSDP; the world for replicated models
    and under tensor or pipeline parallelism (the engine's mesh is then the data-parallel
    sub-mesh of one TP coordinate or stage)."""
    if async_group is not None:
        return async_group
    if not dist.is_initialized():
        return None

    if (_is_mfsdp(model) and parallel_state.get_tensor_model_parallel_world_size() == 1
            and parallel_state.get_pipeline_model_parallel_world_size() == 1):
        return None
    return dist.group.WORLD


def _pieces(model) -> Dict[str, Any]:
    """Pieces of global tensors (tensor and expert parallelism): saved and loaded as the global tensors."""
    return global_slices_by_name(model)


# ----------------------------------------------------------------------------------------
# Asynchronous saves and the exit signal
# ----------------------------------------------------------------------------------------


class _AsyncSaves:
    """The one asynchronous save that may be in flight, and its dedicated gloo group."""
    group = None
    pending: Optional[concurrent.futures.Future] = None
    executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
    description = ""


def _async_group(use_gloo: bool = True):
    """The asynchronous saves' own group: gloo, or with ``use_gloo`` False
    (--disable-gloo-process-groups) the default backend's (its collectives exchange Python
    objects only, which NCCL carries too)."""
    if _AsyncSaves.group is None and dist.is_initialized():
        # Collective: every rank reaches its first async save at the same iteration.
        _AsyncSaves.group = dist.new_group(backend="gloo" if use_gloo else None)
    return _AsyncSaves.group


def finalize_async_save() -> None:
    """Wait for the asynchronous save in flight (if any); re-raise its error."""
    future, _AsyncSaves.pending = _AsyncSaves.pending, None
    executor, _AsyncSaves.executor = _AsyncSaves.executor, None
    if future is not None:
        start = time.time()
        try:
            future.result()
        finally:
            executor.shutdown(wait=True)  # join the writer thread: nothing of the save outlives this call
        print_rank_0(f"> finished asynchronous save of {_AsyncSaves.description} "
                     f"(waited {time.time() - start:.1f} s)")


def release_async_save_group() -> None:
    """Forget the asynchronous saves' group (at shutdown): a group still referenced keeps its
    gloo worker threads after ``destroy_process_group``, and a later ``pretrain()`` in this
    process must not reuse a destroyed group."""
    _AsyncSaves.group = None


class _ExitSignal:
    received = False
    installed = False


def install_exit_signal_handler(sig: int = signal.SIGTERM) -> None:
    """Remember SIGTERM (as SLURM sends before preemption) instead of dying; the training
    loop polls :func:`exit_signal_received` once per iteration."""
    def handler(signum, frame):
        if not _ExitSignal.received:
            print(f"> rank {_rank()}: received signal {signal.Signals(signum).name}; "
                  "finishing the current iteration, then saving and exiting", file=sys.stderr, flush=True)
        _ExitSignal.received = True

    signal.signal(sig, handler)
    _ExitSignal.installed = True


def exit_signal_received() -> bool:
    """True on every rank as soon as any rank received the exit signal (collective)."""
    return any_rank(_ExitSignal.received)


# ----------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------


def save_checkpoint(
    iteration: int,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    opt_param_scheduler,
    args: argparse.Namespace,
    num_floating_point_operations_so_far: float = 0.0,
    *,
    consumed_train_samples: int = 0,
    rerun_state: Optional[Dict[str, Any]] = None,
) -> str:
    """Write ``<args.save>/iter_XXXXXXX`` from every rank, atomically, then the tracker.

    ``rerun_state``: the re-run state machine's ``state_dict`` (None: not saved). With
    ``args.async_save`` the state is staged in CPU memory and the write continues in the
    background; the tracker is updated when it completes. Returns the final path."""
    if not getattr(args, "save", None):
        raise ValueError("save_checkpoint needs --save DIR.")
    finalize_async_save()  # at most one save in flight
    root = args.save
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    use_async = bool(getattr(args, "async_save", False))
    module = _unwrap(model)

    error = None
    tokenizer = None
    if _rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            for name in os.listdir(root):  # leftovers of saves killed midway
                if name.startswith("iter_") and name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.makedirs(os.path.join(tmp, RNG_DIRNAME))
            if rerun_state is not None:
                os.makedirs(os.path.join(tmp, RERUN_DIRNAME))
        except OSError as e:
            error = f"cannot create the checkpoint directory {tmp!r}: {e}"
        if error is None:
            try:  # the tokenizer travels with the model (tokenizer_record.py)
                tokenizer = record_tokenizer(vars(args), tmp)
            except OSError as e:
                error = f"cannot copy the tokenizer's files into the checkpoint {tmp!r}: {e}"
    _comm().agree(error, OSError)

    # Per-rank RNG state, at the time of the call, and the re-run state machine's part.
    rank_entries = _write_rank_file(tmp, _rng_filename(_rank()), rng_state())
    if rerun_state is not None:
        rank_entries.update(_write_rank_file(tmp, _rerun_filename(_rank()), rerun_state["rank"]))

    common = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(iteration),
        "consumed_train_samples": int(consumed_train_samples),
        "data": {"consumed_train_samples": int(consumed_train_samples),
                 "global_batch_size": getattr(args, "global_batch_size", None)},
        "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far),
        "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
        # fp16 loss scaler (trainer-attached), so a resumed run keeps its scale.
        "grad_scaler": (optimizer.grad_scaler.state_dict()
                        if getattr(optimizer, "grad_scaler", None) is not None else None),
        "args": encode_args(dict(vars(args))),
        "use_mfsdp": _is_mfsdp(module),
        "world_size": _world(),
        "has_optimizer": optimizer is not None,
        "model_only": False,
        "tokenizer": tokenizer,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rerun_state_machine": rerun_state["common"] if rerun_state is not None else None,
    }
    group = _async_group(getattr(args, "use_gloo_process_groups", True)) if use_async else None
    result = engine.save_checkpoint(
        module, optimizer, tmp, process_group=_engine_group(module, group), overwrite=True, pieces=_pieces(module),
        async_save=use_async, extra_metadata={"iteration": int(iteration)},
    )
    if not use_async:
        _commit(root, iteration, tmp, final, common, rank_entries, group=None, retain=_retain(args))
        return final

    def finish() -> str:
        result.result()
        _commit(root, iteration, tmp, final, common, rank_entries, group=group, retain=_retain(args))
        return final

    executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron-async-save")
    _AsyncSaves.pending = executor.submit(finish)
    _AsyncSaves.executor = executor
    _AsyncSaves.description = f"iteration {iteration} to {final}"
    return final


def _commit_delay(iteration: int) -> float:
    """The test hook's pause: ``SECONDS`` (every save) or ``SECONDS@ITERATION``."""
    value = os.environ.get(COMMIT_DELAY_ENV, "").strip()
    if not value:
        return 0.0
    seconds, _, only = value.partition("@")
    if only and int(only) != iteration:
        return 0.0
    return float(seconds)


def _retain(args) -> Optional[int]:
    return getattr(args, "save_retain_interval", None)


def _commit(root: str, iteration: int, tmp: str, final: str, common: Dict[str, Any], rank_entries, group,
            retain: Optional[int] = None) -> None:
    """All data is in ``tmp``: write common.json, rename into place, update the tracker,
    then (--save-retain-interval) delete the previous checkpoint unless it is kept."""
    entries = {k: v for part in _comm(group).all_gather(rank_entries) for k, v in part.items()}
    if _rank() == 0:
        in_dir = lambda folder: {k: v for k, v in entries.items() if k.startswith(folder + os.sep)}
        common = dict(common, rng_files=in_dir(RNG_DIRNAME), rerun_files=in_dir(RERUN_DIRNAME))
        write_common(os.path.join(tmp, COMMON_FILENAME), common)
        manifest.fsync_dir(os.path.join(tmp, RNG_DIRNAME))
        if common["rerun_files"]:
            manifest.fsync_dir(os.path.join(tmp, RERUN_DIRNAME))
        manifest.fsync_dir(tmp)
        delay = _commit_delay(iteration)
        if delay > 0:
            print(f"> [test hook] checkpoint {tmp} complete; pausing {delay} s before the rename", flush=True)
            time.sleep(delay)
        old = final + ".old"
        if os.path.isdir(old):
            shutil.rmtree(old)
        if os.path.isdir(final):  # saving the same iteration again: keep the old copy until the swap
            os.replace(final, old)
        os.replace(tmp, final)
        manifest.fsync_dir(root)
        if os.path.isdir(old):
            shutil.rmtree(old)
        previous = read_tracker(root) if os.path.isfile(os.path.join(root, TRACKER_FILENAME)) else None
        write_tracker(root, iteration)
        prune_after_commit(root, previous, iteration, retain)
    _comm(group).barrier()


# ----------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------


def _model_mismatch(path: str, saved: Dict[str, Any], args: argparse.Namespace) -> Optional[str]:
    """What the tensors cannot show but the model depends on: the activation. The message
    names the flag that builds the checkpoint's model; None when they agree."""
    if not hasattr(args, "swiglu") or not any(k in saved for k in ("swiglu", "openai_gelu", "activation_func")):
        return None  # a caller without model flags (a tool), or a checkpoint that does not say
    theirs, ours = activation_from_args(saved), activation_from_args(vars(args))
    if theirs == ours:
        return None
    return (f"{path} holds a model with the {theirs} activation, but these flags build {ours}; "
            f"pass {ACTIVATION_FLAGS.get(theirs, theirs)} to build the checkpoint's model.")


def _same_layout(common: Dict[str, Any], args: argparse.Namespace) -> bool:
    """The checkpoint was saved by as many ranks in the same TP x PP layout (what the
    re-run state's per-rank parts need, as upstream)."""
    saved = common.get("args") or {}
    return (int(common.get("world_size", -1)) == _world()
            and all(saved.get(k, 1) == getattr(args, k, 1)
                    for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")))


# --dist-ckpt-strictness (choices: arguments.DIST_CKPT_STRICTNESS) -> (model tensor the
# checkpoint lacks, checkpoint tensor the model lacks). Upstream's names: "unexpected" keys
# are the ones the model asks for and the checkpoint lacks; "missing" keys the ones the
# checkpoint has and the model does not load.
# assume_ok_unexpected leaves unexpected keys to the storage layer, which raises on them.
# return_* return the keys from upstream's load(); there is no such caller here: they log.
_RAISE, _LOG, _IGNORE = engine.OnMismatch.RAISE, engine.OnMismatch.LOG, engine.OnMismatch.IGNORE
STRICTNESS = {
    "assume_ok_unexpected": (_RAISE, _IGNORE),
    "log_unexpected": (_LOG, _IGNORE),
    "log_all": (_LOG, _LOG),
    "raise_unexpected": (_RAISE, _IGNORE),
    "raise_all": (_RAISE, _RAISE),
    "return_unexpected": (_LOG, _IGNORE),
    "return_all": (_LOG, _LOG),
    "ignore_all": (_IGNORE, _IGNORE),
}


def load_checkpoint(
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    opt_param_scheduler,
    args: argparse.Namespace,
    *,
    load_optim: bool = True,
    load_rng: bool = True,
    rerun_state_machine=None,
) -> Tuple[int, int]:
    """Load ``args.load``'s latest checkpoint; returns (iteration, consumed_train_samples).

    ``rerun_state_machine``: restored from the checkpoint's state of it when the job has the
    checkpoint's world size and TP/PP layout (as upstream: else it is ignored, with a line).

    A directory without a tracker file means "start from scratch" (Megatron's behaviour),
    so one command line serves both the first run and its resumption. ``args.finetune``
    loads the model weights only and starts at iteration 0. Every file is checked on every
    rank before the model is touched; errors name the file or tensor at fault.
    """
    load_dir = getattr(args, "load", None)
    if not load_dir:
        return 0, 0
    if not os.path.isfile(os.path.join(load_dir, COMMON_FILENAME)) and read_tracker(load_dir) is None:
        print_rank_0(f"> no checkpoint in {load_dir} (no {TRACKER_FILENAME}); starting from scratch")
        return 0, 0
    finetune = bool(getattr(args, "finetune", False))

    path, common, error = None, None, None
    try:
        path, common = load_common(load_dir)
    except RuntimeError as e:
        error = str(e)
    _comm().agree(error)
    _comm().agree(_model_mismatch(path, common.get("args") or {}, args), ValueError)

    model_only = bool(common.get("model_only")) or finetune
    if model_only:
        load_optim = load_rng = False
    load_optim = load_optim and optimizer is not None
    if load_optim and not common.get("has_optimizer", True):
        _comm().agree(f"{path} holds no optimizer state; resume with --no-load-optim (or --finetune).", ValueError)

    # This rank's RNG file and re-run state, checked before anything changes.
    saved_rng, error = None, None
    if load_rng:
        rng_name = _rng_filename(_rank())
        saved_rng, error = _read_rank_file(path, rng_name, common.get("rng_files", {}).get(rng_name), "--no-load-rng")
    _comm().agree(error)
    rerun_state, error = None, None
    if rerun_state_machine is not None and not model_only and common.get("rerun_state_machine"):
        if _same_layout(common, args):
            rerun_name = _rerun_filename(_rank())
            mine, error = _read_rank_file(path, rerun_name, common.get("rerun_files", {}).get(rerun_name),
                                          "--rerun-mode disabled")
            rerun_state = {"common": common["rerun_state_machine"], "rank": mine} if mine is not None else None
        else:
            print_rank_0("> job sharding has changed (world size, TP or PP): the re-run state machine's state in "
                         "the checkpoint is ignored")
    _comm().agree(error)

    module = _unwrap(model)
    start = time.time()
    # Without the flag: raise_all, as before the flag existed (upstream's default,
    # assume_ok_unexpected, would skip checkpoint tensors the model lacks without a word).
    absent_from_checkpoint, absent_from_model = STRICTNESS[getattr(args, "dist_ckpt_strictness", None) or "raise_all"]
    try:
        engine.load_checkpoint(module, optimizer if load_optim else None, path,
                               process_group=_engine_group(module), pieces=_pieces(module),
                               absent_from_checkpoint=absent_from_checkpoint, absent_from_model=absent_from_model)
    except engine.OptimizerMismatchError as e:
        raise RuntimeError(f"{e} To load the model weights only, resume with --no-load-optim "
                           "(or --finetune to also restart at iteration 0).") from None
    except engine.CheckpointMismatchError as e:
        how = "with" if common.get("use_mfsdp") else "without"
        raise RuntimeError(f"{path} (saved {how} --use-mfsdp by {common.get('world_size', '?')} ranks) does not fit "
                           f"this model: {e} Compare the model flags with the checkpoint's common.json "
                           "(tools/checkpoint/inspect.py lists its tensors); --dist-ckpt-strictness log_all skips "
                           "tensors that only one side has (not different shapes).") from None

    print_rank_0(f"> loaded checkpoint {path} in {time.time() - start:.2f} s")
    if model_only:
        print_rank_0(f"> loaded model weights from {path} ("
                     + ("--finetune" if finetune else "a model-only checkpoint") + "): starting at iteration 0")
        return 0, 0
    if load_optim and opt_param_scheduler is not None and common.get("opt_param_scheduler") is not None:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    if load_optim and getattr(optimizer, "grad_scaler", None) is not None and common.get("grad_scaler"):
        optimizer.grad_scaler.load_state_dict(common["grad_scaler"])
    if rerun_state is not None:
        rerun_state_machine.load_state_dict(rerun_state)
    if load_rng:
        if saved_rng is not None:
            set_rng_state(saved_rng)
        saved_world = int(common.get("world_size", _world()))
        if saved_world != _world():
            print_rank_0(f"> the checkpoint was saved by {saved_world} ranks and this run has {_world()}: "
                         f"ranks >= {saved_world} keep their seeded RNG state")
    _comm().barrier()
    return int(common["iteration"]), int(common.get("consumed_train_samples", 0))
