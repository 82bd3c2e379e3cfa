"""What a training forward accumulates outside the gradients: the routers' token counts for
the expert bias, the MoE layers' and MTP block's logged metrics. A re-run of a step
(``--rerun-mode``) must start them where the step started, or it would count its
micro-batches twice."""

from __future__ import annotations

import copy
from typing import Any, List, Tuple

import torch.nn as nn

# Attributes, on the modules that have them, that a forward adds to (router.py, moe_layer.py,
# multi_token_prediction.py).
COUNTER_ATTRIBUTES = ("local_tokens_per_expert", "metrics", "loss_sums", "records")


class StepCounters:
    """The counters of one model: which (module, attribute) hold them is found once (they are
    set at construction), so that saving them at every step does not walk the model again."""

    def __init__(self, model: nn.Module):
        self.holders = [(module, name) for module in model.modules() for name in COUNTER_ATTRIBUTES
                        if name in vars(module)]

    def save(self) -> List[Tuple[nn.Module, str, Any]]:
        return [(module, name, copy.deepcopy(getattr(module, name))) for module, name in self.holders]


def save_step_counters(model: nn.Module) -> List[Tuple[nn.Module, str, Any]]:
    return StepCounters(model).save()


def restore_step_counters(saved: List[Tuple[nn.Module, str, Any]]) -> None:
    for module, name, value in saved:
        setattr(module, name, copy.deepcopy(value))  # a copy: the saved one may serve again
