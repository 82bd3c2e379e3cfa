"""What tensor parallelism and mixture-of-experts layers add to a plan: saved activations
and the bytes of their own collectives (the planner in ``estimate.py`` adds the FSDP part).

* ``activation_bytes``: saved activations of one microbatch (Korthikanti et al., 2022),
  with and without full recompute; MoE layers get their own share (``MoEShape``).
* ``tensor_parallel_bytes``: the TP layers' collectives (``tp_all_reduce``,
  ``tp_all_gather``, ``tp_reduce_scatter``), exact, full recompute's repeated ones included;
  ``moe_tensor_parallel_bytes``: what a MoE layer's TP regions carry besides the tokens.
* ``all_to_all_bytes``: the token dispatcher's exchange under uniform routing (exact for
  what a rank sends and, summed over an EP group, for what it receives).

Shapes only: no model, no process group.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

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
