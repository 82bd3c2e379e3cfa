"""Optimizer factory, gradient clipping and learning-rate schedules.

``get_megatron_optimizer`` builds a plain torch optimizer over the model's parameters in
two groups (weight decay on matrices, none on biases and norm weights), so it works the
same on plain tensors (DDP, one rank) and on the sharded DTensor parameters of MFSDP
(where the trainer then hands it to ``fully_shard_optimizer``). With ``optimizer="muon"``
the matrices go to Muon (``muon.py``) and the rest to AdamW, in one optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Optional

import torch
from torch.distributed.tensor import DTensor

from .clip_grads import clip_grad_norm, count_zeros, get_grad_norm, get_params_norm
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .muon import Muon, muon_and_adamw_groups
from .muon_matrices import muon_matrices, takes_muon
from .optimizer_param_scheduler import OptimizerParamScheduler
from .param_groups import get_param_groups, is_embedding_or_output_parameter, mup_overrides, no_weight_decay

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "clip_grad_norm",
    "count_zeros",
    "get_grad_norm",
    "get_params_norm",
    "get_megatron_optimizer",
    "get_param_groups",
    "is_embedding_or_output_parameter",
    "no_weight_decay",
]

_OPTIMIZERS = ("adam", "sgd", "muon")
# AdamW's implementations (torch.optim.AdamW's foreach / fused; torchtitan's --optimizer.implementation).
ADAM_IMPLEMENTATIONS = ("foreach", "for-loop", "fused")


@dataclasses.dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    # foreach: torch's multi-tensor path (the loop's bits); fused: one kernel per group, no
    # temporaries, rounded differently from the loop (the kernel Megatron's FusedAdam stands for).
    adam_implementation: str = "foreach"
    # Upstream's Qwen3-Next option: decay the q/k norm weights (q_layernorm, k_layernorm)
    # although they are 1-D.
    apply_wd_to_qk_layernorm: bool = False
    # --decoupled-lr/--decoupled-min-lr: the embedding and output layer's own schedule.
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    # --use-mup: hidden_size / --mup-base-hidden-size (param_groups.mup_overrides); 1: no muP.
    mup_width_mult: float = 1.0
    # --muon-*: upstream Megatron-LM's names and defaults (the CLI's momentum default, 0.9).
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    muon_split_qkv: bool = True
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 1.0
    muon_fp32_matmul_prec: str = "medium"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "duplicated"

    def __post_init__(self):
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {self.optimizer!r}.")
        if self.adam_implementation not in ADAM_IMPLEMENTATIONS:
            raise ValueError(f"adam_implementation must be one of {ADAM_IMPLEMENTATIONS}, "
                             f"got {self.adam_implementation!r}.")
        if self.adam_implementation != "foreach" and self.optimizer != "adam":
            raise ValueError(f"--optimizer-implementation {self.adam_implementation} is AdamW's; "
                             f"--optimizer {self.optimizer} takes none (drop the flag).")
        if self.lr < 0 or self.weight_decay < 0:
            raise ValueError("lr and weight_decay must be non-negative.")


# AdamW's foreach path holds one temporary as large as the group it steps: up to 2^26 elements
# (256 MiB in fp32) a rank's group takes it, past that the per-parameter loop (the same bits).
FOREACH_MAX_ELEMENTS = 2**26


def _local_numel(param: torch.Tensor) -> int:
    """The elements this rank holds of ``param`` (a DTensor's local shard)."""
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def get_megatron_optimizer(config: OptimizerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    mup = None
    if config.mup_width_mult != 1.0:
        mup = functools.partial(mup_overrides, optimizer=config.optimizer, width_mult=config.mup_width_mult,
                                lr=config.lr, min_lr=config.min_lr, adam_eps=config.adam_eps,
                                decoupled=config.decoupled_lr is not None)
    groups = get_param_groups(model.named_parameters(), config.decoupled_lr, config.decoupled_min_lr,
                              config.apply_wd_to_qk_layernorm, mup)
    if not groups:
        raise ValueError("the model has no trainable parameters; nothing to optimize.")
    for g in groups:
        g["weight_decay"] = config.weight_decay * g["wd_mult"]
    if config.optimizer == "muon":
        return _muon_optimizer(config, model, groups)
    if config.optimizer == "adam":
        # Megatron's "adam" is AdamW (decoupled weight decay). foreach: torch's default off CUDA
        # is its per-parameter loop, which on sharded (DTensor) parameters pays the subclass
        # dispatch once per parameter and operator (3x torchtitan's optimizer time in
        # benchmarks/results/profile_vs_torchtitan.md); the multi-tensor path computes the same
        # bits on CPU and dispatches once per operator, but its temporaries are a copy of the
        # group (4 bytes a parameter beside the 16 of weights, gradients and moments), so a
        # group past FOREACH_MAX_ELEMENTS on this rank stays on the loop. fused (chosen) has no
        # temporaries and one kernel per group: torchtitan's default, and Megatron's on GPU.
        for g in groups:
            if config.adam_implementation == "fused":
                g["fused"] = True
            else:
                g["foreach"] = (config.adam_implementation == "foreach"
                                and sum(_local_numel(p) for p in g["params"]) <= FOREACH_MAX_ELEMENTS)
        return torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
    return torch.optim.SGD(
        groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay
    )


def _muon_optimizer(config: OptimizerConfig, model: torch.nn.Module, groups: List[Dict]) -> torch.optim.Optimizer:
    names = {id(p): n for n, p in model.named_parameters()}
    groups = muon_and_adamw_groups(groups, lambda p: takes_muon(names[id(p)], p))
    for group in groups:
        if group["use_muon"] and group["name"].startswith("muon_mup_"):
            # Upstream's muP leaves the matrices Muon updates to Muon's own scaling.
            del group["max_lr"], group["min_lr"]
    return Muon(groups, muon_matrices(model, config.muon_split_qkv), lr=config.lr,
                weight_decay=config.weight_decay, momentum=config.muon_momentum, nesterov=config.muon_nesterov,
                num_ns_steps=config.muon_num_ns_steps, coefficient_type=config.muon_coefficient_type,
                scale_mode=config.muon_scale_mode, extra_scale_factor=config.muon_extra_scale_factor,
                fp32_matmul_prec=config.muon_fp32_matmul_prec, tp_mode=config.muon_tp_mode,
                adam_betas=(config.adam_beta1, config.adam_beta2), adam_eps=config.adam_eps)
