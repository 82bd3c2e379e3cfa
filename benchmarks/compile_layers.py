"""--compile-layers on CPU: step time of compiled against eager layers, interleaved, under
MFSDP ZeRO-3, with the trainer's own flags, model builder, schedule and optimizer.

Both models are built in one process from the same seed (so they start from the same
weights) and step in turns: eager, compiled, eager, ... on the same batches, after
``--warmup`` steps each (the compiled model's first step compiles). Reported: the median
step time of each, their ratio and the median of the per-pair ratios (each compiled step
against the eager step just before it), the compile time (first compiled step minus an eager
one), and the largest relative loss difference over all steps (inductor against eager).
Every compiled step after the first runs under ``torch.compiler.set_stance("fail_on_recompile")``:
a recompile would stop the run.

Default shape: the Llama-3 "debugmodel" of issue 35 (dim 256, 6 layers, 16 heads, SwiGLU
768, vocab 2048, untied, RoPE base 500000, RMSNorm, no dropout), sequence 512, 2 sequences
per rank, fp32, AdamW::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/compile_layers.py \\
        --steps 8 --out benchmarks/results/compile_layers_n2.json

``--backend aot_eager`` measures dynamo + AOTAutograd without inductor's kernels;
``--extra "--attention-dropout 0.1"`` adds flags to both models.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.loss_reports import mean_loss, reduce_reports  # noqa: E402
from megatron.training.model_builder import (  # noqa: E402
    build_model, build_optimizer, finalize_model_grads, get_grad_norm_and_clip)
from pretrain_gpt import forward_step, model_provider  # noqa: E402

DEBUGMODEL = ("--num-layers 6 --hidden-size 256 --num-attention-heads 16 --ffn-hidden-size 768 --swiglu "
              "--normalization RMSNorm --position-embedding-type rope --rotary-base 500000 "
              "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 2048 "
              "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 2 "
              "--hidden-dropout 0 --attention-dropout 0 --lr 3e-4 --train-iters 100 --mock-data "
              "--tokenizer-type NullTokenizer --seed 7 --use-mfsdp")


def build(argv, world):
    args = parse_args(argv + ["--global-batch-size", str(2 * world)], world_size=world, cuda_available=False)
    args.padded_vocab_size = args.vocab_size
    built = build_model(model_provider, args, torch.device("cpu"))
    optimizer, _ = build_optimizer(args, built)
    built.model.train()
    return args, built, optimizer


def step(args, built, optimizer, micro, state):
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    reports = get_forward_backward_func()(forward_step, iter(micro), built.model, len(micro), context=built.context,
                                          seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                          dp_group=state.dp_cp_group)
    finalize_model_grads(args, built)
    get_grad_norm_and_clip(args, built, optimizer)
    optimizer.step()
    elapsed = time.perf_counter() - start
    return elapsed, mean_loss(reduce_reports(reports))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per model, after the warmup")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    parser.add_argument("--shape", default=DEBUGMODEL, help="the trainer's flags of the model")
    parser.add_argument("--extra", default="", help="flags added to both models")
    parser.add_argument("--out", default=None, help="JSON result file (rank 0)")
    opts = parser.parse_args()

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    argv = opts.shape.split() + opts.extra.split()
    state = parallel_state.initialize_model_parallel(1, 1, "cpu")
    args, *eager = build(argv, world)
    _, *compiled = build(argv + ["--compile-layers", opts.backend], world)

    generator = torch.Generator().manual_seed(1)
    per_rank = args.global_batch_size // world
    times = {"eager": [], "compiled": []}
    losses = {"eager": [], "compiled": []}
    first = {}
    for i in range(opts.warmup + opts.steps):
        tokens = torch.randint(0, args.vocab_size, (args.global_batch_size, args.seq_length + 1), generator=generator)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        micro = [{"tokens": mine[j:j + args.micro_batch_size, :-1], "labels": mine[j:j + args.micro_batch_size, 1:],
                  "loss_mask": torch.ones(args.micro_batch_size, args.seq_length),
                  "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, args.seq_length)}
                 for j in range(0, per_rank, args.micro_batch_size)]
        for name, (built, optimizer) in (("eager", eager), ("compiled", compiled)):
            stance = "fail_on_recompile" if (name == "compiled" and i > 0) else "default"
            with torch.compiler.set_stance(stance):
                elapsed, loss = step(args, built, optimizer, micro, state)
            losses[name].append(loss)
            if i == 0:
                first[name] = elapsed
            if i >= opts.warmup:
                times[name].append(elapsed)
        if rank == 0:
            print(f"step {i}: eager {losses['eager'][-1]:.6f}, compiled {losses['compiled'][-1]:.6f}", flush=True)

    # A step's time is the slowest rank's.
    summary = {}
    for name in times:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        summary[name] = t.tolist()
    result = {
        "command": " ".join(sys.argv), "world_size": world, "backend": opts.backend, "flags": argv,
        "median_step_s": {k: statistics.median(v) for k, v in summary.items()},
        "step_s": summary,
        "compile_s": first["compiled"] - first["eager"],
        "max_rel_loss_diff": max(abs(c - e) / abs(e) for e, c in zip(losses["eager"], losses["compiled"])),
        "losses": losses,
    }
    result["ratio_compiled_to_eager"] = result["median_step_s"]["compiled"] / result["median_step_s"]["eager"]
    # Each compiled step against the eager step just before it: robust to load that drifts.
    result["median_pair_ratio"] = statistics.median(c / e for e, c in zip(summary["eager"], summary["compiled"]))
    if rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k not in ("step_s", "losses", "flags")}, indent=1))
        if opts.out:
            with open(opts.out, "w") as f:
                json.dump(result, f, indent=1)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
