"""The planner's per-rank persistent bytes and per-step collective bytes equal what the
engine measures (FsdpContext.persistent_bytes(), FsdpContext.counter) on trainer-built
models at 2 and 4 ranks; its output also reaches tools/estimate_memory.py."""

import pytest
import torch
import torch.distributed as dist

from _trainer_models import REPO, batches, gpt_provider, trainer_args
from megatron.core.distributed.mfsdp_v2.estimate import ActivationShape, activation_bytes, plan, units_of
from megatron.core.pipeline_parallel import forward_backward_no_pipelining
from megatron.training.model_builder import build_model, build_optimizer

FLAGS = {
    "zero1": ["--data-parallel-sharding-strategy", "optim"],
    "zero2": ["--data-parallel-sharding-strategy", "optim_grads"],
    "zero3": [],
    "hsdp": ["--num-distributed-optimizer-instances", "2"],
    "hfsdp": ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"],
}
# Widths chosen so that rows do not split evenly over 4 ranks (padding is exercised).
SHAPE = "--num-layers 3 --hidden-size 48 --num-attention-heads 4 --ffn-hidden-size 80".split()


def _forward_step(data_iterator, model):
    from pretrain_gpt import forward_step

    return forward_step(data_iterator, model)


def one_step(built, args):
    optimizer, _ = build_optimizer(args, built)
    world, rank = dist.get_world_size(), dist.get_rank()
    (batch,) = batches(1, args.micro_batch_size, args.global_batch_size, args.seq_length, 96)
    per_rank = args.global_batch_size // world
    mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
    mbs = [{k: v[i:i + args.micro_batch_size] for k, v in mine.items()} for i in range(0, per_rank, args.micro_batch_size)]
    built.context.counter.reset()
    forward_backward_no_pipelining(_forward_step, iter(mbs), built.model, len(mbs), context=built.context)
    optimizer.step()
    return optimizer, len(mbs)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("strategy", sorted(FLAGS))
def test_planner_matches_engine_measurements(strategy, arch):
    world = dist.get_world_size()
    if strategy in ("hsdp", "hfsdp") and world % 2:
        strategy = "zero3"  # an odd world has no two replicas
    args = trainer_args(arch, "--use-mfsdp", "--global-batch-size", str(4 * world), *SHAPE, *FLAGS[strategy])
    built = build_model(gpt_provider, args, torch.device("cpu"))
    units = units_of(built.unwrapped, list(built.unwrapped.decoder.layers) + [built.unwrapped])
    optimizer, microbatches = one_step(built, args)
    outer = args.dp_outer_size if strategy in ("hsdp", "hfsdp") else 1
    predicted = plan(units, strategy, world, outer_size=outer, microbatches=microbatches,
                     rank=dist.get_rank())

    measured = built.context.persistent_bytes()
    for key in ("main_weight", "model_weight", "main_grad"):
        assert predicted.persistent[key] == measured[key], (key, predicted.persistent, measured)
    adam = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for state in optimizer.state.values() for k, t in state.items() if k in ("exp_avg", "exp_avg_sq"))
    assert predicted.persistent["optimizer_state"] == adam
    assert predicted.comm_bytes == built.context.counter.bytes_by_kind()


def test_ddp_plan_is_the_whole_model_on_every_rank():
    args = trainer_args("gpt2", *SHAPE)
    model = gpt_provider(args)
    units = units_of(model, list(model.decoder.layers) + [model])
    total = sum(p.numel() for p in model.parameters())
    assert sum(u.numel for u in units) == total
    ddp = plan(units, "ddp", 4)
    assert ddp.persistent == dict(main_weight=0, model_weight=4 * total, main_grad=4 * total, optimizer_state=8 * total)
    assert ddp.comm_bytes == {"all_reduce": 4 * total}
    zero3 = plan(units, "zero3", 4)
    assert zero3.persistent_total < ddp.persistent_total / 3.5  # 16 bytes/param over 4 ranks, plus padding


def test_recompute_shrinks_the_activation_estimate():
    shape = ActivationShape(micro_batch_size=2, seq_length=512, hidden_size=256, num_attention_heads=8,
                            ffn_hidden_size=1024, num_layers=8, vocab_size=1000)
    none, selective, full = (activation_bytes(shape, r) for r in (None, "selective", "full"))
    assert full < selective < none
    logits = 2 * 2 * 512 * 1000 * 4
    # Korthikanti's 34 s b h + 5 a s^2 b per layer (16-bit units), doubled for fp32.
    assert none - logits == 8 * (34 * 512 * 2 * 256 + 5 * 8 * 512 * 512 * 2) * 2


def test_bad_strategy_and_outer_size_are_refused():
    units = []
    with pytest.raises(ValueError, match="strategy must be one of"):
        plan(units, "zero4", 2)
    with pytest.raises(ValueError, match="outer size >= 2 that divides"):
        plan(units, "hsdp", 3, outer_size=2)


def test_estimate_memory_tool_reuses_the_trainer_flags(capsys):
    import sys

    sys.path.insert(0, REPO)
    from tools.estimate_memory import main

    plans = main(["--world-size", "4", *SHAPE, "--seq-length", "16", "--micro-batch-size", "2",
                  "--global-batch-size", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
                  "--lr", "1e-3", "--train-iters", "1"])
    out = capsys.readouterr().out
    assert [p.strategy for p in plans] == ["ddp", "zero1", "zero2", "zero3", "hsdp", "hfsdp"]
    for name in ("ddp", "zero1", "zero2", "zero3", "hsdp", "hfsdp", "all_gather", "reduce_scatter"):
        assert name in out
    with pytest.raises(SystemExit, match="--num-attention-heads"):
        main(["--world-size", "2", "--num-layers", "2", "--hidden-size", "30", "--num-attention-heads", "4",
              "--seq-length", "8", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "96", "--lr", "1e-3", "--train-iters", "1"])
