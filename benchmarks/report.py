#!/usr/bin/env python
"""Turns the JSON files of compare_dp.py into the report: Markdown tables (ratios to FSDP2
and to DDP), a summary JSON and PNG charts.

    python benchmarks/report.py benchmarks/results      # re-render from the JSON files there
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from typing import Dict, List, Optional

# Losses of every contender must match FSDP2's, step by step, within this relative error.
# fp32: the contenders differ only in the order of floating-point sums (reduce-scatter vs
# all-reduce, padding), so they agree to ~1e-6; 1e-4 leaves room for Adam amplifying that.
# bf16: bf16 compute rounds at ~4e-3; DDP's autocast keeps norms/residuals in fp32 while
# MFSDP/FSDP2 run the model in bf16, so their losses differ by up to ~1e-2 after 12 steps.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}
LABELS = {
    "mfsdp_zero3": "MFSDP v2 ZeRO-3",
    "mfsdp_zero2": "MFSDP v2 ZeRO-2",
    "mfsdp_hsdp": "MFSDP v2 HSDP 2x2",
    "mfsdp_no_shard": "MFSDP v2 no_shard",
    "fsdp2": "PyTorch FSDP2",
    "ddp": "PyTorch DDP",
}
MiB = 2 ** 20


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def _load(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _by_world(out: str, prefix: str) -> Dict[int, dict]:
    found = {}
    for path in sorted(glob.glob(os.path.join(out, f"{prefix}_n*.json"))):
        n = int(re.search(rf"{prefix}_n(\d+)\.json$", path).group(1))
        found[n] = _load(path)
    return found


def load_dir(out: str) -> dict:
    alloc = {}
    for path in sorted(glob.glob(os.path.join(out, "alloc_*_n2.json"))):
        alloc[re.search(r"alloc_(.+)_n2\.json$", path).group(1)] = _load(path)
    return {"compare": _by_world(out, "compare"), "optim": _by_world(out, "optim"),
            "overlap": _by_world(out, "overlap"), "sweep": _load(os.path.join(out, "sweep.json")), "alloc": alloc}


# --------------------------------------------------------------------------------------
# Figures per contender
# --------------------------------------------------------------------------------------


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt_ratio(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.2f}"


def _loss_dev(losses: List[float], ref: List[float]) -> Optional[float]:
    if not losses or not ref:
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))


def figures(run: dict, rss: Dict[str, dict]) -> Dict[str, dict]:
    """Flat per-contender figures of one (world size, dtype) run."""
    out = {}
    ref_losses = run["results"].get("fsdp2", {}).get("losses")
    for name, r in run["results"].items():
        if r.get("bytes_only"):
            continue
        t = r["timing"]
        coll = r["collectives"]["by_kind"]
        if "send" in coll and "engine_counter" in r["collectives"]:
            # MFSDP on gloo sends its all-gathers and reduce-scatters point to point
            # (gloo_wire.py): the tap sees messages, the engine's counter the collectives
            # they carry, with the same bytes.
            coll = r["collectives"]["engine_counter"]["by_kind"]
        f = {
            "step_s": t["step"]["median"], "step_p25_s": t["step"]["p25"], "step_p75_s": t["step"]["p75"],
            "step_min_s": t["step"]["min"], "step_max_s": t["step"]["max"], "n_steps": t["step"]["n"],
            "forward_s": t["forward"]["median"], "backward_s": t["backward"]["median"],
            "optimizer_s": t["optimizer"]["median"], "tokens_per_s": t["tokens_per_s"],
            "persistent_bytes": r["persistent_bytes"]["total"],
            "persistent_weights": r["persistent_bytes"]["weights"],
            "persistent_grads": r["persistent_bytes"]["grads"],
            "persistent_optimizer": r["persistent_bytes"]["optimizer"],
            "wire_bytes": r["collectives"]["wire_bytes_total"],
            "wire_by_kind": {k: v["wire_bytes"] for k, v in coll.items()},
            "calls_by_kind": {k: v["calls"] for k, v in coll.items()},
            "losses": r["losses"],
            "loss_max_rel_dev_vs_fsdp2": _loss_dev(r["losses"], ref_losses),
        }
        if name in rss:
            f["peak_rss"] = rss[name]["peak_rss_max"]
            f["peak_rss_over_start"] = rss[name]["peak_over_start_max"]
        out[name] = f
    for name, f in out.items():
        for base in ("fsdp2", "ddp"):
            b = out.get(base)
            if b is None:
                continue
            f[f"vs_{base}"] = {
                "step": _ratio(f["step_s"], b["step_s"]),
                "tokens_per_s": _ratio(f["tokens_per_s"], b["tokens_per_s"]),
                "persistent_bytes": _ratio(f["persistent_bytes"], b["persistent_bytes"]),
                "peak_rss": _ratio(f.get("peak_rss"), b.get("peak_rss")),
                "peak_rss_over_start": _ratio(f.get("peak_rss_over_start"), b.get("peak_rss_over_start")),
                "wire_bytes": _ratio(f["wire_bytes"], b["wire_bytes"]),
            }
    return out


def _pair(f: dict, key: str) -> str:
    return f"{_fmt_ratio(f.get('vs_fsdp2', {}).get(key))} / {_fmt_ratio(f.get('vs_ddp', {}).get(key))}"


def compare_table(n: int, dtype: str, run: dict, figs: Dict[str, dict]) -> str:
    lines = [
        f"#### N = {n} ranks, {dtype}: {run['model_description']}",
        "",
        f"{run['steps']} measured rounds after {run['warmup']} warm-up rounds, contenders interleaved; "
        f"global batch {run['global_tokens_per_step']} tokens/step; load average "
        f"{run['loadavg_before'][0]:.2f} before, {run['loadavg_after'][0]:.2f} after. "
        "Ratios are `x FSDP2 / x DDP` (below 1 = less time, memory or bytes).",
        "",
        "| contender | step ms: median [p25-p75] | x FSDP2 / x DDP | tokens/s | fwd / bwd / opt ms "
        "| persistent MiB/rank (w+g+opt) | x FSDP2 / x DDP | peak RSS MiB/rank (+ over start) | x FSDP2 / x DDP "
        "| sent MiB/step (AG / RS / AR) | x FSDP2 / x DDP | loss rel. dev. vs FSDP2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in figs.items():
        wk = f["wire_by_kind"]
        sent = " / ".join(f"{wk.get(k, 0) / MiB:.1f}" for k in ("all_gather", "reduce_scatter", "all_reduce"))
        persist = (f"{f['persistent_bytes'] / MiB:.1f} ({f['persistent_weights'] / MiB:.1f}+"
                   f"{f['persistent_grads'] / MiB:.1f}+{f['persistent_optimizer'] / MiB:.1f})")
        if "peak_rss" in f:
            rss = f"{f['peak_rss'] / MiB:.0f} (+{f['peak_rss_over_start'] / MiB:.0f})"
            rss_ratio = _pair(f, "peak_rss_over_start")
        else:
            rss, rss_ratio = "–", "–"
        dev = f["loss_max_rel_dev_vs_fsdp2"]
        lines.append(
            f"| {LABELS.get(name, name)} | {f['step_s'] * 1e3:.0f} [{f['step_p25_s'] * 1e3:.0f}-{f['step_p75_s'] * 1e3:.0f}] "
            f"| {_pair(f, 'step')} | {f['tokens_per_s']:.0f} "
            f"| {f['forward_s'] * 1e3:.0f} / {f['backward_s'] * 1e3:.0f} / {f['optimizer_s'] * 1e3:.0f} "
            f"| {persist} | {_pair(f, 'persistent_bytes')} | {rss} | {rss_ratio} | {sent} | {_pair(f, 'wire_bytes')} "
            f"| {'–' if dev is None else f'{dev:.1e}'} |"
        )
    return "\n".join(lines)


def targets(compare: Dict[int, dict], all_figs) -> (str, list):
    rows, checks = [], []

    def add(what, value, ok):
        checks.append({"target": what, "value": value, "met": ok})
        rows.append(f"| {what} | {value} | {'met' if ok else '**not met**'} |")

    for n, data in sorted(compare.items()):
        for dtype, run in data["runs"].items():
            figs = all_figs[(n, dtype)]
            z3, f2 = figs.get("mfsdp_zero3"), figs.get("fsdp2")
            tag = f"N={n} {dtype}"
            if z3 and f2:
                r = z3["vs_fsdp2"]["step"]
                add(f"{tag}: ZeRO-3 step time <= FSDP2 (median ratio <= 1.00)", f"{r:.3f}", r <= 1.0)
                if "peak_rss" in z3 and "peak_rss" in f2:
                    # The gap next to what MFSDP keeps between steps by contract (main_grad is
                    # allocated when a unit is built; FSDP2 frees its gradients at zero_grad).
                    gap = (z3["peak_rss"] - f2["peak_rss"]) / MiB
                    add(f"{tag}: ZeRO-3 peak RSS/rank <= FSDP2",
                        f"{z3['peak_rss'] / MiB:.0f} vs {f2['peak_rss'] / MiB:.0f} MiB (gap {gap:+.0f}; main_grad, "
                        f"persistent by design: {z3['persistent_grads'] / MiB:.0f})", z3["peak_rss"] <= f2["peak_rss"])
            res = run["results"]
            if "mfsdp_zero3" in res:
                pad = res["mfsdp_zero3"]["padding"]
                add(f"{tag}: ZeRO-3 shard = 1/N of unsharded + padding < 1 row of the largest tensor per group",
                    f"padding {pad['padding_numel_per_rank']:.0f} el. < bound {pad['one_row_per_group_numel']} el.",
                    pad["within_bound"])
                exp = res["mfsdp_zero3"]["expected"]
                sent = res["mfsdp_zero3"]["collectives"]["wire_bytes_total"]
                add(f"{tag}: ZeRO-3 bytes/step = 3 P (N-1)/N within 1%",
                    f"{sent / exp['issue_bytes']:.4f} x 3P(N-1)/N; {sent / exp['precise']:.4f} x "
                    "(root gathered once)", abs(sent / exp["precise"] - 1) <= 0.01)
            if "mfsdp_no_shard" in res:
                exp = res["mfsdp_no_shard"]["expected"]
                sent = res["mfsdp_no_shard"]["collectives"]["wire_bytes_total"]
                add(f"{tag}: no_shard bytes/step = 2 P (N-1)/N within 1%", f"{sent / exp['issue_bytes']:.4f}",
                    abs(sent / exp["issue_bytes"] - 1) <= 0.01)
            devs = {k: v["loss_max_rel_dev_vs_fsdp2"] for k, v in figs.items() if v["loss_max_rel_dev_vs_fsdp2"] is not None}
            if devs:
                worst = max(devs, key=devs.get)
                tol = LOSS_RTOL.get(dtype, 1e-2)
                add(f"{tag}: losses of all contenders agree with FSDP2 (rel. tol. {tol:g})",
                    f"max {devs[worst]:.1e} ({LABELS.get(worst, worst)})", devs[worst] <= tol)
    table = "| target | measured | |\n|---|---|---|\n" + "\n".join(rows)
    return table, checks


def hooks_table(*sources: Dict[int, dict]) -> str:
    """One row per MFSDP contender with hook times, over the comparison and the before/after runs."""
    hooks = ("pre_forward", "post_forward", "pre_backward", "post_backward", "finish_backward")
    lines = [
        "| run | contender | units | **hooks ms/step** | ms / unit / step | " + " | ".join(hooks)
        + " | cProfile: engine Python self ms/unit (FSDP2 same measure) |",
        "|---|---|---|---|---|" + "---|" * len(hooks) + "---|",
    ]
    for n, data in (item for source in sources for item in sorted(source.items())):
        for dtype, run in data["runs"].items():
            res = run["results"]
            f2 = res.get("fsdp2", {}).get("python_profile")
            for name, r in res.items():
                h = r.get("hooks")
                if not h or "by_hook_s_per_step" not in h:  # none, or timed before the profiler ranges
                    continue
                prof = r.get("python_profile")
                p = (f"{prof['engine_python_self_s_per_unit'] * 1e3:.2f} ({f2['engine_python_self_s_per_unit'] * 1e3:.2f})"
                     if prof and f2 else "–")
                per_hook = " | ".join(f"{h['by_hook_s_per_step'].get(k, 0.0) * 1e3:.1f}" for k in hooks)
                lines.append(
                    f"| N={n} {dtype} | {LABELS.get(name, name)} | {h['units']} | **{h['hook_s_per_step'] * 1e3:.1f}** "
                    f"| {h['hook_s_per_unit_per_step'] * 1e3:.2f} | {per_hook} | {p} |")
    return "\n".join(lines)


def time_split_table(compare: Dict[int, dict]) -> str:
    """Where each MFSDP contender's step goes next to DDP's, from the engine's profiler
    ranges (``hook_overhead`` in measurement.py) on the profiled steps."""
    lines = [
        "| run | contender | step ms (DDP) | gap to DDP ms | fwd / bwd / opt ms vs DDP's | exposed all-gather | "
        "exposed reduce-scatter | gradient copies into reduce buffers | post-ops (sums, divisions, copy-out) | "
        "other engine work (Python, launches, allocation) | **engine's own ms / unit** | profiled step ms | "
        "engine's own ms / unit without profiler: wall / **thread CPU** |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, data in sorted(compare.items()):
        for dtype, run in data["runs"].items():
            res = run["results"]
            ddp = res.get("ddp", {}).get("timing")
            for name, r in res.items():
                h = r.get("hooks")
                # An engine snapshot from before the wait ranges cannot be split.
                if not h or not h.get("wait_in_hooks_s_per_step") or not ddp:
                    continue
                t = r["timing"]
                phases = " / ".join(f"{t[k]['median'] * 1e3:.0f} ({ddp[k]['median'] * 1e3:.0f})"
                                    for k in ("forward", "backward", "optimizer"))
                ms = lambda x: f"{x * 1e3:.0f}"
                waits_in, waits_out = h["wait_in_hooks_s_per_step"], h["wait_outside_hooks_s_per_step"]
                other = h["own_s_per_step"] - h["stash_s_per_step"] - h["post_ops_s_per_step"]
                lines.append(
                    f"| N={n} {dtype} | {LABELS.get(name, name)} | {ms(t['step']['median'])} ({ms(ddp['step']['median'])}) "
                    f"| {ms(t['step']['median'] - ddp['step']['median'])} | {phases} "
                    f"| {ms(waits_in.get('all_gather', 0.0))} (+{ms(waits_out.get('all_gather', 0.0))} after the step) "
                    f"| {ms(waits_in.get('reduce_scatter', 0.0) + waits_out.get('reduce_scatter', 0.0))} "
                    f"| {ms(h['stash_s_per_step'])} | {ms(h['post_ops_s_per_step'])} | {ms(other)} "
                    f"| **{h['own_s_per_unit_per_step'] * 1e3:.1f}** | {ms(h['step_wall_s'])} | {cpu_cells(r)} |")
    return "\n".join(lines)


def cpu_cells(result: dict) -> str:
    """The engine's own time per unit from its CpuTimeLedger steps: wall / thread CPU."""
    e = result.get("engine_cpu")
    if not e:
        return "–"
    return f"{e['own_wall_s_per_unit_per_step'] * 1e3:.1f} / **{e['own_cpu_s_per_unit_per_step'] * 1e3:.1f}**"


def sweep_table(sweep: dict) -> str:
    names = sweep["contenders"]
    head = "| layers | hidden | params | " + " | ".join(
        f"{LABELS.get(n, n)} step ms / MiB per rank" for n in names) + " | ZeRO-3 step x FSDP2 |"
    lines = [head, "|" + "---|" * (len(names) + 4)]
    for pt in sweep["points"]:
        cells = []
        for n in names:
            r = pt["results"][n]
            cells.append(f"{r['step']['median'] * 1e3:.0f} / {r['persistent_bytes']['total'] / MiB:.1f}")
        z, f = pt["results"].get("mfsdp_zero3"), pt["results"].get("fsdp2")
        ratio = _fmt_ratio(_ratio(z["step"]["median"], f["step"]["median"])) if z and f else "–"
        lines.append(f"| {pt['layers']} | {pt['hidden']} | {pt['num_params'] / 1e6:.2f}M | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def overlap_table(overlap: Dict[int, dict]) -> str:
    lines = []
    for n, o in sorted(overlap.items()):
        v = o["variants"]
        lines += [
            f"#### N = {n}, fp32: {o['model_description']}",
            "",
            "| variant | step ms median [p25-p75] | fwd / bwd / opt ms |",
            "|---|---|---|",
        ]
        for name, r in v.items():
            lines.append(f"| {name} | {r['step']['median'] * 1e3:.0f} [{r['step']['p25'] * 1e3:.0f}-"
                         f"{r['step']['p75'] * 1e3:.0f}] | {r['forward']['median'] * 1e3:.0f} / "
                         f"{r['backward']['median'] * 1e3:.0f} / {r['optimizer']['median'] * 1e3:.0f} |")
        comm, comp = o["comm_only"]["median"], o["compute_only_fwd_bwd_s"]
        with_pf = v["mfsdp_zero3_prefetch1"]["step"]["median"]
        without = v["mfsdp_zero3_noprefetch"]["step"]["median"]
        hidden = (o["serial_bound_s"] - with_pf) / comm if comm > 0 else float("nan")
        lines += [
            "",
            f"compute only (no wrapper, fwd+bwd) {comp * 1e3:.0f} ms; communication only (the step's collectives back "
            f"to back) {comm * 1e3:.0f} ms wall, {o['comm_only'].get('cpu_s_per_rank', float('nan')) * 1e3:.0f} ms of CPU "
            f"time per rank (all threads); ZeRO-3 optimizer {o['mfsdp_optimizer_s'] * 1e3:.0f} ms. "
            f"Serial sum {o['serial_bound_s'] * 1e3:.0f} ms, perfect-overlap bound {o['overlap_bound_s'] * 1e3:.0f} ms. "
            f"MFSDP ZeRO-3 with prefetch {with_pf * 1e3:.0f} ms, without {without * 1e3:.0f} ms "
            f"(prefetch saves {(1 - with_pf / without) * 100:.1f}%); share of the communication time hidden "
            f"behind compute: {hidden * 100:.0f}%. Load average {o['loadavg'][0]:.2f}.",
            "",
        ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Charts
# --------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def compare_chart(all_figs, path: str) -> None:
    plt = _plt()
    configs = sorted(all_figs, key=lambda k: (k[0], 0 if k[1] == "fp32" else 1))
    names = []
    for key in configs:
        for name in all_figs[key]:
            if name not in names:
                names.append(name)
    metrics = [("step", "step time (median, p25-p75)"), ("persistent_bytes", "persistent bytes / rank"),
               ("peak_rss_over_start", "peak RSS / rank (over process start)"), ("wire_bytes", "bytes sent / step")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.5))
    width = 0.8 / max(1, len(names))
    for ax, (metric, title) in zip(axes, metrics):
        for i, name in enumerate(names):
            xs, ys, lo, hi = [], [], [], []
            for j, key in enumerate(configs):
                f = all_figs[key].get(name)
                base = all_figs[key].get("fsdp2")
                if not f or not base:
                    continue
                value = f.get("vs_fsdp2", {}).get(metric)
                if value is None:
                    continue
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(value)
                if metric == "step":
                    lo.append(value - f["step_p25_s"] / base["step_s"])
                    hi.append(f["step_p75_s"] / base["step_s"] - value)
            if xs:
                ax.bar(xs, ys, width, label=LABELS.get(name, name),
                       yerr=[lo, hi] if metric == "step" and lo else None, capsize=2)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"N={n}\n{d}" for n, d in configs])
        ax.set_title(title + "\nratio to FSDP2", fontsize=10)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("MFSDP v2 vs PyTorch FSDP2 vs DDP (CPU, gloo) - ratio to FSDP2, lower is better")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_chart(sweep: dict, path: str) -> None:
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    hiddens = sorted({p["hidden"] for p in sweep["points"]})
    styles = ["-o", "--s", ":^", "-.d"]
    for name in sweep["contenders"]:
        for k, h in enumerate(hiddens):
            pts = [p for p in sweep["points"] if p["hidden"] == h]
            layers = [p["layers"] for p in pts]
            a.plot(layers, [p["results"][name]["step"]["median"] * 1e3 for p in pts], styles[k % 4],
                   label=f"{LABELS.get(name, name)} h={h}")
            b.plot(layers, [p["results"][name]["persistent_bytes"]["total"] / MiB for p in pts], styles[k % 4],
                   label=f"{LABELS.get(name, name)} h={h}")
    for ax, title in ((a, "step time (ms, median)"), (b, "persistent MiB per rank")):
        ax.set_xlabel("layers")
        ax.set_title(title)
        ax.set_xticks(sorted({p["layers"] for p in sweep["points"]}))
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    fig.suptitle(f"Scaling sweep, N={sweep['world_size']}, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def overlap_chart(overlap: Dict[int, dict], path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, len(overlap), figsize=(6 * len(overlap), 4.2), squeeze=False)
    for ax, (n, o) in zip(axes[0], sorted(overlap.items())):
        names = list(o["variants"])
        values = [o["variants"][k]["step"]["median"] * 1e3 for k in names]
        names += ["compute only\n+ comm only", "max(compute,\ncomm)"]
        values += [o["serial_bound_s"] * 1e3, o["overlap_bound_s"] * 1e3]
        ax.bar(range(len(values)), values, color=["C0"] * 3 + ["C1"] * 2 + ["C2"] + ["C7"] * 2)
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels([s.replace("mfsdp_zero3_", "ZeRO-3 ").replace("_", " ") for s in names],
                           rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("ms / step")
        ax.set_title(f"N={n}: prefetch and overlap (fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _env_line(data: dict) -> str:
    env = data.get("environment", {})
    alloc = env.get("allocator", {})
    drv = data.get("driver", {})
    eng = env.get("engine", {})
    last = (eng.get("engine_last_commit") or "").split(" ")[0]
    engine = (f"engine {last} (tree {eng.get('commit')}){' + uncommitted engine edits' if eng.get('engine_dirty') else ''}, "
              if eng else "engine e0004f2 (before 8760f34), ")
    return (f"{engine}torch {env.get('torch')}, {env.get('cpu_count')} CPU cores, {env.get('threads_per_rank')} thread(s)/rank, "
            f"backend {env.get('backend')}, allocator {alloc.get('malloc')} with "
            f"{alloc.get('env') or 'default settings'}; {env.get('optimizer')}. "
            f"Launch wall time {data.get('wall_s', 0):.0f}s"
            + (f"; load average {drv['loadavg_before'][0]:.2f} -> {drv['loadavg_after'][0]:.2f}" if drv else "") + ".")


def optim_table(optim: Dict[int, dict]) -> str:
    lines = []
    for n, data in sorted(optim.items()):
        for dtype, run in data["runs"].items():
            res = run["results"]
            stock = res.get("mfsdp_zero3")
            f2 = res.get("fsdp2")
            lines += [f"##### N = {n}, {dtype}: {run['model_description']}", "",
                      f"Interleaved, {run['steps']} measured rounds; load average {run['loadavg_before'][0]:.2f} -> "
                      f"{run['loadavg_after'][0]:.2f}.", "",
                      "| variant | step ms median [p25-p75] | x stock | x FSDP2 | fwd / bwd / opt ms "
                      "| hook ms / unit / step | page faults / step | peak RSS MiB/rank over start (x FSDP2) "
                      "| loss = stock |",
                      "|---|---|---|---|---|---|---|---|---|"]
            rss = data.get("rss", {}).get(dtype, {})
            f2_rss = rss.get("fsdp2", {}).get("peak_over_start_max")
            for name, r in res.items():
                if r.get("bytes_only"):
                    continue
                t = r["timing"]
                h = r.get("hooks")
                own = "–" if not h or "hook_s_per_unit_per_step" not in h else f"{h['hook_s_per_unit_per_step'] * 1e3:.2f}"
                if stock is None:
                    same = "–"
                elif r["losses"] == stock["losses"]:
                    same = "yes (bitwise)"
                else:
                    same = f"max rel. dev. {_loss_dev(r['losses'], stock['losses']):.1e}"
                base_step = stock["timing"]["step"]["median"] if stock else None
                f2_step = f2["timing"]["step"]["median"] if f2 else None
                faults = t.get("page_faults", {}).get("median", float("nan"))
                label = (name.replace("mfsdp_zero3", "ZeRO-3").replace("mfsdp_zero2", "ZeRO-2").replace("fsdp2", "FSDP2")
                         .replace("ddp", "DDP"))
                mine = rss.get(name, {}).get("peak_over_start_max")
                peak = "–" if mine is None else f"{mine / MiB:.0f} ({_fmt_ratio(_ratio(mine, f2_rss))})"
                lines.append(
                    f"| {label} | {t['step']['median'] * 1e3:.0f} [{t['step']['p25'] * 1e3:.0f}-{t['step']['p75'] * 1e3:.0f}] "
                    f"| {_fmt_ratio(_ratio(t['step']['median'], base_step))} | {_fmt_ratio(_ratio(t['step']['median'], f2_step))} "
                    f"| {t['forward']['median'] * 1e3:.0f} / {t['backward']['median'] * 1e3:.0f} / {t['optimizer']['median'] * 1e3:.0f} "
                    f"| {own} | {faults:.0f} | {peak} | {same} |")
            lines.append("")
    return "\n".join(lines)


def alloc_table(alloc: Dict[str, dict], compare: Dict[int, dict]) -> str:
    settings = dict(alloc)
    main = compare.get(2)
    if main and "fp32" in main["runs"]:
        settings.setdefault(_setting_name(main), main)
    lines = ["| malloc setting of the timed run | contender | step ms median | x FSDP2 | page faults / step "
             "| peak RSS MiB/rank (+ over start) | x FSDP2 (over start) | malloc of the RSS child |",
             "|---|---|---|---|---|---|---|---|"]
    for setting, data in settings.items():
        run = data["runs"]["fp32"]
        figs = figures(run, data.get("rss", {}).get("fp32", {}))
        env = data.get("environment", {}).get("allocator", {}).get("env") or "glibc defaults"
        for name, f in figs.items():
            pf = run["results"][name]["timing"].get("page_faults", {}).get("median", float("nan"))
            rss = (f"{f['peak_rss'] / MiB:.0f} (+{f['peak_rss_over_start'] / MiB:.0f})" if "peak_rss" in f else "–")
            child = data.get("rss", {}).get("fp32", {}).get(name, {}).get("malloc", {}).get("setting", "–")
            child = setting if child == "inherit" else child
            lines.append(f"| {setting}: {env} | {LABELS.get(name, name)} | {f['step_s'] * 1e3:.0f} | {_pair(f, 'step').split(' / ')[0]} "
                         f"| {pf:.0f} | {rss} | {_pair(f, 'peak_rss_over_start').split(' / ')[0]} | {child} |")
    return "\n".join(lines)


def _setting_name(data: dict) -> str:
    return data.get("driver", {}).get("malloc", "main run")


def write_report(out: str, meta: Optional[dict] = None) -> List[str]:
    found = load_dir(out)
    compare, sweep, overlap, optim, alloc = (found[k] for k in ("compare", "sweep", "overlap", "optim", "alloc"))
    md: List[str] = ["# MFSDP v2 vs FSDP2 vs DDP: results", ""]
    summary: dict = {"loss_rtol": LOSS_RTOL, "compare": {}, "targets": []}
    all_figs = {}
    if compare:
        commands = sorted({d.get("driver", {}).get("command", "") for d in compare.values()} - {""})
        md += ["## Side-by-side comparison", ""]
        md += [f"Command: `{c}`" for c in commands] + [""]
        for n, data in sorted(compare.items()):
            md += [f"N={n}: {_env_line(data)}", ""]
        for n, data in sorted(compare.items()):
            for dtype, run in data["runs"].items():
                figs = figures(run, data.get("rss", {}).get(dtype, {}))
                all_figs[(n, dtype)] = figs
                summary["compare"][f"n{n}_{dtype}"] = {"model": run["model_description"], "contenders": figs,
                                                       "loadavg": [run["loadavg_before"], run["loadavg_after"]]}
                md += [compare_table(n, dtype, run, figs), ""]
        rss_malloc = sorted({r.get("malloc", {}).get("setting", "inherit") for d in compare.values()
                             for per in d.get("rss", {}).values() for r in per.values()})
        md += ["Peak RSS: one child process per contender (forked from the same imported image before any "
               "process group exists), with glibc malloc switched (mallopt) to "
               f"`{', '.join(rss_malloc) or '-'}` (mmap64k: every allocation of 64 KiB or more is its own mapping, "
               "returned to the OS on free, so RSS follows live tensor memory for every contender alike); "
               "peak (VmHWM) reset after the warm-up step, measured over the following "
               "steps; ratios use the part over the process start (the absolute peak includes the same "
               "import baseline for every contender). Sent bytes: ring-algorithm bytes a rank sends "
               "(all-gather (N-1) x shard, reduce-scatter (N-1)/N x input, all-reduce 2 (N-1)/N x buffer), "
               "counted by wrapping the torch.distributed calls during one extra untimed step (DDP: a counting "
               "comm hook on a throw-away DDP copy, since its reducer calls gloo from C++).", ""]
        compare_chart(all_figs, os.path.join(out, "compare.png"))
        md += ["![comparison](compare.png)", ""]
        table, checks = targets(compare, all_figs)
        summary["targets"] = checks
        md += ["## Targets", "", table, "", "## Hook overhead (MFSDP's own work per unit per step)", "",
               hooks_table(compare, optim), "",
               "Wall time inside the engine's profiler ranges (`MFSDP <unit> <hook>`, `MFSDP finish_backward`; "
               "torch.profiler on 3 untimed steps, outermost ranges summed): the engine's Python, unshard/reshard, "
               "launching and waiting for collectives, the reductions' post-ops. The per-gradient copy into the "
               "reduce buffer and the optimizer's post-step sync run outside the ranges. A snapshot engine from "
               "before the ranges shows no row. The cProfile column is the self time of Python frames in the "
               "engine's source files during one profiled step (inflated by cProfile; comparable between engines).",
               "", "## Where the time goes (ms per step, MFSDP vs DDP)", "", time_split_table(compare), "",
               "Step, phases and gap: medians of the timed rounds (DDP's in parentheses). The other columns come "
               "from the engine's profiler ranges on 3 profiled steps (`MFSDP wait <kind>`: the host blocked on a "
               "collective inside a hook, i.e. communication not hidden behind compute; `MFSDP stash_grad`: each "
               "gradient copied into its unit's reduce buffer; `MFSDP post_ops <kind>`; the rest of the hooks' time "
               "is the engine's other work). The engine's own work is the last three together. The last column "
               "comes from 3 more steps without the profiler, with the engine's `CpuTimeLedger` on "
               "(`mfsdp_v2/profiling.py`): wall time and the training thread's CPU time inside the same "
               "outermost ranges, waits subtracted. The CPU figure leaves out the time the thread was "
               "descheduled while gloo's transport threads or the other ranks ran on the same cores. What the columns do "
               "not explain of the gap is compute slowed by the communication sharing the same cores (gloo's "
               "transport runs on the CPU) and the optimizer's share.",
               ""]
    if optim:
        commands = sorted({d.get("driver", {}).get("command", "") for d in optim.values()} - {""})
        md += ["## Optimizations: before / after (benchmark prototypes vs the stock engine, one interleaved run)", ""]
        md += [f"Command: `{c}`" for c in commands] + [""]
        md += [f"N={n}: {_env_line(d)}\n" for n, d in sorted(optim.items())]
        md += [optim_table(optim), ""]
        summary["optimizations"] = {f"n{n}_{dt}": {k: v["timing"]["step"] for k, v in run["results"].items()
                                                   if "timing" in v}
                                    for n, d in optim.items() for dt, run in d["runs"].items()}
    if alloc:
        md += ["## Allocator sensitivity (N=2, fp32)", ""]
        md += [f"{k}: {_env_line(d)}\n" for k, d in sorted(alloc.items())]
        md += [alloc_table(alloc, compare), ""]
    if sweep:
        md += ["## Scaling sweep", "", f"Command: `{sweep.get('driver', {}).get('command', '')}`", "",
               _env_line(sweep), "", sweep_table(sweep), "", "![sweep](sweep.png)", ""]
        sweep_chart(sweep, os.path.join(out, "sweep.png"))
        summary["sweep"] = sweep["points"]
    if overlap:
        commands = sorted({d.get("driver", {}).get("command", "") for d in overlap.values()} - {""})
        md += ["## Overlap: prefetch vs no prefetch vs compute + communication", ""]
        md += [f"Command: `{c}`" for c in commands] + [""]
        md += [f"N={n}: {_env_line(d)}\n" for n, d in sorted(overlap.items())]
        md += [overlap_table(overlap), "![overlap](overlap.png)", ""]
        overlap_chart(overlap, os.path.join(out, "overlap.png"))
        summary["overlap"] = {str(n): {k: o[k] for k in ("variants", "comm_only", "compute_only_fwd_bwd_s",
                                                           "serial_bound_s", "overlap_bound_s", "loadavg")}
                              for n, o in overlap.items()}
    if meta:
        summary["last_driver_run"] = meta
    report_md = os.path.join(out, "report.md")
    with open(report_md, "w") as f:
        f.write("\n".join(md))
    summary_json = os.path.join(out, "summary.json")
    with open(summary_json, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return [report_md, summary_json] + [os.path.join(out, p) for p in ("compare.png", "sweep.png", "overlap.png")
                                        if os.path.exists(os.path.join(out, p))]


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def update_readme(readme: str, report_md: str, out: str) -> None:
    """Replace the block between the results markers with the report (image links made
    relative to the README)."""
    with open(report_md) as f:
        body = f.read()
    rel = os.path.relpath(out, os.path.dirname(readme))
    body = re.sub(r"\]\((\w+\.png)\)", lambda m: f"]({rel}/{m.group(1)})", body)
    body = body.replace("# MFSDP v2 vs FSDP2 vs DDP: results\n", "", 1).replace("\n## ", "\n### ").replace("\n#### ", "\n##### ")
    text = ""
    if os.path.exists(readme):
        with open(readme) as f:
            text = f.read()
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    text = text[:start] + "\n" + body.strip() + "\n" + text[end:]
    with open(readme, "w") as f:
        f.write(text)


if __name__ == "__main__":
    import argparse

    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description="Re-render the report from the JSON files of a results folder.")
    parser.add_argument("results", nargs="?", default=os.path.join(here, "results"))
    parser.add_argument("--update-readme", action="store_true", help="rewrite the results block of benchmarks/README.md")
    cli = parser.parse_args()
    print("\n".join(write_report(cli.results)))
    if cli.update_readme:
        update_readme(os.path.join(here, "README.md"), os.path.join(cli.results, "report.md"), cli.results)
