"""Checks of the mixture-of-experts fields of ``TransformerConfig``, and which layers are MoE.

The fields carry Megatron-LM's names and meanings (``num_moe_experts``, ``moe_router_topk``,
``moe_aux_loss_coeff``, ...). ``check_moe_config`` is called by the config's
``__post_init__``; every message says how to fix the setting.
"""

from __future__ import annotations

import ast
from typing import Dict, List, Sequence, Union

import torch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
TOKEN_DROP_POLICIES = ("probs", "position")
TOKEN_DISPATCHER_TYPES = ("alltoall", "allgather")
ROUTER_DTYPES = (None, "fp32", "fp64")


def grouped_gemm_available() -> bool:
    """torch's grouped matmul (``torch.nn.functional.grouped_mm``, torch >= 2.9)."""
    return hasattr(torch.nn.functional, "grouped_mm")


def parse_moe_layer_freq(value: Union[int, str, Sequence[int]]) -> Union[int, List[int]]:
    """Megatron's ``--moe-layer-freq``: an int k (every k-th layer, starting with the first, is
    MoE) or a per-layer pattern of 1 (MoE) and 0 (dense), written as a list or with Megatron's
    list arithmetic, e.g. ``"([1]*3+[0]*1)*2"``. Only list/int literals, ``+`` and ``*`` are
    evaluated (never arbitrary Python)."""
    if isinstance(value, bool):
        raise ValueError(f"--moe-layer-freq must be an int or a list of 0/1, got {value!r}.")
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        result = _evaluate(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as error:
        raise ValueError(
            f"--moe-layer-freq {text!r} is not an int or a list of 0/1 ({error}); write e.g. 2, "
            "'[1,0,1,0]' or '([1]*3+[0]*1)*2'."
        ) from None
    if not isinstance(result, list):
        raise ValueError(f"--moe-layer-freq {text!r} must give an int or a list of 0/1.")
    return result


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_evaluate(element) for element in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"unsupported expression {ast.dump(node)[:40]}")


def moe_layer_pattern(config) -> List[bool]:
    """For each layer (0-based), whether it is a MoE layer."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(v) for v in freq]


def is_moe_layer(config, layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based, Megatron's numbering) has a MoE in place of its MLP."""
    return moe_layer_pattern(config)[layer_number - 1]


def check_moe_config(config) -> None:
    """Reject inconsistent MoE settings (ValueError with the fix); fill ``moe_ffn_hidden_size``."""
    ep = config.expert_model_parallel_size
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert_model_parallel_size must be a positive integer, got {ep!r}.")
    etp = getattr(config, "expert_tensor_parallel_size", None)
    if etp is not None and (not isinstance(etp, int) or etp < 1):
        raise ValueError(f"--expert-tensor-parallel-size must be a positive integer, got {etp!r}; leave it unset "
                         "to split the experts like the dense layers (--tensor-model-parallel-size).")
    experts = config.num_moe_experts
    if experts is None:
        if ep > 1:
            raise ValueError(
                f"--expert-model-parallel-size {ep} needs a mixture of experts; add --num-experts "
                "(a multiple of it) or use --expert-model-parallel-size 1."
            )
        return
    if not isinstance(experts, int) or experts < 1:
        raise ValueError(f"--num-experts must be a positive integer, got {experts!r}.")
    if experts % ep:
        raise ValueError(
            f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size ({ep}): each "
            f"expert-parallel rank holds num_experts / size experts; use a multiple of {ep} experts."
        )
    topk = config.moe_router_topk
    if not 1 <= topk <= experts:
        raise ValueError(f"--moe-router-topk ({topk}) must be between 1 and --num-experts ({experts}).")
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    if config.moe_ffn_hidden_size < 1:
        raise ValueError(f"--moe-ffn-hidden-size must be positive, got {config.moe_ffn_hidden_size}.")
    if config.moe_router_score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"--moe-router-score-function must be one of {SCORE_FUNCTIONS}, got {config.moe_router_score_function!r}."
        )
    _check_load_balancing(config)
    _check_router_selection(config, experts)
    if (topk == 1 and config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
            and config.moe_router_load_balancing_type != "sinkhorn"):
        # A softmax over the one chosen logit is always 1: the router would get no gradient.
        raise ValueError("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a softmax over "
                         "one logit is always 1); add it, or use sigmoid scores or sinkhorn.")
    if config.moe_z_loss_coeff is not None and config.moe_z_loss_coeff < 0:
        raise ValueError(f"--moe-z-loss-coeff must be non-negative, got {config.moe_z_loss_coeff}.")
    if config.moe_router_topk_scaling_factor is not None and config.moe_router_topk_scaling_factor <= 0:
        raise ValueError("--moe-router-topk-scaling-factor must be positive.")
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        raise ValueError(f"--moe-expert-capacity-factor must be positive, got {factor}; leave it unset for dropless.")
    if factor is not None and config.moe_router_load_balancing_type == "sinkhorn":
        raise ValueError("--moe-expert-capacity-factor does not work with sinkhorn routing; use aux_loss, "
                         "seq_aux_loss, global_aux_loss or none, or drop the capacity factor.")
    if config.moe_token_drop_policy not in TOKEN_DROP_POLICIES:
        raise ValueError(f"--moe-token-drop-policy must be one of {TOKEN_DROP_POLICIES}.")
    if config.moe_pad_expert_input_to_capacity and factor is None:
        raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor.")
    if config.moe_token_dispatcher_type not in TOKEN_DISPATCHER_TYPES:
        raise ValueError(
            f"--moe-token-dispatcher-type {config.moe_token_dispatcher_type!r} is not supported; use alltoall."
        )
    if config.moe_router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"--moe-router-dtype must be fp32 or fp64, got {config.moe_router_dtype!r}.")
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and shared < 1:
        raise ValueError(f"--moe-shared-expert-intermediate-size must be positive, got {shared}.")
    if config.moe_grouped_gemm:
        if not grouped_gemm_available():
            raise ValueError(
                f"--moe-grouped-gemm needs torch.nn.functional.grouped_mm (torch >= 2.9; this is torch "
                f"{torch.__version__}); drop the flag to run the experts in a loop."
            )
        # grouped_mm wants 16-byte aligned rows: 8 elements covers bf16/fp16 and fp32. Under
        # TP a rank's expert is moe_ffn_hidden_size / TP wide.
        tp = getattr(config, "expert_tensor_parallel_size", None) or getattr(config, "tensor_model_parallel_size", 1)
        widths = {"--hidden-size": config.hidden_size,
                  "--moe-ffn-hidden-size" + (f" / TP {tp}" if tp > 1 else ""): config.moe_ffn_hidden_size // tp}
        odd = [f"{flag} {width}" for flag, width in widths.items() if width % 8]
        if odd:
            raise ValueError(
                f"--moe-grouped-gemm needs widths that are multiples of 8 (16-byte rows), got {', '.join(odd)}; "
                "change them or drop --moe-grouped-gemm."
            )
    _check_moe_tensor_parallel(config)
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--moe-layer-freq must be at least 1, got {freq}.")
    else:
        if len(freq) != config.num_layers or any(v not in (0, 1) for v in freq):
            raise ValueError(
                f"--moe-layer-freq as a pattern needs one 0/1 per layer ({config.num_layers}), got {list(freq)}."
            )
        if not any(freq):
            raise ValueError("--moe-layer-freq makes no layer a MoE layer; put a 1 somewhere or drop --num-experts.")


def aux_loss_coeffs(config) -> Dict[str, float]:
    """Load-balancing loss type -> its coefficient (only the aux-loss types, coefficient > 0).
    ``moe_router_load_balancing_type`` may be one type or a list of them (one coefficient each)."""
    types, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if isinstance(types, str):
        types, coeffs = [types], [coeffs]
    return {t: float(c) for t, c in zip(types, coeffs) if t in AUX_LOSS_TYPES and c > 0}


def _check_load_balancing(config) -> None:
    types, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    as_list = list(types) if isinstance(types, (list, tuple)) else [types]
    unknown = [t for t in as_list if t not in LOAD_BALANCING_TYPES]
    if unknown:
        raise ValueError(f"--moe-router-load-balancing-type {unknown[0]!r} is not known; use one or more of "
                         f"{', '.join(LOAD_BALANCING_TYPES)}.")
    if isinstance(types, (list, tuple)):
        if not isinstance(coeffs, (list, tuple)) or len(coeffs) != len(types):
            raise ValueError(f"--moe-router-load-balancing-type lists {len(types)} types: give --moe-aux-loss-coeff "
                             f"as many coefficients (one per type), got {coeffs!r}.")
        if "sinkhorn" in types:
            raise ValueError("--moe-router-load-balancing-type sinkhorn is a routing, not a loss, and cannot be "
                             "listed with others; use it alone.")
    elif isinstance(coeffs, (list, tuple)):
        raise ValueError(f"--moe-aux-loss-coeff has {len(coeffs)} values for one load-balancing type; give one, or "
                         "list as many types in --moe-router-load-balancing-type.")
    coeff_list = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs]
    if any(c < 0 for c in coeff_list):
        raise ValueError(f"--moe-aux-loss-coeff must be non-negative, got {coeffs}.")
    if types == "sinkhorn" and coeffs > 0:
        raise ValueError("sinkhorn routing balances without an aux loss: set --moe-aux-loss-coeff 0 or use another "
                         "--moe-router-load-balancing-type.")


def _check_router_selection(config, experts: int) -> None:
    """Expert bias (aux-loss-free balancing) and group-limited routing."""
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        raise ValueError("--moe-router-enable-expert-bias needs sigmoid scores: add --moe-router-score-function "
                         "sigmoid or drop --moe-router-enable-expert-bias.")
    group_topk, groups = config.moe_router_group_topk, config.moe_router_num_groups
    if not group_topk:
        return
    if not groups:
        raise ValueError(f"--moe-router-group-topk {group_topk} needs --moe-router-num-groups (how many groups the "
                         "experts are split into).")
    if groups < 1 or experts % groups:
        raise ValueError(f"--num-experts ({experts}) must be divisible by --moe-router-num-groups ({groups}); use a "
                         f"divisor of {experts}.")
    if group_topk > groups:
        raise ValueError(f"--moe-router-group-topk ({group_topk}) must not exceed --moe-router-num-groups "
                         f"({groups}).")
    if group_topk * (experts // groups) < config.moe_router_topk:
        raise ValueError(f"--moe-router-group-topk {group_topk} groups of {experts // groups} experts hold fewer than "
                         f"--moe-router-topk ({config.moe_router_topk}) experts; select more groups.")


def _check_moe_tensor_parallel(config) -> None:
    """Experts under TP: each expert split over the expert TP group (the TP group, as
    Megatron does by default, or --expert-tensor-parallel-size ranks), the shared expert
    over TP like a dense MLP."""
    tp = getattr(config, "tensor_model_parallel_size", 1)
    etp = getattr(config, "expert_tensor_parallel_size", None) or tp
    etp_flag = "--tensor-model-parallel-size" if etp == tp else "--expert-tensor-parallel-size"
    sizes = {"--moe-ffn-hidden-size": (config.moe_ffn_hidden_size, etp, etp_flag),
             "--moe-shared-expert-intermediate-size": (config.moe_shared_expert_intermediate_size, tp,
                                                        "--tensor-model-parallel-size")}
    for flag, (size, parts, parts_flag) in sizes.items():
        if size is not None and size % parts:
            raise ValueError(f"{flag} ({size}) must be divisible by {parts_flag} ({parts}); "
                             "each TP rank holds an equal piece of every expert.")
    if tp == 1:
        return
