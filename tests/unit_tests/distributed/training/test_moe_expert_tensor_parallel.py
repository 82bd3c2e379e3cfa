"""Experts split apart from TP (``--expert-tensor-parallel-size`` != ``--tensor-model-parallel-size``)
equal a single-process TP=1/EP=1 reference.

The layouts are upstream's expert view of the same ranks (etp innermost, then ep, then
expert-dp): TP=2 with ETP=1 (the EP groups are then the TP groups, or lie across them),
with and without sequence parallelism, and TP=1 with ETP=2 (data-parallel ranks split
each expert). Built by the trainer's flags and model builder, fp32, dropless, with the
router losses and a shared expert on one case; compared as in test_moe_tensor_parallel.py:
losses, gradient norms, every gradient after the first backward, every weight after
training, the logged token loads and router losses. Also: a broken divisor fails, and a
checkpoint saved at ETP=1 x TP=2 loads at TP=1 with the same logits.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from _trainer_models import gpt_provider, trainer_args
from megatron.core import parallel_state
from megatron.core.global_slices import global_slices_by_name
from megatron.core.transformer.moe.expert_parallel import ExpertParallel
from megatron.core.transformer.moe.metrics import collect_moe_metrics
from megatron.training.model_builder import build_model
from test_moe_expert_parallel import compare_grads, compare_weights
from test_moe_tensor_parallel import (MOE, NO_ROUTER_LOSSES, ROUTER_LOSSES, ROWS, SEQ, global_batch, reference_model,
                                      this_rank_alone, train)

WORLD = dist.get_world_size()
# (TP, ETP, EP, sequence parallel, router losses) that fit the world (ETP x EP | the world).
LAYOUTS = [layout for layout in ((2, 1, 2, False, True), (2, 1, 1, True, False),
                                 (1, 2, max(WORLD // 2, 1), False, False), (2, 1, WORLD, True, False))
           if WORLD > 1 and WORLD % layout[0] == 0 and WORLD % (layout[1] * layout[2]) == 0] or [(1, 1, 1, False, False)]
LAYOUTS = list(dict.fromkeys(LAYOUTS))


@contextlib.contextmanager
def expert_view(tp: int, etp: int, ep: int, instances: int = 1):
    """The trainer's parallel state with the expert view (etp, ep) of the same ranks."""
    parallel_state.destroy_model_parallel()
    state = parallel_state.initialize_model_parallel(tp, instances, "cpu", expert_model_parallel_size=ep,
                                                     expert_tensor_parallel_size=etp)
    try:
        yield state
    finally:
        parallel_state.destroy_model_parallel()


def etp_args(tp, etp, ep, sp, losses, instances=1):
    flags = MOE + (ROUTER_LOSSES if losses else NO_ROUTER_LOSSES) + [
        "--use-mfsdp", "--tensor-model-parallel-size", str(tp), "--expert-tensor-parallel-size", str(etp),
        "--expert-model-parallel-size", str(ep)] + (["--sequence-parallel"] if sp else [])
    flags += ["--num-distributed-optimizer-instances", str(instances)] if instances > 1 else []
    return trainer_args("gpt2" if losses else "llama", *flags, world_size=WORLD)


def run_case(tp, etp, ep, sp, losses, check_grads=True, instances=1):
    with expert_view(tp, etp, ep, instances) as state:
        args = etp_args(tp, etp, ep, sp, losses, instances)
        built = build_model(gpt_provider, args, torch.device("cpu"))
        reference = reference_model("gpt2" if losses else "llama", losses)
        compare_weights(built, reference, rtol=0, atol=0)  # the same global weights at every layout
        result = train(args, built, reference, state, losses, check_grads)
        metrics = collect_moe_metrics(built.unwrapped, group=state.dp_group)
    return built, reference, result, metrics


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"tp{t}-etp{e}-ep{p}{'-sp' if s else ''}{'-aux' if x else ''}"
                                                 for t, e, p, s, x in LAYOUTS])
def test_experts_split_apart_from_tp_match_the_reference(layout):
    tp, etp, ep, sp, losses = layout
    built, reference, (mine, ref, norms, ref_norms), metrics = run_case(*layout)
    if dist.get_rank() == 0:
        print(f"\n{layout}: losses {mine} reference {ref}; norms {norms} reference {ref_norms}")
    experts = built.unwrapped.decoder.layers[0].mlp.experts
    assert experts.linear_fc2.weight.shape[-1] == 32 // etp  # split over the expert TP size, not TP
    assert experts.linear_fc1.tensor_parallel_split == () or etp == tp
    assert mine == pytest.approx(ref, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    assert ref[-1] < ref[0]
    compare_weights(built, reference)
    ref_metrics = collect_moe_metrics(reference, group=this_rank_alone())
    dp = WORLD // tp
    for layer in (1, 2):
        key = f"moe/layer{layer}/"
        assert metrics[key + "mean_tokens_per_expert"] == pytest.approx(dp * ROWS * SEQ * 2 / 4)
        if losses:
            for name in ("load_balancing_loss", "z_loss"):
                assert metrics[key + name] == pytest.approx(ref_metrics[key + name], rel=1e-5)
        else:
            assert metrics[key + "max_tokens_per_expert"] == ref_metrics[key + "max_tokens_per_expert"]


def test_experts_split_apart_from_tp_under_hsdp_match_the_reference():
    """HSDP over 2 instances: the expert view (expert_outer, expert_inner, ep, tp) with TP=2,
    ETP=1 at 4 ranks (each instance's 2 ranks are one TP pair). Below 4 ranks no instance
    holds 2 ranks: plain HSDP experts (the same path at ETP = TP)."""
    layout = (2, 1, 1, False, True) if WORLD >= 4 else (1, 1, 1, False, True)
    instances = 2 if WORLD >= 2 else 1
    built, reference, (mine, ref, norms, ref_norms), _ = run_case(*layout, instances=instances)
    if instances > 1:
        mesh = built.unwrapped.decoder.layers[0].mlp.experts.linear_fc1.weight.device_mesh
        assert mesh.mesh_dim_names == ("expert_outer", "expert_inner")
    assert mine == pytest.approx(ref, rel=2e-5)
    assert norms == pytest.approx(ref_norms, rel=2e-5)
    compare_weights(built, reference)


# A layout whose divisor EP x ETP / TP is not EP (1/2 at TP=2, ETP=1, EP=1).
BROKEN = next((layout for layout in LAYOUTS if layout[0] != layout[1]), None)


def test_parity_fails_with_the_expert_parallel_divisor():
    """The divisor EP x ETP / TP matters: the EP size alone gives other weights."""
    if BROKEN is None:  # one rank: nothing to break; the reference itself still has to match
        _, _, (mine, ref, _, _), _ = run_case(*LAYOUTS[0])
        assert mine == pytest.approx(ref, rel=2e-5)
        return
    original = ExpertParallel.grad_divisor
    layout = BROKEN
    try:
        ExpertParallel.grad_divisor = property(lambda self: float(self.size))
        _, _, (mine, ref, norms, ref_norms), _ = run_case(*layout, check_grads=False)
    finally:
        ExpertParallel.grad_divisor = original
    assert not (mine == pytest.approx(ref, rel=2e-5) and norms == pytest.approx(ref_norms, rel=2e-5))


def test_checkpoint_saved_with_experts_apart_from_tp_loads_at_tp1(tmp_path_factory):
    """Saved at the first layout after training: loads at TP=1/EP=1 with the same weights and logits."""
    from megatron.core.distributed.mfsdp_v2.checkpoint import load_checkpoint, save_checkpoint

    path = str(tmp_path_factory.mktemp("moe_etp_ckpt")) if dist.get_rank() == 0 else None
    holder = [path]
    dist.broadcast_object_list(holder)
    path = holder[0]
    tp, etp, ep, sp, losses = LAYOUTS[0]
    built, reference, _, _ = run_case(tp, etp, ep, sp, losses, check_grads=False)
    tokens, _ = global_batch(1)
    world = dist.group.WORLD
    save_checkpoint(built.model, None, path, process_group=world, pieces=global_slices_by_name(built.model))
    saved_logits = built.model(tokens)
    with expert_view(1, 1, 1):
        fresh = build_model(gpt_provider, etp_args(1, 1, 1, False, losses), torch.device("cpu"))
        load_checkpoint(fresh.model, None, path, process_group=world, pieces=global_slices_by_name(fresh.model))
        compare_weights(fresh, reference)
        logits = fresh.model(tokens)
    torch.testing.assert_close(logits, saved_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, reference(tokens), rtol=1e-4, atol=1e-5)
