"""One logical parameter of an FSDP unit: its names, where it is installed, and its two
forms (the sharded DTensor parameter at rest, the unsharded tensor during compute)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn as nn


class FsdpParameter:
    """One logical parameter: tied parameters are one entry with several names."""

    def __init__(self, fqns: Tuple[str, ...], slots, original: nn.Parameter, index: int):
        self.fqns = fqns
        # (module, attribute) pairs that hold this parameter, one per name.
        self.slots: List[Tuple[nn.Module, str]] = slots
        self.shape = original.shape
        self.stride = _contiguous_stride(original.shape)
        self.requires_grad = original.requires_grad
        self.index = index  # position in the group's layout
        self.sharded_param: Optional[nn.Parameter] = None
        self.unsharded_param: Optional[nn.Parameter] = None

    def __repr__(self) -> str:
        return f"FsdpParameter({', '.join(self.fqns)}, shape={tuple(self.shape)})"

    def install(self, param: nn.Parameter) -> None:
        for module, name in self.slots:
            module._parameters[name] = param


def _contiguous_stride(shape: torch.Size) -> Tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))
