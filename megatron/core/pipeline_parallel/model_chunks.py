"""A rank's pipeline chunks (virtual stages) seen as one module with the whole model's names.

Each chunk names its parameters globally already (``decoder.layers.5`` is layer 5 on
whichever chunk holds it, see ``transformer_block.LayerStack``), so the chunks of a rank
share one namespace. ``ModelChunks`` walks them without adding a prefix of its own:
``named_parameters()``, ``named_modules()``, and everything built on them (optimizers,
checkpoints, norms, the parameter count) see the names of the unparallel model. The
schedule runs the chunks themselves (``list(chunks)``); the container has no forward.
"""

from __future__ import annotations

from typing import Iterator, List, Sequence

import torch.nn as nn


class ModelChunks(nn.Module):
    def __init__(self, chunks: Sequence[nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.config = getattr(self.chunks[0], "config", None)

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.chunks)

    def __getitem__(self, index: int) -> nn.Module:
        return self.chunks[index]

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        """This container under ``prefix``, then each chunk's modules under the chunk's own
        names (no ``chunks.<i>.`` in between)."""
        if memo is None:
            memo = set()
        if self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
        for chunk in self.chunks:
            yield from chunk.named_modules(memo, prefix, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        """The chunks' state dicts merged (their keys are global, so they do not collide)."""
        merged = {}
        for chunk in self.chunks:
            merged.update(chunk.state_dict(*args, **kwargs))
        return merged

    def forward(self, *args, **kwargs):
        raise RuntimeError("ModelChunks holds pipeline chunks; run them through the pipeline schedule "
                           "(get_forward_backward_func()) with list(chunks) as the model.")


def chunks_of(model: nn.Module) -> List[nn.Module]:
    """The chunks of ``model``: those of a ``ModelChunks``, else ``[model]``."""
    return list(model) if isinstance(model, ModelChunks) else [model]
