"""Megatron's parameter groups: which parameters are decayed, and which are the embedding or
output layer (their own learning rate with ``--decoupled-lr``; never Muon's). A module of its
own so that the optimizers (``muon_matrices``) read the same rules the factory uses, without
importing the factory back."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

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


def get_param_groups(
    named_parameters: Iterable[Tuple[str, torch.Tensor]],
    decoupled_lr: Optional[float] = None,
    decoupled_min_lr: Optional[float] = None,
    apply_wd_to_qk_layernorm: bool = False,
) -> List[Dict]:
    """Megatron's groups: decayed or not, and with ``decoupled_lr`` the embedding/output
    weights apart, carrying their own ``max_lr`` (and ``min_lr``) for the scheduler."""
    groups = {}
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        decoupled = decoupled_lr is not None and is_embedding_or_output_parameter(name)
        groups.setdefault((decoupled, no_weight_decay(name, param, apply_wd_to_qk_layernorm)), []).append(param)
    out = []
    # Non-decoupled groups first: the log's learning rate is param_groups[0]'s.
    for decoupled in (False, True):
        for no_decay in (False, True):
            params = groups.get((decoupled, no_decay))
            if not params:
                continue
            # wd_mult is read by OptimizerParamScheduler.step when it sets each group's decay.
            group = {"params": params, "wd_mult": 0.0 if no_decay else 1.0,
                     "name": ("decoupled_" if decoupled else "") + ("no_decay" if no_decay else "decay")}
            if decoupled:
                group["max_lr"] = decoupled_lr
                if decoupled_min_lr is not None:
                    group["min_lr"] = decoupled_min_lr
            out.append(group)
    return out
