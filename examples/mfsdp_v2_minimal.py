"""The smallest complete MFSDP v2 program: a toy language model trained with ZeRO-3.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/mfsdp_v2_minimal.py

Runs on CPU (gloo) or CUDA (nccl) unchanged. Every rank sees a different slice of each
global batch; the printed loss is the global-batch mean and falls steadily.
"""

import argparse
import datetime
import gc
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from megatron.core.distributed.mfsdp_v2 import (
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h) @ self.embed.weight.t()  # tied output projection


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--plain", action="store_true", help="no FSDP: one process, whole batch (reference)")
    args = parser.parse_args()

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if not args.plain:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    torch.manual_seed(0)  # same init on every rank
    vocab, hidden, seq = 64, 128, 32
    model = TinyLM(vocab, hidden, layers=4)
    if args.plain:
        optimizer = torch.optim.AdamW(model.to(device).parameters(), lr=3e-3)
    else:
        mesh = init_device_mesh(device.type, (world,))
        with fully_shard_context(device=device) as context:
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, placements=Placements.zero3())
            fully_shard(model, mesh=mesh, placements=Placements.zero3())
        optimizer = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))

    # A learnable toy language: each token is the previous one plus a fixed step, mod vocab.
    def batch(step):
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, vocab, (16, 1), generator=g)
        tokens = (starts + 3 * torch.arange(seq + 1)) % vocab
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    per_rank = 16 // world
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        inputs, labels = batch(step)
        inputs, labels = inputs[rank * per_rank:(rank + 1) * per_rank], labels[rank * per_rank:(rank + 1) * per_rank]
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        chunks = list(zip(inputs.chunk(args.microbatches), labels.chunk(args.microbatches)))
        for i, (x, y) in enumerate(chunks):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) / len(chunks)
            if args.plain:
                loss.backward()
            else:
                with microbatch(context, is_last=i == len(chunks) - 1):
                    loss.backward()
            total += loss.detach()
        optimizer.step()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= world
        times.append(time.perf_counter() - start)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d} | loss {total.item():.4f} | step time {1000 * times[-1]:.1f} ms", flush=True)
    if rank == 0:
        steady = sorted(times[5:])
        print(f"median step time: {1000 * steady[len(steady) // 2]:.1f} ms ({'plain' if args.plain else f'MFSDP v2 ZeRO-3, {world} ranks'})")
    if dist.is_initialized():
        # Drop the engine's state (its units hold the mesh's groups) before the groups go, so that
        # nothing of the process groups is left for the interpreter's teardown to destroy.
        del model, optimizer, context
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
