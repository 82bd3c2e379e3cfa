"""MoE step time, all-to-all bytes and peak RSS at one expert-parallel size (CPU, gloo).

    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/moe_ep.py --ep 2

The model is built by the trainer (flags, model builder, MFSDP ZeRO-3, Adam); each step is
one forward/backward of a micro-batch per rank and an optimizer step. The all-to-all bytes
are counted by a tap on ``torch.distributed.all_to_all_single`` (sent by this rank, summed
over ranks, per step); peak RSS is ``ru_maxrss`` of the process (max over ranks). Prints
one JSON line from rank 0.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FLAGS = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 "
         "--lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 "
         "--hidden-dropout 0 --attention-dropout 0 --swiglu --disable-bias-linear --normalization RMSNorm "
         "--position-embedding-type rope --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512 "
         "--use-mfsdp").split()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    opts = parser.parse_args()
    dist.init_process_group("gloo")
    from megatron.training.arguments import parse_args
    from megatron.training.model_builder import build_model, build_optimizer
    from pretrain_gpt import model_provider

    args = parse_args(FLAGS + ["--expert-model-parallel-size", str(opts.ep)], world_size=dist.get_world_size(),
                      cuda_available=False)
    args.padded_vocab_size = 1024
    built = build_model(model_provider, args, torch.device("cpu"))
    optimizer, _ = build_optimizer(args, built)

    sent = [0]
    original = dist.all_to_all_single

    def counting(output, input, *a, **k):
        sent[0] += input.numel() * input.element_size()
        return original(output, input, *a, **k)

    dist.all_to_all_single = counting
    from megatron.core.distributed.mfsdp_v2 import microbatch

    generator = torch.Generator().manual_seed(dist.get_rank())
    times, bytes_per_step = [], []
    for step in range(opts.warmup + opts.steps):
        tokens = torch.randint(0, 1024, (4, 129), generator=generator)
        sent[0] = 0
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with microbatch(built.context, is_last=True):
            built.model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        optimizer.step()
        dist.barrier()
        if step >= opts.warmup:
            times.append(time.perf_counter() - start)
            bytes_per_step.append(sent[0])
    stats = torch.tensor([statistics.median(times), statistics.mean(bytes_per_step),
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    total = stats.clone()
    dist.all_reduce(total)
    peak = stats.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(json.dumps({"ep": opts.ep, "world": dist.get_world_size(),
                          "step_ms_median_max_over_ranks": round(1000 * float(peak[0]), 1),
                          "all_to_all_bytes_per_step_all_ranks": int(total[1]),
                          "peak_rss_mb_max_over_ranks": round(float(peak[2]), 1),
                          "parameters_on_rank0": sum(p.numel() for p in built.unwrapped.parameters())}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
