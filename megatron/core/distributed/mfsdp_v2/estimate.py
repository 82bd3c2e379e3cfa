"""Memory and communication planner: what each strategy costs a rank, before building it.

Given the parameter shapes of each FSDP unit (``units_of(model, unit_modules)`` reads them
from a model object, which may live on ``meta``), ``plan(...)`` returns per rank:

* persistent bytes, under the engine's own names (``main_weight``, ``model_weight``,
  ``main_grad``, as ``FsdpContext.persistent_bytes()`` reports them) plus the optimizer
  state (Adam: two main-dtype states per main weight element);
* the transient peak: gathered units in flight, reduce buffers, and (given an
  ``ActivationShape``) saved activations with and without recompute;
* bytes sent per step by collective kind, as ``FsdpContext.counter`` counts them (the
  input a rank contributes to each collective).

Shard sizes come from the engine's ``FlatLayout``, so the persistent bytes and the
collective bytes are exact; activations are an estimate (Korthikanti et al., 2022, for a
transformer layer without tensor parallelism). DDP is planned as torch's DDP: full
weights, gradients and optimizer state, one all-reduce of every gradient per step.

Imports nothing but the engine's layout; no trainer or model code.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .layout import FlatLayout

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp", "hfsdp")
ADAM_STATES = 2  # exp_avg and exp_avg_sq, in the main dtype


@dataclasses.dataclass(frozen=True)
class UnitShapes:
    """One FSDP unit: the shapes of the parameters it owns, in the engine's order."""

    name: str
    shapes: Tuple[torch.Size, ...]
    is_root: bool = False

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclasses.dataclass(frozen=True)
class ActivationShape:
    """What one microbatch's activations depend on."""

    micro_batch_size: int
    seq_length: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_layers: int
    vocab_size: int
    element_bytes: int = 4


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


def units_of(model: nn.Module, unit_modules: Sequence[nn.Module]) -> List[UnitShapes]:
    """Shapes owned by each unit: its parameters not under a nested unit, each tied
    parameter once, in the order ``fully_shard`` packs them. ``unit_modules`` lists the
    modules to be wrapped, children before parents (as they are passed to fully_shard)."""
    unit_ids = {id(m) for m in unit_modules}
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for unit in unit_modules:
        seen, shapes = set(), []
        stack = [unit]
        while stack:
            module = stack.pop()
            for param in module._parameters.values():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    shapes.append(param.shape)
            stack.extend(c for c in reversed(list(module._modules.values()))
                         if c is not None and id(c) not in unit_ids)
        out.append(UnitShapes(names.get(id(unit), type(unit).__name__), tuple(shapes), unit is model))
    return out


def activation_bytes(shape: ActivationShape, recompute: Optional[str] = None) -> int:
    """Saved activations of one microbatch's forward, per rank.

    Per layer, 34*s*b*h + 5*a*s^2*b elements in 16-bit units (attention scores, softmax and
    dropout account for the second term); scaled to ``element_bytes``. Selective recompute
    drops the attention core's share; full recompute keeps one layer input per layer plus
    one layer's activations rebuilt during backward. The output logits (and their softmax)
    are kept in fp32 either way."""
    s, b, h, a = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.num_attention_heads
    scale = shape.element_bytes / 2
    # 34 s b h assumes ffn = 4h; the MLP's share (19 of the 34) scales with ffn / 4h.
    dense = int((15 + 19 * shape.ffn_hidden_size / (4 * h)) * s * b * h * scale)
    core = int(5 * a * s * s * b * scale)
    logits = 2 * b * s * shape.vocab_size * 4
    if recompute == "full":
        return shape.num_layers * s * b * h * shape.element_bytes + dense + core + logits
    if recompute == "selective":
        return shape.num_layers * dense + core + logits
    return shape.num_layers * (dense + core) + logits


def plan(units: Sequence[UnitShapes], strategy: str, world_size: int, *, outer_size: int = 1,
         microbatches: int = 1, compute_bytes: int = 4, main_bytes: int = 4, grad_bytes: Optional[int] = None,
         comm_bytes: Optional[int] = None, rank: int = 0,
         activations: Optional[ActivationShape] = None) -> Plan:
    """The plan of ``strategy`` at ``world_size`` ranks (``outer_size`` replicas for HSDP/HFSDP).

    ``grad_bytes`` defaults to ``compute_bytes`` and ``comm_bytes`` to ``grad_bytes`` (the
    engine's MixedPrecisionPolicy defaults). ``rank`` is the rank in the (outer, inner)
    mesh: shards are padded to one size, but the optimizer states cover only a rank's
    own rows, and HFSDP's outer shards differ between ranks."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    hybrid = strategy in ("hsdp", "hfsdp")
    if hybrid and (outer_size < 2 or world_size % outer_size):
        raise ValueError(f"{strategy} needs an outer size >= 2 that divides the world size {world_size}; "
                         f"got {outer_size}.")
    if not hybrid and outer_size != 1:
        raise ValueError(f"outer_size applies to hsdp/hfsdp only; {strategy} shards over all {world_size} ranks.")
    grad_bytes = compute_bytes if grad_bytes is None else grad_bytes
    comm_bytes = grad_bytes if comm_bytes is None else comm_bytes
    inner = world_size // outer_size
    inner_rank, outer_rank = rank % inner, rank // inner
    mb = microbatches
    alias = compute_bytes == main_bytes
    persistent = dict(main_weight=0, model_weight=0, main_grad=0, optimizer_state=0)
    comm: Dict[str, int] = {}
    gathered: List[int] = []  # bytes of each unit's gathered weights
    reduce_inputs: List[int] = []  # bytes of each unit's gradients in gathered layout

    def send(kind: str, nbytes: int) -> None:
        comm[kind] = comm.get(kind, 0) + nbytes

    for unit in units:
        T = unit.numel
        if strategy == "ddp":
            persistent["model_weight"] += T * compute_bytes
            persistent["main_grad"] += T * grad_bytes
            persistent["optimizer_state"] += ADAM_STATES * T * compute_bytes
            send("all_reduce", T * comm_bytes)
            continue
        layout = FlatLayout(unit.shapes, inner)
        S, G = layout.shard_numel, layout.gathered_numel
        optim, optim_used = S, layout.used_numel(inner_rank)
        if strategy == "zero1":
            persistent.update(main_weight=persistent["main_weight"] + S * main_bytes,
                              model_weight=persistent["model_weight"] + T * compute_bytes,
                              main_grad=persistent["main_grad"] + (inner * S + S) * grad_bytes)
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
                outer_layout = _outer_layout(layout, inner_rank, outer_size)
                So = outer_layout.shard_numel
                optim, optim_used, grads = So, outer_layout.used_numel(outer_rank), S + So
                send("reduce_scatter", outer_size * So * comm_bytes)
                send("all_gather", So * compute_bytes)
            persistent["main_weight"] += optim * main_bytes
            if strategy == "hfsdp":
                persistent["model_weight"] += S * compute_bytes
            elif not alias:
                persistent["model_weight"] += S * compute_bytes
            persistent["main_grad"] += grads * grad_bytes
        persistent["optimizer_state"] += ADAM_STATES * optim_used * main_bytes

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
        transient["activations"] = activation_bytes(activations)
        transient["activations_full_recompute"] = activation_bytes(activations, "full")
    return Plan(strategy, world_size, persistent, transient, comm)


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
