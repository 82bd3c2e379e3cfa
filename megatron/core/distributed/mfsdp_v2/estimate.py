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
    expert: bool = False  # sharded over the expert-data-parallel mesh (world_size / ep_size)
    # Per shape: replicated over TP (norms, row-parallel biases, position embeddings); under
    # sequence parallelism their gradients are summed over TP once per step. Empty: none.
    tp_replicated: Tuple[bool, ...] = ()

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
    tp_size: int = 1
    sequence_parallel: bool = False
    # Full recompute runs these layers' forward again in backward, in checkpointed chunks;
    # ``recomputed_dense_chunk_ends``: chunks whose last layer has a dense MLP.
    recomputed_layers: int = 0
    recomputed_dense_chunk_ends: int = 0
    hidden_dropout: float = 0.0


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The routed layers of a mixture-of-experts model."""

    num_moe_layers: int
    num_experts: int
    topk: int
    ep_size: int = 1
    recomputed_moe_layers: int = 0  # of them, under full recompute
    # What the layer's TP regions carry besides the tokens (moe_layer.py, router.py): the
    # router's probabilities ``[b*s, E]`` (in the router's dtype; None: the activations'),
    # a shared expert (a dense TP MLP), and under sequence parallelism the router losses'
    # all-reduces over TP.
    router_bytes: Optional[int] = None
    shared_expert_ffn: int = 0  # the shared expert's width; 0: none
    # For the activation estimate: the experts' width (0: not modelled, a dense MLP is
    # assumed), SwiGLU experts, experts with biases.
    ffn_hidden_size: int = 0
    gated: bool = False
    biased: bool = False
    aux_loss: bool = False
    z_loss: bool = False


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


def activation_bytes(shape: ActivationShape, recompute: Optional[str] = None,
                     moe: Optional[MoEShape] = None) -> int:
    """Saved activations of one microbatch's forward, per rank.

    Per layer, 34*s*b*h + 5*a*s^2*b elements in 16-bit units (attention scores, softmax and
    dropout account for the second term); scaled to ``element_bytes``. Selective recompute
    drops the attention core's share; full recompute keeps one layer input per layer plus
    one layer's activations rebuilt during backward. The output logits (and their softmax)
    are kept in fp32 either way. Under T-way TP the attention and MLP internals (8 + 16 of
    the 34 at ffn = 4h), the core and the logits are 1/T; the layer inputs, norms and
    dropout masks too with sequence parallelism, else they are whole on every rank.

    A MoE layer (``moe`` with ``moe.ffn_hidden_size``) has, instead of the MLP's share, per
    token in the same 16-bit units: the router's input and the dropout mask (3h, split
    with SP), its logits' softmax and routing map (3E), the k dispatched rows and the k
    expert outputs kept for the router weights' gradient (4kh, 6kh with biases; whole on
    every TP rank: the tokens are gathered before the dispatch), and per row what the
    experts' fc1 and activation keep (6 ffn_e, 10 ffn_e SwiGLU, split by TP).
    Uniform routing; a shared expert adds a dense MLP of its width. An estimate like the
    rest (within 10% of the saved tensors of a MoE layer's forward), not a count."""
    s, b, h, a = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.num_attention_heads
    t, sp = shape.tp_size, shape.sequence_parallel
    scale = shape.element_bytes / 2
    seq_split = t if sp else 1

    def mlp_units(ffn: int) -> float:  # 34 s b h assumes ffn = 4h; the MLP's 19 scale with ffn / 4h
        ratio = ffn / (4 * h)
        return 16 * ratio / t + 3 * ratio / seq_split

    attention = 8 / t + 7 / seq_split
    dense = int((attention + mlp_units(shape.ffn_hidden_size)) * s * b * h * scale)
    routed, n_moe = dense, 0
    if moe is not None and moe.ffn_hidden_size:
        k, e = moe.topk, moe.num_experts
        rows = 6 if moe.biased else 4  # the dispatched rows, the outputs (and the biased fc2's sum)
        per_row_ffn = k * moe.ffn_hidden_size * (10 if moe.gated else 6) / t
        experts = (3 * h / seq_split + 3 * e + rows * k * h + per_row_ffn) / h
        shared = mlp_units(moe.shared_expert_ffn) if moe.shared_expert_ffn else 0
        routed, n_moe = int((attention + experts + shared) * s * b * h * scale), moe.num_moe_layers
    layers = (shape.num_layers - n_moe) * dense + n_moe * routed
    core = int(5 * a * s * s * b * scale / t)
    logits = 2 * b * s * shape.vocab_size * 4 // t
    layer_input = s * b * h * shape.element_bytes // seq_split
    rebuilt = max(dense if n_moe < shape.num_layers else 0, routed if n_moe else 0)  # one layer, in backward
    if recompute == "full":
        return shape.num_layers * layer_input + rebuilt + core + logits
    if recompute == "selective":
        return layers + core + logits
    return layers + shape.num_layers * core + logits


def tensor_parallel_bytes(shape: ActivationShape, microbatches: int = 1,
                          replicated_grad_numel: int = 0, moe: Optional[MoEShape] = None) -> Dict[str, int]:
    """Bytes a rank contributes per step to the TP layers' collectives (all inputs, as the
    counter counts them), for ``microbatches`` forwards and backwards.

    Each microbatch: every layer's two row-parallel outputs (attention projection, fc2)
    reduce forward and its two column-parallel inputs (QKV, fc1) backward; the vocab-parallel
    embedding reduces forward and the output layer's input gradient backward; the loss
    all-reduces three fp32 ``[b, s]`` tensors (max, target logit, sum of exponentials).
    Without sequence parallelism each reduction is an all-reduce of ``[b, s, h]``; with it,
    an all-gather of the rank's ``[b, s/T, h]`` chunk where the sequence enters a TP region
    and a reduce-scatter of ``[b, s, h]`` where it leaves (the backward swaps the two), and
    after the last microbatch the gradients of the TP-replicated parameters
    (``replicated_grad_numel`` elements of this rank, fp32) are all-reduced once.

    A layer that full recompute runs again issues its forward collectives again, except
    that torch's non-reentrant checkpoint stops once backward has all it saved: without
    hidden dropout (whose mask needs it) nothing needs the output of a chunk's last
    reduction (fc2's), so the chunk's dense last layer skips it.

    A MoE layer (``moe``) enters and leaves its TP region where the dense MLP does, with
    the same ``[b, s, h]`` reductions, and adds (``moe_tensor_parallel_bytes``) the
    router's probabilities and, under sequence parallelism, its routing map and losses."""
    t = shape.tp_size
    if t == 1:
        return {}
    if moe is not None and moe.recomputed_moe_layers:
        raise ValueError("the TP collectives of MoE layers under full recompute are not modelled; "
                         "plan MoE with TP without --recompute-granularity full.")
    tokens = shape.micro_batch_size * shape.seq_length
    act = tokens * shape.hidden_size * shape.element_bytes
    loss = 3 * tokens * 4
    # The layers' four, the embedding's and the output layer's; recompute's again.
    per_microbatch = 4 * shape.num_layers + 2
    skipped = 0 if shape.hidden_dropout else shape.recomputed_dense_chunk_ends
    again = 2 * shape.recomputed_layers - skipped  # reductions; the gathers all run again
    if not shape.sequence_parallel:
        out = {"tp_all_reduce": microbatches * ((per_microbatch + again) * act + loss)}
    else:
        out = {
            "tp_all_gather": microbatches * (per_microbatch + 2 * shape.recomputed_layers) * act // t,
            "tp_reduce_scatter": microbatches * (per_microbatch + again) * act,
            "tp_all_reduce": microbatches * loss + replicated_grad_numel * 4,
        }
    if moe is not None:
        for kind, nbytes in moe_tensor_parallel_bytes(shape, moe).items():
            out[kind] += microbatches * nbytes
    return out


def moe_tensor_parallel_bytes(shape: ActivationShape, moe: MoEShape) -> Dict[str, int]:
    """What one microbatch's MoE layers send over TP beyond a dense MLP's two reductions.

    Without sequence parallelism the probabilities enter through a copy, whose backward
    all-reduces their ``[b*s, E]`` gradient. With it, each rank's chunk of the
    probabilities and of the routing map (uint8, no gradient) is gathered, the
    probabilities' gradient reduce-scattered back, and the router's losses all-reduce
    over TP what they log (the load-balancing loss: the E int64 token counts and the fp32
    loss; the z-loss: its fp32 value). A shared expert is a dense TP MLP: two more."""
    t, tokens = shape.tp_size, shape.micro_batch_size * shape.seq_length
    act = tokens * shape.hidden_size * shape.element_bytes
    probs = tokens * moe.num_experts * (moe.router_bytes or shape.element_bytes)
    shared = 2 * act if moe.shared_expert_ffn else 0
    n = moe.num_moe_layers
    if not shape.sequence_parallel:
        return {"tp_all_reduce": n * (probs + shared)}
    losses = (8 * moe.num_experts + 4 if moe.aux_loss else 0) + (4 if moe.z_loss else 0)
    return {
        "tp_all_gather": n * (probs + tokens * moe.num_experts + shared) // t,
        "tp_reduce_scatter": n * (probs + shared),
        "tp_all_reduce": n * losses,
    }


def all_to_all_bytes(shape: ActivationShape, moe: MoEShape, microbatches: int = 1) -> Dict[str, int]:
    """Bytes a rank contributes per step to the token dispatcher's all-to-alls (EP > 1),
    under uniform routing. Each MoE layer and microbatch: forward, the tokens per expert
    (E int64), the k rows of every token and their router weights to their experts, and
    the experts' rows back; backward, the same rows and weights reversed. What a rank sends
    forward (T*k rows and weights, T = b*s tokens) is exact; what it receives (the combine's
    forward and the dispatch's backward input) depends on the routing and equals T*k rows
    only in expectation, or summed over the EP group. Capacity dropping sends fewer rows.
    A layer that full recompute runs again repeats its forward exchanges, all of them:
    unlike a dense layer's last reduction (``tensor_parallel_bytes``), the combine's
    output feeds the un-permutation, whose index backward keeps."""
    if moe.ep_size == 1:
        return {}
    rows = shape.micro_batch_size * shape.seq_length * moe.topk
    forward = moe.num_experts * 8 + rows * (2 * shape.hidden_size + 1) * shape.element_bytes
    backward = rows * (2 * shape.hidden_size + 1) * shape.element_bytes
    per_microbatch = moe.num_moe_layers * (forward + backward) + moe.recomputed_moe_layers * forward
    return {"all_to_all": microbatches * per_microbatch}


def plan(units: Sequence[UnitShapes], strategy: str, world_size: int, *, outer_size: int = 1,
         microbatches: int = 1, compute_bytes: int = 4, main_bytes: int = 4, grad_bytes: Optional[int] = None,
         comm_bytes: Optional[int] = None, rank: int = 0,
         activations: Optional[ActivationShape] = None, moe: Optional[MoEShape] = None) -> Plan:
    """The plan of ``strategy`` at ``world_size`` data-parallel ranks (``outer_size``
    replicas for HSDP/HFSDP).

    ``grad_bytes`` defaults to ``compute_bytes`` and ``comm_bytes`` to ``grad_bytes`` (the
    engine's MixedPrecisionPolicy defaults). ``rank`` is the rank in the (outer, inner)
    data-parallel mesh: shards are padded to one size, but the optimizer states cover only
    a rank's own rows, and HFSDP's outer shards differ between ranks. ``activations``
    (with its TP size) adds the activation estimate and the TP collectives; ``moe`` (with
    ``activations``) the all-to-all bytes, and lays the expert units out over
    ``world_size / moe.ep_size`` ranks."""
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
        transient["activations"] = activation_bytes(activations, moe=moe)
        transient["activations_full_recompute"] = activation_bytes(activations, "full", moe)
        for kind, nbytes in tensor_parallel_bytes(activations, mb, tp_replicated_grads, moe).items():
            send(kind, nbytes)
        if moe is not None:
            for kind, nbytes in all_to_all_bytes(activations, moe, mb).items():
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
