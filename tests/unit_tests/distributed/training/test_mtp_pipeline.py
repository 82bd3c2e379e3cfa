"""Multi-token prediction under pipeline parallelism trains like the unpipelined model
(and, last test, MFSDP's chunks kept gathered through a step train like resharded ones).

The same tiny Llama with two MTP depths (the trainer's flags, model builder, schedule and
finalize) runs at PP=1 over every rank (data-parallel), then at PP=2 (x DP=2 at 4 ranks),
with the depths on the last stage: by default, by an explicit ``--pipeline-model-parallel-layout``
with ``m``, and by one with virtual stages. Over 2 optimizer steps on the same data the
losses, the logged MTP losses and every parameter's gradient (the last stage's copy of the
word embedding included, after finalize sums the copies) equal the PP=1 run's (relative
1e-5, fp32); tied and untied output weights, per-micro-batch-mean and per-token losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist_helpers import _rank_order, module_cache
from _trainer_models import batches
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.multi_token_prediction import (
    collect_mtp_metrics,
    mtp_token_scale_hook,
    set_mtp_loss_backward_scale,
)
from megatron.training.arguments import parse_args
from megatron.training.loss_reports import mean_loss, reduce_reports
from megatron.training.model_builder import build_model, build_optimizer, finalize_model_grads

WORLD = dist.get_world_size()
STEPS, MICRO = 2, 2
ARGV = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
        "--lr 1e-3 --train-iters 3 --mock-data --tokenizer-type NullTokenizer --vocab-size 96 "
        "--hidden-dropout 0 --attention-dropout 0 --seed 11 --normalization RMSNorm --position-embedding-type rope "
        "--swiglu --ffn-hidden-size 64 --disable-bias-linear --mtp-num-layers 2 --mtp-loss-scaling-factor 0.5").split()
PIPELINES = {
    "default": ["--pipeline-model-parallel-size", "2"],
    "layout": ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tmmL"],
    "virtual": ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|t|tmmL"],
}


def _forward_step(mean_per_microbatch):
    from pretrain_gpt import forward_step  # the script at the repo root: imported on use, as the other tests do

    def step(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        if not mean_per_microbatch:
            return output, loss_func

        def mean(out):  # what the trainer makes of it without --calculate-per-token-loss
            loss_sum, tokens, report = loss_func(out)
            return loss_sum / tokens, report
        return output, mean
    return step


def full_grads(model) -> dict:
    """name -> full gradient of every parameter of this rank (every rank must call it; the
    stages hold different parameters, so the pieces travel as objects, by name)."""
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    pieces = [None] * WORLD
    dist.all_gather_object(pieces, {n: g.to_local().detach().clone() for n, g in named if hasattr(g, "to_local")})
    return {n: torch.cat([pieces[r][n].reshape(-1) for r in _rank_order(g)]).reshape(g.shape)
            if hasattr(g, "to_local") else g.clone() for n, g in named}


def train(flags, per_token):
    """Per step: (loss, {"mtp_k loss"}, {name: gradient of this rank's parameters})."""
    argv = ARGV + ["--global-batch-size", str(MICRO * WORLD)] + flags + (["--calculate-per-token-loss"] * per_token)
    args = parse_args(argv, world_size=WORLD, cuda_available=False)
    args.padded_vocab_size = 128
    parallel_state.destroy_model_parallel()
    state = parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, 1, "cpu", pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    try:
        from pretrain_gpt import model_provider  # the trainer's provider; a root script, imported on use

        built = build_model(model_provider, args, torch.device("cpu"))
        optimizer, _ = build_optimizer(args, built)
        built.unwrapped.train()
        forward_backward = get_forward_backward_func()
        per_rank = args.global_batch_size // state.dp_size
        history = []
        for batch in batches(STEPS, 1, args.global_batch_size, args.seq_length, 96):
            batch["loss_mask"] = (torch.rand(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(3)) > 0.3
                                  ).float()  # micro-batches with different token counts
            mine = {k: v[state.dp_rank * per_rank:(state.dp_rank + 1) * per_rank] for k, v in batch.items()}
            micro = [{k: v[i:i + 1] for k, v in mine.items()} for i in range(per_rank)]
            optimizer.zero_grad(set_to_none=True)
            # The trainer's factors: 1 / micro-batches, or the schedule's per-token one.
            set_mtp_loss_backward_scale(built.unwrapped, 1.0 / len(micro))
            hook = dict(token_scale_hook=mtp_token_scale_hook(built.unwrapped)) if per_token else {}
            kwargs = dict(seq_length=args.seq_length, micro_batch_size=1) if args.pipeline_model_parallel_size > 1 else {}
            reports = forward_backward(_forward_step(not per_token), iter(micro), built.model, len(micro),
                                       context=built.context, dp_group=state.dp_cp_group, **kwargs, **hook)
            finalize_model_grads(args, built)
            grads = full_grads(built.unwrapped)
            optimizer.step()
            mtp = collect_mtp_metrics(built.unwrapped, depths=2)
            history.append((mean_loss(reduce_reports(reports)), mtp, grads))
        if built.context is not None:
            ALL_GATHERS.append(built.context.counter.counts().get("all_gather", 0))
        return history
    finally:
        parallel_state.destroy_model_parallel()


REFERENCES = module_cache()
ALL_GATHERS = []  # with MFSDP: the all-gathers of each train() call (the engine's counter)
# (pipeline, tied output weights, per-token loss, MFSDP ZeRO-3 instead of plain chunks, TP size)
CASES = [("default", False, False, False, 1), ("default", False, True, False, 1),
         ("layout", True, True, False, 1), ("virtual", False, False, False, 1), ("virtual", True, False, False, 1),
         ("default", False, True, True, 1), ("virtual", False, False, True, 1)]
if WORLD == 4:  # PP=2 x TP=2 with sequence parallelism (the vocabulary-parallel embedding copy)
    CASES += [("default", False, True, True, 2), ("layout", True, False, False, 2)]


@pytest.mark.parametrize("pipeline,tied,per_token,mfsdp,tp", CASES,
                         ids=["-".join([c[0], "tied" if c[1] else "untied", "per_token" if c[2] else "mean"]
                                       + (["mfsdp"] if c[3] else []) + (["tp2_sp"] if c[4] > 1 else []))
                              for c in CASES])
def test_mtp_under_pipeline_parallelism_equals_one_stage(pipeline, tied, per_token, mfsdp, tp):
    flags = ([] if tied else ["--untie-embeddings-and-output-weights"]) + (["--use-mfsdp"] if mfsdp else []) + \
        (["--tensor-model-parallel-size", str(tp), "--sequence-parallel"] if tp > 1 else [])
    key = (tied, per_token, mfsdp, tp)
    if key not in REFERENCES:  # the PP=1 run, shared by the cases with the same flags
        REFERENCES[key] = train(flags, per_token)
    reference = REFERENCES[key]
    pipelined = train(flags + PIPELINES[pipeline], per_token)
    for step, ((loss, mtp, grads), (ref_loss, ref_mtp, ref_grads)) in enumerate(zip(pipelined, reference)):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (step, "loss")
        assert sorted(mtp) == ["mtp_1 loss", "mtp_2 loss"]
        assert [mtp[k] for k in sorted(mtp)] == pytest.approx([ref_mtp[k] for k in sorted(mtp)], rel=1e-5), step
        assert grads, "every stage holds parameters"
        worst = 0.0
        for name, grad in grads.items():
            ref = ref_grads[name]
            error = float((grad - ref).norm() / ref.norm().clamp(min=1e-30))
            assert error < 1e-5, f"step {step}: {name} gradient differs by {error:.2e} (relative, L2)"
            worst = max(worst, error)
        print(f"step {step}: loss {loss:.6f} vs {ref_loss:.6f}, largest relative gradient difference {worst:.1e}")
    if any(name.startswith("mtp.") for name in pipelined[0][2]):  # the last stage: its embedding copy is compared
        assert "embedding.word_embeddings.weight" in pipelined[0][2]


def test_chunks_kept_gathered_train_bitwise_like_resharded_chunks():
    """``--megatron-fsdp-no-reshard-after-forward`` (MFSDP ZeRO-3, interleaved PP=2 x 2
    virtual stages): the losses and every gradient equal the default's bitwise (which the
    "virtual-untied-mean-mfsdp" case above compares with the PP=1 run), with fewer all-gathers."""
    flags = ["--untie-embeddings-and-output-weights", "--use-mfsdp"] + PIPELINES["virtual"]
    ALL_GATHERS.clear()
    resharded = train(flags, per_token=False)
    kept = train(flags + ["--megatron-fsdp-no-reshard-after-forward"], per_token=False)
    for step, ((loss, mtp, grads), (kept_loss, kept_mtp, kept_grads)) in enumerate(zip(resharded, kept)):
        assert (kept_loss, kept_mtp) == (loss, mtp), step
        assert kept_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert torch.equal(kept_grads[name], grad), f"step {step}: {name}"
    # Each unit gathers once per step instead of at every forward and backward of each microbatch.
    assert ALL_GATHERS[1] < ALL_GATHERS[0] / 2, ALL_GATHERS
