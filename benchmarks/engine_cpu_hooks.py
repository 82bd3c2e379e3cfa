#!/usr/bin/env python
"""The engine's own CPU time per step, per unit and per hook kind, MFSDP v2 next to FSDP2.

Run under torch.distributed.run (one process per rank), e.g.::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/engine_cpu_hooks.py \\
        --contenders mfsdp_zero3,mfsdp_zero3@d9230aa,fsdp2 --out benchmarks/results/engine_cpu_hooks_n2.json

Every contender is built from one reference initialization of the benchmark's GPT
(contenders.py, 50M parameters in fp32 by default) and they run interleaved, one step each
per round. What is measured is the training thread's CPU time (``time.thread_time``, not
wall time: the other ranks and gloo's threads share the cores) inside each hook:

* MFSDP: the engine's own profiler ranges (``MFSDP <unit> <hook>``) observed by a
  ``CpuTimeLedger`` that also keeps each outermost range's name; the waits on collectives
  nested in them are subtracted (own CPU time), as ``measurement.engine_cpu_time`` does.
  The ranges outside any hook (gradient stashing, post-ops launched outside) are one row.
* FSDP2: no range of its own can be observed without a profiler, so each of its hooks is
  bracketed by hooks of ours registered next to it through public APIs only: module forward
  pre-hooks and forward hooks before and after FSDP2's (pre_forward, post_forward), tensor
  hooks before and after its pre-backward tensor hook on the outputs (pre_backward), a
  pre-hook and a hook on its ``RegisterPostBackwardFunction`` node (post_backward) and
  autograd-engine callbacks queued around its final callback (finish). FSDP2 waits inside
  its hooks too (its all-gathers and reduce-scatters are waited for in them on CPU); that
  wait is counted, since it cannot be split off from outside.

Rank 0 writes one JSON file; ``--markdown`` writes the tables generated from it
(``--render FILE.json --markdown FILE.md`` regenerates them without running). Also kept:
the minor page faults of the training thread inside the engine's ranges (first touches of
memory the allocator had returned to the system, which cost CPU time in the kernel).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import os
import platform
import resource
import sys
import time
from typing import Dict, Iterator, List

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from contenders import (DEFAULT_CONFIGS, SMOKE_CONFIG, Meshes, ModelSpec, Options, build,  # noqa: E402
                        build_reference, make_batches)
from cpu_time_ledger import CpuTimeLedger  # noqa: E402
from measurement import log, rank, world  # noqa: E402


def queue_engine_callback(fn) -> None:
    """Run ``fn`` when the current backward finishes (as the engine's finish_backward is queued)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "finish", "outside hooks")


class RangeLedger(CpuTimeLedger):
    """A ``CpuTimeLedger`` that also adds up each outermost range's own CPU time (its
    waits subtracted) under its (unit, hook kind)."""

    def __init__(self):
        super().__init__()
        self.by_range: Dict[tuple, float] = collections.defaultdict(float)
        self.page_faults = 0  # minor page faults of this thread inside the outermost ranges

    @contextlib.contextmanager
    def measure(self, name: str, inner) -> Iterator[None]:
        outermost = self._depth == 0
        wait0 = self.wait_cpu_s
        faults = _thread_faults()
        cpu = time.thread_time()
        try:
            with super().measure(name, inner):
                yield
        finally:
            if outermost:
                own = time.thread_time() - cpu - (self.wait_cpu_s - wait0)
                self.by_range[mfsdp_key(name)] += own
                self.page_faults += _thread_faults() - faults


def _thread_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def mfsdp_key(name: str):
    """``MFSDP <unit> <hook>`` -> (unit, hook kind); other ranges -> ("", "outside hooks")."""
    parts = name.split(" ")
    if name == "MFSDP finish_backward":
        return "<root>", "finish"
    if len(parts) == 3 and parts[0] == "MFSDP" and parts[2] in HOOKS:
        return parts[1], parts[2]
    return "", "outside hooks"


class Fsdp2Brackets:
    """Thread CPU time inside FSDP2's hooks, bracketed by our own hooks registered around
    them (see the module docstring). Register after ``fully_shard`` of every module."""

    def __init__(self, units: Dict[str, torch.nn.Module]):
        self.by_range: Dict[tuple, float] = collections.defaultdict(float)
        self._open: Dict[tuple, float] = {}
        self._finish_queued = False
        self._seen_nodes = set()
        for label, module in units.items():
            module.register_forward_pre_hook(self._start_hook(label, "pre_forward"), prepend=True)
            module.register_forward_pre_hook(self._end_pre_forward(label), with_kwargs=True)
            module.register_forward_hook(self._start_post_forward(label), prepend=True)
            module.register_forward_hook(self._end_post_forward(label))

    def _start(self, key):
        self._open[key] = time.thread_time()

    def _end(self, key):
        start = self._open.pop(key, None)
        if start is not None:
            self.by_range[key] += time.thread_time() - start

    def _start_hook(self, label, hook):
        def fn(*unused):
            self._start((label, hook))
        return fn

    def _end_pre_forward(self, label):
        def fn(module, args, kwargs):
            self._end((label, "pre_forward"))
            if not torch.is_grad_enabled():
                return None
            for t in _tensors((args, kwargs)):  # the outputs of FSDP2's RegisterPostBackwardFunction
                node = t.grad_fn
                if node is None or "RegisterPostBackward" not in type(node).__name__ or node in self._seen_nodes:
                    continue
                self._seen_nodes.add(node)
                key = (label, "post_backward")
                node.register_prehook(lambda *unused, key=key: self._start(key))
                node.register_hook(lambda *unused, key=key: self._end(key))
            return None
        return fn

    def _start_post_forward(self, label):
        def fn(module, args, output):
            self._start((label, "post_forward"))
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    t.register_hook(lambda grad: self._start_pre_backward(label))
        return fn

    def _end_post_forward(self, label):
        def fn(module, args, output):
            self._end((label, "post_forward"))
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    t.register_hook(lambda grad: self._end_pre_backward(label))
        return fn

    def _start_pre_backward(self, label):
        self._start((label, "pre_backward"))
        if not self._finish_queued:  # FSDP2 queues its final callback in the first pre-backward
            self._finish_queued = True
            queue_engine_callback(lambda: self._start(("<root>", "finish")))
            self._queue_end = True
        return None

    def _end_pre_backward(self, label):
        self._end((label, "pre_backward"))
        if getattr(self, "_queue_end", False):
            self._queue_end = False
            queue_engine_callback(self._end_finish)
        return None

    def _end_finish(self):
        self._end(("<root>", "finish"))
        self._finish_queued = False
        self._seen_nodes.clear()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def unit_labels(model) -> Dict[str, torch.nn.Module]:
    """The units of the benchmark's GPT, labelled as the engine labels its ranges."""
    units = {f"decoder.layers.{i}": layer for i, layer in enumerate(model.decoder.layers)}
    units["<root>"] = model
    return units


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contenders", type=lambda s: s.split(","), default=["mfsdp_zero3", "fsdp2"])
    p.add_argument("--smoke", action="store_true", help="tiny model (for a test)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--steps", type=int, default=3, help="measured rounds (each contender one step per round)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default cores // N, >= 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="JSON file written by rank 0")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="no run: write --markdown (or print) the tables of a JSON file this script wrote")
    p.add_argument("--markdown", default=None, help="also write the tables as markdown (rank 0)")
    return p.parse_args(argv)


def measure(args) -> dict:
    spec = ModelSpec(**(SMOKE_CONFIG if args.smoke else DEFAULT_CONFIGS["fp32"]))
    meshes = Meshes()
    ref = build_reference(spec, args.seed, torch.float32)
    batches = make_batches(spec, args.warmup + args.steps, args.seed)
    contenders, ledgers = [], {}
    for name in args.contenders:
        c = build(name, ref, torch.float32, meshes, Options())
        if c.kind == "mfsdp":
            ledgers[name] = RangeLedger()
        elif c.kind == "fsdp2":
            ledgers[name] = Fsdp2Brackets(unit_labels(c.model))
        else:
            raise ValueError(f"{name}: only MFSDP and FSDP2 contenders have hooks to time")
        contenders.append(c)
    del ref
    steps: Dict[str, List[float]] = {c.name: [] for c in contenders}
    for i, batch in enumerate(batches):
        measured = i >= args.warmup
        for c in contenders:
            ledger = ledgers[c.name]
            if measured and c.kind == "mfsdp":
                _observe(c, ledger)
            elif c.kind == "fsdp2" and not measured:
                ledger.by_range.clear()
            cpu = time.thread_time()
            c.step(*batch)
            if measured:
                steps[c.name].append(time.thread_time() - cpu)
            if c.kind == "mfsdp":
                _observe(c, None)
        log(f"round {i} done")
    results = {}
    for c in contenders:
        by_range = ledgers[c.name].by_range
        table = collections.defaultdict(dict)
        for (unit, hook), seconds in by_range.items():
            table[unit or "-"][hook] = 1e3 * seconds / args.steps
        total = sum(by_range.values()) * 1e3 / args.steps
        results[c.name] = {"kind": c.kind, "units": len(unit_labels(c.model)), "ms_per_step": dict(table),
                           "total_ms_per_step": total,
                           "page_faults_per_step": getattr(ledgers[c.name], "page_faults", 0) / args.steps,
                           "wait_cpu_ms_per_step": 1e3 * getattr(ledgers[c.name], "wait_cpu_s", 0.0) / args.steps,
                           "step_cpu_ms": [1e3 * s for s in steps[c.name]]}
    return {"spec": vars(spec), "world": world(), "warmup": args.warmup, "steps": args.steps,
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average": os.getloadavg(), "contenders": results}


def _observe(c, ledger) -> None:
    handle = getattr(c.ctx, "device_handle", None)
    if handle is not None and hasattr(handle, "range_observer"):
        handle.range_observer = None if ledger is None else ledger.measure
    else:  # an engine revision with a process-wide ledger of its own
        importlib.import_module(c.engine.__name__ + ".profiling").record_cpu_time(ledger)


def to_markdown(result: dict) -> str:
    names = list(result["contenders"])
    lines = [f"Engine CPU time per step (ms, thread CPU time inside the hooks, rank 0), "
             f"{result['world']} ranks, GPT {result['spec']}, {result['steps']} measured rounds, "
             f"load average {', '.join(f'{x:.1f}' for x in result['load_average'])}.", ""]
    lines += ["| contender | " + " | ".join(HOOKS) + " | total | waits (subtracted) | step CPU (median) | page faults in the hooks |",
              "|---|" + "---|" * (len(HOOKS) + 4)]
    for name in names:
        r = result["contenders"][name]
        sums = collections.defaultdict(float)
        for hooks in r["ms_per_step"].values():
            for hook, ms in hooks.items():
                sums[hook] += ms
        step = sorted(r["step_cpu_ms"])[len(r["step_cpu_ms"]) // 2]
        lines.append(f"| {name} | " + " | ".join(f"{sums.get(h, 0.0):.1f}" for h in HOOKS)
                     + f" | **{r['total_ms_per_step']:.1f}** | "
                     + (f"{r['wait_cpu_ms_per_step']:.1f} | " if r["kind"] == "mfsdp" else "counted | ")
                     + f"{step:.0f} | " + (f"{r['page_faults_per_step']:.0f} |" if r["kind"] == "mfsdp" else "- |"))
    lines += ["", "Per unit (ms per step):", ""]
    units = []
    for name in names:
        for unit in result["contenders"][name]["ms_per_step"]:
            if unit not in units:
                units.append(unit)
    header = "| unit | hook | " + " | ".join(names) + " |"
    lines += [header, "|---|---|" + "---|" * len(names)]
    for unit in units:
        for hook in HOOKS:
            cells = [result["contenders"][n]["ms_per_step"].get(unit, {}).get(hook) for n in names]
            if all(c is None for c in cells):
                continue
            lines.append(f"| {unit} | {hook} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        with open(args.render) as f:
            text = to_markdown(json.load(f))
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text)
        print(text)
        return
    if not args.out:
        raise SystemExit("engine_cpu_hooks.py: pass --out FILE.json (or --render FILE.json).")
    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world()))
    try:
        result = measure(args)
        is_first = rank() == 0
    finally:
        dist.destroy_process_group()
    if is_first:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(to_markdown(result))
        print(to_markdown(result))


if __name__ == "__main__":
    main()
