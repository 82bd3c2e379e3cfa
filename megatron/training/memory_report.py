"""One line after the first iteration a run trains: the bytes a rank keeps between steps, measured.

Upstream Megatron prints a memory report at its first log line (CUDA allocator figures).
Here the line counts the tensors themselves, per rank (rank 0's), in the planner's terms
(tools/estimate_memory.py's ``persist`` column): weights (MFSDP: main and model weight
buffers), gradients (MFSDP: main_grad buffers), optimizer state (the optimizer's state
tensors, the local shard of a DTensor), plus the process's max RSS so far (CPU) or the
allocator's max allocated bytes (CUDA), which include everything else (activations,
communication buffers, the interpreter)::

    > memory after iteration 1 (MiB, rank 0): persistent 1.23 (weights 0.41, grads 0.27, optimizer state 0.55) | mem (max RSS MB) 402.1
"""

from typing import Dict, Iterable

import torch
from torch.distributed.tensor import DTensor

from megatron.training.log_utils import memory_label, peak_memory_mb


def _bytes(tensors: Iterable) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def _optimizer_state(optimizer) -> Iterable:
    for state in getattr(optimizer, "state", {}).values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def persistent_bytes(built, optimizer) -> Dict[str, int]:
    """{weights, grads, optimizer state, total} of this rank (bytes)."""
    if built.context is not None:
        engine = built.context.persistent_bytes()
        weights, grads = engine.get("main_weight", 0) + engine.get("model_weight", 0), engine.get("main_grad", 0)
    else:
        params = list(built.unwrapped.parameters())
        weights, grads = _bytes(params), _bytes(p.grad for p in params)
    state = _bytes(_optimizer_state(optimizer))
    return {"weights": weights, "grads": grads, "optimizer state": state, "total": weights + grads + state}


def memory_line(built, optimizer, device: torch.device, iteration: int) -> str:
    mib = persistent_bytes(built, optimizer)
    parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in mib.items() if k != "total")
    return (f"> memory after iteration {iteration} (MiB, rank 0): persistent {mib['total'] / 2**20:.2f} ({parts}) | "
            f"{memory_label(device)} {peak_memory_mb(device):.1f}")
