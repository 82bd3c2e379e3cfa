"""Optimizer factory, gradient clipping and learning-rate schedules.

``get_megatron_optimizer`` builds a plain torch optimizer over the model's parameters in
two groups (weight decay on matrices, none on biases and norm weights), so it works the
same on plain tensors (DDP, one rank) and on the sharded DTensor parameters of MFSDP
(where the trainer then hands it to ``fully_shard_optimizer``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Tuple

import torch

from .clip_grads import clip_grad_norm, count_zeros, get_grad_norm, get_params_norm
from .grad_scaler import ConstantGradScaler, DynamicGradScaler
from .optimizer_param_scheduler import OptimizerParamScheduler

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
    "no_weight_decay",
]

_OPTIMIZERS = ("adam", "sgd")


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
    # Upstream's Qwen3-Next option: decay the q/k norm weights (q_layernorm, k_layernorm)
    # although they are 1-D.
    apply_wd_to_qk_layernorm: bool = False

    def __post_init__(self):
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {self.optimizer!r}.")
        if self.lr < 0 or self.weight_decay < 0:
            raise ValueError("lr and weight_decay must be non-negative.")


def no_weight_decay(name: str, param: torch.Tensor, apply_wd_to_qk_layernorm: bool = False) -> bool:
    """Megatron's rule: biases and 1-D parameters (norm weights) are not decayed; with
    ``apply_wd_to_qk_layernorm`` the q/k norms' parameters are (upstream's name match)."""
    if apply_wd_to_qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name):
        return False
    # DTensor.shape is the global shape, so sharded parameters are classified correctly.
    return name.endswith(".bias") or len(param.shape) == 1


def get_param_groups(
    named_parameters: Iterable[Tuple[str, torch.Tensor]], apply_wd_to_qk_layernorm: bool = False
) -> List[Dict]:
    decay, no_decay = [], []
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        (no_decay if no_weight_decay(name, param, apply_wd_to_qk_layernorm) else decay).append(param)
    # wd_mult is read by OptimizerParamScheduler.step when it sets each group's decay.
    groups = [
        {"params": decay, "wd_mult": 1.0, "name": "decay"},
        {"params": no_decay, "wd_mult": 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def get_megatron_optimizer(config: OptimizerConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = get_param_groups(model.named_parameters(), config.apply_wd_to_qk_layernorm)
    if not groups:
        raise ValueError("the model has no trainable parameters; nothing to optimize.")
    for g in groups:
        g["weight_decay"] = config.weight_decay * g["wd_mult"]
    if config.optimizer == "adam":
        # Megatron's "adam" is AdamW (decoupled weight decay).
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
