"""Models, meshes and ground truth for the checkpoint tests (CPU, gloo, 1/2/4 ranks).

The ground truth of a saved checkpoint never comes from the checkpoint code: the full
tensors of the saved model and of its optimizer state are rebuilt with this file's own
all-gather of every rank's ZeRO-3 rows (the rows a rank holds are ``layout.local_piece``,
which the engine's layout tests check). A loaded model is then compared with the rows
the engine itself would give each rank when built from those full tensors
(``group.views.optimizer_rows``: the path that fills a freshly wrapped model), bit for bit.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from _dist_helpers import gather_rows, owners, rank
from megatron.core.distributed.mfsdp_v2 import microbatch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

VOCAB = 37  # odd sizes: shards are uneven at 2 and 4 ranks
SEQ = 6
HIDDEN = 12


# ----------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------


class Odd(nn.Module):
    """Awkward shapes: a 3-element linear (some rank of 4 holds no row of it), a 0-d
    parameter, a buffer, and a nested unit."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(5, 7, dtype=dtype), nn.Tanh(), nn.Linear(7, 2, dtype=dtype))
        self.tiny = nn.Linear(2, 1, dtype=dtype)
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=dtype))
        self.register_buffer("offset", torch.arange(3, dtype=torch.float32))

    def forward(self, x):
        return self.tiny(self.inner(x)) * self.scale + self.offset.sum()

    def units(self):
        return [self.inner, self]

    def batch(self, generator, rows):
        return torch.randn(rows, 5, generator=generator).to(self.tiny.weight.dtype)

    def loss(self, out):
        return out.float().pow(2).mean()


def gpt(style: str = "gpt", dtype=torch.float32, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    if style == "gpt":
        config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=3, params_dtype=dtype)
        return GPTModel(config, VOCAB, SEQ)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_query_groups=1,
                               normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                               ffn_hidden_size=20, position_embedding_type="rope", params_dtype=dtype)
    return GPTModel(config, VOCAB, SEQ, share_embeddings_and_output_weights=False)


def gpt_units(model):
    return list(model.decoder.layers) + [model]


def gpt_batch(generator, rows):
    return torch.randint(0, VOCAB, (rows, SEQ), generator=generator)


def gpt_loss(model, tokens):
    return model(tokens, labels=tokens.roll(-1, dims=1)).mean()


# ----------------------------------------------------------------------------------------
# Process groups and training
# ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def subgroup(ranks: List[int]):
    """A process group of ``ranks`` (created on every rank); yields it to members, None to others."""
    group = dist.new_group(ranks=ranks)
    yield group if rank() in ranks else None


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def train(model, ctx, optimizer, batch_fn, loss_fn, steps: int, seed: int, dp_rank: int, dp_size: int) -> List[float]:
    """``steps`` steps on a global batch of 2 rows per data-parallel rank; returns local losses."""
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        batch = batch_fn(generator, 2 * dp_size)
        mine = batch[2 * dp_rank: 2 * dp_rank + 2]
        optimizer.zero_grad(set_to_none=True)
        if ctx is not None:
            with microbatch(ctx, is_last=True):
                loss = loss_fn(model, mine)
                loss.backward()
        else:
            loss = loss_fn(model, mine)
            loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses


# ----------------------------------------------------------------------------------------
# Ground truth
# ----------------------------------------------------------------------------------------


def shared_tmpdir(group=None) -> str:
    """A fresh directory, the same path on every rank of ``group``."""
    path = [tempfile.mkdtemp(prefix="mfsdp_ckpt_test_") if rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def remove_tmpdir(path: str) -> None:
    dist.barrier()
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def full_state_zero3(model, ctx, optimizer) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, torch.Tensor]]]:
    """(full parameters by name, full optimizer state by name) of a ZeRO-3 model over the world."""
    own = owners(ctx)
    params, state = {}, {}
    for name, p in model.named_parameters():
        _, group, fp = own[id(p)]
        params[name] = gather_rows(p.to_local(), group.layout, fp.index, fp.shape)
        entries = {}
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, DTensor):
                entries[key] = gather_rows(value.to_local(), group.layout, fp.index, fp.shape)
            else:
                entries[key] = value.detach().clone()
        state[name] = entries
    return params, state


def expected_local(full: torch.Tensor, group, fp) -> torch.Tensor:
    """The rows a rank of ``group`` holds in its optimizer placement (the engine's own
    construction path, which its tests check against a reference)."""
    return group.views.optimizer_rows(full, fp)


def assert_loaded(model, ctx, optimizer, full_params, full_state, check_optimizer=True):
    """Bitwise: every main-weight view and optimizer state equals the ground truth rows."""
    own = owners(ctx)
    for name, p in model.named_parameters():
        _, group, fp = own[id(p)]
        expected = expected_local(full_params[name], group, fp)
        got = p.to_local()
        assert got.dtype == expected.dtype, name
        assert torch.equal(got, expected), f"{name}: loaded rows differ from the saved model"
        if not check_optimizer or optimizer is None:
            continue
        saved_state = full_state[name]
        state = optimizer.state.get(p, {})
        assert set(state) == set(saved_state), (name, set(state), set(saved_state))
        for key, value in saved_state.items():
            if isinstance(state[key], DTensor):
                assert torch.equal(state[key].to_local(), expected_local(value, group, fp)), f"{name}.{key}"
            else:
                assert torch.equal(state[key], value), f"{name}.{key}"
