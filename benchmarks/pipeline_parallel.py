"""Pipeline layouts at 4 ranks (CPU, gloo): DP=4 vs PP=2 x DP=2 vs PP=4, 1F1B vs interleaved.

At 2 ranks (two cores, one rank per core: the bubble is not blurred by time-slicing),
DP=2 vs PP=2 (1F1B) vs PP=2 x 2 virtual stages (interleaved)::

    for m in 2 4 8 16; do
        for layout in dp2 pp2 pp2_vp2; do
            python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/pipeline_parallel.py \\
                --layout $layout --microbatches-per-rank $m --out /tmp/pp_bench2
        done
    done
    python benchmarks/pipeline_parallel.py --report-2rank /tmp/pp_bench2 \\
        --json benchmarks/results/pipeline_parallel_n2.json > benchmarks/results/pipeline_parallel_n2.md

At 4 ranks, one layout per torchrun launch (each has its processes, and their peak RSS, to itself)::

    for layout in dp4 pp2_dp2 pp4 pp4_vp2; do
        for m in 4 8 16; do
            python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/pipeline_parallel.py \\
                --layout $layout --microbatches-per-rank $m --out /tmp/pp_bench
        done
    done
    python benchmarks/pipeline_parallel.py --report /tmp/pp_bench

The trainer's own model build (meta device, MFSDP ZeRO-3, one context for all chunks) and
its schedules, on the same GPT and the same global batch per layout (the global batch is
``--microbatches-per-rank`` microbatches per pipeline, times the data-parallel size).
Per stage: step time (median of the measured steps), the time the stage spent blocked in
a pipeline receive (its idle time: the bubble, plus waits caused by slower peers), and the
peak RSS. The bubble formulas: 1F1B idles ``(p - 1) / (m + p - 1)`` of the step, the
interleaved schedule with ``v`` chunks ``(p - 1) / (v m + p - 1)``. The 2-rank table also gives
each stage's idle fraction of the schedule alone (``schedule_idle``: the formulas' domain,
without the optimizer step and gradient finalization, and counting the wait of a stage that
finished its schedule before the other). At 4 ranks two cores run four ranks, so stages
also wait for the CPU; the measured fractions carry that.
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

# (pp, virtual stages); the first three run at 2 ranks (the table of --report-2rank).
LAYOUTS = {"dp2": (1, 1), "pp2": (2, 1), "pp2_vp2": (2, 2),
           "dp4": (1, 1), "pp2_dp2": (2, 1), "pp4": (4, 1), "pp4_vp2": (4, 2)}
MODEL = ("--num-layers 8 --hidden-size {hidden} --num-attention-heads {heads} --seq-length 128 --micro-batch-size 2 "
         "--lr 1e-4 --train-iters 100 --mock-data --tokenizer-type NullTokenizer --vocab-size 2048 "
         "--hidden-dropout 0 --attention-dropout 0 --use-mfsdp")


def model_flags(hidden: int) -> str:
    """The GPT at this hidden size (32 per head). The last stage also runs the output layer and
    the loss, about 2048 / (12 * hidden) of a layer's work per token: at hidden 128 over a
    layer, at 512 a third of one (the bubble formulas assume equal stages)."""
    return MODEL.format(hidden=hidden, heads=hidden // 32)


WARMUP, STEPS = 2, 4
TWO_RANK = ("dp2", "pp2", "pp2_vp2")


def run(layout: str, microbatches: int, out: str, hidden: int = 128) -> None:
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
    pp, vp = LAYOUTS[layout]
    if (layout in TWO_RANK) != (world == 2):
        raise SystemExit(f"layout {layout} is for {'2' if layout in TWO_RANK else '4'} ranks, not {world}.")
    dp = world // pp
    flags = model_flags(hidden) + f" --global-batch-size {2 * microbatches * dp} --pipeline-model-parallel-size {pp}"
    if vp > 1:
        flags += f" --num-virtual-stages-per-pipeline-rank {vp}"
    args = parse_args(flags.split(), world_size=world, cuda_available=False)
    args.padded_vocab_size = args.unpadded_vocab_size = 2048
    state = parallel_state.initialize_model_parallel(
        1, 1, "cpu", pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    torch.manual_seed(0)
    built = build_model(pretrain_gpt.model_provider, args, torch.device("cpu"))
    optimizer, _ = build_optimizer(args, built)
    generator = torch.Generator().manual_seed(1 + state.dp_rank)

    def batch():
        tokens = torch.randint(0, 2048, (2, 129), generator=generator)
        return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 128),
                "position_ids": torch.arange(128).expand(2, 128)}

    class TimedP2P(PipelineP2P):
        blocked = 0.0

        def recv(self, kind):
            start = time.perf_counter()
            try:
                return super().recv(kind)
            finally:
                TimedP2P.blocked += time.perf_counter() - start

    schedule = get_forward_backward_func()
    times, idle, schedules, blocked = [], [], [], []
    for step in range(WARMUP + STEPS):
        data = iter([batch() for _ in range(microbatches)])
        kwargs = dict(seq_length=128, micro_batch_size=2, dp_group=state.dp_group)
        if pp > 1:
            kwargs["p2p"] = TimedP2P(state.pp_group, state.pp_grad_group, (2, 128, hidden), torch.float32,
                                     torch.device("cpu"))
        dist.barrier()
        TimedP2P.blocked = 0.0
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        schedule_start = time.perf_counter()
        schedule(pretrain_gpt.forward_step, data, built.model, microbatches, built.context, **kwargs)
        schedule_s = time.perf_counter() - schedule_start
        finalize_model_grads(args, built)
        optimizer.step()
        elapsed = time.perf_counter() - start
        if step >= WARMUP:
            times.append(elapsed)
            idle.append(TimedP2P.blocked / elapsed)
            schedules.append(schedule_s)
            blocked.append(TimedP2P.blocked)
    record = dict(layout=layout, pp=pp, vp=vp, dp=dp, microbatches=microbatches, rank=dist.get_rank(), hidden=hidden,
                  stage=state.pp_rank, step_s=statistics.median(times), idle_fraction=statistics.median(idle),
                  peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  schedule_s_per_step=schedules, blocked_s_per_step=blocked)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{layout}_m{microbatches}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


def bubble(pp: int, vp: int, m: int) -> float:
    return (pp - 1) / (vp * m + pp - 1) if pp > 1 else 0.0


def report(out: str) -> None:
    rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "*.json")))]
    groups = {}
    for r in rows:
        groups.setdefault((r["layout"], r["microbatches"]), []).append(r)
    print("| layout | microbatches per pipeline | step (s, slowest stage) | ms per sample | idle per stage (measured) | "
          "bubble formula | peak RSS per stage (MB) |")
    print("|---|---|---|---|---|---|---|")
    for (layout, m), rs in sorted(groups.items(), key=lambda kv: (list(LAYOUTS).index(kv[0][0]), kv[0][1])):
        stages = {}
        for r in rs:
            stages.setdefault(r["stage"], []).append(r)
        idle = " / ".join(f"{max(x['idle_fraction'] for x in stages[s]):.2f}" for s in sorted(stages))
        rss = " / ".join(f"{max(x['peak_rss_mb'] for x in stages[s]):.0f}" for s in sorted(stages))
        pp, vp = rs[0]["pp"], rs[0]["vp"]
        step = max(r["step_s"] for r in rs)
        samples = 2 * m * rs[0]["dp"]  # micro batch 2, m microbatches per pipeline, dp pipelines
        print(f"| {layout} | {m} | {step:.3f} | {1000 * step / samples:.1f} | {idle} | {bubble(pp, vp, m):.2f} "
              f"| {rss} |")


def schedule_idle(rs: list) -> list:
    """Each stage's idle fraction of the pipeline schedule alone (the formula's domain: no
    optimizer step, no gradient finalization): per step, the time blocked in a receive plus
    the time from the end of its own schedule to the end of the slowest stage's (a stage
    that has finished waits too, outside any receive: the last stage during the drain),
    over the slowest stage's schedule time (every rank starts after the same barrier); the
    median over the steps."""
    steps = len(rs[0]["schedule_s_per_step"])
    per_rank = {}
    for k in range(steps):
        longest = max(r["schedule_s_per_step"][k] for r in rs)
        for r in rs:
            waited = r["blocked_s_per_step"][k] + longest - r["schedule_s_per_step"][k]
            per_rank.setdefault(r["rank"], []).append(waited / longest)
    stage_of = {r["rank"]: r["stage"] for r in rs}
    return [max(statistics.median(v) for rank, v in per_rank.items() if stage_of[rank] == s)
            for s in sorted(set(stage_of.values()))]


def report_2rank(out: str, json_path: str | None) -> None:
    """The 2-rank table: per m, DP=2 vs PP=2 1F1B vs PP=2 interleaved (v=2): time per sample,
    each stage's measured idle fraction next to the bubble formula."""
    rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "*.json")))]
    runs = {}
    for r in rows:
        if r["layout"] in TWO_RANK:
            runs.setdefault((r["layout"], r["microbatches"]), []).append(r)

    def cell(layout, m):
        rs = runs.get((layout, m))
        if not rs:
            return None
        step = max(r["step_s"] for r in rs)  # the slowest rank's median step
        samples = 2 * m * rs[0]["dp"]
        idle = [max(r["idle_fraction"] for r in rs if r["stage"] == s) for s in sorted({r["stage"] for r in rs})]
        pp, vp = rs[0]["pp"], rs[0]["vp"]
        result = dict(step_s=step, ms_per_sample=1000 * step / samples, idle_per_stage=idle,
                      idle_mean=sum(idle) / len(idle), bubble=bubble(pp, vp, m),
                      peak_rss_mb=max(r["peak_rss_mb"] for r in rs))
        if pp > 1 and all("schedule_s_per_step" in r for r in rs):
            result["schedule_idle_per_stage"] = schedule_idle(rs)
            result["schedule_idle_mean"] = sum(result["schedule_idle_per_stage"]) / pp
        return result

    table = {}
    for m in sorted({m for _, m in runs}):
        table[m] = {layout: cell(layout, m) for layout in TWO_RANK}
    print("| m | DP=2 ms/sample | 1F1B ms/sample | 1F1B / DP=2 | 1F1B idle per stage | 1F1B idle, mean of stages "
          "| (p-1)/(m+p-1) | mean / formula | interleaved v=2 ms/sample | interleaved idle per stage | "
          "interleaved idle, mean | (p-1)/(vm+p-1) | mean / formula | interleaved / 1F1B step | "
          "1F1B schedule idle per stage, mean / formula | interleaved schedule idle per stage, mean / formula |")
    print("|---" * 16 + "|")

    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    def idle_columns(x):
        if x is None:
            return ["-"] * 4
        return [" / ".join(f"{i:.3f}" for i in x["idle_per_stage"]), f"{x['idle_mean']:.3f}", f"{x['bubble']:.3f}",
                f"{x['idle_mean'] / x['bubble']:.2f}"]

    def schedule_column(x):
        if x is None or "schedule_idle_mean" not in x:
            return "-"
        return (" / ".join(f"{i:.3f}" for i in x["schedule_idle_per_stage"])
                + f", {x['schedule_idle_mean']:.3f} / {x['bubble']:.3f} = **{x['schedule_idle_mean'] / x['bubble']:.2f}**")

    for m, c in table.items():
        dp, one, inter = c["dp2"], c["pp2"], c["pp2_vp2"]
        parts = ([str(m), fmt(dp and dp["ms_per_sample"], ".1f"), fmt(one and one["ms_per_sample"], ".1f"),
                  fmt(one and dp and one["ms_per_sample"] / dp["ms_per_sample"])] + idle_columns(one)
                 + [fmt(inter and inter["ms_per_sample"], ".1f")] + idle_columns(inter)
                 + [fmt(one and inter and inter["step_s"] / one["step_s"])]
                 + [schedule_column(one), schedule_column(inter)])
        print("| " + " | ".join(parts) + " |")
    if json_path:
        with open(json_path, "w") as f:
            hidden = {r.get("hidden", 128) for r in rows}
            model = model_flags(hidden.pop()) if len(hidden) == 1 else f"mixed hidden sizes {sorted(hidden)}"
            json.dump({"model": model, "warmup": WARMUP, "steps": STEPS, "table": table, "ranks": rows}, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=LAYOUTS)
    parser.add_argument("--microbatches-per-rank", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128, help="the GPT's hidden size (32 per head)")
    parser.add_argument("--out", default="/tmp/pp_bench")
    parser.add_argument("--report", metavar="DIR")
    parser.add_argument("--report-2rank", metavar="DIR", help="the 2-rank table (dp2, pp2, pp2_vp2) of DIR's files")
    parser.add_argument("--json", metavar="FILE", help="with --report-2rank: also write the table as JSON")
    options = parser.parse_args()
    if options.report_2rank:
        report_2rank(options.report_2rank, options.json)
    elif options.report:
        report(options.report)
    else:
        run(options.layout, options.microbatches_per_rank, options.out, options.hidden_size)
