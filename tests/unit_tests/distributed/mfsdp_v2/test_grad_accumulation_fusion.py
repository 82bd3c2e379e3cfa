"""Gradient-accumulation fusion: linear layers compute their weight gradient straight into
the unit's reduce-scatter input. Fused training must equal unfused training bit for bit
(and the single-process reference within float tolerance), the copies into the reduce
buffer must actually go away, and the awkward graphs (a weight used twice, a weight used
inside and outside a reentrant recompute, an embedding tied to the output layer) must stay
exact."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from _dist_helpers import H, check, compare_params, full_tensors, mesh_2d, train_pair, world, wrap
from _mfsdp_models import VOCAB, BlocksAroundProjection, Case
from megatron.core.distributed.mfsdp_v2 import Placements
from megatron.core.distributed.mfsdp_v2.layout import FlatLayout
from megatron.core.tensor_parallel.grad_accumulation_fusion import linear
from megatron.core.transformer.layers import Embedding, Linear


class Block(nn.Module):
    """``outer.weight`` is used inside a reentrant recompute (plain ``F.linear``) and before
    and after it (the fused layer): the recompute's own graph delivers a gradient of that
    weight while the outer graph still holds the fused slot and has yet to add to it.
    ``first`` (used before everything) keeps the unit from counting all of its gradients
    as received before the outer graph has delivered."""

    def __init__(self, fusion: bool, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.first = Linear(H, H, bias=True, init_std=0.3, gradient_accumulation_fusion=fusion)
        self.inner = Linear(H, H, bias=True, init_std=0.3, gradient_accumulation_fusion=fusion)
        self.outer = Linear(H, H, bias=False, init_std=0.3, gradient_accumulation_fusion=fusion)

    def _recomputed(self, h):
        return torch.tanh(self.inner(h) + F.linear(h, self.outer.weight))

    def forward(self, h):
        h = checkpoint(self._recomputed, self.outer(self.first(h)), use_reentrant=self.reentrant)
        return self.outer(h)


def Net(fusion: bool = True) -> BlocksAroundProjection:
    """Two blocks (their own units; reentrant recompute: two graph tasks, non-reentrant:
    saved tensors recomputed) and a root ``proj`` applied twice (one weight, two fused
    gradients summed by autograd)."""
    return BlocksAroundProjection([Block(fusion, reentrant) for reentrant in (True, False)],
                                  Linear(H, H, bias=True, init_std=0.3, gradient_accumulation_fusion=fusion))


class TiedLM(nn.Module):
    """Token embedding and output projection share one weight (in the root unit), around a
    block of its own unit: the output layer's fused backward writes the slot, the
    embedding's backward adds into it."""

    def __init__(self, fusion: bool = True):
        super().__init__()
        self.fusion = fusion
        self.emb = Embedding(VOCAB, H, init_std=0.3, gradient_accumulation_fusion=fusion)
        self.mid = Linear(H, H, bias=True, init_std=0.3, gradient_accumulation_fusion=fusion)

    def forward(self, ids):
        return linear(torch.tanh(self.mid(self.emb(ids))), self.emb.weight, fusion=self.fusion)

    def units(self):
        return [self.mid, self]


TIED = Case("tied_lm", TiedLM, tokens=True)


def _sharding(name: str) -> dict:
    if name == "hfsdp":  # gradients reduce-scattered on the inner axis, then on the outer one
        shape = (2, world() // 2) if world() >= 4 else (1, world())
        return {"mesh": mesh_2d(shape), "placements": Placements.hfsdp("outer", "inner")}
    return {"placements": name}


def _check_fused_equals_unfused(build, placements: str, **train_kwargs) -> None:
    """Train ``build(fusion)`` with and without fusion: each run matches the reference, and
    the two agree bit for bit (losses and parameters)."""
    runs = {}
    for fusion in (True, False):
        model, reference, _, _, losses, ref_losses = train_pair(
            lambda: build(fusion), "adamw", microbatches=2, steps=3, **train_kwargs, **_sharding(placements))
        runs[fusion] = (losses, full_tensors(list(model.parameters())))
        compare_params(model, reference)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    (fused_losses, fused_params), (plain_losses, plain_params) = runs[True], runs[False]
    check(torch.equal(fused_losses, plain_losses), f"losses differ: {fused_losses} vs {plain_losses}")
    check(all(torch.equal(a, b) for a, b in zip(fused_params, plain_params)), "parameters differ")


@pytest.mark.parametrize("placements", ["zero3", "zero2", "hfsdp"])
def test_fused_training_equals_unfused_bit_for_bit(placements):
    _check_fused_equals_unfused(Net, placements)


@pytest.mark.parametrize("placements", ["zero3", "zero2", "hfsdp"])
def test_tied_embedding_fused_equals_unfused_bit_for_bit(placements):
    _check_fused_equals_unfused(TiedLM, placements, batch=TIED.batch, loss=TIED.loss)


def test_tied_embedding_gradient_is_added_in_place(monkeypatch):
    """With fusion the tied weight's two gradients meet in its slot: no copy into the reduce
    buffer, and the embedding gives autograd no gradient to sum. Without fusion autograd sums
    them and the hook copies the sum."""
    copies = []
    original = FlatLayout.copy_in

    def counting_copy_in(self, source, gathered, index):
        copies.append(tuple(source.shape))
        return original(self, source, gathered, index)

    for fusion, expected in ((True, []), (False, [(VOCAB, H)])):
        torch.manual_seed(0)
        model = TiedLM(fusion)
        wrap(model)
        x, y = TIED.batch(torch.Generator().manual_seed(1), 4)
        loss = TIED.loss(model, x, y)
        copies.clear()
        monkeypatch.setattr(FlatLayout, "copy_in", counting_copy_in)
        loss.backward()
        monkeypatch.setattr(FlatLayout, "copy_in", original)
        tied_copies = [shape for shape in copies if shape == (VOCAB, H)]
        check(tied_copies == expected, f"fusion={fusion}: tied-weight copies {tied_copies}, expected {expected}")


def test_fused_gradients_are_not_copied_into_the_reduce_buffer(monkeypatch):
    """Every weight of a bias-free stack of fused linears is written in place: the hook
    copies nothing. The unfused model copies every gradient once."""
    copies = []
    original = FlatLayout.copy_in

    def counting_copy_in(self, source, gathered, index):
        copies.append(index)
        return original(self, source, gathered, index)

    def stack(fusion):
        torch.manual_seed(0)
        return nn.Sequential(*(Linear(H, H, bias=False, init_std=0.3, gradient_accumulation_fusion=fusion)
                               for _ in range(3)))

    for fusion, expected in ((True, 0), (False, 3)):
        model = stack(fusion)
        wrap(model, units=[*model, model])
        x = torch.randn(4, H)
        out = model(x)
        copies.clear()
        monkeypatch.setattr(FlatLayout, "copy_in", counting_copy_in)
        out.square().mean().backward()
        monkeypatch.setattr(FlatLayout, "copy_in", original)
        check(len(copies) == expected, f"fusion={fusion}: {len(copies)} gradient copies, expected {expected}")


def test_fused_layers_under_zero1_train_like_the_reference():
    """ZeRO-1 keeps gradients unsharded until the last microbatch: there is nothing to fuse
    into, and a plain (unwrapped) weight offers no slot either."""
    plain = Linear(H, H, bias=False, init_std=0.3)
    assert getattr(plain.weight, "fused_wgrad_out", None) is None
    model, reference, _, _, losses, ref_losses = train_pair(lambda: Net(True), "sgd", microbatches=2, steps=2,
                                                            placements="zero1")
    unit = model.blocks[0]
    assert all(getattr(p.unsharded_param, "fused_wgrad_out", None) is None
               for group in unit.parameter_groups for p in group.fsdp_parameters)
    compare_params(model, reference)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
