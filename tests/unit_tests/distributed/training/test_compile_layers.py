"""--compile-layers under MFSDP ZeRO-3 trains like eager: the same losses and gradient norms
(relative 1e-5) over 5 steps, and no recompile after the first step.

The same tiny Llama (the trainer's flags, model builder, schedule, finalize, clip and
optimizer) runs eager, then compiled; alone over the data-parallel ranks, with full and
selective recompute, with TP=2 and sequence parallelism, and with PP=2. The backend is
aot_eager: dynamo and AOTAutograd are what meet the engine (hooks around the graph,
parameters swapped in and out, gradients into the reduce buffers); inductor's code
generation costs about a minute of gcc per process on this CPU and is compared in
benchmarks/compile_layers.py instead.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from _trainer_models import batches, trainer_args
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.training.loss_reports import mean_loss, reduce_reports
from megatron.training.model_builder import (
    build_model, build_optimizer, finalize_model_grads, get_grad_norm_and_clip)

WORLD = dist.get_world_size()
STEPS = 5
CASES = {
    "dp": [],
    "full_recompute": ["--recompute-granularity", "full"],
    "selective_recompute": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"],
}
if WORLD % 2 == 0:  # 2 and 4 ranks (DP=1 and DP=2 beside the TP or PP pair)
    CASES.update(tp2_sp=["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                 pp2=["--pipeline-model-parallel-size", "2"])


def _forward_step(data_iterator, model):
    from pretrain_gpt import forward_step  # the script at the repo root: imported on use, as the other tests do

    return forward_step(data_iterator, model)


def train(flags):
    """(loss, grad norm) of each of STEPS steps on the same global batch."""
    args = trainer_args("llama", "--use-mfsdp", "--micro-batch-size", "1", *flags)
    parallel_state.destroy_model_parallel()
    state = parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, 1, "cpu", pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    try:
        from pretrain_gpt import model_provider  # the trainer's provider; a root script, imported on use

        built = build_model(model_provider, args, torch.device("cpu"))
        optimizer, _ = build_optimizer(args, built)
        built.model.train()
        per_rank = args.global_batch_size // state.dp_size
        history = []
        for step, batch in enumerate(batches(STEPS, 1, args.global_batch_size, args.seq_length, 96)):
            mine = {k: v[state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank] for k, v in batch.items()}
            micro = [{k: v[i:i + 1] for k, v in mine.items()} for i in range(per_rank)]
            # After the first step's compile, any further compile is a recompile: refuse it.
            stance = "fail_on_recompile" if (step > 0 and args.compile_layers) else "default"
            with torch.compiler.set_stance(stance):
                optimizer.zero_grad(set_to_none=True)
                reports = get_forward_backward_func()(
                    _forward_step, iter(micro), built.model, len(micro), context=built.context,
                    seq_length=args.seq_length, micro_batch_size=1, dp_group=state.dp_cp_group)
                finalize_model_grads(args, built)
                norm = float(get_grad_norm_and_clip(args, built, optimizer))
                optimizer.step()
            history.append((mean_loss(reduce_reports(reports)), norm))
        return history
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_layers_train_like_eager(case):
    flags = CASES[case]
    eager = train(flags)
    compiled = train(flags + ["--compile-layers", "aot_eager"])
    for step, ((loss, norm), (c_loss, c_norm)) in enumerate(zip(eager, compiled)):
        assert math.isfinite(loss) and loss > 0
        assert c_loss == pytest.approx(loss, rel=1e-5), (case, step, "loss")
        assert c_norm == pytest.approx(norm, rel=1e-5), (case, step, "grad norm")
    assert eager[-1][0] < eager[0][0]  # it trains
