"""Fault-tolerant HSDP on torchft: replica groups that die, continue and rejoin.

Each replica group is one torchrun job (``--ft-replica-group-id R`` of
``--ft-num-replica-groups G``). Inside it MFSDP shards over the group's own ranks; the
replica (outer) dimension of HSDP is torchft's ``Manager``:

* **Reduction.** ``ManagedReplicaReducer`` is the engine's ``replica_reducer``
  (``mfsdp_v2/replica.py``): on each step's last microbatch every reduced gradient shard
  is summed over the live groups on torchft's managed gloo group (group rank r of every
  group meets group rank r of the others) and divided by the live count.
* **Step.** ``start_step()`` runs torchft's quorum *synchronously* (``use_async_quorum=False``)
  at the step boundary, before the forward. ``should_commit()`` after the backward and the
  clipping says whether every rank of this group saw a healthy step; only then the
  optimizer, the LR scheduler, the iteration and the data position advance. An uncommitted
  step leaves weights and optimizer state as they were (the optimizer never ran), and the
  same batch is read again.
* **Recovery.** A group whose step is behind the quorum's (a restarted one) receives its
  peer's state from torchft's checkpoint transport: each group rank its own shards from the
  same rank of a healthy group (the groups have the same layout). Safe points only: the
  state is served by torchft's quorum thread while the main thread waits in ``start_step``
  (``_state`` copies it, so later in-place updates cannot reach what is being sent), and it
  is applied by the main thread, inside ``start_quorum``, before the forward. The state is
  the weights, the optimizer state, the LR scheduler, the counters and the RNG states
  (python, numpy, torch CPU and CUDA: ``checkpointing.rng_state``), so the recovered group
  draws the same dropout masks as its peer from then on (every rank is seeded alike,
  ``initialize.set_random_seed``; there is no separate TP RNG tracker in this trainer).
* **Test hook.** ``MEGATRON_FT_TEST_HOLD_SEND=PATH`` (set only by the tests): a group about
  to send its state holds inside the transfer (after the quorum that decided the recovery,
  with the recovering group waiting in torchft's ``recv_checkpoint``) until ``PATH`` exists,
  so a test can kill either side in that window deterministically. Once ``PATH`` exists
  later transfers do not hold.
* **Data.** Group R's data-parallel rank d reads as rank R x dp + d of G x dp (the ranks of
  one HSDP job of G x dp ranks). The data position is the committed steps' (nominal
  ``consumed``): a dead group's share of the steps it missed is never read (dropped, as
  torchtitan does); the samples actually trained on are torchft's committed batches x the
  group's batch (logged at each quorum change).

torchft is an optional dependency (``pip install .[ft]``): imported only here, only when
the ft flags are given.
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.mfsdp_v2.checkpoint.load import create_optimizer_state, sync_compute_weights
from megatron.core.distributed.weight_hash import local_weight_hashes
from megatron.training.checkpointing import rng_state, set_rng_state
from megatron.training.log_utils import print_rank_0
from megatron.training.user_errors import UserError

# torchft's own timeouts (collectives, should_commit, transfers; the quorum) when its
# TORCHFT_TIMEOUT_SEC / TORCHFT_QUORUM_TIMEOUT_SEC are not set.
DEFAULT_TIMEOUT = timedelta(seconds=60)
DEFAULT_QUORUM_TIMEOUT = timedelta(seconds=120)
_STATE_KEY = "megatron"
TEST_HOLD_SEND_ENV = "MEGATRON_FT_TEST_HOLD_SEND"  # the test hook (module doc)


class ManagedReplicaReducer:
    """``mfsdp_v2.replica.ReplicaReducer`` over a torchft ``Manager``: SUM on its managed
    process group; an error there is reported to the Manager (the step will not commit),
    not raised."""

    def __init__(self, manager) -> None:
        self.manager = manager

    def all_reduce_sum(self, tensor: torch.Tensor):
        return self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)

    def live_replicas(self) -> int:
        return self.manager.num_participants()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _snapshot(value: Any) -> Any:
    return _local(value).detach().clone() if isinstance(value, torch.Tensor) else value


class FaultTolerance:
    """One replica group's torchft Manager and the trainer's side of it (see the module doc)."""

    def __init__(self, args) -> None:
        from torchft import Manager, ProcessGroupGloo  # optional dependency: only with the ft flags

        self.args = args
        self.group_id, self.groups = args.ft_replica_group_id, args.ft_num_replica_groups
        timeout = _env_timeout("TORCHFT_TIMEOUT_SEC", DEFAULT_TIMEOUT)
        self.quorum_timeout = _env_timeout("TORCHFT_QUORUM_TIMEOUT_SEC", DEFAULT_QUORUM_TIMEOUT)
        self.min_groups = args.ft_min_replica_groups
        # torchft's Manager keeps its keys in the job's TCP store (MASTER_ADDR:MASTER_PORT,
        # set by torchrun and by the SLURM launch). A group of one process started without a
        # launcher has none (its world of one needs no rendezvous): it gets a store of its own.
        self._own_store = None
        store_addr, store_port = None, None
        if "MASTER_ADDR" not in os.environ and dist.get_world_size() == 1:
            self._own_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self._own_store.port
        self.manager = Manager(
            store_addr=store_addr, store_port=store_port,
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None, state_dict=None,  # registered by attach()
            min_replica_size=args.ft_min_replica_groups,
            use_async_quorum=False,  # quorum and recovery at the step boundary, never during the forward
            init_sync=False,  # every group draws the same initial weights (seeded by name)
            timeout=timeout,
            quorum_timeout=self.quorum_timeout,
            replica_id=f"megatron_ft_{self.group_id}",  # torchft reads the trailing digits as the group's index
            lighthouse_addr=args.ft_lighthouse,
            rank=dist.get_rank(), world_size=dist.get_world_size(),
        )
        self.reducer = ManagedReplicaReducer(self.manager)
        self.trainer = None
        self._participants: Optional[int] = None
        self._recovered = False
        self.group_batch = args.global_batch_size // self.groups

    # Wiring ------------------------------------------------------------------------------
    def attach(self, trainer, iteration: int) -> None:
        """Register the state callbacks on ``trainer`` (after any checkpoint load: torchft's
        step starts at ``iteration``, so groups resumed from the same checkpoint agree)."""
        self.trainer = trainer
        self.manager.load_state_dict({"step": iteration, "batches_committed": iteration * self.groups})
        self.manager.register_state_dict_fn(_STATE_KEY, self._load, self._state)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # The step ----------------------------------------------------------------------------
    def start_step(self) -> bool:
        """Join this step's quorum (blocking). Returns True when this group was just
        recovered from a peer (its counters and data position changed). Fewer live groups
        than --ft-min-replica-groups: wait for more, up to the quorum timeout, then a
        ``UserError`` (one line), rather than run steps that cannot commit."""
        self._recovered = False
        deadline, waiting = time.monotonic() + self.quorum_timeout.total_seconds(), False
        while True:
            try:
                self.manager.start_quorum()
                participants = self.manager.num_participants()
            except Exception as error:  # torchft's quorum RPC: a timeout, a lost lighthouse
                raise UserError(f"torchft quorum (lighthouse {self.args.ft_lighthouse}): "
                                f"{str(error).splitlines()[0][:200]}; is the lighthouse up, and were "
                                "the other replica groups started?") from error
            if participants >= self.min_groups:
                break
            if time.monotonic() > deadline:
                waited = self.quorum_timeout.total_seconds()
                raise UserError(f"only {participants} of the {self.min_groups} replica groups that "
                                f"--ft-min-replica-groups asks for joined within {waited:.0f} s "
                                "(TORCHFT_QUORUM_TIMEOUT_SEC); restart the missing groups or lower "
                                "--ft-min-replica-groups.")
            if not waiting:
                print_rank_0(f"ft: group {self.group_id}: quorum {participants} of {self.groups}, below "
                             f"--ft-min-replica-groups {self.min_groups}: waiting for more groups")
                waiting = True
            time.sleep(1.0)
        if participants != self._participants:
            print_rank_0(f"ft: group {self.group_id}: quorum {participants} of {self.groups} at step "
                         f"{self.manager.current_step()} ({self.manager.batches_committed() * self.group_batch}"
                         " samples trained so far)")
            self._participants = participants
        return self._recovered

    def should_commit(self) -> bool:
        """After backward and clipping, before the optimizer: may this step be applied?"""
        committed = self.manager.should_commit()
        if not committed:
            error = self.manager.errored()
            print_rank_0(f"ft: group {self.group_id}: step {self.trainer.iteration + 1} not committed "
                         f"(quorum {self.manager.num_participants()} of {self.groups}"
                         + (f", {str(error.original_exception).splitlines()[0][:160]}" if error else "")
                         + "): weights and optimizer state kept, the step is run again")
        return committed

    def log_weights(self, iteration: int) -> None:
        """``ft: step S, quorum Q of G, weights sha256 HEX`` (a collective of the group)."""
        digest = replica_weights_sha256(self.trainer.built.unwrapped, self.trainer.built.context)
        print_rank_0(f"ft: step {iteration}, quorum {self.manager.num_participants()} of {self.groups}, "
                     f"weights sha256 {digest}")
        print_rank_0(f"ft: step {iteration}, rng sha256 {replica_rng_sha256()}")

    # State moved to a recovering group ------------------------------------------------------
    def _state(self) -> Dict[str, Any]:
        """This rank's whole training state, copied (runs on torchft's quorum thread while
        the main thread waits in start_step; the copy is what the transport serves)."""
        t = self.trainer
        if dist.get_rank() == 0:
            print(f"ft: group {self.group_id}: sending state of step {t.iteration} to a recovering group",
                  flush=True)
        _hold_for_test(self.group_id)
        model = t.built.unwrapped
        optimizer = t.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {
            "model": {name: _snapshot(p) for name, p in model.named_parameters()},
            "buffers": {name: _snapshot(b) for name, b in model.named_buffers()},
            "optimizer_state": {i: {k: _snapshot(v) for k, v in optimizer.state[p].items()}
                                for i, p in enumerate(params) if optimizer.state.get(p)},
            "param_groups": [{k: _snapshot(v) for k, v in g.items() if k != "params"}
                             for g in optimizer.param_groups],
            "scheduler": t.scheduler.state_dict(),
            "iteration": t.iteration,
            "consumed": t.consumed,
            "rng": rng_state(),
        }

    def _load(self, state: Dict[str, Any]) -> None:
        """Apply a peer's state (main thread, inside start_step, before the forward)."""
        t = self.trainer
        model, optimizer = t.built.unwrapped, t.optimizer
        with torch.no_grad():
            for name, p in model.named_parameters():
                _local(p).copy_(state["model"][name])
            for name, b in model.named_buffers():
                _local(b).copy_(state["buffers"][name])
            params = [p for group in optimizer.param_groups for p in group["params"]]
            create_optimizer_state(optimizer, [params[i] for i in state["optimizer_state"]])
            for i, saved in state["optimizer_state"].items():
                current = optimizer.state[params[i]]
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor) and isinstance(current.get(key), torch.Tensor):
                        _local(current[key]).copy_(value)
                    else:
                        current[key] = value
            for group, saved in zip(optimizer.param_groups, state["param_groups"]):
                group.update(saved)
        sync_compute_weights(model)  # the compute copies follow the written main weights
        t.scheduler.load_state_dict(state["scheduler"])
        t.iteration, t.consumed = state["iteration"], state["consumed"]
        t.reposition_data()  # before the RNG: a new data iterator draws no training randomness (fork_rng)
        set_rng_state(state["rng"])
        self._recovered = True
        print_rank_0(f"ft: group {self.group_id}: recovered weights, optimizer state, RNG state and counters "
                     f"from a healthy group: continuing at step {t.iteration}")


def replica_weights_sha256(model: torch.nn.Module, context=None, group=None) -> str:
    """SHA-256 over every piece of the replica's weights: each rank hashes its pieces
    (``weight_hash.local_weight_hashes``), the group gathers them and hashes them in a fixed
    order (rank, then piece name). Equal on two replica groups of the same layout exactly
    when their weights are bitwise equal."""
    mine = sorted((repr(piece), digest) for piece, digest in local_weight_hashes(model, context).items())
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    total = hashlib.sha256()
    for rank, pieces in enumerate(everyone):
        for name, digest in pieces:
            total.update(f"{rank}:{name}:{digest}\n".encode())
    return total.hexdigest()


def replica_rng_sha256(group=None) -> str:
    """SHA-256 over every rank's RNG states (python, numpy, torch CPU, CUDA), in rank
    order: equal on two groups exactly when they will draw the same dropout masks."""
    state = rng_state()
    mine = hashlib.sha256(repr(state["random"]).encode())
    mine.update(state["numpy"][1].numpy().tobytes() + repr(state["numpy"][2:]).encode())
    for key in ("torch", "cuda"):
        if key in state:
            mine.update(state[key].numpy().tobytes())
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine.hexdigest(), group=group)
    return hashlib.sha256("\n".join(everyone).encode()).hexdigest()


def _hold_for_test(group_id: int) -> None:
    """The test hook (module doc): wait inside the state transfer until the file named by
    MEGATRON_FT_TEST_HOLD_SEND exists."""
    path = os.environ.get(TEST_HOLD_SEND_ENV)
    if not path or os.path.exists(path):
        return
    if dist.get_rank() == 0:
        print(f"ft: group {group_id}: holding the state transfer until {path} exists ({TEST_HOLD_SEND_ENV}, "
              "a test hook)", flush=True)
    while not os.path.exists(path):
        time.sleep(0.05)


def _env_timeout(name: str, default: timedelta) -> timedelta:
    value = os.environ.get(name)
    return timedelta(seconds=float(value)) if value else default
