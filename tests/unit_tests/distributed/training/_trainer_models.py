"""Tiny GPT configurations built through the trainer's own flags and model builder.

``full_weights`` rebuilds every (possibly sharded) parameter with the distributed tests'
own all-gather (``_dist_helpers.full_tensors``), so no engine layout query is involved in
any comparison.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, *[os.pardir] * 4))
sys.path.insert(0, REPO)

from _dist_helpers import full_tensors  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--lr 1e-2 --train-iters 3 --mock-data --tokenizer-type NullTokenizer --vocab-size 96 "
        "--hidden-dropout 0 --attention-dropout 0 --seed 11").split()
ARCHS = {
    "gpt2": [],
    "llama": ("--normalization RMSNorm --position-embedding-type rope --swiglu --ffn-hidden-size 64 "
              "--disable-bias-linear --untie-embeddings-and-output-weights --num-query-groups 2").split(),
}


def trainer_args(arch: str, *extra: str, world_size: int | None = None):
    world_size = dist.get_world_size() if world_size is None else world_size
    argv = BASE + ["--global-batch-size", str(2 * max(world_size, 2))] + ARCHS[arch] + list(extra)
    args = parse_args(argv, world_size=world_size, cuda_available=False)
    args.padded_vocab_size = 128
    return args


def gpt_provider(args):
    from pretrain_gpt import model_provider

    return model_provider(args)


def provider_with_buffers(args):
    """The GPT model plus the non-parameter buffers real models carry: RoPE inverse
    frequencies inside a layer (a unit of its own) and a causal mask on the root."""
    model = gpt_provider(args)
    d = args.hidden_size // args.num_attention_heads
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    model.decoder.layers[0].self_attention.register_buffer("inv_freq", inv_freq, persistent=False)
    model.register_buffer("causal_mask", torch.ones(args.seq_length, args.seq_length).tril().bool())
    return model


def full_weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """name -> full tensor of every parameter (every rank must call it)."""
    named = list(model.named_parameters())
    sharded = [(n, p) for n, p in named if hasattr(p, "to_local")]
    fulls = dict(zip([n for n, _ in sharded], full_tensors([p for _, p in sharded]))) if sharded else {}
    return {n: fulls[n] if n in fulls else p.detach().clone() for n, p in named}


def batches(steps: int, micro: int, global_batch: int, seq: int, vocab: int) -> List[List[dict]]:
    """The same global batch, ``steps`` times (so the loss must fall), on every rank; each
    rank takes its own rows of it."""
    out = []
    for _ in range(steps):
        generator = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=generator)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": torch.ones(global_batch, seq), "position_ids": torch.arange(seq).expand(global_batch, seq)})
    return out
