"""Build the model for training: MFSDP units inside one ``fully_shard_context``, PyTorch FSDP2, or DDP.

With ``--use-mfsdp`` every TransformerLayer becomes an FSDP unit, then the root module
(which owns what is left: the tied embedding/output weight, the final norm, position
embeddings). All of them are built inside *one* ``fully_shard_context``, whose context is
handed to the schedule (``microbatch``) and to ``fully_shard_optimizer``. With
``--use-torch-fsdp2`` the same units are sharded by PyTorch's ``fully_shard``
(``build_torch_fsdp2``). Otherwise the model runs under PyTorch DDP, or plainly on a
single rank.

Under pipeline parallelism a rank builds only its stage: one model chunk, or one per
virtual stage, each a root of the same context (independently sharded roots sharing the
streams). With tied embeddings the word embedding lives on the first and the last stage;
each copy is a unit of its own there, so that both copies have the same shard layout and
their gradients add up shard by shard (``finalize_model_grads``). Without MFSDP the chunks
are not DDP-wrapped (DDP's reducer cannot tell a pipeline's microbatches apart): their
gradients are averaged over the data-parallel ranks after the schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate
from torch.nn.modules.module import register_module_parameter_registration_hook

from megatron.core import parallel_state
from megatron.core.distributed.mfsdp_v2 import (
    FsdpModule,
    MixedPrecisionPolicy,
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
)
from megatron.core.optimizer import (
    OptimizerConfig,
    OptimizerParamScheduler,
    count_zeros,
    get_megatron_optimizer,
    get_params_norm,
)
from megatron.core.optimizer.clip_grads import clip_grads_to, get_grad_norm
from megatron.core.pipeline_parallel.model_chunks import ModelChunks, chunks_of
from megatron.core.tensor_parallel import all_reduce_sequence_parallel_grads, tensor_parallel_parameters
from megatron.core.transformer.initialization import initialize_parameters_
from megatron.core.transformer.moe.model_queries import (
    expert_parallel_of,
    expert_parameters,
    expert_tensor_parallel_args,
)
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.training.compile_layers import compile_layers

# The activation each flag combination builds, and the flags that select it.
ACTIVATION_FLAGS = {"silu": "--swiglu", "quick_gelu": "--quick-geglu", "gelu_tanh": "--openai-gelu", "gelu": "neither --swiglu nor --openai-gelu"}


def activation_from_args(args: dict) -> str:
    """The MLP activation that saved (or parsed) arguments build: SwiGLU's silu, GPT-OSS's
    quick GELU (--quick-geglu, gated too), the tanh
    GELU of ``--openai-gelu`` (GPT-2's ``gelu_new``), else the exact GELU. A checkpoint
    written by convert.py records the name itself as ``activation_func``."""
    if args.get("swiglu"):
        return "silu"
    if args.get("quick_geglu"):
        return "quick_gelu"
    if args.get("activation_func"):
        return args["activation_func"]
    return "gelu_tanh" if args.get("openai_gelu") else "gelu"


@dataclasses.dataclass
class BuiltModel:
    # What the schedule calls: the FSDP root, a DDP wrapper or the plain model; under
    # pipeline parallelism with virtual stages, the list of this rank's chunks.
    model: Any
    # The GPTModel itself (config, generation, parameter counts); with virtual stages a
    # ModelChunks, whose names are the whole model's. What checkpoints save.
    unwrapped: torch.nn.Module
    context: Any = None  # FsdpContext with MFSDP, else None
    mesh: Any = None
    placements: Any = None
    torch_fsdp2: bool = False  # sharded by PyTorch's fully_shard (--use-torch-fsdp2)

    @property
    def use_mfsdp(self) -> bool:
        return self.context is not None

    @property
    def chunks(self) -> List[torch.nn.Module]:
        """This rank's model chunks, unwrapped (one without virtual pipeline stages)."""
        return chunks_of(self.unwrapped)


def parallel_state_for(args, device_type: str):
    """This process's parallel state (``megatron.core.parallel_state``; the trainer builds
    it at start-up), or one built now for ``args`` (tools and tests that build a model alone)."""
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_parallel_state()
    return parallel_state.build_parallel_state(
        getattr(args, "tensor_model_parallel_size", 1), args.dp_outer_size, device_type,
        pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
        context_parallel_size=getattr(args, "context_parallel_size", 1))


def build_device_mesh(args, device_type: str):
    """The data-parallel mesh the engine shards over: 1-D ``("dp",)``, or 2-D
    ``("outer", "inner")`` for HSDP/HFSDP (a sub-mesh of the world mesh under TP). Under
    context parallelism the CP ranks are folded in (``dp_cp_mesh``): they hold the same
    parameters, and their gradients (each of its own tokens) are averaged like DP ranks'."""
    return parallel_state_for(args, device_type).dp_cp_mesh


def build_placements(args, dims: Optional[Tuple[str, ...]] = None):
    """ZeRO-0..3 -> no_shard/zero1/zero2/zero3 over the mesh dim ``dims[0]``; with K>1 instances,
    outer no_shard -> HSDP over ``dims = (outer, inner)`` (inner strategy from
    --data-parallel-sharding-strategy), outer optim -> HFSDP. ``dims``: the names of the
    mesh's dimensions, by default the dense mesh's (``("dp",)`` or ``("outer", "inner")``)."""
    presets = {
        "no_shard": Placements.no_shard,
        "optim": Placements.zero1,
        "optim_grads": Placements.zero2,
        "optim_grads_params": Placements.zero3,
    }
    strategy = args.data_parallel_sharding_strategy
    dims = dims or (("outer", "inner") if args.dp_outer_size > 1 else ("dp",))
    if len(dims) != (2 if args.dp_outer_size > 1 else 1):
        raise ValueError(f"mesh dims {dims} do not fit {args.dp_outer_size} distributed-optimizer instance(s); "
                         "pass (outer, inner) with instances, else one dim.")
    if args.dp_outer_size == 1:
        return presets[strategy](dims[0])
    if strategy == "optim_grads_params":
        if args.outer_dp_sharding_strategy == "optim":
            return Placements.hfsdp(*dims)
        return Placements.hsdp(*dims)
    # HSDP with a no_shard/ZeRO-1/2 inner axis (HFSDP needs ZeRO-3 inside; see arguments.py).
    inner = presets[strategy](dims[1])
    return Placements(
        dims,
        (Replicate(), inner.parameter[0]),
        (Partial("avg"), inner.gradient[0]),
        (Replicate(), inner.optimizer[0]),
    )


def build_mixed_precision_policy(args):
    return MixedPrecisionPolicy(
        main_params_dtype=args.main_params_dtype,
        main_grads_dtype=args.main_grads_dtype,
        grad_comm_dtype=args.grad_comm_dtype,
    )


def transformer_layers(model: torch.nn.Module):
    decoder = getattr(model, "decoder", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no decoder.layers; model_provider must return a GPTModel "
            "(or a model with the same structure) so that each transformer layer can be sharded."
        )
    mtp = getattr(model, "mtp", None)  # multi-token prediction's layers: units too, in forward order
    return list(layers) + ([layer.mtp_model_layer for layer in mtp.layers] if mtp is not None else [])


def pipeline_chunk_kwargs(args) -> List[dict]:
    """The keyword arguments of ``model_provider`` for each of this rank's model chunks:
    ``[{}]`` without pipeline parallelism (a provider may then take ``args`` alone), else
    Megatron's ``pre_process``, ``post_process`` and ``vp_stage`` per virtual stage."""
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    if pp == 1:
        return [{}]

    rank = parallel_state.get_pipeline_model_parallel_rank()
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    return [dict(pre_process=rank == 0 and v == 0, post_process=rank == pp - 1 and v == vp - 1, vp_stage=v)
            for v in range(vp)]


def build_model(model_provider: Callable, args, device: torch.device, replica_reducer=None) -> BuiltModel:
    """Build, initialize (seeded per parameter name, see ``initialization.py``) and wrap.

    With ``--use-mfsdp`` (or ``--use-torch-fsdp2``) and ``--init-model-with-meta-device`` (the default) the parameters
    are created on ``meta``, wrapped, then materialized one unit at a time straight into
    this rank's shards: no rank holds more than its shards plus one unit gathered.
    ``replica_reducer``: the outer replica reduction of a fault-tolerant job
    (``fault_tolerance.py``), given to the engine's context."""
    use_torch_fsdp2 = getattr(args, "use_torch_fsdp2", False)
    meta = bool((args.use_mfsdp or use_torch_fsdp2) and getattr(args, "init_model_with_meta_device", False))
    chunks = []
    for kwargs in pipeline_chunk_kwargs(args):
        chunk = _build_on_meta(model_provider, args, kwargs) if meta else model_provider(args, **kwargs)
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"model_provider must return an nn.Module, got {type(chunk).__name__}.")
        if not meta:
            initialize_parameters_(chunk, args.seed)
            chunk = chunk.to(device)
        chunks.append(chunk)
    if getattr(args, "compile_layers", None):
        # torchtitan's order: compile each block, then shard (the hooks fully_shard adds stay eager).
        for chunk in chunks:
            compile_layers(transformer_layers(chunk), args.compile_layers)
    if use_torch_fsdp2:  # one chunk: FSDP2 runs without pipeline parallelism (torch_fsdp2_arguments.py)
        return build_torch_fsdp2(chunks[0], args, device, meta)
    pipelined = getattr(args, "pipeline_model_parallel_size", 1) > 1
    unwrapped = chunks[0] if len(chunks) == 1 else _model_chunks(chunks)
    schedule_model = chunks[0] if len(chunks) == 1 else chunks

    if args.use_mfsdp:
        mesh = build_device_mesh(args, device.type)
        placements = build_placements(args)
        policy = build_mixed_precision_policy(args)
        with fully_shard_context(
            device=device, unify_communication_stream=args.mfsdp_unify_communication_stream,
            replica_reducer=replica_reducer,
        ) as context:
            # Children first: each layer is its own unit (its experts one before it); the
            # root then owns the rest. Every chunk is a root of this one context.
            units = []
            for chunk in chunks:
                for layer in transformer_layers(chunk):
                    units += shard_experts(layer, args, policy)
                    units.append(fully_shard(layer, mesh, placements, mixed_precision_policy=policy))
                tied = tied_embedding_module(chunk) if pipelined else None
                if tied is not None:
                    units.append(fully_shard(tied, mesh, placements, mixed_precision_policy=policy))
                units.append(fully_shard(chunk, mesh, placements, mixed_precision_policy=policy))
        for chunk in chunks:  # --megatron-fsdp-no-reshard-after-forward: chunks stay gathered through a step
            chunk.set_reshard_after_forward(args.megatron_fsdp_reshard_after_forward)
        if meta:
            materialize_units(units, args.seed)
        return BuiltModel(schedule_model, unwrapped, context, mesh, placements)

    if pipelined:
        return BuiltModel(schedule_model, unwrapped)
    model = chunks[0]
    if dist.is_initialized() and dist.get_world_size() // getattr(args, "tensor_model_parallel_size", 1) > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=parallel_state_for(args, device.type).dp_cp_group,
        )
        return BuiltModel(ddp, model)
    return BuiltModel(model, model)


def build_torch_fsdp2(model: torch.nn.Module, args, device: torch.device, meta: bool) -> BuiltModel:
    """PyTorch's FSDP2 (``--use-torch-fsdp2``): the same units as MFSDP, in the same order
    (each transformer layer, then the root with the rest: the tied embedding and output
    weight, the final norm), over the same data-parallel mesh. From ``meta`` each unit is
    materialized unsharded with the world-size-invariant init just before it is sharded,
    so no rank holds more than its shards plus one unit, and the weights equal MFSDP's."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # only this backend needs it

    mesh = build_device_mesh(args, device.type)
    # Compute (and all-gather) in bf16/fp16 with --bf16/--fp16 (fp16's loss scale is the
    # trainer's); reduce and keep gradients in the main grads dtype (fp32 by default) unless
    # --megatron-fsdp-grad-comm-dtype says otherwise.
    compute = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else None)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=args.grad_comm_dtype or args.main_grads_dtype)
    gloo = dist.get_backend(mesh.get_group()) == "gloo"
    prefixes = {id(m): f"{name}." if name else "" for name, m in model.named_modules()}
    for unit in transformer_layers(model) + [model]:  # children first, the root last
        if meta:
            _replace_own_parameters(unit, FSDPModule, lambda p: torch.empty_like(p, device=device))
            initialize_parameters_(unit, args.seed, prefixes[id(unit)], stop_at=lambda m: isinstance(m, FSDPModule))
        # The stored (main) weights' dtype: fp32 unless --megatron-fsdp-main-params-dtype.
        _replace_own_parameters(unit, FSDPModule, lambda p: p.detach().to(args.main_params_dtype))
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
        if gloo:
            # FSDP2 divides inside the collective (AVG, or PREMUL_SUM once a divide factor
            # is set), and gloo has no PREMUL_SUM: sum, then divide by the data-parallel
            # size after the reduction: the same mean.
            unit.set_force_sum_reduction_for_comms(True)
    return BuiltModel(model, model, mesh=mesh, torch_fsdp2=True)


def reshard_torch_fsdp2(model: torch.nn.Module) -> None:
    """Free every FSDP2 unit's gathered weights: after a forward-only pass (evaluation) the
    root, and with --torch-fsdp2-no-reshard-after-forward every layer, still hold them."""
    from torch.distributed.fsdp import FSDPModule  # only this backend needs it

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _replace_own_parameters(unit: torch.nn.Module, nested_unit: type, make: Callable) -> None:
    """Replace every parameter ``unit`` itself holds (not those of units already sharded
    inside it) by a new parameter of the tensor ``make(old)``, where that differs in device
    or dtype. A parameter shared by several modules (a tied weight) gets one replacement."""
    new, stack = {}, [unit]
    while stack:
        module = stack.pop()
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in new:
                tensor = make(p)
                same = tensor.device == p.device and tensor.dtype == p.dtype
                new[id(p)] = p if same else torch.nn.Parameter(tensor, requires_grad=p.requires_grad)
            if new[id(p)] is not p:
                setattr(module, name, new[id(p)])
        stack += [child for child in module.children() if not isinstance(child, nested_unit)]


def shard_experts(layer: torch.nn.Module, args, policy) -> list:
    """A MoE layer's experts as their own unit: sharded over the expert-data-parallel mesh
    (the ranks holding the same experts; 2-D under HSDP/HFSDP) with the run's strategy and
    ``grad_divisor`` = the EP size, EP x ETP / TP with the expert TP size apart from TP
    (``megatron/core/transformer/moe/expert_parallel.py`` says why). [] for a dense layer."""
    moe = getattr(layer, "mlp", None)
    if not isinstance(moe, MoELayer):
        return []
    ep = moe.expert_parallel
    if ep.outer_size != args.dp_outer_size:
        # Else the experts would not get the run's HSDP/HFSDP levels.
        raise ValueError(
            f"the expert-parallel layout was built for {ep.outer_size} distributed-optimizer instance(s), the run has "
            f"{args.dp_outer_size}; build it with build_expert_parallel(..., dp_outer_size={args.dp_outer_size})."
        )
    return [fully_shard(moe.experts, ep.expert_dp_mesh, build_placements(args, ep.expert_dp_dims),
                        mixed_precision_policy=policy, grad_divisor=ep.grad_divisor)]


META_BUILD_FAILED = (
    "model_provider failed while its parameters were on the meta device ({error}): it reads "
    "parameter values during construction (.item(), .tolist(), a copy to the CPU, ...). Build "
    "it without reading them, or pass --no-init-model-with-meta-device to build the whole "
    "model on every rank before sharding."
)


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered in this scope is moved to ``meta`` as it is registered.

    Unlike ``torch.device("meta")``, buffers (RoPE inverse frequencies, causal masks) keep
    their real values: they are computed at construction, are small, and nothing else could
    recompute them after materialization. Each parameter exists on the CPU only between its
    ``torch.empty`` and its registration, untouched, so the build costs no real memory."""
    def to_meta(module, name, param):
        if param is not None and not param.is_meta:
            return torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        return None  # keep it as it is

    # torch's own extension point: a hook that may replace each parameter as it is registered.
    handle = register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def _model_chunks(chunks):
    return ModelChunks(chunks)


def tied_embedding_module(chunk: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module holding a pipeline chunk's copy of the word-embedding weight that the
    first and the last stage both hold (the first stage's embedding; the last stage's
    output projection with tied weights, or its embedding for multi-token prediction), or None."""
    config = getattr(chunk, "config", None)
    if not (getattr(chunk, "share_embeddings_and_output_weights", False) or getattr(config, "mtp_num_layers", None)):
        return None
    embedding = getattr(chunk, "embedding", None)
    return getattr(embedding, "word_embeddings", None) if embedding is not None else None


def _build_on_meta(model_provider: Callable, args, kwargs: dict) -> torch.nn.Module:
    try:
        with parameters_on_meta():
            model = model_provider(args, **kwargs)
    except (RuntimeError, NotImplementedError) as error:
        if "meta" not in str(error):
            raise
        raise RuntimeError(META_BUILD_FAILED.format(error=f"{type(error).__name__}: {error}")) from error
    if isinstance(model, torch.nn.Module):
        for name, buffer in model.named_buffers():
            if buffer.is_meta:
                raise ValueError(
                    f"buffer '{name}' was created on the meta device, so its values are lost; create "
                    "buffers with real values in model_provider (the trainer puts only parameters on "
                    "meta), or pass --no-init-model-with-meta-device."
                )
    return model


def materialize_units(units, seed: int) -> None:
    """Initialize each unit's own parameters unsharded, one unit at a time, keeping this
    rank's rows; names are the unit's within the model, so values match an unsharded build."""
    for unit in units:
        prefix = f"{unit.name}." if unit.name else ""
        unit.init_parameters(
            lambda module, prefix=prefix: initialize_parameters_(
                module, seed, prefix, stop_at=lambda sub: isinstance(sub, FsdpModule)
            )
        )


# The --muon-* settings OptimizerConfig takes under the same names.
MUON_FIELDS = ("muon_momentum", "muon_nesterov", "muon_split_qkv", "muon_scale_mode", "muon_extra_scale_factor",
               "muon_fp32_matmul_prec", "muon_coefficient_type", "muon_num_ns_steps", "muon_tp_mode")


def build_optimizer(args, built: BuiltModel):
    """Torch optimizer over the (possibly sharded) parameters, plus the LR scheduler."""
    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        adam_implementation=getattr(args, "adam_implementation", "foreach"),
        decoupled_lr=getattr(args, "decoupled_lr", None),
        decoupled_min_lr=getattr(args, "decoupled_min_lr", None),
        apply_wd_to_qk_layernorm=getattr(args, "apply_wd_to_qk_layernorm", False),
        mup_width_mult=getattr(args, "mup_width_mult", 1.0) if getattr(args, "use_mup", False) else 1.0,
        **{name: getattr(args, name) for name in MUON_FIELDS if hasattr(args, name)},
    )
    # Named parameters of the unwrapped model: DDP's "module." prefix does not matter to
    # the bias rule, and with MFSDP these are the sharded DTensor parameters.
    optimizer = get_megatron_optimizer(config, built.unwrapped)
    if built.use_mfsdp:
        fully_shard_optimizer(optimizer, context=built.context)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_samples,
        lr_decay_steps=args.lr_decay_samples,
        lr_decay_style=args.lr_decay_style,
        weight_decay=args.weight_decay,
        use_checkpoint_opt_param_scheduler=getattr(args, "use_checkpoint_opt_param_scheduler", False),
    )
    return optimizer, scheduler


def get_grad_norm_and_clip(args, built: BuiltModel, optimizer: Optional[torch.optim.Optimizer] = None):
    """Global grad norm over all (sharded) gradients; clipped to --clip-grad when > 0.
    Under pipeline parallelism the stages' norms add up (squares) over the pipeline, the
    tied embedding counted once, and every stage clips with the same coefficient."""
    params = [p for p in built.unwrapped.parameters() if p.requires_grad]
    norm = get_grad_norm(_counted_once(args, built, params), **norm_axes(args, built))
    clip_grads_to(params, norm, args.clip_grad)
    return norm


def norm_axes(args, built: BuiltModel) -> dict:
    """The gradient/parameter norms' keyword arguments that count each TP piece, each
    expert and each pipeline stage once (megatron/core/optimizer/clip_grads.py)."""
    axes = tensor_parallel_norm_args(args, built)
    ep = expert_parallel_of(built.unwrapped)
    if ep is not None and (ep.size > 1 or ep.tensor_parallel_apart):
        # Expert gradients differ across the EP group (and split over their own TP group).
        axes.update(expert_params=expert_parameters(built.unwrapped), ep_group=ep.group if ep.size > 1 else None)
        apart = expert_tensor_parallel_args(built.unwrapped, ep)
        if apart is not None:
            axes.update(expert_tensor_parallel_params=apart["tensor_parallel_params"], expert_tp_group=apart["tp_group"])
    if getattr(args, "pipeline_model_parallel_size", 1) > 1:
        axes.update(pp_group=parallel_state.get_parallel_state().pp_group)
    return axes


def _counted_once(args, built: BuiltModel, params) -> list:
    """``params`` without the last stage's copy of the tied embedding under pipeline
    parallelism (the first stage's holds the same values and, after
    ``finalize_model_grads``, the same gradient)."""
    if getattr(args, "pipeline_model_parallel_size", 1) == 1 or parallel_state.is_pipeline_first_stage():
        return list(params)
    copies = {id(m.weight) for m in (tied_embedding_module(c) for c in built.chunks) if m is not None}
    return [p for p in params if id(p) not in copies]


def tensor_parallel_norm_args(args, built: BuiltModel) -> dict:
    """What the gradient/parameter norms need to count each TP piece once."""
    if getattr(args, "tensor_model_parallel_size", 1) == 1:
        return {}

    return dict(tensor_parallel_params=tensor_parallel_parameters(built.unwrapped),
                tp_group=parallel_state.get_tensor_model_parallel_group())


def finalize_model_grads(args, built: BuiltModel) -> None:
    """After the last microbatch's backward: under sequence parallelism, sum the gradients
    of the TP-replicated parameters over TP (megatron/core/tensor_parallel/finalize_grads.py);
    under pipeline parallelism, average the gradients over data-parallel ranks when no
    engine did (plain chunks), and sum the two copies of a tied embedding's gradient over
    the first and last stage (Megatron's embedding group)."""
    if getattr(args, "sequence_parallel", False):
        all_reduce_sequence_parallel_grads(built.unwrapped, parallel_state.get_tensor_model_parallel_group())
    if getattr(args, "pipeline_model_parallel_size", 1) == 1:
        return
    state = parallel_state.get_parallel_state()
    if not built.use_mfsdp and state.dp_size * state.cp_size > 1:
        for p in built.unwrapped.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=state.dp_cp_group)
    if state.embedding_group is not None:
        for module in (tied_embedding_module(c) for c in built.chunks):
            grad = module.weight.grad if module is not None else None
            if grad is not None:
                dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=state.embedding_group)


def get_params_norm_of(args, built: BuiltModel, params) -> torch.Tensor:
    """--log-params-norm: the global norm of ``params`` (each TP piece, expert and stage counted once)."""
    return get_params_norm(_counted_once(args, built, params), **norm_axes(args, built))


def count_zeros_of(args, built: BuiltModel, params) -> int:
    """--log-num-zeros-in-grad: zero gradient entries of ``params`` (each TP piece, expert and stage once)."""
    return count_zeros(_counted_once(args, built, params), **norm_axes(args, built))

