"""Megatron-LM's mixture-of-experts flags: parsing, parse-time checks, and the config they give.

The flags keep Megatron's names and meanings (``--num-experts``, ``--moe-router-topk``,
``--expert-model-parallel-size``, ...). ``validate_moe_args`` runs the model config's own
MoE checks (``megatron/core/transformer/moe/config.py``) on the parsed flags, so that a bad
combination fails before any process group exists, with the same message.
"""

from __future__ import annotations

import argparse
import types

from megatron.core.parallel_state import check_expert_mesh_sizes
from megatron.core.transformer.moe.config import check_moe_config, parse_moe_layer_freq
from megatron.core.transformer.moe.expert_parallel import check_expert_parallel_size


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixture of experts (Megatron-LM's MoE flags)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: a dense model)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=_layer_freq, default=1,
                   help="every k-th layer is MoE (k), or a 0/1 pattern per layer, e.g. '([1]*3+[0]*1)*2'")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="top-k of the softmax over all experts (default: softmax over the top-k logits)")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None, help="routing in this precision")
    g.add_argument("--moe-router-load-balancing-type", nargs="+",
                   choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"), default="aux_loss",
                   help="aux_loss (per micro-batch), seq_aux_loss (per sequence), global_aux_loss (over the "
                        "data-parallel ranks), sinkhorn, none; several aux-loss types with one coefficient each")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                   help="weight of the load-balancing loss (one per listed type)")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="expert groups for group-limited routing")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="groups each token chooses its experts from (group-limited routing)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias for the choice, updated after each step (sigmoid)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="the expert bias's step: bias += rate * sign(mean load - load)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="weight of the router z-loss")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="drop tokens beyond capacity = ceil(tokens * topk / experts * factor) per expert (default dropless)")
    g.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="run each layer's experts with torch's grouped matmul instead of a loop")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN size of a shared expert every token goes through")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Qwen2-MoE: scale the shared expert's output by sigmoid(x @ gate_weight), a [1, hidden] weight")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"), default="alltoall",
                   help="alltoall (allgather and flex run it too: same results)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks that split each layer's experts (inner within the data-parallel ranks)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ranks that split each expert (default --tensor-model-parallel-size); innermost in the "
                        "expert view of a pipeline stage's ranks, then EP, then expert data parallelism")


def moe_config_kwargs(args) -> dict:
    """The ``TransformerConfig`` MoE fields the flags give (getattr: argument sets saved
    before these flags existed mean a dense model)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return dict(
        num_moe_experts=get("num_experts"),
        moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
        moe_layer_freq=get("moe_layer_freq", 1),
        moe_router_topk=get("moe_router_topk", 2),
        moe_router_pre_softmax=get("moe_router_pre_softmax", False),
        moe_router_score_function=get("moe_router_score_function", "softmax"),
        moe_router_topk_scaling_factor=get("moe_router_topk_scaling_factor"),
        moe_router_dtype=get("moe_router_dtype"),
        moe_router_force_load_balancing=get("moe_router_force_load_balancing", False),
        moe_router_load_balancing_type=_one_or_list(get("moe_router_load_balancing_type", "aux_loss")),
        moe_aux_loss_coeff=_one_or_list(get("moe_aux_loss_coeff", 0.0)),
        moe_router_num_groups=get("moe_router_num_groups"),
        moe_router_group_topk=get("moe_router_group_topk"),
        moe_router_enable_expert_bias=get("moe_router_enable_expert_bias", False),
        moe_router_bias_update_rate=get("moe_router_bias_update_rate", 1e-3),
        moe_z_loss_coeff=get("moe_z_loss_coeff"),
        moe_expert_capacity_factor=get("moe_expert_capacity_factor"),
        moe_token_drop_policy=get("moe_token_drop_policy", "probs"),
        moe_pad_expert_input_to_capacity=get("moe_pad_expert_input_to_capacity", False),
        moe_grouped_gemm=get("moe_grouped_gemm", False),
        moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=get("moe_shared_expert_gate", False),
        moe_token_dispatcher_type="alltoall",  # allgather and flex (DeepEP) give the same results
        expert_model_parallel_size=get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=get("expert_tensor_parallel_size"),
    )


def _layer_freq(text: str):
    """``parse_moe_layer_freq`` whose message argparse shows (it hides a ValueError's)."""
    try:
        return parse_moe_layer_freq(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _one_or_list(value):
    """A one-element list (``nargs="+"``) means that element, as upstream's argument checks say."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def validate_moe_args(args: argparse.Namespace) -> None:
    """Parse-time checks (ValueError with the fix). Needs the model shape and MFSDP fields."""
    if getattr(args, "moe_enable_deepep", False) and args.moe_token_dispatcher_type != "flex":
        raise ValueError("--moe-enable-deepep selects the flex dispatcher's backend; add --moe-token-dispatcher-type "
                         "flex or drop it.")
    if args.moe_shared_expert_gate and args.moe_shared_expert_intermediate_size is None:
        raise ValueError("--moe-shared-expert-gate gates the shared expert; add --num-experts and "
                         "--moe-shared-expert-intermediate-size, or drop it.")
    fields = moe_config_kwargs(args)
    fields.update(num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                  tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
                  sequence_parallel=getattr(args, "sequence_parallel", False))
    check_moe_config(types.SimpleNamespace(**fields))
    args.moe_router_load_balancing_type = fields["moe_router_load_balancing_type"]
    args.moe_aux_loss_coeff = fields["moe_aux_loss_coeff"]
    _validate_expert_tensor_parallel(args)
    if args.num_experts is None:
        return
    ep, tp = args.expert_model_parallel_size, getattr(args, "tensor_model_parallel_size", 1)
    cp = getattr(args, "context_parallel_size", 1)  # CP ranks route their own tokens: EP spans DP x CP
    if (args.expert_tensor_parallel_size or tp) == tp:  # else the expert view's own check above
        check_expert_parallel_size(ep, args.data_parallel_size * cp, tp, args.dp_outer_size, cp_size=cp)
    if ep > 1 and not args.use_mfsdp:  # map_expert_parallel_without_mfsdp ran first
        raise ValueError(
            f"--expert-model-parallel-size {ep} needs --use-mfsdp: DDP would average the gradients of "
            "different experts across the expert-parallel ranks."
        )


def _validate_expert_tensor_parallel(args: argparse.Namespace) -> None:
    """--expert-tensor-parallel-size: the expert view (etp x ep x expert-dp) must cut each
    pipeline stage's ranks, as upstream asserts for any model; experts split apart from TP
    need MFSDP (their gradients are averaged over ranks of several TP coordinates) and,
    without sequence parallelism, a sequence that splits over TP (each TP rank routes its
    chunk of the tokens)."""
    tp = getattr(args, "tensor_model_parallel_size", 1)
    etp = args.expert_tensor_parallel_size or tp
    if etp == tp:  # the expert-parallel size check (EP | data-parallel size) says the same
        return
    check_expert_mesh_sizes(args.world_size, getattr(args, "pipeline_model_parallel_size", 1),
                            args.dp_outer_size if args.num_experts else 1, args.expert_model_parallel_size, etp)
    if args.num_experts is None:
        return
    if getattr(args, "context_parallel_size", 1) > 1:  # the token path apart from TP is not built for CP splits
        raise ValueError(f"--expert-tensor-parallel-size {etp} apart from --tensor-model-parallel-size {tp} with "
                         "--context-parallel-size > 1 is not supported; set --expert-tensor-parallel-size "
                         f"{tp} (or --context-parallel-size 1).")
    if not args.use_mfsdp:
        raise ValueError(f"--expert-tensor-parallel-size {etp} apart from --tensor-model-parallel-size {tp} needs "
                         "--use-mfsdp: DDP averages over the TP coordinate's data-parallel ranks only; add it, or "
                         f"set --expert-tensor-parallel-size {tp}.")
    if tp > 1 and not getattr(args, "sequence_parallel", False) and args.seq_length % tp:
        raise ValueError(f"--seq-length ({args.seq_length}) must be a multiple of --tensor-model-parallel-size ({tp}) "
                         f"when --expert-tensor-parallel-size ({etp}) differs from it: each TP rank routes its chunk "
                         "of the sequence; pad the sequence or add --sequence-parallel.")


def map_expert_parallel_without_mfsdp(args: argparse.Namespace, note) -> None:
    """Upstream's DDP with --expert-model-parallel-size > 1 (its expert gradients reduced over
    the expert-data-parallel ranks): here MFSDP no_shard, DDP's replicated layout with the
    experts a unit of their own on the expert mesh (torch's DDP would average different
    experts). Resolved before validation, like --use-distributed-optimizer's ZeRO-1."""
    if args.expert_model_parallel_size <= 1 or args.use_mfsdp:
        return
    if args.data_parallel_sharding_strategy not in (None, "no_shard"):
        raise ValueError(f"--expert-model-parallel-size without --use-mfsdp runs MFSDP no_shard (DDP's layout); drop "
                         f"--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} or add --use-mfsdp.")
    args.use_mfsdp = True
    args.data_parallel_sharding_strategy = "no_shard"
    note(f"--expert-model-parallel-size {args.expert_model_parallel_size} without --use-mfsdp: MFSDP runs with "
         "--data-parallel-sharding-strategy no_shard (DDP's replicated layout, experts reduced over the ranks "
         "that hold them).")
