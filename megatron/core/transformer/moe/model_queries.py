"""Questions the trainer asks of a built model about its MoE layers: which they are, the
expert layout they were built with, which parameters are experts (sharding, norms).

Apart from ``expert_parallel.py`` (the layout itself), which ``moe_layer`` imports: these
functions need ``MoELayer``, so keeping them there made a cycle."""

from __future__ import annotations

from typing import List, Optional

import torch.nn as nn

from .expert_parallel import ExpertParallel
from .moe_layer import MoELayer


def moe_layers(model: nn.Module) -> List[nn.Module]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def expert_parallel_of(model: nn.Module) -> Optional[ExpertParallel]:
    """The layout the model's MoE layers were built with (None for a dense model)."""
    layers = moe_layers(model)
    return layers[0].expert_parallel if layers else None


def expert_parameters(model: nn.Module) -> List[nn.Parameter]:
    """Parameters that differ across the EP group (this rank's experts)."""
    return [p for layer in moe_layers(model) for p in layer.experts.parameters()]


def expert_tensor_parallel_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The expert parameters split over the expert TP group when it is not the TP group."""
    return [module._parameters[name] for layer in moe_layers(model) for module in layer.experts.modules()
            for name in getattr(module, "expert_tensor_parallel_split", ())]


def expert_tensor_parallel_args(model: nn.Module, ep: ExpertParallel) -> Optional[dict]:
    """``tensor_parallel_params`` / ``tp_group`` of the experts for the norms when their TP
    group is not the dense one (None otherwise: the experts are counted with the TP pieces)."""
    if ep is None or not ep.tensor_parallel_apart:
        return None
    return dict(tensor_parallel_params=expert_tensor_parallel_parameters(model), tp_group=ep.tp_group)
