"""Which flat buffers a parameter group keeps, read off its strategy's placements.

| buffer       | placements         | dtype             | exists / aliases                          |
|--------------|--------------------|-------------------|-------------------------------------------|
| main_weight  | optimizer          | main_params_dtype | always; what the optimizer updates        |
| model_weight | parameter          | compute dtype     | Shard(0) parameters; aliases main_weight  |
|              |                    |                   | when the dtypes agree (not under HFSDP)   |
| unsharded    | Replicate          | compute dtype     | ZeRO-3: the gathered buffer, storage only |
|              |                    |                   | between unshard and reshard; otherwise    |
|              |                    |                   | packed and persistent, or main_weight     |
| main_grad    | gradient           | main_grads_dtype  | trainable groups, allocated eagerly on    |
|              |                    |                   | the reduce-scatter stream                 |
| reduced_grad | optimizer          | main_grads_dtype  | what ``.grad`` shows; aliases main_grad   |
|              |                    |                   | unless the last-microbatch reduction      |
|              |                    |                   | changes its shape (ZeRO-1, HFSDP)         |

Sizes come from the group's ``FlatLayout``: a shard (``shard_numel``), the gathered
buffer (``gathered_numel``, shards end to end with their padding), or, for HFSDP's
optimizer, a shard of the inner shard (``outer_layout.shard_numel``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .flat_buffer import storage_bytes


@dataclasses.dataclass
class GroupBuffers:
    main_weight: torch.Tensor
    model_weight: Optional[torch.Tensor]  # None: ``unsharded`` is the compute weight
    unsharded: torch.Tensor
    main_grad: Optional[torch.Tensor]
    reduced_grad: Optional[torch.Tensor]


def allocate_buffers(layout, outer_layout, strategy, precision, device, resources, requires_grad) -> GroupBuffers:
    S, G = layout.shard_numel, layout.gathered_numel
    optim_numel = outer_layout.shard_numel if outer_layout is not None else S if strategy.optim_sharded else G
    main_weight = torch.zeros(optim_numel, dtype=precision.main_params, device=device)
    model_weight = None
    if strategy.param_sharded:
        if precision.model_weight_aliases_main and outer_layout is None:
            model_weight = main_weight
        else:
            model_weight = torch.zeros(S, dtype=precision.compute, device=device)
    # Replicated parameters keep a packed buffer (tensors end to end, no shard padding),
    # or use the main weight itself when nothing is sharded and the dtypes agree.
    if strategy.param_sharded:
        unsharded = torch.zeros(G, dtype=precision.compute, device=device)
    elif not strategy.optim_sharded and precision.model_weight_aliases_main:
        unsharded = main_weight
    else:
        unsharded = torch.zeros(layout.total_numel, dtype=precision.compute, device=device)
    main_grad = reduced_grad = None
    if requires_grad:
        with resources.device.stream(resources.reduce_scatter_stream):
            main_grad = torch.zeros(S if strategy.grad_sharded else G, dtype=precision.main_grads, device=device)
            # A Partial -> Shard step at the last microbatch (ZeRO-1, HFSDP's outer axis)
            # lands in a smaller buffer; every other reduction works in place.
            if any(g + o == "PS" for g, o in zip(strategy.gradient, strategy.optimizer)):
                reduced_grad = torch.zeros(optim_numel, dtype=precision.main_grads, device=device)
            else:
                reduced_grad = main_grad
        # Their zero-fill ran on the reduce-scatter stream; compute writes them too (no_shard, ZeRO-1).
        resources.device.current_waits_for(resources.reduce_scatter_stream)
    return GroupBuffers(main_weight, model_weight, unsharded, main_grad, reduced_grad)


def persistent_bytes(group) -> dict:
    """Bytes a group keeps between steps, per buffer (unsharded storage excluded for ZeRO-3)."""
    out = {"main_weight": storage_bytes(group.main_weight), "model_weight": 0}
    if group.model_weight is not None and group.model_weight is not group.main_weight:
        out["model_weight"] = storage_bytes(group.model_weight)
    if not group.strategy.param_sharded and group.unsharded is not group.main_weight:
        out["model_weight"] = storage_bytes(group.unsharded)
    out["main_grad"] = storage_bytes(group.main_grad) if group.main_grad is not None else 0
    if group.reduced_grad is not None and group.reduced_grad is not group.main_grad:
        out["main_grad"] += storage_bytes(group.reduced_grad)
    return out
