"""Where a training step's time goes, ours against torchtitan's: one step's phases (data,
forward, loss, backward, gradient finalization, optimizer, logging, other) in ms, from
PyTorch profiler traces of the same model, tokens and recipe as the peer benchmark.

    python benchmarks/profile_vs_torchtitan.py --label before
    python benchmarks/profile_vs_torchtitan.py --label after
    python benchmarks/profile_vs_torchtitan.py --report      # results/profile_vs_torchtitan.md

Both trainers run under ``torch.distributed.run`` (``--nproc`` ranks, default 2: both shard
then, torchtitan with FSDP2, ours with ``--use-mfsdp`` ZeRO-3 or ``--engine fsdp2``; at one
rank torchtitan applies no FSDP at all while ours still runs its engine) with the settings
of ``benchmarks/torchtitan_peer.py`` (``ours_flags``, its launcher, its token file). Rank 0
records steps ``--profile-step-start`` .. ``--profile-step-end - 1`` (0-based), each in an
``iteration <n>`` range:

* ours: ``pretrain_gpt.py --profile --use-pytorch-profiler`` (the trainer's own profiling)
  and its ``step/<phase>`` ranges (``megatron/core/step_phases.py``);
* torchtitan: ``benchmarks/torchtitan_cpu_launcher.py --profile-dir``, which opens ranges of
  the same names at the calls between torchtitan's phases (its docstring says where).

A phase's time is the wall time of its ranges less the phases nested in them (ours computes
the cross-entropy inside the forward, torchtitan after it: either way it counts as loss).
torchtitan's default loss (``ChunkedLossWrapper``) runs the output projection, the
cross-entropy and both of their backwards chunk by chunk inside its loss call, so its "loss"
holds work that ours counts as forward and backward: compare "forward + loss + backward";
"other" is the rest of the step (zeroing gradients, moving the batch, the global token count,
the trainer's bookkeeping). Under each table, the kernels both trainers run on the same
shapes (matrix products and attention, ``PRODUCT_OPS``) are summed per side, with the ratio
ours would reach against torchtitan's step if nothing but those kernels were left: a bound
on what removing overhead can buy (at one rank, where neither trainer shards or waits on a
peer, it is the bound; at two ranks on two cores a kernel also slows by what shares its
core). Then, for every phase where ours takes more than
``--ops-threshold`` times torchtitan's and at least 2 ms more, the operators with the most
self time in that phase on each side (self time: the operator's wall time less the
operators and ranges it calls; the phase's time outside any operator, the trainers' and the
engines' Python, is "(outside operators)").

Timings on a shared 2-core box are noisy: the profiled steps are averaged, and the two
trainers run one after the other in one call. The profiler itself costs time (both sides
record shapes, as the trainer's ``--profile`` does).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import torchtitan_peer as peer  # noqa: E402  (the shapes, flags, token file and venv of the peer benchmark)

RESULTS = peer.RESULTS
PHASES = ["data", "forward", "loss", "backward", "grad-finalize", "optimizer", "logging"]
# The kernels both trainers run on the same shapes (step_floor.py's "products"): matrix
# products and the attention kernel, forward and backward. Their self time is the kernel.
PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
               "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


# Reading a trace -------------------------------------------------------------------------
def _complete_events(path: str) -> list:
    """The trace's complete events, less gloo's ``gloo:<collective>`` spans: each runs from
    the issue of an asynchronous collective to its completion on the caller's thread, so
    it overlaps the operators after it without enclosing them, and would otherwise take
    them from their true parent (whose self time would then hold their time)."""
    with open(path) as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"]
            if e.get("ph") == "X" and "dur" in e and not e.get("name", "").startswith("gloo:")]


def _contains(outer: dict, inner: dict) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def _one_step(events: list, it: dict) -> tuple:
    """({phase: us}, {phase: {operator: self us}}) of one ``iteration <n>`` range."""
    phases = collections.Counter()
    ops = collections.defaultdict(collections.Counter)
    inside = sorted((e for e in events if e["tid"] == it["tid"] and e is not it and _contains(it, e)),
                    key=lambda e: (e["ts"], -e["dur"]))
    stack = []  # enclosing events, outermost first
    top_level_phase_time = 0.0
    children_time = collections.Counter()  # id(event) -> time of its direct children
    phase_of = {}  # id(event) -> the innermost enclosing phase ("other" outside any)
    for e in inside:
        while stack and not _contains(stack[-1], e):
            stack.pop()
        parent = stack[-1] if stack else None
        enclosing = phase_of[id(parent)] if parent is not None else "other"
        is_phase = e["name"].startswith("step/")
        if parent is not None and (e.get("cat") in ("cpu_op", "user_annotation") or is_phase):
            children_time[id(parent)] += e["dur"]
        if is_phase:
            # Time counts once, for the innermost phase: take this range out of its enclosing one.
            if enclosing == "other":
                top_level_phase_time += e["dur"]
            else:
                phases[enclosing] -= e["dur"]
            phases[e["name"][len("step/"):]] += e["dur"]
            phase_of[id(e)] = e["name"][len("step/"):]
        else:
            phase_of[id(e)] = enclosing
        stack.append(e)
    phases["other"] += it["dur"] - top_level_phase_time
    for e in inside:
        if e.get("cat") == "cpu_op":
            ops[phase_of[id(e)]][e["name"]] += e["dur"] - children_time[id(e)]
    for phase, counter in ops.items():  # the trainers' and engines' Python, between operators
        counter["(outside operators)"] = max(phases[phase] - sum(counter.values()), 0.0)
    return phases, ops


def step_breakdown(path: str) -> dict:
    """{"steps": n, "total_ms", "phases": {phase: ms}, "ops": {phase: {op: ms}}} over the
    ``iteration <n>`` ranges of one trace: each figure the median over the steps (one step
    that the shared box stalled does not move it)."""
    events = _complete_events(path)
    iterations = [e for e in events if e["name"].startswith("iteration ")]
    if not iterations:
        raise RuntimeError(f"{path} holds no 'iteration <n>' range")
    steps = [_one_step(events, it) for it in iterations]
    phases = {p: statistics.median(s[0][p] for s in steps) / 1000.0 for p in PHASES + ["other"]}
    ops = {}
    for phase in {p for s in steps for p in s[1]}:
        names = {name for s in steps for name in s[1].get(phase, {})}
        ops[phase] = {name: statistics.median(s[1].get(phase, {}).get(name, 0.0) for s in steps) / 1000.0
                      for name in names}
    return dict(steps=len(steps), total_ms=statistics.median(it["dur"] for it in iterations) / 1000.0,
                step_ms=[it["dur"] / 1000.0 for it in iterations], phases=phases, ops=ops)


# Running both trainers -------------------------------------------------------------------
def run_torchtitan(python, opts, shape, tokens, tokenizer, env, work) -> str:
    trace_dir = os.path.join(work, "torchtitan_trace")
    shutil.rmtree(trace_dir, ignore_errors=True)
    args = peer.titan_args(opts.steps, work, shape, tokens, tokenizer, "torchtitan") + [
        "--profile-dir", trace_dir, "--profile-step-start", str(opts.profile_step_start),
        "--profile-step-end", str(opts.profile_step_end)] + (["--compile"] if opts.compiled else [])
    peer.torchrun(python, opts.nproc, args, env, os.path.join(work, "torchtitan.log"))
    return os.path.join(trace_dir, "rank0.trace.json")


def run_ours(opts, shape, tokenizer, prefix, env, work) -> str:
    log_dir, trace_dir = os.path.join(work, "ours_logs"), os.path.join(work, "ours_trace")
    for d in (log_dir, trace_dir):
        shutil.rmtree(d, ignore_errors=True)
    flags = peer.ours_flags(shape, opts.nproc, opts.steps, tokenizer, prefix, log_dir, opts.compiled, opts.engine)
    flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(opts.profile_step_start),
              "--profile-step-end", str(opts.profile_step_end), "--profile-ranks", "0",
              "--tensorboard-dir", trace_dir]
    peer.torchrun(sys.executable, opts.nproc, ["pretrain_gpt.py"] + flags, env, os.path.join(work, "ours.log"))
    traces = glob.glob(os.path.join(trace_dir, "rank0*.pt.trace.json"))
    if len(traces) != 1:
        raise RuntimeError(f"expected one rank-0 trace in {trace_dir}, found {traces}")
    return traces[0]


def main_run(opts) -> None:
    python = peer.setup_venv()
    shape = peer.SHAPES[opts.shape]
    tokenizer, prefix = peer.shakespeare()
    tokens, _ = peer.dump_tokens(opts.shape, opts.nproc, opts.steps, tokenizer, prefix)
    work = os.path.join(opts.work, f"n{opts.nproc}_{opts.shape}_{opts.label}")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=REPO)
    titan_env = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    titan = step_breakdown(run_torchtitan(python, opts, shape, tokens, tokenizer, titan_env, work))
    ours = step_breakdown(run_ours(opts, shape, tokenizer, prefix, env, work))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    result = dict(label=opts.label, command=" ".join(["python", os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time=time.time(),
                  commit=commit + (" (with uncommitted changes)" if dirty else ""),
                  load_average=os.getloadavg(), nproc=opts.nproc, shape=opts.shape, engine=opts.engine,
                  variant="compiled" if opts.compiled else "eager",
                  steps=opts.steps, profiled_steps=[opts.profile_step_start, opts.profile_step_end],
                  ops_threshold=opts.ops_threshold, torchtitan=titan, ours=ours)
    out = os.path.join(RESULTS, f"profile_vs_torchtitan_{opts.label}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(render_one(result))
    print(f"-> {out}; python benchmarks/profile_vs_torchtitan.py --report")


# The report ------------------------------------------------------------------------------
# Runs recorded before this time (2026-12-07 00:20 UTC) were read with gloo's spans kept.
GLOO_SPANS_DROPPED_SINCE = 1796602800


def products_ms(side: dict) -> float:
    """Self ms per step of PRODUCT_OPS over all phases (each a median over the steps)."""
    return sum(ops.get(name, 0.0) for ops in side["ops"].values() for name in PRODUCT_OPS)


def products_text(titan: dict, ours: dict) -> str:
    """The share of each step in the kernels both trainers share, and the lowest step ratio
    ours could reach against this torchtitan step with everything else removed: the same
    kernels timed in torchtitan's run (its own share; no drift of the box between the two
    runs enters it) and as timed in ours."""
    pt, po = products_ms(titan), products_ms(ours)
    t, o = titan["total_ms"], ours["total_ms"]
    return (f"Matrix products and attention kernels (self time, all phases): torchtitan {pt:.1f} ms "
            f"({pt / t:.0%} of its step), ours {po:.1f} ms ({po / o:.0%}); the rest of the step: torchtitan "
            f"{t - pt:.1f} ms, ours {o - po:.1f} ms. With nothing but these kernels left, ours would take "
            f"**{pt / t:.2f}** of torchtitan's step at torchtitan's kernel times ({po / t:.2f} at ours').")


def render_one(data: dict) -> str:
    titan, ours = data["torchtitan"], data["ours"]
    engine = {"mfsdp": "MFSDP ZeRO-3", "fsdp2": "torch FSDP2"}[data["engine"]]
    compiled = ", both compiled" if data.get("variant") == "compiled" else ""
    lines = [f"## {data['label']}: {data['nproc']} ranks, {data['shape']} shape, ours on {engine}{compiled}", "",
             f"`{data['command']}`; {data['date']}, commit {data['commit']}, load average "
             f"{data['load_average'][0]:.1f}; rank 0, steps {data['profiled_steps'][0]}..{data['profiled_steps'][1] - 1} "
             f"(0-based) of {data['steps']}, ms per step (median over {ours['steps']} steps, each row on its own: "
             "the rows need not add up to the step).", "",
             "| phase | torchtitan (ms) | ours (ms) | ours - torchtitan (ms) | ours / torchtitan |",
             "|---|---|---|---|---|"]
    if data.get("note"):  # a remark added to the JSON by hand: what the run's code was
        lines[2:2] = [f"Note: {data['note']}", ""]
    if data.get("time", 0.0) < GLOO_SPANS_DROPPED_SINCE:
        lines[2:2] = ["Read before the reader dropped gloo's asynchronous spans (`_complete_events`): the phases, "
                      "the step and the products stand; in the operator tables an autograd node may hold the "
                      "time of operators that ran under it.", ""]
    for phase in PHASES + ["other"]:
        t, o = titan["phases"][phase], ours["phases"][phase]
        ratio = f"{o / t:.2f}" if t > 0.05 else "-"
        lines.append(f"| {phase} | {t:.1f} | {o:.1f} | {o - t:+.1f} | {ratio} |")
    t, o = (sum(side["phases"][p] for p in ("forward", "loss", "backward")) for side in (titan, ours))
    lines.append(f"| forward + loss + backward | {t:.1f} | {o:.1f} | {o - t:+.1f} | {o / t:.2f} |")
    t, o = titan["total_ms"], ours["total_ms"]
    lines += [f"| **step** | **{t:.1f}** | **{o:.1f}** | **{o - t:+.1f}** | **{o / t:.2f}** |", "",
              "Steps (ms): torchtitan " + ", ".join(f"{x:.0f}" for x in titan["step_ms"]) + "; ours "
              + ", ".join(f"{x:.0f}" for x in ours["step_ms"]) + ".", "", products_text(titan, ours), ""]
    for phase in PHASES + ["other"]:
        t, o = titan["phases"][phase], ours["phases"][phase]
        if o - t < 2.0 or (t > 0 and o / t < data["ops_threshold"]):
            continue
        lines += [f"Operators of **{phase}** (self ms per step, median over the steps, top 8):", "",
                  "| torchtitan | ms | ours | ms |", "|---|---|---|---|"]
        top_t = sorted(titan["ops"].get(phase, {}).items(), key=lambda kv: -kv[1])[:8]
        top_o = sorted(ours["ops"].get(phase, {}).items(), key=lambda kv: -kv[1])[:8]
        for i in range(max(len(top_t), len(top_o))):
            a = top_t[i] if i < len(top_t) else ("", None)
            b = top_o[i] if i < len(top_o) else ("", None)
            lines.append(f"| `{a[0]}` | {'' if a[1] is None else f'{a[1]:.1f}'} | `{b[0]}` | "
                         f"{'' if b[1] is None else f'{b[1]:.1f}'} |")
        lines.append("")
    return "\n".join(lines)


def report(results_dir: str) -> str:
    runs = []
    for path in glob.glob(os.path.join(results_dir, "profile_vs_torchtitan_*.json")):
        with open(path) as f:
            runs.append(json.load(f))
    runs.sort(key=lambda d: d.get("time", 0.0))  # in the order they ran
    lines = ["# One training step, phase by phase: ours against torchtitan 0.3.0", "",
             "Written by `python benchmarks/profile_vs_torchtitan.py --report` from "
             "`profile_vs_torchtitan_*.json`; the method is in that script's docstring (the same model, tokens "
             "and recipe as `torchtitan_peer.py`, PyTorch profiler traces, `step/<phase>` ranges). Timings come "
             "from a shared 2-core box and include the profiler's own cost: read the differences between "
             "phases, not the absolute step times. torchtitan's loss phase holds the output projection and "
             "its backward too (its default chunked loss), so forward, loss and backward compare summed.", ""]
    for data in runs:
        lines += [render_one(data), ""]
    text = "\n".join(lines)
    with open(os.path.join(results_dir, "profile_vs_torchtitan.md"), "w") as f:
        f.write(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--shape", choices=peer.SHAPES, default="small")
    parser.add_argument("--engine", choices=peer.ENGINES, default="mfsdp", help="our trainer's engine")
    parser.add_argument("--steps", type=int, default=7, help="training steps per run")
    parser.add_argument("--compiled", action="store_true", help="both compiled: torchtitan --compile.enable, "
                        "ours --compile-layers inductor (the peer benchmark's variant 'compiled')")
    parser.add_argument("--profile-step-start", type=int, default=3, help="first profiled step (0-based)")
    parser.add_argument("--profile-step-end", type=int, default=6, help="the step after the last profiled one")
    parser.add_argument("--ops-threshold", type=float, default=1.2,
                        help="list the operators of phases where ours / torchtitan exceeds this")
    parser.add_argument("--label", default="run", help="names the JSON file and the report's section")
    parser.add_argument("--work", default="/tmp/profile_vs_torchtitan", help="logs and traces")
    parser.add_argument("--report", nargs="?", const=RESULTS, metavar="DIR", help="render DIR's JSON files")
    opts = parser.parse_args()
    if opts.report:
        print(report(opts.report))
        return
    if not 0 <= opts.profile_step_start < opts.profile_step_end <= opts.steps:
        parser.error("need 0 <= --profile-step-start < --profile-step-end <= --steps")
    main_run(opts)


if __name__ == "__main__":
    main()
