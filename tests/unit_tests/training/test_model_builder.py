"""The model builder: flags -> placements/mesh, layers wrapped inside one context, and a
microbatched MFSDP step (world of one) equal to the plain model's full-batch step."""

import argparse
import copy
import sys
from functools import partial

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from megatron.core.distributed.mfsdp_v2 import FsdpModule, Placements
from megatron.core.distributed.mfsdp_v2.placements import decode_strategy
from megatron.core.pipeline_parallel import forward_backward_no_pipelining
from megatron.core.transformer.initialization import initialize_parameters_
from megatron.training.arguments import parse_args
from megatron.training.model_builder import build_model, build_optimizer, build_placements, get_grad_norm_and_clip


def ns(strategy, outer=1, outer_strategy="no_shard"):
    return argparse.Namespace(data_parallel_sharding_strategy=strategy, dp_outer_size=outer,
                              outer_dp_sharding_strategy=outer_strategy)


@pytest.mark.parametrize(
    "strategy, preset",
    [("no_shard", Placements.no_shard), ("optim", Placements.zero1),
     ("optim_grads", Placements.zero2), ("optim_grads_params", Placements.zero3)],
)
def test_zero_levels_map_to_presets(strategy, preset):
    assert build_placements(ns(strategy)) == preset("dp")


def test_instances_map_to_hsdp_and_hfsdp():
    assert build_placements(ns("optim_grads_params", 2, "no_shard")) == Placements.hsdp("outer", "inner")
    assert build_placements(ns("optim_grads_params", 2, "optim")) == Placements.hfsdp("outer", "inner")
    zero2_hsdp = build_placements(ns("optim_grads", 2, "no_shard"))
    assert zero2_hsdp.parameter == (Replicate(), Replicate())
    assert zero2_hsdp.gradient == (Partial("avg"), Shard(0))
    assert zero2_hsdp.optimizer == (Replicate(), Shard(0))


def test_every_mapped_combination_is_supported_by_the_engine(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh

    mesh1 = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("outer", "inner"))
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        decode_strategy(build_placements(ns(strategy)), mesh1)
        decode_strategy(build_placements(ns(strategy, 2, "no_shard")), mesh2)
    decode_strategy(build_placements(ns("optim_grads_params", 2, "optim")), mesh2)


def test_outer_optim_with_unsupported_inner_strategy_is_rejected_at_parse_time():
    base = ("--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
            "--lr 1e-3 --train-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --use-mfsdp "
            "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim").split()
    for inner in ("no_shard", "optim", "optim_grads"):
        with pytest.raises(ValueError, match="use --data-parallel-sharding-strategy optim_grads_params"):
            parse_args(base + ["--data-parallel-sharding-strategy", inner], world_size=2, cuda_available=False)
    # HSDP (outer no_shard) accepts every inner strategy.
    base_hsdp = base[: base.index("--outer-dp-sharding-strategy")]
    args = parse_args(base_hsdp + ["--data-parallel-sharding-strategy", "optim"], world_size=2, cuda_available=False)
    assert args.dp_outer_size == 2 and args.dp_inner_size == 1


# --- end to end in a world of one ----------------------------------------------------------

ARGV = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 8 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-2 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 64 --hidden-dropout 0 --attention-dropout 0 --clip-grad 0.5").split()


def _gpt_provider(args):
    sys.path.insert(0, ".")
    from pretrain_gpt import model_provider

    return model_provider(args)


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (8, 9), generator=g)
    mask = (torch.rand(8, 8, generator=g) > 0.3).float()
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
            "position_ids": torch.arange(8).expand(8, 8)}


def _forward_step(data_iterator, model):
    from pretrain_gpt import forward_step

    return forward_step(data_iterator, model)


def test_mfsdp_model_step_equals_plain_full_batch_step(world_of_one):
    sys.path.insert(0, ".")
    args = parse_args(ARGV + ["--use-mfsdp"], world_size=1, cuda_available=False)
    args.padded_vocab_size = 64
    torch.manual_seed(0)
    built = build_model(_gpt_provider, args, torch.device("cpu"))
    plain = _gpt_provider(args)
    initialize_parameters_(plain, args.seed)  # what build_model does, unsharded

    assert built.context is not None and built.context.finalized
    layers = list(built.model.decoder.layers)
    assert all(isinstance(l, FsdpModule) for l in layers) and isinstance(built.model, FsdpModule)
    assert built.context.roots == [built.model]
    optimizer, scheduler = build_optimizer(args, built)
    assert getattr(optimizer, "_mfsdp_context", None) is built.context

    # MFSDP: 4 microbatches of 2 through the schedule (microbatch(context, is_last=...)).
    batch = _batch()
    mbs = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    optimizer.zero_grad()
    forward_backward_no_pipelining(_forward_step, iter(mbs), built.model, 4, context=built.context)
    norm = get_grad_norm_and_clip(args, built)

    # Plain: one full batch, loss normalized by its token count, torch's clipping.
    plain.zero_grad()
    out = plain(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    ((out * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)

    sharded = dict(built.unwrapped.named_parameters())
    for name, p in plain.named_parameters():
        g = sharded[name].grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=name)
