"""``fully_shard``: turn a module into an FSDP unit of the active scope, in place."""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .context import current_fully_shard_context
from .mixed_precision import MixedPrecisionPolicy, check_supported_dtype
from .module import FsdpModule, UnitState, fsdp_class_for
from .parameter_group import CommResources, FsdpParameter, ParameterGroup
from .placements import Placements, decode_strategy


def _owned_parameters(module: nn.Module, context):
    """Parameters below ``module`` that no nested unit owns, grouped by object.

    Returns ``[(param, [(fqn, owning_module, attr), ...]), ...]`` in first-seen order;
    a tied parameter appears once with all of its names."""
    found: Dict[int, Tuple[nn.Parameter, List]] = {}

    def walk(mod: nn.Module, prefix: str) -> None:
        for attr, param in mod._parameters.items():
            if param is None:
                continue
            fqn = prefix + attr
            owner = context._managed_params.get(id(param))
            if owner is not None and owner is not module:
                if id(param) in context._sharded_param_ids:
                    continue  # a nested unit's sharded parameter: that unit owns it
                raise ValueError(
                    f"Parameter '{fqn}' is already owned by FSDP unit {type(owner).__name__} "
                    "(it is tied to a parameter inside that unit). A parameter can belong to one "
                    "unit only: wrap a common ancestor of all its uses instead."
                )
            found.setdefault(id(param), (param, []))[1].append((fqn, mod, attr))
        for child_name, child in mod._modules.items():
            if child is None:
                continue
            if isinstance(child, FsdpModule):
                continue  # a nested unit owns everything below it
            walk(child, prefix + child_name + ".")

    walk(module, "")
    return list(found.values())


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements,
    mixed_precision_policy: Optional[MixedPrecisionPolicy] = None,
    grad_divisor: float = 1,
) -> nn.Module:
    """Make ``module`` an FSDP unit, in place, owning every parameter below it that no
    nested unit owns. Wrap children before parents, all inside one ``fully_shard_context``;
    the module's class gains the ``FsdpModule`` mixin, so parents keep their references.

    After the scope exits, the unit's parameters rest as DTensor views of this rank's
    optimizer shard (``main_weight``); forward and backward see full parameters in the
    compute dtype; ``.grad`` is the reduced gradient at the end of each backward that
    reduced (every microbatch for ZeRO-2/3, the last one for ZeRO-1, no_shard and the
    outer axis of HSDP/HFSDP; see ``microbatch``).

    Args:
        module: the module to shard. Its parameters must be float32, bfloat16 or float16
            plain tensors (not DTensors), on the context's device or on ``meta`` (then
            materialized later with ``init_parameters``).
        mesh: the ``DeviceMesh`` the data-parallel axes of ``placements`` name, on the
            context's device type: 1-D for no_shard and ZeRO-1/2/3, 2-D (outer, inner) for
            HSDP and HFSDP. Units of one model may use different meshes (e.g. the expert
            units of an MoE model their expert-data-parallel mesh).
        placements: the strategy, a ``Placements`` value (``Placements.zero3()``, ...).
        mixed_precision_policy: compute, main-parameter, gradient-communication and
            main-gradient dtypes (``MixedPrecisionPolicy``); None keeps everything in the
            parameters' own dtype.
        grad_divisor: gradients are averaged over the data-parallel ranks of ``mesh`` and
            then divided by this (> 0). Use it where the same parameter's gradient is
            summed over ranks outside ``mesh`` too, e.g. ``ep_size`` for expert units
            whose tokens come from ``ep_size`` times more ranks, so the result is the
            average over all ranks that computed it.

    Returns:
        ``module`` itself (now an ``FsdpModule``).

    Raises:
        RuntimeError: called outside a ``fully_shard_context`` scope.
        TypeError: ``module`` is not an ``nn.Module``, ``placements`` not a
            ``Placements``, or ``mesh`` not a ``DeviceMesh``.
        ValueError: the module (or a submodule of another context) is already sharded,
            the mesh's device type differs from the context's, ``grad_divisor <= 0``, or
            the placements do not fit the mesh.
        NotImplementedError: a placement combination, mesh rank or parameter dtype the
            engine does not support, or a parameter that is already a DTensor.

    On any error the module is left exactly as it was."""
    context = current_fully_shard_context()
    if context is None:
        raise RuntimeError(
            "fully_shard must be called inside fully_shard_context(): "
            "`with fully_shard_context() as ctx: fully_shard(layer, mesh=mesh, placements=...)`."
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}.")
    if isinstance(module, FsdpModule):
        raise ValueError(
            f"{type(module).__name__} is already managed by FSDP; call fully_shard once per module."
        )
    for name, sub in module.named_modules():
        if isinstance(sub, FsdpModule) and sub.context is not context:
            raise ValueError(
                f"Submodule '{name}' is an FSDP unit of another fully_shard_context; all units "
                "of one model must be built inside the same scope."
            )
    if not isinstance(placements, Placements):
        raise TypeError("placements must be a Placements value, e.g. Placements.zero3().")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError("mesh must be a torch.distributed DeviceMesh (init_device_mesh(...)).")
    if mesh.device_type != context.device.type:
        raise ValueError(
            f"The mesh is on '{mesh.device_type}' but the fully_shard_context is on "
            f"'{context.device.type}'; build both for the same device type."
        )
    if grad_divisor <= 0:
        raise ValueError(f"grad_divisor must be positive, got {grad_divisor}.")
    strategy = decode_strategy(placements, mesh)
    policy = mixed_precision_policy or MixedPrecisionPolicy()

    owned = _owned_parameters(module, context)
    for param, slots in owned:
        check_supported_dtype(param.dtype, f"Parameter '{slots[0][0]}'")
        if isinstance(param, torch.distributed.tensor.DTensor):
            raise NotImplementedError(
                f"Parameter '{slots[0][0]}' is already a DTensor; MFSDP v2 shards plain tensors only."
            )

    # Group by (dtype, requires_grad) in first-seen order; build everything before touching
    # the module so that a failure leaves it as it was.
    by_key: Dict[Tuple[torch.dtype, bool], List] = {}
    for param, slots in owned:
        by_key.setdefault((param.dtype, param.requires_grad), []).append((param, slots))
    resources = CommResources(
        context.device_handle, context.allgather_stream, context.reduce_scatter_stream, context.counter,
        context.replica_reducer,
    )
    groups: List[ParameterGroup] = []
    for (dtype, _), members in by_key.items():
        fsdp_params = [
            FsdpParameter(tuple(fqn for fqn, _, _ in slots), [(m, a) for _, m, a in slots], param, index)
            for index, (param, slots) in enumerate(members)
        ]
        groups.append(
            ParameterGroup(
                type(module).__name__, fsdp_params, [p for p, _ in members], mesh, strategy,
                policy.resolve(dtype), context.device, resources, grad_divisor,
            )
        )

    # Commit.
    state = UnitState(module, context, mesh, placements, strategy, groups, grad_divisor)
    for param, _ in owned:
        context._managed_params[id(param)] = module
        # The id means this parameter only while it lives: forget it when the original is
        # freed, or a new parameter that reuses the address would look already owned.
        weakref.finalize(param, context._managed_params.pop, id(param), None).atexit = False
    for group in groups:
        for p in group.fsdp_parameters:
            p.install(p.sharded_param)
            context._managed_params[id(p.sharded_param)] = module
            context._sharded_param_ids.add(id(p.sharded_param))
            context._param_group[id(p.sharded_param)] = group
            p.sharded_param._mfsdp_context = context
    _move_buffers(module, context.device)
    module._fsdp_state = state
    module.__class__ = fsdp_class_for(module.__class__)
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True, prepend=True)
    module.register_forward_hook(state.post_forward, with_kwargs=True)
    module.register_load_state_dict_pre_hook(_refuse_assign)
    context._register(module)
    return module


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is None or buf.device == device:
                continue
            # A meta buffer has no values to move: give it storage; init_parameters'
            # init_fn (or the module's own reset) must fill it.
            mod._buffers[name] = torch.zeros_like(buf, device=device) if buf.is_meta else buf.to(device)


def _refuse_assign(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    if local_metadata.get("assign_to_params_buffers", False):
        raise RuntimeError(
            "load_state_dict(assign=True) is not supported on an FSDP-wrapped module: it would "
            "replace the sharded parameters and detach them from their flat buffers. Call "
            "load_state_dict(state_dict) without assign (or load before fully_shard)."
        )
