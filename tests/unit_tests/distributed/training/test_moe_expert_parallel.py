"""MoE with expert parallelism under MFSDP equals a single-process EP=1 reference.

The model is built by the trainer's own flags and model builder (experts a unit of their
own over the expert-data-parallel mesh with grad_divisor = EP size, dense units over the
whole mesh); the reference is the same GPT built on one process with all experts local,
from the same seed (the invariant initializer gives the same global weights at every EP
size). Each rank trains on its rows of the global batch, the reference on all of it.

With the load-balancing loss on, the loss is per micro-batch per rank (Megatron's
definition), so the reference runs each rank's rows as one micro-batch of a gradient
accumulation (scale 1 / world for the main and the aux losses): the same objective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist_helpers import full_tensors
from _trainer_models import full_weights, gpt_provider, trainer_args
from megatron.core.transformer.moe.expert_bias import update_expert_biases
from megatron.core.distributed.mfsdp_v2 import fully_shard, fully_shard_optimizer, microbatch
from megatron.core.global_slices import global_slices_by_name, global_slices_of
from megatron.core.transformer.initialization import initialize_parameters_
from megatron.core.transformer.moe.metrics import collect_moe_metrics
from megatron.core.transformer.moe.router import set_aux_loss_backward_scale
from megatron.core.transformer.multi_token_prediction import set_mtp_loss_backward_scale
from megatron.training import model_builder
from megatron.training.model_builder import build_model, count_zeros_of, get_grad_norm_and_clip, get_params_norm_of

WORLD = dist.get_world_size()
EP_SIZES = [p for p in (1, 2, 4) if p <= WORLD and WORLD % p == 0]
# HSDP/HFSDP over 2 instances (dense mesh (2, W/2)); EP must divide the W/2 ranks of one.
HYBRIDS = {"hsdp": ["--num-distributed-optimizer-instances", "2"],
           "hfsdp": ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"]}
HYBRID_EP = max(p for p in EP_SIZES if (WORLD // 2) % p == 0) if WORLD >= 2 else None
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32".split()
SEQ, VOCAB, STEPS, ROWS = 16, 96, 3, 2


def moe_args(ep: int, strategy: str, aux: float, *extra, world_size=WORLD, mfsdp=True):
    flags = MOE + ["--expert-model-parallel-size", str(ep), "--moe-aux-loss-coeff", str(aux), "--clip-grad", "0"]
    if mfsdp:
        flags += ["--use-mfsdp", "--data-parallel-sharding-strategy", strategy]
    return trainer_args("llama", *flags, *extra, world_size=world_size)


def reference_model(args):
    ref_args = moe_args(1, None, args.moe_aux_loss_coeff, world_size=1, mfsdp=False)
    model = gpt_provider(ref_args)
    initialize_parameters_(model, ref_args.seed)
    return model


def global_batch():
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (ROWS * WORLD, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train(args, built, reference, aux: float, check_grads: bool = False):
    """STEPS SGD steps on the same global batch; returns (losses, ref_losses, norms, ref_norms).
    With ``check_grads`` the gradients of the first step are compared with the reference's."""
    optimizer = fully_shard_optimizer(torch.optim.SGD(built.model.parameters(), lr=0.5), context=built.context)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    tokens, labels = global_batch()
    mine = slice(dist.get_rank() * ROWS, (dist.get_rank() + 1) * ROWS)
    set_aux_loss_backward_scale(reference, 1.0 / WORLD)
    set_mtp_loss_backward_scale(reference, 1.0 / WORLD)  # MTP losses are per micro-batch per rank too
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        with microbatch(built.context, is_last=True):
            loss = built.model(tokens[mine], labels=labels[mine]).mean()
            loss.backward()
        ref_optimizer.zero_grad(set_to_none=True)
        ref_loss = reference_backward(reference, tokens, labels, WORLD, per_rank=bool(aux))
        if step == 0 and check_grads:
            compare_grads(built.unwrapped, reference)

        norms.append(float(get_grad_norm_and_clip(args, built)))
        optimizer.step()
        update_expert_biases(built.unwrapped)  # the trainer's call after each step
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / WORLD)
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))))
        ref_optimizer.step()
        update_expert_biases(reference)
        ref_losses.append(ref_loss)
    return losses, ref_losses, norms, ref_norms


def reference_backward(reference, tokens, labels, ranks: int, per_rank: bool) -> float:
    """The reference's loss and backward on the global batch of ``ranks`` data-parallel
    ranks; with ``per_rank`` each rank's rows are one micro-batch of a gradient
    accumulation (the router losses are per micro-batch)."""
    if not per_rank:
        loss = reference(tokens, labels=labels).mean()
        loss.backward()
        return float(loss.detach())
    total, rows = 0.0, tokens.shape[0] // ranks
    for r in range(ranks):
        mine = slice(r * rows, (r + 1) * rows)
        part = reference(tokens[mine], labels=labels[mine]).mean() / ranks
        part.backward()
        total += float(part.detach())
    return total


def full_grads(model):
    """name -> the whole gradient of every parameter on this rank (sharded ones gathered)."""
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    sharded = [(n, p.grad) for n, p in named if hasattr(p.grad, "to_local")]
    fulls = dict(zip([n for n, _ in sharded], full_tensors([g for _, g in sharded]))) if sharded else {}
    return {n: fulls[n] if n in fulls else p.grad.detach().clone() for n, p in named}


def compare_grads(model, reference, rtol=1e-4, atol=1e-6):
    """Every gradient is this rank's piece of the reference's gradient (experts by global index)."""
    pieces = global_slices_by_name(model)
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for name, grad in full_grads(model).items():
        ref = expected[name]
        if name in pieces:
            ref = pieces[name].take(ref)
        torch.testing.assert_close(grad, ref, rtol=rtol, atol=atol, msg=lambda m: f"grad of {name}: {m}")


def compare_weights(built, reference, rtol=2e-5, atol=2e-6):
    """Every weight equals the reference's piece of the same global tensor (a parameter
    with ``global_slices`` holds this rank's experts of the reference's global one)."""
    pieces = {id(getattr(module, attr)): piece for module in built.unwrapped.modules()
              for attr, piece in global_slices_of(module).items()}
    expected = dict(reference.named_parameters())
    params = dict(built.unwrapped.named_parameters())
    for name, full in full_weights(built.unwrapped).items():
        ref = expected[name].detach()
        if id(params[name]) in pieces:
            ref = pieces[id(params[name])].take(ref)
        torch.testing.assert_close(full, ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def run_case(ep, strategy, aux, *extra, check_grads=False):
    args = moe_args(ep, strategy, aux, *extra)
    built = build_model(gpt_provider, args, torch.device("cpu"))
    reference = reference_model(args)
    result = train(args, built, reference, aux, check_grads)
    return built, reference, result


@pytest.mark.parametrize("aux", [0.0, 0.1])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
@pytest.mark.parametrize("ep", EP_SIZES)
def test_expert_parallel_matches_ep1_reference(ep, strategy, aux):
    built, reference, (losses, ref_losses, norms, ref_norms) = run_case(ep, strategy, aux)
    assert losses == pytest.approx(ref_losses, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    assert ref_losses[-1] < ref_losses[0]  # the steps did something
    compare_weights(built, reference)
    # --log-params-norm and --log-num-zeros-in-grad count every expert once, at any EP size.
    params = [p for p in built.unwrapped.parameters() if p.requires_grad]
    ref_params = list(reference.parameters())
    assert float(get_params_norm_of(moe_args(ep, strategy, aux), built, params)) == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in ref_params]))), rel=1e-5)
    assert count_zeros_of(moe_args(ep, strategy, aux), built, params) == sum(int((p.grad == 0).sum()) for p in ref_params)


@pytest.mark.parametrize("extra", [("--recompute-granularity", "full"), ("--moe-grouped-gemm",),
                                   ("--mtp-num-layers", "1", "--moe-router-enable-expert-bias",
                                    "--moe-router-score-function", "sigmoid"),
                                   ("--moe-shared-expert-intermediate-size", "16", "--moe-z-loss-coeff", "0.01"),
                                   ("--moe-expert-capacity-factor", "1.0")])
def test_expert_parallel_with_recompute_grouped_gemm_shared_experts_and_dropping(extra):
    """Full recompute (the all-to-all runs again in backward), grouped GEMM, shared experts
    with the z-loss, and capacity dropping (per micro-batch per rank, like the aux loss) at
    the largest EP size, still equal to the EP=1 reference."""
    ep = EP_SIZES[-1]
    args = moe_args(ep, "optim_grads_params", 0.1, *extra)
    built = build_model(gpt_provider, args, torch.device("cpu"))
    ref_args = moe_args(1, None, 0.1, *extra, world_size=1, mfsdp=False)
    reference = gpt_provider(ref_args)
    initialize_parameters_(reference, ref_args.seed)
    losses, ref_losses, norms, ref_norms = train(args, built, reference, 0.1)
    assert losses == pytest.approx(ref_losses, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    compare_weights(built, reference)
    if "--moe-expert-capacity-factor" in extra:
        assert collect_moe_metrics(built.unwrapped)["moe_dropped_tokens"] > 0  # the case drops tokens


def test_expert_parallel_without_mfsdp_is_mfsdp_no_shard_and_matches_the_reference():
    """Upstream's command lines run EP under DDP: here that is MFSDP no_shard (DDP's layout)."""
    ep = EP_SIZES[-1]
    args = moe_args(ep, None, 0.1, mfsdp=False)
    assert args.use_mfsdp == (ep > 1) and (ep == 1 or args.data_parallel_sharding_strategy == "no_shard")
    built = build_model(gpt_provider, args, torch.device("cpu"))
    reference = reference_model(args)
    losses, ref_losses, norms, ref_norms = train(args, built, reference, 0.1)
    assert losses == pytest.approx(ref_losses, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    compare_weights(built, reference)


@pytest.mark.parametrize("modules", [("moe", "layernorm"), ("moe_act", "shared_experts", "layernorm", "core_attn")])
def test_expert_parallel_with_recompute_modules_matches_the_reference_without(modules):
    """--recompute-modules at the largest EP size (the MoE layer's all-to-alls run again in
    backward with "moe"), against the EP=1 reference that recomputes nothing."""
    ep = EP_SIZES[-1]
    common = ("--moe-grouped-gemm", "--moe-shared-expert-intermediate-size", "16")
    args = moe_args(ep, "optim_grads_params", 0.1, *common, "--recompute-granularity", "selective",
                    "--recompute-modules", *modules)
    built = build_model(gpt_provider, args, torch.device("cpu"))
    ref_args = moe_args(1, None, 0.1, *common, world_size=1, mfsdp=False)
    assert ref_args.recompute_granularity is None
    reference = gpt_provider(ref_args)
    initialize_parameters_(reference, ref_args.seed)
    losses, ref_losses, norms, ref_norms = train(args, built, reference, 0.1, check_grads=True)
    assert losses == pytest.approx(ref_losses, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    compare_weights(built, reference)


@pytest.mark.parametrize("hybrid", sorted(HYBRIDS))
def test_expert_parallel_under_hsdp_and_hfsdp_matches_the_reference(hybrid):
    """Dense units over ("outer", "inner"), experts over ("expert_outer", "expert_inner")
    (EP=2 at 4 ranks, EP=1 at 2), with the aux loss: the losses, norms, first gradients
    (experts by global index) and weights are the reference's."""
    built, reference, (losses, ref_losses, norms, ref_norms) = run_case(
        HYBRID_EP, "optim_grads_params", 0.1, *HYBRIDS[hybrid], check_grads=True)
    if dist.get_rank() == 0:
        print(f"\nEP={HYBRID_EP} {hybrid}: losses {losses} reference {ref_losses}")
    expert = built.unwrapped.decoder.layers[0].mlp.experts.linear_fc1.weight
    assert expert.device_mesh.mesh_dim_names == ("expert_outer", "expert_inner")
    assert losses == pytest.approx(ref_losses, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    assert ref_losses[-1] < ref_losses[0]
    compare_weights(built, reference)


def test_an_expert_layout_built_for_another_number_of_instances_is_refused():
    """Experts built on a 1-D expert-data-parallel mesh would miss the run's HSDP level."""
    args = moe_args(HYBRID_EP, "optim_grads_params", 0.0)
    layer = gpt_provider(args).decoder.layers[0]
    with pytest.raises(ValueError, match=r"built for 1 distributed-optimizer instance\(s\).*dp_outer_size=2"):
        model_builder.shard_experts(layer, moe_args(HYBRID_EP, "optim_grads_params", 0.0, *HYBRIDS["hsdp"]), None)


WRONG_DIVISORS = sorted({1 if EP_SIZES[-1] > 1 else 2, 2 * EP_SIZES[-1]})


@pytest.mark.parametrize("divisor", WRONG_DIVISORS)
def test_wrong_expert_grad_divisor_breaks_parity(divisor, monkeypatch):
    """The parity test can fail: experts sharded with any other grad_divisor than the EP
    size train differently from the reference."""
    ep = EP_SIZES[-1]

    def shard_with_wrong_divisor(layer, args, policy):
        moe = layer.mlp
        placements = model_builder.build_placements(args, moe.expert_parallel.expert_dp_dims)
        return [fully_shard(moe.experts, moe.expert_parallel.expert_dp_mesh, placements,
                            mixed_precision_policy=policy, grad_divisor=divisor)]

    monkeypatch.setattr(model_builder, "shard_experts", shard_with_wrong_divisor)
    built, reference, _ = run_case(ep, "optim_grads_params", 0.0)
    with pytest.raises(AssertionError, match="not close"):
        compare_weights(built, reference)


def test_experts_without_the_outer_reduction_break_parity(monkeypatch):
    """The HSDP parity test can fail: experts sharded over one instance's expert_inner only
    (no average over the instances) train differently from the reference."""
    from megatron.core.distributed.mfsdp_v2 import Placements

    def shard_within_one_instance(layer, args, policy):
        moe = layer.mlp
        return [fully_shard(moe.experts, moe.expert_parallel.mesh["expert_inner"], Placements.zero3("expert_inner"),
                            mixed_precision_policy=policy, grad_divisor=moe.expert_parallel.size)]

    monkeypatch.setattr(model_builder, "shard_experts", shard_within_one_instance)
    built, reference, _ = run_case(HYBRID_EP, "optim_grads_params", 0.0, *HYBRIDS["hsdp"])
    with pytest.raises(AssertionError, match="not close"):
        compare_weights(built, reference)


def test_expert_weights_are_pieces_of_the_ep1_weights():
    """Same seed, any EP size: this rank's experts are its rows of the EP=1 initial weights."""
    ep = EP_SIZES[-1]
    built = build_model(gpt_provider, moe_args(ep, "optim_grads_params", 0.0), torch.device("cpu"))
    compare_weights(built, reference_model(moe_args(ep, "optim_grads_params", 0.0)), rtol=0, atol=0)


def shared_tmp_dir(tmp_path_factory, name: str) -> str:
    """One temporary directory for all ranks (rank 0's)."""
    holder = [str(tmp_path_factory.mktemp(name)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    return holder[0]


def test_checkpoint_stores_experts_globally_and_loads_at_every_ep_size(tmp_path_factory):
    """Saved at the largest EP size, after training: loads at every EP size (experts by
    global index), and the offline reader sees the global [experts * rows, ...] tensors."""
    from megatron.core.distributed.mfsdp_v2.checkpoint import load_checkpoint, load_tensors, save_checkpoint

    path = shared_tmp_dir(tmp_path_factory, "moe_ckpt")
    ep = EP_SIZES[-1]
    built, reference, _ = run_case(ep, "optim_grads_params", 0.0)
    save_checkpoint(built.model, None, path, pieces=global_slices_by_name(built.model))
    for load_ep in EP_SIZES:
        for strategy in ("optim_grads_params", "optim"):
            fresh = build_model(gpt_provider, moe_args(load_ep, strategy, 0.0), torch.device("cpu"))
            load_checkpoint(fresh.model, None, path, pieces=global_slices_by_name(fresh.model))
            compare_weights(fresh, reference)
    key = "model.decoder.layers.0.mlp.experts.linear_fc1.weight"
    offline = load_tensors(path, [key])[key]
    torch.testing.assert_close(offline, dict(reference.named_parameters())[key[len("model."):]].detach(),
                               rtol=2e-5, atol=2e-6)


def test_checkpoint_saved_with_experts_under_hsdp_loads_at_ep1_zero3(tmp_path_factory):
    """Saved at EP=2 under HSDP (EP=1 at 2 ranks) after training: loads into EP=1 ZeRO-3
    with the reference's weights and the saved model's logits."""
    from megatron.core.distributed.mfsdp_v2.checkpoint import load_checkpoint, save_checkpoint

    path = shared_tmp_dir(tmp_path_factory, "moe_hsdp_ckpt")
    built, reference, _ = run_case(HYBRID_EP, "optim_grads_params", 0.0, *HYBRIDS["hsdp"])
    save_checkpoint(built.model, None, path, pieces=global_slices_by_name(built.model))
    tokens, _ = global_batch()
    saved_logits = built.model(tokens)
    fresh = build_model(gpt_provider, moe_args(1, "optim_grads_params", 0.0), torch.device("cpu"))
    load_checkpoint(fresh.model, None, path, pieces=global_slices_by_name(fresh.model))
    compare_weights(fresh, reference)
    logits = fresh.model(tokens)
    torch.testing.assert_close(logits, saved_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, reference(tokens), rtol=1e-4, atol=1e-5)
