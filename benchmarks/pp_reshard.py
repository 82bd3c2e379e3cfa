"""Reshard after forward, per pipeline chunk: gathered for every forward and backward
(ZeRO-3, the default) vs kept gathered from a chunk's first forward to its last
microbatch's backward (``--megatron-fsdp-no-reshard-after-forward``).

Interleaved pipeline (PP=2, two virtual stages per rank) at 2 ranks (DP=1), the trainer's
model build and schedule. One setting per torchrun launch (its processes' peak RSS to
itself); the launches alternate the two settings, four rounds::

    for round in 1 2 3 4; do for m in 4 8; do for mode in reshard keep; do
        python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/pp_reshard.py \\
            --mode $mode --microbatches $m --round $round --out /tmp/pp_reshard
    done; done; done
    python benchmarks/pp_reshard.py --report /tmp/pp_reshard --json benchmarks/results/pp_reshard_n2.json \\
        --md benchmarks/results/pp_reshard.md

The 4-rank figure (PP=2 x DP=2): the same loop with ``--nproc-per-node 4`` (m=8 four rounds,
m=4 one) into another ``--out``, reported with ``--json .../pp_reshard_n4.json --md`` a
scratch file whose table is then appended to ``results/pp_reshard.md``.

Per rank: step time (median of the measured steps), all-gathers per step (the engine's
CollectiveCounter), the peak of gathered parameter bytes (the unsharded storages alive,
sampled at every unit's forward and every pipeline receive) and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODEL = ("--num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
         "--lr 1e-4 --train-iters 100 --mock-data --tokenizer-type NullTokenizer --vocab-size 2048 "
         "--hidden-dropout 0 --attention-dropout 0 --use-mfsdp --pipeline-model-parallel-size 2 "
         "--num-virtual-stages-per-pipeline-rank 2")
WARMUP, STEPS = 1, 4
HIDDEN, SEQ, MBS, VOCAB = 256, 128, 2, 2048


def run(mode: str, microbatches: int, round_: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import PipelineP2P
    from megatron.training.arguments import parse_args
    from megatron.training.model_builder import build_model, build_optimizer, finalize_model_grads

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    flags = MODEL + f" --global-batch-size {MBS * microbatches * world // 2}"
    if mode == "keep":
        flags += " --megatron-fsdp-no-reshard-after-forward"
    args = parse_args(flags.split(), world_size=world, cuda_available=False)
    args.padded_vocab_size = args.unpadded_vocab_size = VOCAB
    state = parallel_state.initialize_model_parallel(
        1, 1, "cpu", pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    torch.manual_seed(0)
    built = build_model(pretrain_gpt.model_provider, args, torch.device("cpu"))
    optimizer, _ = build_optimizer(args, built)
    generator = torch.Generator().manual_seed(1 + state.dp_rank)
    groups = [g for unit in built.context.units for g in unit.fsdp_state.groups]

    def gathered_bytes() -> int:
        return sum(t.untyped_storage().nbytes() for g in groups for t in g.views.unsharded_storages())

    def batch():
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=generator)
        return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(MBS, SEQ),
                "position_ids": torch.arange(SEQ).expand(MBS, SEQ)}

    class SampledP2P(PipelineP2P):
        peak = 0

        def recv(self, kind):  # once per schedule step that receives: sample what is gathered
            SampledP2P.sample()
            return super().recv(kind)

        @staticmethod
        def sample(*_):
            SampledP2P.peak = max(SampledP2P.peak, gathered_bytes())

    for unit in built.context.units:  # runs after the engine's pre-forward (its gather and prefetch)
        unit.register_forward_pre_hook(SampledP2P.sample)

    schedule = get_forward_backward_func()
    times, gathers, losses = [], [], []
    for step in range(WARMUP + STEPS):
        data = iter([batch() for _ in range(microbatches)])
        p2p = SampledP2P(state.pp_group, state.pp_grad_group, (MBS, SEQ, HIDDEN), torch.float32, torch.device("cpu"))
        dist.barrier()
        built.context.counter.reset()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        reports = schedule(pretrain_gpt.forward_step, data, built.model, microbatches, built.context,
                           seq_length=SEQ, micro_batch_size=MBS, dp_group=state.dp_group, p2p=p2p)
        finalize_model_grads(args, built)
        optimizer.step()
        elapsed = time.perf_counter() - start
        losses.append([float(v.double().sum()) for r in reports for v in r.values()])
        if step >= WARMUP:
            times.append(elapsed)
            gathers.append(built.context.counter.counts().get("all_gather", 0))
    record = dict(mode=mode, microbatches=microbatches, round=round_, rank=dist.get_rank(), stage=state.pp_rank,
                  step_s=statistics.median(times), all_gathers_per_step=gathers[0],
                  peak_gathered_mb=SampledP2P.peak / 2**20,
                  peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, losses=losses)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{mode}_m{microbatches}_r{round_}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def report(out: str, json_path: str, md_path: str) -> None:
    rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "*.json")))]
    table = []
    for m in sorted({r["microbatches"] for r in rows}):
        for mode in ("reshard", "keep"):
            rs = [r for r in rows if r["microbatches"] == m and r["mode"] == mode]
            if not rs:
                continue
            per_round = {}
            for r in rs:  # the slowest rank's step, per launch
                per_round[r["round"]] = max(per_round.get(r["round"], 0.0), r["step_s"])
            table.append(dict(
                microbatches=m, mode=mode, step_s=statistics.median(per_round.values()),
                step_s_per_round=[per_round[k] for k in sorted(per_round)],
                all_gathers_per_step=[max(r["all_gathers_per_step"] for r in rs if r["rank"] == k) for k in (0, 1)],
                peak_gathered_mb=[max(r["peak_gathered_mb"] for r in rs if r["rank"] == k) for k in (0, 1)],
                peak_rss_mb=[max(r["peak_rss_mb"] for r in rs if r["rank"] == k) for k in (0, 1)],
                losses_last_stage=next(r["losses"] for r in rs if r["rank"] == 1)))
    for m in {t["microbatches"] for t in table}:
        pair = [t for t in table if t["microbatches"] == m]
        if len(pair) == 2:
            pair[1]["same_losses_as_reshard"] = pair[0]["losses_last_stage"] == pair[1]["losses_last_stage"]
    with open(json_path, "w") as f:
        json.dump(table, f, indent=1)
    lines = ["| microbatches | mode | step (s, median of launches; each launch: slowest rank) | all-gathers per step "
             "(rank 0 / 1) | peak gathered params (MB, rank 0 / 1) | peak RSS (MB, rank 0 / 1) |",
             "|---|---|---|---|---|---|"]
    for t in table:
        rounds = ", ".join(f"{s:.3f}" for s in t["step_s_per_round"])
        lines.append(f"| {t['microbatches']} | {t['mode']} | {t['step_s']:.3f} ({rounds}) | "
                     f"{t['all_gathers_per_step'][0]} / {t['all_gathers_per_step'][1]} | "
                     f"{t['peak_gathered_mb'][0]:.1f} / {t['peak_gathered_mb'][1]:.1f} | "
                     f"{t['peak_rss_mb'][0]:.0f} / {t['peak_rss_mb'][1]:.0f} |")
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("reshard", "keep"))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--round", type=int, default=1)
    parser.add_argument("--out", default="/tmp/pp_reshard")
    parser.add_argument("--report", metavar="DIR")
    parser.add_argument("--json", default="benchmarks/results/pp_reshard_n2.json")
    parser.add_argument("--md", default="benchmarks/results/pp_reshard.md")
    options = parser.parse_args()
    if options.report:
        report(options.report, options.json, options.md)
    else:
        run(options.mode, options.microbatches, options.round, options.out)
