"""Megatron's parameter groups: which parameters are decayed, and which are the embedding or
output layer (their own learning rate with ``--decoupled-lr``; never Muon's). A module of its
own so that the optimizers (``muon_matrices``) read the same rules the factory uses, without
importing the factory back."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch


def no_weight_decay(name: str, param: torch.Tensor, apply_wd_to_qk_layernorm: bool = False) -> bool:
    """Megatron's rule: biases and 1-D parameters (norm weights) are not decayed; with
    ``apply_wd_to_qk_layernorm`` the q/k norms' parameters are (upstream's name match)."""
    if apply_wd_to_qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name):
        return False
    # DTensor.shape is the global shape, so sharded parameters are classified correctly.
    return name.endswith(".bias") or len(param.shape) == 1


# Upstream's is_embedding_or_output_parameter: the word embedding and the untied output
# layer (matched by name, which survives DDP's "module." prefix and MFSDP's resharding).
_EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_embedding_or_output_parameter(name: str) -> bool:
    return any(name == n or name.endswith("." + n) for n in _EMBEDDING_OR_OUTPUT)


def is_mup_vector_like(name: str, param: torch.Tensor) -> bool:
    """muP's "vector-like" parameters (upstream's is_embedding_parameter or dim <= 1): the
    embedding module's parameters, the output layer's weight, biases and norm weights. The
    others are the hidden matrices, whose learning rate muP scales with the width."""
    return "embedding" in name.split(".") or is_embedding_or_output_parameter(name) or len(param.shape) <= 1


def mup_overrides(name: str, param: torch.Tensor, *, optimizer: str, width_mult: float, lr: float,
                  min_lr: float, adam_eps: float, decoupled: bool) -> Dict[str, float]:
    """Upstream's get_mup_config_overrides for one parameter: Adam (and Muon's AdamW part):
    hidden matrices get max_lr, min_lr and (Adam) eps divided by the width multiplier; SGD:
    vector-like parameters get max_lr and min_lr multiplied by it. With --decoupled-lr the
    embedding and output layer keep their decoupled LR. Empty at width multiplier 1."""
    if width_mult == 1.0:
        return {}
    vector_like = is_mup_vector_like(name, param)
    if optimizer == "sgd":
        if not vector_like or (decoupled and is_embedding_or_output_parameter(name)):
            return {}
        return {"max_lr": lr * width_mult, "min_lr": min_lr * width_mult}
    if vector_like:
        return {}
    out = {"max_lr": lr / width_mult, "min_lr": min_lr / width_mult}
    if optimizer == "adam":
        out["eps"] = adam_eps / width_mult
    return out


def get_param_groups(
    named_parameters: Iterable[Tuple[str, torch.Tensor]],
    decoupled_lr: Optional[float] = None,
    decoupled_min_lr: Optional[float] = None,
    apply_wd_to_qk_layernorm: bool = False,
    mup: Optional[Callable[[str, torch.Tensor], Dict[str, float]]] = None,
) -> List[Dict]:
    """Megatron's groups: decayed or not, and with ``decoupled_lr`` the embedding/output
    weights apart, carrying their own ``max_lr`` (and ``min_lr``) for the scheduler. ``mup``
    (``mup_overrides`` bound to the run's settings) gives a parameter's muP overrides; the
    parameters with overrides form groups of their own (``mup_`` names) after the others."""
    groups = {}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        decoupled = decoupled_lr is not None and is_embedding_or_output_parameter(name)
        overrides = tuple(sorted(mup(name, param).items())) if mup is not None else ()
        key = (decoupled, overrides, no_weight_decay(name, param, apply_wd_to_qk_layernorm))
        groups.setdefault(key, []).append(param)
    out = []
    # Non-decoupled groups first, muP's after the plain ones: the log's learning rate is
    # param_groups[0]'s.
    for decoupled, overrides, no_decay in sorted(groups, key=lambda k: (k[0], k[1] != (), k[1], k[2])):
        params = groups[(decoupled, overrides, no_decay)]
        # wd_mult is read by OptimizerParamScheduler.step when it sets each group's decay.
        group = {"params": params, "wd_mult": 0.0 if no_decay else 1.0,
                 "name": ("mup_" if overrides else "") + ("decoupled_" if decoupled else "")
                 + ("no_decay" if no_decay else "decay")}
        if decoupled:
            group["max_lr"] = decoupled_lr
            if decoupled_min_lr is not None:
                group["min_lr"] = decoupled_min_lr
        group.update(overrides)
        out.append(group)
    return out
