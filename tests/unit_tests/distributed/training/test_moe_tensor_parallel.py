"""MoE under tensor parallelism (experts split over TP, EP inside each TP coordinate)
equals a single-process TP=1/EP=1 reference.

Built by the trainer's flags and model builder: TP=2 x EP=2 (DP=2) and TP=2 x EP=1, with
and without sequence parallelism, in fp32, dropless, with and without the router losses.
The reference is the same GPT on one process from the same seed (the invariant
initializer cuts every TP/EP piece from the same global tensors, checked bitwise). Each
data-parallel rank trains on its rows of the global batch (the same on both TP ranks);
with the router losses on, the reference runs each data-parallel rank's rows as one
micro-batch of a gradient accumulation (the losses are per micro-batch, Megatron's
definition). Compared: losses, gradient norms, every gradient after the first backward
(experts by global index), every weight after training, and the logged token loads and
router losses.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from _trainer_models import gpt_provider, trainer_args
from megatron.core.transformer.moe.expert_bias import update_expert_biases
from megatron.core import parallel_state
from megatron.core.distributed.mfsdp_v2 import fully_shard_optimizer, microbatch
from megatron.core.global_slices import global_slices_by_name
from megatron.core.transformer.initialization import initialize_parameters_
from megatron.core.transformer.moe import moe_layer, router
from megatron.core.transformer.moe.metrics import collect_moe_metrics
from megatron.core.transformer.moe.router import set_aux_loss_backward_scale
from megatron.core.transformer.multi_token_prediction import collect_mtp_metrics, set_mtp_loss_backward_scale
from megatron.training.model_builder import build_model, finalize_model_grads, get_grad_norm_and_clip
from test_moe_expert_parallel import compare_grads, compare_weights, reference_backward

WORLD = dist.get_world_size()
SEQ, VOCAB, STEPS, ROWS = 16, 96, 3, 2  # ROWS per data-parallel rank
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --clip-grad 0".split()
# The router-loss cases also run a shared expert (a dense TP MLP); the others the grouped GEMM.
ROUTER_LOSSES = "--moe-aux-loss-coeff 0.1 --moe-z-loss-coeff 0.01 --moe-shared-expert-intermediate-size 16".split()
NO_ROUTER_LOSSES = ["--moe-grouped-gemm"]

# (TP, EP, sequence parallel) that fit the world; TP=1 at one rank (a run without torchrun).
LAYOUTS = [(tp, ep, sp) for tp, ep, sp in ((2, 2, False), (2, 1, False), (2, 2, True), (2, 1, True))
           if WORLD % tp == 0 and (WORLD // tp) % ep == 0 and not (sp and ep == 1 and WORLD >= 4)] or [(1, 1, False)]
# Each layout with and without the router losses: SwiGLU experts without biases (grouped
# GEMM), GELU experts with biases (and a shared expert).
CASES = [(layout, arch, losses) for layout in LAYOUTS for arch, losses in (("llama", False), ("gpt2", True))]


@contextlib.contextmanager
def tensor_parallel(tp: int, instances: int = 1):
    """The trainer's parallel state for TP size ``tp`` and ``instances`` HSDP instances (model providers read it)."""
    parallel_state.destroy_model_parallel()
    state = parallel_state.initialize_model_parallel(tp, instances, "cpu")
    try:
        yield state
    finally:
        parallel_state.destroy_model_parallel()


def moe_args(arch: str, tp: int, ep: int, sp: bool, losses: bool, world_size=WORLD, instances=1, extra=()):
    flags = MOE + (ROUTER_LOSSES if losses else NO_ROUTER_LOSSES) + ["--expert-model-parallel-size", str(ep),
                                                                     "--use-mfsdp", *extra]
    flags += ["--num-distributed-optimizer-instances", str(instances)] if instances > 1 else []
    if tp > 1:
        flags += ["--tensor-model-parallel-size", str(tp)] + (["--sequence-parallel"] if sp else [])
    return trainer_args(arch, *flags, world_size=world_size)


def reference_model(arch: str, losses: bool, extra=()):
    args = moe_args(arch, 1, 1, False, losses, world_size=1, extra=extra)
    model = gpt_provider(args)
    initialize_parameters_(model, args.seed)
    return model


def global_batch(dp: int):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (ROWS * dp, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train(args, built, reference, state, losses: bool, check_grads: bool = True):
    """STEPS SGD steps on the same global batch; (losses, ref_losses, norms, ref_norms).
    The gradients of the first step are compared with the reference's (``check_grads``)."""
    dp = state.dp_size
    optimizer = fully_shard_optimizer(torch.optim.SGD(built.model.parameters(), lr=0.5), context=built.context)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    tokens, labels = global_batch(dp)
    mine = slice(state.dp_rank * ROWS, (state.dp_rank + 1) * ROWS)
    set_aux_loss_backward_scale(reference, 1.0 / dp)
    set_mtp_loss_backward_scale(reference, 1.0 / dp)  # MTP losses are per micro-batch too
    out = ([], [], [], [])
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        with microbatch(built.context, is_last=True):
            loss = built.model(tokens[mine], labels=labels[mine]).mean()
            loss.backward()
        finalize_model_grads(args, built)

        ref_optimizer.zero_grad(set_to_none=True)
        ref_loss = reference_backward(reference, tokens, labels, dp, per_rank=losses)
        if step == 0 and check_grads:
            compare_grads(built.unwrapped, reference)

        out[2].append(float(get_grad_norm_and_clip(args, built)))
        out[3].append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))))
        optimizer.step()
        update_expert_biases(built.unwrapped)  # the trainer's call after each step
        ref_optimizer.step()
        update_expert_biases(reference)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=state.dp_group)
        out[0].append(float(loss) / dp)
        out[1].append(ref_loss)
    return out


def run_case(arch, tp, ep, sp, losses, check_grads=True, instances=1):
    """Build at (TP, EP, SP) with ``instances`` HSDP instances, check the initial weights
    bitwise, train; (built, reference, result, logged MoE metrics)."""
    with tensor_parallel(tp, instances) as state:
        args = moe_args(arch, tp, ep, sp, losses, instances=instances)
        built = build_model(gpt_provider, args, torch.device("cpu"))
        reference = reference_model(arch, losses)
        compare_weights(built, reference, rtol=0, atol=0)  # the same global weights at every layout
        result = train(args, built, reference, state, losses, check_grads)
        metrics = collect_moe_metrics(built.unwrapped, group=state.dp_group)
    return built, reference, result, metrics


@pytest.mark.parametrize("layout,arch,losses", CASES, ids=[f"tp{t}-ep{e}{'-sp' if s else ''}-{a}{'-aux' if x else ''}"
                                                           for (t, e, s), a, x in CASES])
def test_moe_with_tensor_parallelism_matches_the_reference(layout, arch, losses):
    tp, ep, sp = layout
    built, reference, (mine, ref, norms, ref_norms), metrics = run_case(arch, tp, ep, sp, losses)
    if dist.get_rank() == 0:
        print(f"\n{layout} {arch} losses={losses}: losses {mine} reference {ref}")
    assert mine == pytest.approx(ref, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    assert ref[-1] < ref[0]  # the steps did something
    compare_weights(built, reference)
    # Logged once per token: the router losses and the token loads are the reference's.
    ref_metrics = collect_moe_metrics(reference, group=this_rank_alone())
    for layer in (1, 2):
        key = f"moe/layer{layer}/"
        dp = WORLD // tp
        # A micro-batch of the whole data-parallel world: ROWS x SEQ tokens per rank, top-2 of 4 experts.
        assert metrics[key + "mean_tokens_per_expert"] == pytest.approx(dp * ROWS * SEQ * 2 / 4)
        if losses:
            for name in ("load_balancing_loss", "z_loss"):
                assert metrics[key + name] == pytest.approx(ref_metrics[key + name], rel=1e-5)
        else:  # the reference ran the same micro-batch of the whole world
            assert metrics[key + "max_tokens_per_expert"] == ref_metrics[key + "max_tokens_per_expert"]


MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}-ep{e}{'-sp' if s else ''}" for t, e, s in LAYOUTS])
def test_multi_token_prediction_under_tensor_and_expert_parallelism(layout):
    """Two MTP depths (MoE layers, as the last decoder layer) sharing the vocab-parallel
    embedding and output layer, with the router losses, against the TP=1/EP=1 reference."""
    tp, ep, sp = layout
    with tensor_parallel(tp) as state:
        args = moe_args("gpt2", tp, ep, sp, True, extra=MTP)
        built = build_model(gpt_provider, args, torch.device("cpu"))
        reference = reference_model("gpt2", True, extra=MTP)
        compare_weights(built, reference, rtol=0, atol=0)
        mine, ref, norms, ref_norms = train(args, built, reference, state, True)
        logged = collect_mtp_metrics(built.unwrapped, group=state.dp_group)
    assert mine == pytest.approx(ref, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    compare_weights(built, reference)
    ref_logged = collect_mtp_metrics(reference, group=this_rank_alone())
    assert list(logged) == ["mtp_1 loss", "mtp_2 loss"]
    # The reference ran each data-parallel rank's rows as a micro-batch: the same mean.
    assert [logged[k] for k in logged] == pytest.approx([ref_logged[k] for k in logged], rel=1e-5)


# TP=2 under HSDP over 2 instances: (TP, EP) with EP | the ranks of one instance (TP=1 at 2 ranks).
HSDP_LAYOUT = (2, WORLD // 4) if WORLD >= 4 else (1, 1)


def test_moe_with_tensor_parallelism_under_hsdp_matches_the_reference():
    """Dense units over ("outer", "inner") x TP, experts over ("expert_outer",
    "expert_inner") x TP (mesh (expert_outer, expert_inner, ep, tp)), router losses on."""
    tp, ep = HSDP_LAYOUT
    built, reference, (mine, ref, norms, ref_norms), _ = run_case("gpt2", tp, ep, False, True, instances=2)
    if dist.get_rank() == 0:
        print(f"\nTP={tp} EP={ep} HSDP: losses {mine} reference {ref}")
    assert built.unwrapped.decoder.layers[0].mlp.experts.linear_fc1.weight.device_mesh.mesh_dim_names == (
        "expert_outer", "expert_inner")
    assert mine == pytest.approx(ref, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    compare_weights(built, reference)


_ALONE = []


def this_rank_alone():
    """A process group of this rank only (the reference is a model of one process)."""
    if not _ALONE:
        _ALONE.append(dist.new_subgroups(group_size=1)[0])
    return _ALONE[0]


def _identity(x, group):
    return x


# Each would be a silent error: without the TP sum of the experts' outputs, or with every
# TP rank's sequence chunk weighing its router losses as a whole micro-batch.
# (what, the first layout with TP and that sequence parallelism, what to break there)
BROKEN = [(what, next(layout for layout in LAYOUTS if layout[0] > 1 and layout[2] == sp), name)
          for what, sp, name in (("no TP sum of the expert outputs", False, "reduce_from_tensor_model_parallel_region"),
                                 ("router losses not shared over the sequence chunks", True, "sequence_group"))
          if any(layout[0] > 1 and layout[2] == sp for layout in LAYOUTS)]


@pytest.mark.parametrize("what,layout,name", BROKEN or [("none", (1, 1, False), None)])
def test_parity_fails_without_the_tensor_parallel_reductions(what, layout, name, monkeypatch):
    if name is None:  # one rank: no TP to break; the reference itself still has to match
        _, _, (mine, ref, _, _), _ = run_case("gpt2", *layout, True)
        assert mine == pytest.approx(ref, rel=2e-5)
        return
    if name == "sequence_group":
        monkeypatch.setattr(router.TopKRouter, "sequence_group", property(lambda self: None))
    else:
        monkeypatch.setattr(moe_layer, name, _identity)
    _, _, (mine, ref, norms, ref_norms), _ = run_case("gpt2", *layout, True, check_grads=False)
    # Decided together: TP ranks may be wrong in different ways.
    matches = torch.tensor([float(mine == pytest.approx(ref, rel=2e-5) and norms == pytest.approx(ref_norms, rel=2e-5))])
    dist.all_reduce(matches, op=dist.ReduceOp.MIN)
    assert matches.item() == 0.0, f"{what}: still equal to the reference"


def test_checkpoint_saved_with_tensor_and_expert_parallelism_loads_at_tp1_ep1(tmp_path_factory):
    """Saved at TP=2 x EP=2 (or the largest layout that fits) after training: loads at
    TP=1/EP=1 with the same weights and logits, and the offline reader sees the global
    stacked experts (``linear_fc2`` cut along two dims: experts, then TP columns)."""
    from megatron.core.distributed.mfsdp_v2.checkpoint import load_checkpoint, load_tensors, save_checkpoint

    path = str(tmp_path_factory.mktemp("moe_tp_ckpt")) if dist.get_rank() == 0 else None
    holder = [path]
    dist.broadcast_object_list(holder)
    path = holder[0]
    tp, ep, sp = LAYOUTS[0]
    built, reference, _, _ = run_case("gpt2", tp, ep, sp, False)
    tokens, _ = global_batch(1)
    world = dist.group.WORLD  # the engine's meshes are data-parallel only (what the trainer passes under TP)
    save_checkpoint(built.model, None, path, process_group=world, pieces=global_slices_by_name(built.model))
    saved_logits = built.model(tokens)
    fresh = build_model(gpt_provider, moe_args("gpt2", 1, 1, False, False), torch.device("cpu"))
    load_checkpoint(fresh.model, None, path, process_group=world, pieces=global_slices_by_name(fresh.model))
    compare_weights(fresh, reference)
    logits = fresh.model(tokens)
    torch.testing.assert_close(logits, saved_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, reference(tokens), rtol=1e-4, atol=1e-5)
    keys = [f"model.decoder.layers.0.mlp.experts.linear_fc{i}.weight" for i in (1, 2)]
    offline = load_tensors(path, keys)
    expected = dict(reference.named_parameters())
    for key in keys:
        torch.testing.assert_close(offline[key], expected[key[len("model."):]].detach(), rtol=2e-5, atol=2e-6)


def test_an_expert_layout_built_for_another_tp_size_is_refused():
    """EP and expert-data-parallel groups built without the TP dimension would mix
    different TP pieces of the experts: the MoE layer refuses such a layout."""
    from megatron.core.transformer.moe.expert_parallel import build_expert_parallel
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from pretrain_gpt import core_transformer_config_from_args

    tp = LAYOUTS[0][0]
    with tensor_parallel(tp):
        config = core_transformer_config_from_args(moe_args("llama", tp, 1, False, False))
        assert MoELayer(config, 1, build_expert_parallel(1, "cpu", tp_size=tp)).experts.linear_fc2.weight.shape[1] == 32 // tp
        if tp > 1:
            with pytest.raises(ValueError, match=f"built for TP size 1.*build_expert_parallel\\(..., tp_size={tp}\\)"):
                MoELayer(config, 1, build_expert_parallel(1, "cpu", tp_size=1))
