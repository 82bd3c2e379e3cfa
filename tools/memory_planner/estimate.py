"""Memory and communication planner: what each strategy costs a rank, before building it.

Given the parameter shapes of each FSDP unit (``units_of(model, unit_modules)`` reads them
from a model object, which may live on ``meta``), ``plan(...)`` returns per rank:

* persistent bytes, under the engine's own names (``main_weight``, ``model_weight``,
  ``main_grad``, as ``FsdpContext.persistent_bytes()`` reports them) plus the optimizer
  state (Adam: two main-dtype states per main weight element);
* the transient peak: gathered units in flight, reduce buffers, and (given an
  ``ActivationShape``) saved activations with and without recompute;
* bytes sent per step by collective kind, as ``FsdpContext.counter`` counts them (the
  input a rank contributes to each collective); with tensor parallelism also the TP
  layers' collectives (``tp_all_reduce``, ``tp_all_gather``, ``tp_reduce_scatter``), with
  experts on several EP ranks the token dispatcher's ``all_to_all``.

Under tensor parallelism the units hold one TP rank's (TP-local) shapes and
``world_size`` is the data-parallel size (world / TP): the engine shards those plain
tensors over the DP sub-mesh only. Expert units (``UnitShapes.expert``, a MoE layer's
``mlp.experts``: E/EP experts' stacked weights) are laid out over the expert-data-parallel
mesh of ``world_size / ep_size`` ranks, every other unit over all ``world_size``; under
HSDP/HFSDP the experts' mesh is two-level like the dense one: the same ``outer_size``
replicas, each sharding over ``world_size / outer_size / ep_size`` ranks. Under TP the
expert units hold TP-local shapes too (fc1 column-split, fc2 row-split), and the MoE
layers' TP regions are counted with the dense layers' collectives.

Shard sizes come from the engine's ``FlatLayout``, so the persistent bytes and the FSDP
collective bytes are exact, and so are the TP bytes (they depend on shapes only; full
recompute's repeated ones included). The
all-to-all bytes of dropless routing depend on where tokens go: the plan gives the value
of uniform routing, which is exact for what a rank sends and, summed over an EP group,
for what it receives. Activations are an estimate (Korthikanti et al., 2022). DDP is
planned as torch's DDP: full weights, gradients and optimizer state, one all-reduce of
every gradient per step.

Under context parallelism of size C, ``world_size`` is the data-parallel size times C (the
engine shards over DP x CP ranks), the ``ActivationShape`` is one CP rank's (S / C tokens
of each sequence, ``cp_size`` C) and the plan adds the exchange's transient K/V buffers
(``cp_buffers``) and its bytes (``cp_send``, ``cp_all_gather``, ``cp_reduce_scatter``,
``cp_all_to_all``).

The activation and TP/MoE/CP traffic models are in ``estimate_activations.py``. Imports nothing but the engine's layout; no trainer or model code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .estimate_activations import (
    ActivationShape, MoEShape, activation_bytes, all_to_all_bytes, context_parallel_buffer_bytes,
    context_parallel_bytes, tensor_parallel_bytes)
from megatron.core.distributed.mfsdp_v2.layout import FlatLayout

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp", "hfsdp")
ADAM_STATES = 2  # exp_avg and exp_avg_sq, in the main dtype


@dataclasses.dataclass(frozen=True)
class UnitShapes:
    """One FSDP unit: the shapes of the parameters it owns, in the engine's order."""

    name: str
    shapes: Tuple[torch.Size, ...]
    is_root: bool = False
    expert: bool = False  # sharded over the expert-data-parallel mesh (world_size / ep_size)
    # Per shape: replicated over TP (norms, row-parallel biases, position embeddings); under
    # sequence parallelism their gradients are summed over TP once per step. Empty: none.
    tp_replicated: Tuple[bool, ...] = ()

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclasses.dataclass
class Plan:
    strategy: str
    world_size: int
    persistent: Dict[str, int]
    transient: Dict[str, int]
    comm_bytes: Dict[str, int]  # kind -> bytes this rank contributes per step

    @property
    def persistent_total(self) -> int:
        return sum(self.persistent.values())

    def peak(self, recompute: bool = False) -> int:
        """Persistent plus the transient peak (with or without full recompute)."""
        skip = "activations" if recompute else "activations_full_recompute"
        return self.persistent_total + sum(v for k, v in self.transient.items() if k != skip)


def units_of(model: nn.Module, unit_modules: Sequence[nn.Module], expert_modules: Sequence[nn.Module] = (),
             tp_split: Sequence[torch.Tensor] = ()) -> List[UnitShapes]:
    """Shapes owned by each unit: its parameters not under a nested unit, each tied
    parameter once, in the order ``fully_shard`` packs them. ``unit_modules`` lists the
    modules to be wrapped, children before parents (as they are passed to fully_shard);
    those also in ``expert_modules`` are expert units. ``tp_split``: the parameters split
    over TP (every other one is replicated over TP)."""
    unit_ids = {id(m) for m in unit_modules}
    expert_ids = {id(m) for m in expert_modules}
    split_ids = {id(p) for p in tp_split}
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for unit in unit_modules:
        seen, shapes, replicated = set(), [], []
        stack = [unit]
        while stack:
            module = stack.pop()
            for param in module._parameters.values():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    shapes.append(param.shape)
                    replicated.append(id(param) not in split_ids)
            stack.extend(c for c in reversed(list(module._modules.values()))
                         if c is not None and id(c) not in unit_ids)
        out.append(UnitShapes(names.get(id(unit), type(unit).__name__), tuple(shapes), unit is model,
                              id(unit) in expert_ids, tuple(replicated) if split_ids else ()))
    return out


def plan(units: Sequence[UnitShapes], strategy: str, world_size: int, *, outer_size: int = 1,
         microbatches: int = 1, compute_bytes: int = 4, main_bytes: int = 4, grad_bytes: Optional[int] = None,
         comm_bytes: Optional[int] = None, rank: int = 0,
         activations: Optional[ActivationShape] = None, moe: Optional[MoEShape] = None,
         activations_in_flight: int = 1) -> Plan:
    """The plan of ``strategy`` at ``world_size`` data-parallel ranks (``outer_size``
    replicas for HSDP/HFSDP).

    ``grad_bytes`` defaults to ``compute_bytes`` and ``comm_bytes`` to ``grad_bytes`` (the
    engine's MixedPrecisionPolicy defaults). ``rank`` is the rank in the (outer, inner)
    data-parallel mesh: shards are padded to one size, but the optimizer states cover only
    a rank's own rows, and HFSDP's outer shards differ between ranks. ``activations``
    (with its TP size) adds the activation estimate and the TP collectives; ``moe`` (with
    ``activations``) the all-to-all bytes, and lays the expert units out over
    ``world_size / moe.ep_size`` ranks. ``activations_in_flight``: how many microbatches'
    activations a rank holds at once (a pipeline stage's schedule; 1 without pipelining)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    hybrid = strategy in ("hsdp", "hfsdp")
    if hybrid and (outer_size < 2 or world_size % outer_size):
        raise ValueError(f"{strategy} needs an outer size >= 2 that divides the world size {world_size}; "
                         f"got {outer_size}.")
    if not hybrid and outer_size != 1:
        raise ValueError(f"outer_size applies to hsdp/hfsdp only; {strategy} shards over all {world_size} ranks.")
    ep = moe.ep_size if moe is not None else 1
    inner = world_size // outer_size
    if any(u.expert for u in units) and inner % ep:
        raise ValueError(f"expert units need an EP size ({ep}) that divides the data-parallel size of one "
                         f"instance ({inner} = {world_size} / {outer_size} replicas); choose such an EP size.")
    grad_bytes = compute_bytes if grad_bytes is None else grad_bytes
    comm_bytes = grad_bytes if comm_bytes is None else comm_bytes
    inner_rank, outer_rank = rank % inner, rank // inner
    mb = microbatches
    alias = compute_bytes == main_bytes
    persistent = dict(main_weight=0, model_weight=0, main_grad=0, optimizer_state=0)
    comm: Dict[str, int] = {}
    gathered: List[int] = []  # bytes of each unit's gathered weights
    reduce_inputs: List[int] = []  # bytes of each unit's gradients in gathered layout
    tp_replicated_grads = 0  # elements of this rank's gradients of TP-replicated parameters

    def send(kind: str, nbytes: int) -> None:
        comm[kind] = comm.get(kind, 0) + nbytes

    for unit in units:
        T = unit.numel
        if strategy == "ddp":
            persistent["model_weight"] += T * compute_bytes
            persistent["main_grad"] += T * grad_bytes
            persistent["optimizer_state"] += ADAM_STATES * T * compute_bytes
            send("all_reduce", T * comm_bytes)
            tp_replicated_grads += sum(math.prod(s) for s, r in zip(unit.shapes, unit.tp_replicated) if r)
            continue
        # Experts: EP ranks r, r + ep, ... of an instance hold the same experts; under
        # HSDP/HFSDP their outer axis is the dense one (expert_parallel.py's expert mesh).
        shards, shard = (inner // ep, inner_rank // ep) if unit.expert else (inner, inner_rank)
        layout = FlatLayout(unit.shapes, shards)
        S, G = layout.shard_numel, layout.gathered_numel
        optim, optim_used = S, layout.used_numel(shard)
        optim_layout, optim_shard = layout, shard
        if strategy == "zero1":
            persistent.update(main_weight=persistent["main_weight"] + S * main_bytes,
                              model_weight=persistent["model_weight"] + T * compute_bytes,
                              main_grad=persistent["main_grad"] + (shards * S + S) * grad_bytes)
            send("reduce_scatter", G * comm_bytes)
            send("all_gather", S * compute_bytes)
        elif strategy == "zero2":
            persistent.update(main_weight=persistent["main_weight"] + S * main_bytes,
                              model_weight=persistent["model_weight"] + T * compute_bytes,
                              main_grad=persistent["main_grad"] + S * grad_bytes)
            send("reduce_scatter", mb * G * comm_bytes)
            send("all_gather", S * compute_bytes)
            reduce_inputs.append(G * comm_bytes)
        else:  # ZeRO-3 on the inner axis (zero3, hsdp, hfsdp)
            gathers = mb * (1 if unit.is_root else 2)
            send("all_gather", gathers * S * compute_bytes)
            send("reduce_scatter", mb * G * comm_bytes)
            gathered.append(G * compute_bytes)
            reduce_inputs.append(G * comm_bytes)
            grads = S
            if strategy == "hsdp":
                send("all_reduce", S * comm_bytes)
            elif strategy == "hfsdp":
                outer_layout = _outer_layout(layout, shard, outer_size)
                So = outer_layout.shard_numel
                optim, optim_used, grads = So, outer_layout.used_numel(outer_rank), S + So
                optim_layout, optim_shard = outer_layout, outer_rank
                send("reduce_scatter", outer_size * So * comm_bytes)
                send("all_gather", So * compute_bytes)
            persistent["main_weight"] += optim * main_bytes
            if strategy == "hfsdp":
                persistent["model_weight"] += S * compute_bytes
            elif not alias:
                persistent["model_weight"] += S * compute_bytes
            persistent["main_grad"] += grads * grad_bytes
        persistent["optimizer_state"] += ADAM_STATES * optim_used * main_bytes
        tp_replicated_grads += _replicated_grad_numel(unit, layout, shard, optim_layout, optim_shard)

    transient = {}
    if strategy == "ddp":
        # Torch DDP's gradient buckets (25 MiB each, two in flight).
        transient["reduce_buffers"] = min(2 * 25 * 2**20, sum(u.numel for u in units) * comm_bytes)
    else:
        # ZeRO-3: the root stays gathered through forward and backward; next to it, the
        # unit that computes and the one being prefetched.
        root = sum(g for g, u in zip(gathered, units) if u.is_root)
        others = sorted((g for g, u in zip(gathered, units) if not u.is_root), reverse=True)
        transient["gathered_units"] = root + sum(others[:2])
        # One reduction in flight plus the unit whose reduction is being filled.
        transient["reduce_buffers"] = sum(sorted(reduce_inputs, reverse=True)[:2])
    if activations is not None:
        transient["activations"] = activations_in_flight * activation_bytes(activations, moe=moe)
        transient["activations_full_recompute"] = activations_in_flight * activation_bytes(activations, "full", moe)
        for kind, nbytes in tensor_parallel_bytes(activations, mb, tp_replicated_grads, moe).items():
            send(kind, nbytes)
        if moe is not None:
            for kind, nbytes in all_to_all_bytes(activations, moe, mb).items():
                send(kind, nbytes)
        if activations.cp_size > 1:
            transient["cp_buffers"] = context_parallel_buffer_bytes(activations)
            for kind, nbytes in context_parallel_bytes(activations, mb).items():
                send(kind, nbytes)
    return Plan(strategy, world_size, persistent, transient, comm)


def _replicated_grad_numel(unit: UnitShapes, layout: FlatLayout, shard: int, optim_layout: FlatLayout,
                           optim_shard: int) -> int:
    """Elements of this rank's ``.grad`` (the optimizer's rows) of the unit's TP-replicated
    parameters: what sequence parallelism all-reduces over TP."""
    if not any(unit.tp_replicated):
        return 0
    if optim_layout is layout:
        index_of = list(range(len(unit.shapes)))
    else:  # HFSDP: the outer layout's tensors are the inner shard's pieces
        index_of = [pc.index for pc in layout.pieces_by_shard[shard]]
    total = 0
    for j, shape in enumerate(optim_layout.shapes):
        if not unit.tp_replicated[index_of[j]]:
            continue
        if optim_layout.replicated[j]:
            total += 1
        else:
            start, end, _ = optim_layout.local_piece(j, optim_shard)
            total += (end - start) * math.prod(shape[1:])
    return total


def _outer_layout(layout: FlatLayout, inner_rank: int, outer_size: int) -> FlatLayout:
    """HFSDP: this inner shard's pieces, laid out again over the outer axis."""
    shapes = [
        torch.Size(()) if layout.replicated[pc.index]
        else torch.Size((pc.row_end - pc.row_start,) + tuple(layout.shapes[pc.index][1:]))
        for pc in layout.pieces_by_shard[inner_rank]
    ]
    return FlatLayout(shapes, outer_size)


def format_plans(plans: Sequence[Plan]) -> str:
    """A table, one strategy per row, in MiB per rank."""
    mib = lambda n: f"{n / 2**20:10.1f}"  # noqa: E731
    head = (f"{'strategy':9s} {'main_w':>10s} {'model_w':>10s} {'main_grad':>10s} {'optim':>10s} {'persist':>10s} "
            f"{'gathered':>10s} {'reduce':>10s} {'act':>10s} {'act_rc':>10s} {'peak':>10s} {'peak_rc':>10s}  sent/step")
    rows = [head]
    for p in plans:
        t = p.transient
        comm = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(p.comm_bytes.items()))
        rows.append(
            f"{p.strategy:9s} {mib(p.persistent['main_weight'])} {mib(p.persistent['model_weight'])} "
            f"{mib(p.persistent['main_grad'])} {mib(p.persistent['optimizer_state'])} {mib(p.persistent_total)} "
            f"{mib(t.get('gathered_units', 0))} {mib(t.get('reduce_buffers', 0))} {mib(t.get('activations', 0))} "
            f"{mib(t.get('activations_full_recompute', 0))} {mib(p.peak())} {mib(p.peak(recompute=True))}  {comm}"
        )
    return "\n".join(rows)
