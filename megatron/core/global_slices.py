"""Where a rank's parameter sits inside the layout-independent global tensor.

Tensor and expert parallelism give each rank a piece of some parameters: a column-parallel
weight holds rows of the global weight, a row-parallel weight columns, SwiGLU's fused
``linear_fc1`` two row blocks (its gate rows and its up rows), an expert-parallel weight
the experts of this rank. The module that owns such a parameter says so in a
``global_slices`` attribute: ``{parameter attribute name: GlobalSlice}``.

A piece cut along two dims (an expert's row-parallel ``linear_fc2`` under expert and
tensor parallelism: this rank's experts, then its TP columns of them) is a slice with an
``inner`` slice: ``inner`` cuts the local tensor out of what the outer slice cuts out.

Everything that must not depend on the layout reads it: the invariant initializer draws
the global tensor and keeps this rank's piece, checkpoints store global tensors at their
true offsets, and converters assemble the global tensor. A parameter without an entry is
the same on every rank of its tensor/expert-parallel group (norms, row-parallel biases).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class GlobalSlice:
    """The concatenation, along ``dim``, of ``ranges`` of the global tensor of shape
    ``global_shape`` (``(start, stop)`` pairs in global coordinates) is the local tensor, or,
    with ``inner``, the tensor of shape ``inner.global_shape`` that ``inner`` cuts the local
    tensor from."""

    global_shape: Tuple[int, ...]
    dim: int
    ranges: Tuple[Tuple[int, int], ...]
    inner: Optional["GlobalSlice"] = None

    def __post_init__(self):
        if not 0 <= self.dim < len(self.global_shape):
            raise ValueError(f"GlobalSlice dim {self.dim} is outside a {len(self.global_shape)}-D tensor.")
        size = self.global_shape[self.dim]
        for start, stop in self.ranges:
            if not 0 <= start < stop <= size:
                raise ValueError(f"GlobalSlice range ({start}, {stop}) is outside [0, {size}) on dim {self.dim}.")
        if self.inner is not None and tuple(self.inner.global_shape) != self.outer_shape:
            raise ValueError(f"the inner GlobalSlice cuts a tensor of shape {tuple(self.inner.global_shape)}, "
                             f"but the outer one gives {self.outer_shape}.")

    @property
    def outer_shape(self) -> Tuple[int, ...]:
        """The shape of what ``ranges`` cut out (the local shape without ``inner``)."""
        shape = list(self.global_shape)
        shape[self.dim] = sum(stop - start for start, stop in self.ranges)
        return tuple(shape)

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return self.outer_shape if self.inner is None else self.inner.local_shape

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the global tensor ``full`` (a new tensor)."""
        if tuple(full.shape) != tuple(self.global_shape):
            raise ValueError(f"expected a global tensor of shape {self.global_shape}, got {tuple(full.shape)}.")
        outer = torch.cat([full.narrow(self.dim, start, stop - start) for start, stop in self.ranges], dim=self.dim)
        return outer if self.inner is None else self.inner.take(outer)


def partition(global_shape, dim: int, rank: int, size: int, blocks: int = 1) -> GlobalSlice:
    """Rank ``rank`` of ``size``'s piece when dim ``dim`` is split evenly, each of ``blocks``
    equal blocks split on its own (``blocks=2`` for SwiGLU's [gate; up] rows)."""
    global_shape = tuple(int(s) for s in global_shape)
    total = global_shape[dim]
    if total % (blocks * size):
        raise ValueError(f"dim {dim} of size {total} does not split into {blocks} block(s) x {size} ranks.")
    block, piece = total // blocks, total // (blocks * size)
    ranges = tuple((b * block + rank * piece, b * block + (rank + 1) * piece) for b in range(blocks))
    return GlobalSlice(global_shape, dim, ranges)


def partition_sections(global_shape, dim: int, rank: int, size: int, sections) -> GlobalSlice:
    """Rank ``rank`` of ``size``'s piece when dim ``dim`` is the concatenation of blocks of the
    sizes ``sections`` (unequal, e.g. the gated delta net's [q; k; v; z; b; a] rows), each
    split evenly on its own: the rank holds its part of every block, in block order."""
    global_shape = tuple(int(s) for s in global_shape)
    sections = [int(n) for n in sections]
    if sum(sections) != global_shape[dim]:
        raise ValueError(f"sections {sections} do not add up to dim {dim} of size {global_shape[dim]}.")
    ranges, start = [], 0
    for n in sections:
        if n % size:
            raise ValueError(f"a block of {n} rows does not split over {size} ranks.")
        piece = n // size
        ranges.append((start + rank * piece, start + (rank + 1) * piece))
        start += n
    return GlobalSlice(global_shape, dim, tuple(ranges))


def global_slices_of(module: nn.Module) -> Dict[str, GlobalSlice]:
    return getattr(module, "global_slices", None) or {}


def global_slices_by_name(model: nn.Module) -> Dict[str, GlobalSlice]:
    """``{parameter fqn: GlobalSlice}`` of every parameter that is a piece of a global
    tensor (what checkpoints take as ``pieces``)."""
    out = {}
    for module_name, module in model.named_modules():
        for attr, piece in global_slices_of(module).items():
            if module._parameters.get(attr) is not None:
                out[f"{module_name}.{attr}" if module_name else attr] = piece
    return out
