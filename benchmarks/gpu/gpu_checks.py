#!/usr/bin/env python
"""GPU checks for MFSDP v2 at world size 1 (one NVIDIA GPU), all figures into one JSON.

Run by ``benchmarks/gpu/run_all.sh`` under ``torch.distributed.run --nproc-per-node 1``.
Checks (each independent; a failure is recorded and the next one runs):

parity      The engine on CUDA (NCCL) against an unwrapped CUDA reference and against the
            same engine on CPU (gloo): ZeRO-3 / ZeRO-2 / ZeRO-1 / no_shard, 2 microbatches,
            and ZeRO-3 with activation recomputation. Losses and final weights must match.
overlap     Prefetch really overlaps: from a torch.profiler CUDA trace, the all-gather of
            unit i+1 must start before the forward kernels of unit i end.
bf16        bf16 compute with fp32 main weights: main weights/optimizer state are fp32, a
            tiny update that bf16 would round away survives in the main weights, and the
            loss follows the fp32 reference.
te          Transformer Engine (if importable): the GPT with transformer_impl
            ="transformer_engine" trains under MFSDP ZeRO-3 and matches the local GPT.
mfu         Model FLOPs utilization of a ~1B-parameter GPT, bf16: MFSDP v2 ZeRO-3 vs
            PyTorch FSDP2 vs no wrapper.

``--device cpu --tiny`` runs every check with tiny sizes on CPU/gloo (the CUDA-only parts
are reported as skipped): it is how the script is exercised on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from megatron.core.distributed.mfsdp_v2 import (  # noqa: E402
    MixedPrecisionPolicy,
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.model_stats import flops_per_token, num_parameters  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

# Dense bf16 peak of the GPU for MFU; H100/H200 SXM spec sheet: 989.4 TFLOP/s.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def log(msg: str) -> None:
    print(f"[gpu_checks {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpt(layers, hidden, heads, vocab, seq, device, dtype=torch.float32, seed=0, impl="local", recompute=None):
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, params_dtype=dtype,
                            transformer_impl=impl, recompute_granularity=recompute)
    with torch.device(device):
        return GPTModel(cfg, vocab, seq)


def batches(n, rows, seq, vocab, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (rows, seq + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def wrap(model, placements, mesh, device, policy=None):
    with fully_shard_context(device=device) as ctx:
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=mesh, placements=placements, mixed_precision_policy=policy)
        fully_shard(model, mesh=mesh, placements=placements, mixed_precision_policy=policy)
    return ctx


def full_tensor(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


# --------------------------------------------------------------------------------------
# parity
# --------------------------------------------------------------------------------------


def train(model, data, ctx=None, micro=1, lr=1e-3, steps=3, autocast_dtype=None, fused=None):
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, **({"fused": fused} if fused is not None else {}))
    if ctx is not None:
        opt = fully_shard_optimizer(opt)
    losses = []
    for s in range(steps):
        inputs, labels = data[s]
        chunks = list(zip(inputs.chunk(micro), labels.chunk(micro)))
        total = 0.0
        for i, (x, y) in enumerate(chunks):
            scope = microbatch(ctx, is_last=i == micro - 1) if ctx is not None else contextlib.nullcontext()
            with scope:
                loss = model(x, labels=y).mean() / micro
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def check_parity(device, mesh_dev, mesh_cpu, tiny) -> dict:
    size = dict(layers=2, hidden=64, heads=4, vocab=256, seq=32) if tiny else dict(layers=4, hidden=256, heads=4, vocab=1024, seq=128)
    data_dev = batches(3, 4, size["seq"], size["vocab"], device)
    data_cpu = [(x.cpu(), y.cpu()) for x, y in data_dev]
    ref_model = gpt(**size, device=device)
    ref_losses = train(ref_model, data_dev, micro=2)
    ref_weights = {k: v.detach().float().cpu() for k, v in ref_model.named_parameters()}
    cases = {}
    strategies = {"zero3": Placements.zero3(), "zero2": Placements.zero2(), "zero1": Placements.zero1(),
                  "no_shard": Placements.no_shard()}
    worst = 0.0
    for name, placements in strategies.items():
        m = gpt(**size, device=device)
        ctx = wrap(m, placements, mesh_dev, device)
        losses = train(m, data_dev, ctx=ctx, micro=2)
        weight_err = max((full_tensor(p).detach().float().cpu() - ref_weights[k]).abs().max().item()
                         for k, p in m.named_parameters())
        # The same engine, same model and data on CPU/gloo.
        mc = gpt(**size, device="cpu")
        ctxc = wrap(mc, placements, mesh_cpu, torch.device("cpu"))
        cpu_losses = train(mc, data_cpu, ctx=ctxc, micro=2)
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        cpu_err = max(abs(a - b) / abs(b) for a, b in zip(losses, cpu_losses))
        cases[name] = {"losses": losses, "cpu_losses": cpu_losses, "max_rel_loss_err_vs_ref": loss_err,
                       "max_rel_loss_err_vs_cpu_engine": cpu_err, "max_abs_weight_err_vs_ref": weight_err}
        worst = max(worst, loss_err, cpu_err)
    # ZeRO-3 with activation recomputation (the engine must recognise the re-run forward).
    m = gpt(**size, device=device, recompute="full")
    ctx = wrap(m, Placements.zero3(), mesh_dev, device)
    losses = train(m, data_dev, ctx=ctx, micro=2)
    err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    cases["zero3_recompute"] = {"losses": losses, "max_rel_loss_err_vs_ref": err}
    worst = max(worst, err)
    tol = 1e-4 if device.type == "cuda" else 1e-5  # TF32 off by default for matmuls; kernels differ from CPU
    return {"reference_losses": ref_losses, "cases": cases, "worst_rel_err": worst, "tolerance": tol,
            "passed": worst <= tol}


# --------------------------------------------------------------------------------------
# overlap (profiler trace)
# --------------------------------------------------------------------------------------


def check_overlap(device, mesh_dev, tiny, out_dir) -> dict:
    size = dict(layers=4, hidden=64, heads=4, vocab=256, seq=32) if tiny else dict(layers=8, hidden=2048, heads=16, vocab=32768, seq=1024)
    rows = 2 if tiny else 4
    m = gpt(**size, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32) if device.type == "cuda" else None
    ctx = wrap(m, Placements.zero3(), mesh_dev, device, policy)
    opt = fully_shard_optimizer(torch.optim.AdamW(m.parameters(), lr=1e-4))
    data = batches(4, rows, size["seq"], size["vocab"], device)
    layers = list(m.decoder.layers)
    open_ranges = {}

    def pre(i):
        def hook(module, args):
            r = torch.profiler.record_function(f"fwd_layer_{i}")
            r.__enter__()
            open_ranges[i] = r
        return hook

    def post(i):
        def hook(module, args, output):
            open_ranges.pop(i).__exit__(None, None, None)
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i)))  # runs after MFSDP's (prepended) pre-hook
        handles.append(layer.register_forward_hook(post(i)))

    def step(x, y):
        with microbatch(ctx, is_last=True):
            m(x, labels=y).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for x, y in data[:2]:
        step(x, y)
    sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        x, y = data[2]
        with microbatch(ctx, is_last=True):
            loss = m(x, labels=y).mean()
            sync(device)
            loss.backward()
        sync(device)
    for h in handles:
        h.remove()
    trace = os.path.join(out_dir, f"overlap_trace_{device.type}.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    result = analyze_overlap(events, len(layers), device.type)
    result["trace_file"] = os.path.basename(trace)
    return result


def analyze_overlap(events, n_layers, device_type) -> dict:
    if device_type != "cuda":
        # CPU: gloo runs collectives on its own threads; compare the launch of the
        # prefetch (the c10d op on the training thread) with the layer range.
        spans = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                 if e.get("ph") == "X" and str(e.get("name", "")).startswith("fwd_layer_") and e.get("cat") == "user_annotation"}
        gathers = sorted(e["ts"] for e in events if e.get("ph") == "X" and "allgather" in str(e.get("name", "")).lower()
                         and e.get("cat") == "cpu_op")
        return {"note": "CPU run: checks that the code path works; the GPU verdict needs CUDA kernels.",
                "layer_spans_found": len(spans), "allgather_ops_found": len(gathers), "passed": None}
    fwd = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("fwd_layer_"):
            i = int(e["name"].rsplit("_", 1)[1])
            s, t = e["ts"], e["ts"] + e.get("dur", 0)
            if i not in fwd:  # the first (forward) occurrence; recomputation would add more
                fwd[i] = (s, t)
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    if not gpu or not fwd:
        return {"passed": None, "note": "no GPU kernels or no gpu_user_annotation spans in the trace"}
    by_stream = {}
    for e in gpu:
        by_stream.setdefault(e["args"].get("stream"), []).append(e)
    compute_stream = max(by_stream, key=lambda s: sum(e.get("dur", 0) for e in by_stream[s]))
    fwd_end = max(t for _, t in fwd.values())
    fwd_start = min(s for s, _ in fwd.values())
    side = sorted((e for e in gpu if e["args"].get("stream") != compute_stream and e["ts"] <= fwd_end),
                  key=lambda e: e["ts"])
    gathers = [e for e in side if "allgather" in e["name"].lower() or "all_gather" in e["name"].lower()
               or e.get("cat") == "gpu_memcpy"]
    # forward order: root, layer 0, layer 1, ...: the k-th gather of the forward belongs to unit k.
    checks = []
    for i in range(n_layers - 1):
        k = i + 2  # gather of layer i+1 (index 0 is the root)
        if k >= len(gathers) or i not in fwd:
            continue
        g = gathers[k]
        checks.append({"layer": i, "next_gather_start_us": g["ts"] - fwd_start, "layer_fwd_end_us": fwd[i][1] - fwd_start,
                       "layer_fwd_start_us": fwd[i][0] - fwd_start, "starts_before_end": g["ts"] < fwd[i][1]})
    overlap_us = 0.0
    compute = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in by_stream[compute_stream] if e["ts"] <= fwd_end)
    for g in gathers:
        gs, ge = g["ts"], g["ts"] + g.get("dur", 0)
        for cs, ce in compute:
            overlap_us += max(0.0, min(ge, ce) - max(gs, cs))
    total_gather_us = sum(g.get("dur", 0) for g in gathers)
    ok = bool(checks) and all(c["starts_before_end"] for c in checks)
    return {"passed": ok, "compute_stream": compute_stream, "gathers_in_forward": len(gathers),
            "checks": checks, "gather_time_us": total_gather_us, "gather_time_overlapped_us": overlap_us,
            "overlapped_fraction": overlap_us / total_gather_us if total_gather_us else None}


# --------------------------------------------------------------------------------------
# bf16 with fp32 main weights
# --------------------------------------------------------------------------------------


def check_bf16(device, mesh_dev, tiny) -> dict:
    size = dict(layers=2, hidden=64, heads=4, vocab=256, seq=32) if tiny else dict(layers=4, hidden=512, heads=8, vocab=4096, seq=256)
    data = batches(6, 4, size["seq"], size["vocab"], device)
    ref = gpt(**size, device=device)
    with torch.no_grad():  # bf16-representable start, so both runs begin at the same weights
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ref_losses = train(copy.deepcopy(ref), data, steps=6)
    m = copy.deepcopy(ref).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                  grad_comm_dtype=torch.bfloat16)
    ctx = wrap(m, Placements.zero3(), mesh_dev, device, policy)
    params = list(m.parameters())
    dtypes = sorted({str(p.dtype) for p in params})
    t = time.perf_counter()
    losses = train(m, data, ctx=ctx, steps=6)
    sync(device)
    elapsed = time.perf_counter() - t
    opt_state_dtypes = set()
    # A tiny update that bf16 would round away must survive in the fp32 main weights.
    m2 = copy.deepcopy(ref).to(torch.bfloat16)
    ctx2 = wrap(m2, Placements.zero3(), mesh_dev, device, policy)
    # Adam's first step moves every weight by ~lr = 1e-6, far below bf16's resolution (~1e-4
    # at 0.02), so only fp32 main weights can keep it.
    opt = fully_shard_optimizer(torch.optim.AdamW(m2.parameters(), lr=1e-6, weight_decay=0.0))
    before = {k: full_tensor(p).detach().clone() for k, p in m2.named_parameters()}
    x, y = data[0]
    with microbatch(ctx2, is_last=True):
        m2(x, labels=y).mean().backward()
    opt.step()
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                opt_state_dtypes.add(str(v.dtype))
    changed_main = sum(int((full_tensor(p).detach() != before[k]).any().item()) for k, p in m2.named_parameters())
    bf16_visible = 0
    for k, p in m2.named_parameters():
        delta = (full_tensor(p).detach() - before[k])
        bf16_visible += int(((before[k] + delta).to(torch.bfloat16) != before[k].to(torch.bfloat16)).any().item())
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    ok = dtypes == ["torch.float32"] and changed_main > 0 and rel < 3e-2
    return {"main_weight_dtypes": dtypes, "optimizer_state_dtypes": sorted(opt_state_dtypes),
            "losses_bf16_mfsdp": losses, "losses_fp32_reference": ref_losses, "max_rel_loss_diff": rel,
            "params_changed_by_tiny_update_in_main_fp32": changed_main,
            "params_where_that_update_is_visible_in_bf16": bf16_visible, "six_steps_s": elapsed, "passed": ok}


# --------------------------------------------------------------------------------------
# Transformer Engine
# --------------------------------------------------------------------------------------


def check_te(device, mesh_dev, tiny) -> dict:
    if device.type != "cuda":
        return {"skipped": "Transformer Engine needs CUDA", "passed": None}
    try:
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine
        version = getattr(transformer_engine, "__version__", "?")
    except Exception as error:  # not installed, or its CUDA libraries are missing
        return {"skipped": f"not importable: {type(error).__name__}: {error}", "passed": None}
    size = dict(layers=2, hidden=256, heads=4, vocab=1024, seq=128)
    data = batches(3, 4, size["seq"], size["vocab"], device)
    local = gpt(**size, device=device)
    te_model = gpt(**size, device=device, impl="transformer_engine")
    te_model.load_state_dict(local.state_dict(), strict=False)
    ref_losses = train(copy.deepcopy(te_model), data)
    ctx = wrap(te_model, Placements.zero3(), mesh_dev, device)
    losses = train(te_model, data, ctx=ctx)
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return {"version": version, "losses_mfsdp_te": losses, "losses_te_unwrapped": ref_losses,
            "max_rel_loss_diff": rel, "passed": rel < 1e-3}


# --------------------------------------------------------------------------------------
# MFU of a ~1B GPT
# --------------------------------------------------------------------------------------


def check_mfu(device, mesh_dev, tiny, steps, warmup) -> dict:
    if tiny:
        size = dict(layers=2, hidden=64, heads=4, vocab=256, seq=64)
        rows = 2
    else:
        size = dict(layers=20, hidden=2048, heads=16, vocab=50304, seq=2048)
        rows = 4
    cfg = TransformerConfig(num_layers=size["layers"], hidden_size=size["hidden"], num_attention_heads=size["heads"])
    n_params = num_parameters(cfg, size["vocab"], size["seq"])
    fpt = flops_per_token(cfg, size["vocab"], size["seq"])
    tokens = rows * size["seq"]
    data = batches(warmup + steps, rows, size["seq"], size["vocab"], device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    fused = True if device.type == "cuda" else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {"model": dict(size, micro_batch=rows, params=n_params), "device": name, "peak_bf16_tflops": peak,
           "flops_per_token": fpt, "tokens_per_step": tokens, "contenders": {}}

    def run(label, build):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        model, step = build()
        times = []
        for i, (x, y) in enumerate(data):
            sync(device)
            t = time.perf_counter()
            step(x, y)
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t)
        med = sorted(times)[len(times) // 2]
        tflops = fpt * tokens / med / 1e12
        entry = {"step_median_s": med, "step_min_s": min(times), "tokens_per_s": tokens / med, "model_tflops_per_s": tflops,
                 "mfu": tflops / peak if peak else None}
        if device.type == "cuda":
            entry["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["contenders"][label] = entry
        log(f"mfu {label}: {med * 1e3:.1f} ms/step, {tflops:.1f} TFLOP/s" + (f", MFU {tflops / peak:.3f}" if peak else ""))
        del model, step

    def no_wrapper():
        # Ceiling: bf16 parameters, no sharding, no fp32 main weights, fused AdamW.
        m = gpt(**size, device=device, dtype=dtype)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, **({"fused": fused} if fused else {}))

        def step(x, y):
            m(x, labels=y).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return m, step

    def mfsdp():
        m = gpt(**size, device=device, dtype=dtype)
        policy = MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                      grad_comm_dtype=dtype) if dtype != torch.float32 else None
        ctx = wrap(m, Placements.zero3(), mesh_dev, device, policy)
        opt = fully_shard_optimizer(torch.optim.AdamW(m.parameters(), lr=1e-4, **({"fused": fused} if fused else {})))

        def step(x, y):
            with microbatch(ctx, is_last=True):
                m(x, labels=y).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return m, step

    def fsdp2():
        from torch.distributed.fsdp import MixedPrecisionPolicy as P2
        from torch.distributed.fsdp import fully_shard as fs2

        m = gpt(**size, device=device)
        pol = P2(param_dtype=dtype, reduce_dtype=dtype) if dtype != torch.float32 else P2()
        for layer in m.decoder.layers:
            fs2(layer, mesh=mesh_dev, mp_policy=pol)
        fs2(m, mesh=mesh_dev, mp_policy=pol)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, **({"fused": fused} if fused else {}))

        def step(x, y):
            m(x, labels=y).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return m, step

    for label, build in (("no_wrapper", no_wrapper), ("mfsdp_zero3", mfsdp), ("fsdp2", fsdp2)):
        try:
            run(label, build)
        except Exception as error:
            out["contenders"][label] = {"error": f"{type(error).__name__}: {error}"}
            traceback.print_exc()
    c = out["contenders"]
    if "step_median_s" in c.get("mfsdp_zero3", {}) and "step_median_s" in c.get("fsdp2", {}):
        out["mfsdp_step_ratio_vs_fsdp2"] = c["mfsdp_zero3"]["step_median_s"] / c["fsdp2"]["step_median_s"]
    if "step_median_s" in c.get("mfsdp_zero3", {}) and "step_median_s" in c.get("no_wrapper", {}):
        out["mfsdp_step_ratio_vs_no_wrapper"] = c["mfsdp_zero3"]["step_median_s"] / c["no_wrapper"]["step_median_s"]
    return out


# --------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU dry run)")
    p.add_argument("--checks", default="parity,overlap,bf16,te,mfu")
    p.add_argument("--mfu-steps", type=int, default=10)
    p.add_argument("--mfu-warmup", type=int, default=3)
    p.add_argument("--out", required=True, help="JSON file")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --tiny for a dry run")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        else:
            store = tempfile.mktemp(prefix="gpu_checks_store_")
            dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                                    init_method=f"file://{store}", rank=0, world_size=1)
    mesh_dev = init_device_mesh(device.type, (1,))
    mesh_cpu = init_device_mesh("cpu", (1,)) if device.type == "cuda" else mesh_dev
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "world_size": dist.get_world_size(),
              "tiny": args.tiny, "checks": {}}
    runners = {
        "parity": lambda: check_parity(device, mesh_dev, mesh_cpu, args.tiny),
        "overlap": lambda: check_overlap(device, mesh_dev, args.tiny, out_dir),
        "bf16": lambda: check_bf16(device, mesh_dev, args.tiny),
        "te": lambda: check_te(device, mesh_dev, args.tiny),
        "mfu": lambda: check_mfu(device, mesh_dev, args.tiny, args.mfu_steps, args.mfu_warmup),
    }
    failed = False
    for name in args.checks.split(","):
        t = time.perf_counter()
        log(f"{name} ...")
        try:
            r = runners[name]()
        except Exception as error:
            traceback.print_exc()
            r = {"error": f"{type(error).__name__}: {error}", "passed": False}
        r["seconds"] = time.perf_counter() - t
        result["checks"][name] = r
        failed |= r.get("passed") is False
        log(f"{name}: passed={r.get('passed')} ({r['seconds']:.1f}s)")
        with open(args.out, "w") as f:  # after every check, so a timeout keeps what finished
            json.dump(result, f, indent=1, default=str)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
