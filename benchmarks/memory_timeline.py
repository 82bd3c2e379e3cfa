#!/usr/bin/env python
"""Where the peak RSS of a training step comes from: RSS at every unit boundary of one
step, for MFSDP v2 ZeRO-3 and PyTorch FSDP2 on the same model, side by side.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/memory_timeline.py \
        --out benchmarks/results/memory_timeline_n2.json
    python benchmarks/memory_timeline.py --report benchmarks/results   # -> memory_timeline.md

Each contender runs in its own forked child (the same image, before any process group
exists) with glibc malloc switched to one mapping per allocation of 64 KiB or more (the
``mmap64k`` setting of rss.py), so RSS follows live tensor memory. After two
warm-up steps, one step is recorded:

* marks: RSS read at the start and end of every unit's forward (module hooks that run
  after the wrapper's own), when the gradient of a unit's output arrives (its backward
  starts) and when the gradient of its input arrives (its backward compute is done), and
  around ``optimizer.step()`` and ``zero_grad()``;
* a sampling thread (every 0.2 ms) for the true peak between marks, with the phase it
  fell in.

Figures are per rank 0, in MiB over the RSS at the start of the recorded step ("base"),
and the base itself: the base holds what persists between steps (weights, optimizer
state and, for MFSDP, ``main_grad``, which the engine's contract allocates when a unit is
built and keeps; FSDP2 frees its sharded gradients at ``zero_grad(set_to_none=True)``).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import contenders as cd  # noqa: E402
from compare_dp import engine_version  # noqa: E402
from rss import run_forked  # noqa: E402

MiB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


class Recorder:
    def __init__(self):
        self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        self.marks = []
        self.phase = "idle"
        self.samples = []
        self._stop = False
        self._thread = None

    def rss(self) -> int:
        # pread: no shared file offset, so the sampling thread and the marks can both read.
        return int(os.pread(self._statm, 256, 0).split()[1]) * PAGE

    def mark(self, what: str) -> None:
        self.phase = what
        self.marks.append((what, self.rss()))

    def _sample(self) -> None:
        while not self._stop:
            self.samples.append((self.rss(), self.phase))
            time.sleep(0.0002)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._thread.join()


def instrument(model, optimizer, rec: Recorder) -> None:
    units = [("root", model)] + [(f"layer{i}", layer) for i, layer in enumerate(model.decoder.layers)]
    for name, module in units:
        def pre(m, args, name=name):
            rec.mark(f"{name} forward start")
            if torch.is_grad_enabled():
                for t in args:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda g, name=name: rec.mark(f"{name} backward done"))
                        break

        def post(m, args, out, name=name):
            rec.mark(f"{name} forward end")
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, name=name: rec.mark(f"{name} backward start"))

        # prepend=False: these run after the wrapper's own hooks (unshard / reshard).
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    step, zero_grad = optimizer.step, optimizer.zero_grad

    def timed_step(*args, **kwargs):
        rec.mark("optimizer.step start")
        out = step(*args, **kwargs)
        rec.mark("optimizer.step end")
        return out

    def timed_zero_grad(*args, **kwargs):
        zero_grad(*args, **kwargs)
        rec.mark("zero_grad end")

    optimizer.step, optimizer.zero_grad = timed_step, timed_zero_grad


def record(name: str, spec: cd.ModelSpec, seed: int) -> dict:
    rec = Recorder()
    ref = cd.build_reference(spec, seed, torch.float32)
    batches = cd.make_batches(spec, 3, seed + 1)
    c = cd.build(name, ref, torch.float32, cd.Meshes(), cd.Options())
    del ref
    instrument(c.model, c.optimizer, rec)
    for batch in batches[:2]:
        dist.barrier()
        c.step(*batch)
    gc.collect()
    dist.barrier()
    rec.marks.clear()
    base = rec.rss()
    rec.start()
    rec.mark("step start")
    c.step(*batches[2])
    rec.stop()
    peak_rss, peak_phase = max(rec.samples + [(r, w) for w, r in rec.marks], key=lambda s: s[0])
    grads = 0
    if c.kind == "mfsdp":
        grads = c.ctx.persistent_bytes().get("main_grad", 0)
    return {
        "contender": name, "base": base, "peak": peak_rss, "peak_phase": peak_phase,
        "persistent_grad_bytes_at_step_start": grads,
        "marks": [(w, r - base) for w, r in rec.marks],
        "samples": len(rec.samples),
    }


def main_worker(args) -> None:
    world = int(os.environ["WORLD_SIZE"])
    spec = cd.resolve_spec(args, "fp32")
    out = {"world_size": world, "model": spec.describe(), "contenders": {}}
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    for name in args.contenders.split(","):
        result = run_forked(f"/tmp/mfsdp_memtl_{run_id}_{name}", "mmap64k", max(1, (os.cpu_count() or 1) // world),
                               lambda: record(name, spec, args.seed))
        if result is not None:
            out["contenders"][name] = result
    if int(os.environ["RANK"]) == 0:
        out["environment"] = {"torch": torch.__version__, "engine": engine_version()}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}", flush=True)


def report(directory: str) -> str:
    lines = ["# Peak RSS of one step, unit by unit: MFSDP v2 ZeRO-3 vs PyTorch FSDP2", "",
             "Generated by `python benchmarks/memory_timeline.py --report " + directory + "` from "
             "`memory_timeline_n*.json` (see the script's docstring for the method). MiB on rank 0.", ""]
    for path in sorted(glob.glob(os.path.join(directory, "memory_timeline_n*.json"))):
        with open(path) as f:
            data = json.load(f)
        runs = data["contenders"]
        names = list(runs)
        eng = data["environment"]["engine"]
        lines += [f"## N = {data['world_size']}: {data['model']}", "",
                  f"Tree {eng.get('commit', '?')}, engine {eng.get('engine_last_commit', '?')[:7]}"
                  f"{' (uncommitted edits)' if eng.get('engine_dirty') else ''}, torch {data['environment']['torch']}; "
                  "glibc malloc with one mapping per allocation of 64 KiB or more.", ""]
        lines += ["| | " + " | ".join(names) + " | difference (first - second) |", "|---|" + "---|" * (len(names) + 1)]

        def row(label, values):
            diff = f"{values[0] - values[1]:+.1f}" if len(values) == 2 else ""
            lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {diff} |")

        row("RSS at step start (base)", [runs[n]["base"] / MiB for n in names])
        row("of which gradients kept between steps", [runs[n]["persistent_grad_bytes_at_step_start"] / MiB for n in names])
        row("peak during the step, over base", [(runs[n]["peak"] - runs[n]["base"]) / MiB for n in names])
        row("peak during the step (absolute)", [runs[n]["peak"] / MiB for n in names])
        lines.append("| phase of the peak | " + " | ".join(runs[n]["peak_phase"] for n in names) + " | |")
        lines += ["", "RSS over base at each mark:", "",
                  "| mark | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        marks = [dict(runs[n]["marks"]) for n in names]
        order = [w for w, _ in runs[names[0]]["marks"]]
        for what in order:
            lines.append(f"| {what} | " + " | ".join(
                f"{m[what] / MiB:+.1f}" if what in m else "–" for m in marks) + " |")
        lines.append("")
    text = "\n".join(lines)
    with open(os.path.join(directory, "memory_timeline.md"), "w") as f:
        f.write(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", metavar="DIR", help="render DIR/memory_timeline_n*.json into DIR/memory_timeline.md")
    p.add_argument("--contenders", default="mfsdp_zero3,fsdp2")
    p.add_argument("--out", help="JSON written by rank 0")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--smoke", action="store_true")
    for key in ("layers", "hidden", "heads", "vocab", "seq", "micro_batch"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    args = p.parse_args()
    if args.report:
        print(report(args.report))
        return
    if not args.out:
        p.error("--out is required (or --report DIR)")
    main_worker(args)


if __name__ == "__main__":
    main()
