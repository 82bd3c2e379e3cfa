"""Every recompute variant under MFSDP ZeRO-3 (and DDP) gives the no-recompute gradients."""

import pytest
import torch
import torch.distributed as dist

from _dist_helpers import full_tensors
from _trainer_models import batches, gpt_provider, trainer_args
from megatron.core.pipeline_parallel import forward_backward_no_pipelining
from megatron.training.model_builder import build_model

VARIANTS = {
    "selective": ["--recompute-granularity", "selective"],
    # --recompute-modules: the norms' outputs and the whole MLP recomputed (recompute.py).
    "modules": ["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp", "core_attn"],
    "full": ["--recompute-granularity", "full"],
    "uniform2": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
    "block2": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
}
SHAPE = ["--num-layers", "3"]


def _forward_step(data_iterator, model):
    from pretrain_gpt import forward_step

    return forward_step(data_iterator, model)


def gradients(flags):
    args = trainer_args("llama", *SHAPE, *flags)
    built = build_model(gpt_provider, args, torch.device("cpu"))
    built.model.train()
    world, rank = dist.get_world_size(), dist.get_rank()
    (batch,) = batches(1, args.micro_batch_size, args.global_batch_size, args.seq_length, 96)
    per_rank = args.global_batch_size // world
    mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
    mbs = [{k: v[i:i + args.micro_batch_size] for k, v in mine.items()} for i in range(0, per_rank, args.micro_batch_size)]
    forward_backward_no_pipelining(_forward_step, iter(mbs), built.model, len(mbs), context=built.context)
    grads = {n: p.grad for n, p in built.unwrapped.named_parameters()}
    sharded = [n for n, g in grads.items() if hasattr(g, "to_local")]
    fulls = dict(zip(sharded, full_tensors([grads[n] for n in sharded]))) if sharded else {}
    return {n: fulls.get(n, g) for n, g in grads.items()}


@pytest.mark.parametrize("engine", ["mfsdp", "ddp"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_recompute_matches_no_recompute_gradients(engine, variant):
    base = ["--use-mfsdp"] if engine == "mfsdp" else []
    expected = gradients(base)
    got = gradients(base + VARIANTS[variant])
    assert got.keys() == expected.keys()
    for name in expected:
        assert expected[name].abs().sum() > 0, name
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)
