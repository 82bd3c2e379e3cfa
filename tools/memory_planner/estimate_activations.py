"""What tensor parallelism and mixture-of-experts layers add to a plan: saved activations
and the bytes of their own collectives (the planner in ``estimate.py`` adds the FSDP part).

* ``activation_bytes``: saved activations of one microbatch (Korthikanti et al., 2022),
  with and without full recompute; MoE layers get their own share (``MoEShape``).
* ``tensor_parallel_bytes``: the TP layers' collectives (``tp_all_reduce``,
  ``tp_all_gather``, ``tp_reduce_scatter``), exact, full recompute's repeated ones included;
  ``moe_tensor_parallel_bytes``: what a MoE layer's TP regions carry besides the tokens.
* ``all_to_all_bytes``: the token dispatcher's exchange under uniform routing (exact for
  what a rank sends and, summed over an EP group, for what it receives).
* Context parallelism (``ActivationShape.cp_size``): ``seq_length`` is then the tokens of
  each sequence this rank holds (S / CP), so every per-token term, the TP and the
  all-to-all bytes are a CP rank's; the attention core depends on the comm type
  (``activation_bytes``); ``context_parallel_buffer_bytes`` is the exchange's transient
  K/V buffers and ``context_parallel_bytes`` its traffic.

Shapes only: no model, no process group.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

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
    gated_mlp: bool = False  # SwiGLU: fc1 is 2 x ffn wide and the gating keeps two more tensors
    # Context parallelism: seq_length is this rank's S / cp_size tokens of each sequence;
    # one comm type for every layer, or one per layer (counted in proportion).
    cp_size: int = 1
    cp_comm_types: Tuple[str, ...] = ("p2p",)
    cp_a2a_size: int = 0  # a2a+p2p: the a2a group's size (0: the whole CP group), the ring the rest
    num_query_groups: int = 0  # K/V heads (0: num_attention_heads, MHA)

    @property
    def kv_hidden(self) -> int:
        """The K (or V) width of a token, all heads: h * G / a."""
        groups = self.num_query_groups or self.num_attention_heads
        return self.hidden_size * groups // self.num_attention_heads


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

    def mlp_units(ffn: int, gated: bool = False) -> float:
        # Korthikanti's 19 of the 34 at ffn = 4h: fc1's input (2) and the dropout mask after
        # fc2 (1), whatever the width; fc1's output and the activation's (16), in proportion
        # to ffn / 4h. SwiGLU keeps fc1's 2 x ffn output, silu(gate) and the product: 32.
        if not ffn:
            return 0.0
        return 3 / seq_split + (32 if gated else 16) * (ffn / (4 * h)) / t

    attention = 8 / t + 7 / seq_split
    dense = int((attention + mlp_units(shape.ffn_hidden_size, shape.gated_mlp)) * s * b * h * scale)
    routed, n_moe = dense, 0
    if moe is not None and moe.ffn_hidden_size:
        k, e = moe.topk, moe.num_experts
        rows = 6 if moe.biased else 4  # the dispatched rows, the outputs (and the biased fc2's sum)
        per_row_ffn = k * moe.ffn_hidden_size * (10 if moe.gated else 6) / t
        experts = (3 * h / seq_split + 3 * e + rows * k * h + per_row_ffn) / h
        shared = mlp_units(moe.shared_expert_ffn, moe.gated) if moe.shared_expert_ffn else 0
        routed, n_moe = int((attention + experts + shared) * s * b * h * scale), moe.num_moe_layers
    layers = (shape.num_layers - n_moe) * dense + n_moe * routed
    core = attention_core_bytes(shape)
    logits = 2 * b * s * shape.vocab_size * 4 // t
    layer_input = s * b * h * shape.element_bytes // seq_split
    rebuilt = max(dense if n_moe < shape.num_layers else 0, routed if n_moe else 0)  # one layer, in backward
    if recompute == "full":
        return shape.num_layers * layer_input + rebuilt + core + logits
    if recompute == "selective":
        return layers + core + logits
    return layers + shape.num_layers * core + logits


_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _type_shares(shape: ActivationShape) -> Dict[str, float]:
    """Each comm type's share of the layers."""
    types = shape.cp_comm_types
    bad = [x for x in types if x not in _CP_COMM_TYPES]
    if bad:
        raise ValueError(f"cp_comm_types {bad} are not comm types; use {', '.join(_CP_COMM_TYPES)}.")
    return {x: types.count(x) / len(types) for x in set(types)}


def attention_core_bytes(shape: ActivationShape) -> int:
    """What one layer's attention core keeps beyond q, k, v (those are in the 34 s b h):
    the unfused kernel's scores, softmax and dropout, 5 a s^2 b (16-bit units), without CP.

    Per CP rank (s = S / CP local tokens): ``all_gather`` and ``a2a`` run the attention
    module's kernel on this rank's queries against all S keys (all_gather) or on a / CP
    heads of the whole sequence (a2a), so 5 a s^2 b becomes 5 a s S b either way;
    all_gather also keeps the gathered K/V (2 S b h_kv) and the [s, S] mask as the
    kernel's float copy. ``p2p`` and ``a2a+p2p`` run the ring's own blockwise kernel,
    which keeps only its output and log-sum-exp (fp32 at least): no s^2 term. (A fused
    kernel, e.g. SDPA's on CPU, keeps output and log-sum-exp instead of the scores.)"""
    s, b, a, t = shape.seq_length, shape.micro_batch_size, shape.num_attention_heads, shape.tp_size
    eb = shape.element_bytes
    if shape.cp_size == 1:
        return int(5 * a * s * s * b * eb / 2 / t)
    S, acc = s * shape.cp_size, max(4, eb)
    scores = 5 * a * s * S * b * eb / 2 / t
    by_type = {
        "all_gather": scores + 2 * S * b * shape.kv_hidden * eb / t + s * S * eb,  # one mask for all heads
        "a2a": scores,
        "p2p": (s * b * shape.hidden_size + s * b * a) * acc / t,
    }
    by_type["a2a+p2p"] = by_type["p2p"]
    return int(sum(share * by_type[x] for x, share in _type_shares(shape).items()))


def context_parallel_buffer_bytes(shape: ActivationShape) -> int:
    """The largest transient buffer of one layer's CP exchange (0 without CP): p2p's
    K/V block and, in backward, its dK/dV accumulator, each current and in flight (fp32
    at least), plus one block's scores and probabilities; all_gather's full-sequence
    dK/dV before the reduce-scatter; a2a's send and receive copies of q, K/V; a2a+p2p both."""
    if shape.cp_size == 1:
        return 0
    s, b, a, t = shape.seq_length, shape.micro_batch_size, shape.num_attention_heads, shape.tp_size
    eb, acc = shape.element_bytes, max(4, shape.element_bytes)
    kv = 2 * s * b * shape.kv_hidden  # elements of one rank's packed K/V
    ring = 4 * kv * acc / t + 2 * b * a * (s // 2) ** 2 * acc / t
    a2a = 2 * (s * b * shape.hidden_size + kv) * eb / t
    by_type = {"p2p": ring, "all_gather": kv * shape.cp_size * eb / t, "a2a": a2a, "a2a+p2p": ring + a2a}
    return int(max(by_type[x] for x in _type_shares(shape)))


def context_parallel_bytes(shape: ActivationShape, microbatches: int = 1) -> Dict[str, int]:
    """Bytes a rank sends per step in the CP exchanges (as the counter counts inputs), for
    ``microbatches`` forwards and backwards of every layer (a full-recompute layer's
    forward exchange again). Per layer and microbatch, with KV the rank's packed K/V:
    p2p sends KV cp-1 times forward, and backward KV cp-1 times and the dK/dV accumulator
    cp times (``cp_send``, fp32 at least; nothing on a ring of one rank); all_gather
    gathers KV and reduce-scatters the whole sequence's dK/dV; a2a trades q, K/V and the
    output each way (``cp_all_to_all``); a2a+p2p the same all-to-alls inside its a2a group
    (``cp_a2a_size`` ranks) and a ring over the CP / a2a groups, whose blocks hold as many
    elements as the rank's own K/V (H / a heads of a x the tokens)."""
    if shape.cp_size == 1:
        return {}
    cp, s, b, t = shape.cp_size, shape.seq_length, shape.micro_batch_size, shape.tp_size
    eb, acc = shape.element_bytes, max(4, shape.element_bytes)
    kv = 2 * s * b * shape.kv_hidden // t
    q = s * b * shape.hidden_size // t
    forwards = shape.num_layers + shape.recomputed_layers
    out: Dict[str, float] = {}

    def add(kind, per_forward, per_backward, share):
        out[kind] = out.get(kind, 0) + share * microbatches * (
            forwards * per_forward + shape.num_layers * per_backward)

    def ring(size, share):
        if size > 1:
            add("cp_send", (size - 1) * kv * acc, ((size - 1) + size) * kv * acc, share)

    for x, share in _type_shares(shape).items():
        if x == "p2p":
            ring(cp, share)
        elif x == "all_gather":
            add("cp_all_gather", kv * eb, 0, share)
            add("cp_reduce_scatter", 0, cp * kv * eb, share)
        else:  # a2a, and a2a+p2p's all-to-alls and ring
            add("cp_all_to_all", (2 * q + kv) * eb, (2 * q + kv) * eb, share)
            if x == "a2a+p2p":
                ring(cp // (shape.cp_a2a_size or cp), share)
    return {kind: int(v) for kind, v in out.items()}


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
