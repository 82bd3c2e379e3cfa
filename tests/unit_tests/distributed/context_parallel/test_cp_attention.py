"""Context-parallel attention equals full causal attention on the whole sequence.

Every rank builds the same global q, k, v (one seed), keeps its CP split and runs
``context_parallel_attention``; the reference is plain softmax attention written here,
on the whole sequence in one process. Forward outputs and q/k/v gradients of every rank
are compared with the reference's, split the same way. World 2: cp=2; world 4: cp=4 and
cp=2 (two groups of two); a plain pytest run: cp=1.
"""

import pytest
import torch
import torch.distributed as dist
from _cp_helpers import CP_SIZES, cp_group
from _dist_helpers import check

from megatron.core.transformer.context_parallel import (
    SUPPORTED_CP_COMM_TYPES,
    context_parallel_attention,
    gather_from_context_parallel,
    split_for_context_parallel,
)

B, S, HEADS, D = 2, 16, 4, 8


def reference_attention(q, k, v, keep=None, dropout_p=0.0):
    """softmax(q k^T / sqrt(d) + causal mask) v on the whole sequence, kv heads repeated."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = q.shape[2]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(dim=-1)
    if keep is not None:
        probs = probs * keep / (1 - dropout_p)
    return probs @ v


def global_inputs(groups, dtype=torch.float32, heads=HEADS):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, heads, S, D, generator=g, dtype=dtype)
    k = torch.randn(B, groups, S, D, generator=g, dtype=dtype)
    v = torch.randn(B, groups, S, D, generator=g, dtype=dtype)
    weight = torch.randn(B, heads, S, D, generator=g, dtype=dtype)  # d(loss)/d(out)
    return q, k, v, weight


def run_cp(q, k, v, weight, cp, comm_type, **kwargs):
    """Output and q/k/v gradients of this rank's split."""
    group = cp_group(cp)
    rank = dist.get_rank(group)
    local = [split_for_context_parallel(t, cp, rank, seq_dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, group, comm_type, **kwargs)
    (out * split_for_context_parallel(weight, cp, rank, seq_dim=2)).sum().backward()
    return out.detach(), [t.grad for t in local], group, rank


@pytest.mark.parametrize("cp", CP_SIZES)
@pytest.mark.parametrize("heads, groups", [(HEADS, HEADS), (2 * HEADS, HEADS)], ids=["mha", "gqa"])
@pytest.mark.parametrize("comm_type", SUPPORTED_CP_COMM_TYPES)
def test_matches_full_causal_attention(comm_type, heads, groups, cp):
    # GQA: 2 query heads per group, and 4 groups, so that 'a2a' can scatter them at cp=4.
    q, k, v, weight = global_inputs(groups, heads=heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*leaves)
    (expected * weight).sum().backward()

    out, grads, group, rank = run_cp(q, k, v, weight, cp, comm_type)
    errors = []
    for name, got, want in [("out", out, expected.detach())] + list(zip(("dq", "dk", "dv"), grads,
                                                                          (t.grad for t in leaves))):
        want = split_for_context_parallel(want, cp, rank, seq_dim=2)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            errors.append(f"{name}: max error {(got - want).abs().max():.3g}")
    check(not errors, f"{comm_type} cp={cp}: {errors}")
    # The un-split output is the reference's (the inverse gather).
    whole = gather_from_context_parallel(out, group, seq_dim=2)
    check(torch.allclose(whole, expected.detach(), rtol=1e-5, atol=1e-5), "gathered output differs")


@pytest.mark.parametrize("cp", CP_SIZES)
def test_p2p_dropout_backward_replays_the_forward_masks(cp):
    """With dropout the output is a function of the seed; its gradient must be the
    derivative of that same function: compare the autograd directional derivative with a
    central finite difference (fp64, same RNG state for every evaluation)."""
    q, k, v, weight = global_inputs(2, torch.float64)
    direction = [torch.randn_like(t) for t in (q, k, v)]
    group = cp_group(cp)
    rank = dist.get_rank(group)
    split = [split_for_context_parallel(t, cp, rank, seq_dim=2) for t in (q, k, v)]
    dsplit = [split_for_context_parallel(t, cp, rank, seq_dim=2) for t in direction]
    w = split_for_context_parallel(weight, cp, rank, seq_dim=2)

    def value(eps):
        torch.manual_seed(99)
        inputs = [(t + eps * dt).requires_grad_() for t, dt in zip(split, dsplit)]
        out = context_parallel_attention(*inputs, group, "p2p", dropout_p=0.3)
        return (out * w).sum(), inputs, out

    loss, inputs, out = value(0.0)
    loss.backward()
    autograd = sum((t.grad * dt).sum() for t, dt in zip(inputs, dsplit))
    eps = 1e-6
    numeric = (value(eps)[0] - value(-eps)[0]).detach() / (2 * eps)
    totals = torch.stack([autograd.detach(), numeric])
    dist.all_reduce(totals, group=group)  # the loss is the sum over the CP ranks
    check(torch.allclose(totals[0], totals[1], rtol=1e-7, atol=1e-7), f"autograd {totals[0]} vs numeric {totals[1]}")
    # ... and the dropout is real: about 30% of the probabilities are gone.
    no_dropout = context_parallel_attention(*split, group, "p2p")
    check(bool((out.detach() - no_dropout).abs().max() > 1e-2), "dropout changed nothing")


def test_a2a_needs_heads_divisible_by_cp():
    cp = CP_SIZES[0]
    if cp == 1:
        pytest.skip("every head count is divisible by 1")
    q = torch.randn(B, cp + 1, 4, D)
    k = torch.randn(B, cp + 1, 4, D)
    with pytest.raises(ValueError, match="must be divisible by context_parallel_size"):
        context_parallel_attention(q, k, k, cp_group(cp), "a2a")


@pytest.mark.parametrize("comm_type", ["a2a+p2p", "ring"])
def test_unsupported_comm_type(comm_type):
    q = torch.randn(B, HEADS, 4, D)
    with pytest.raises(ValueError, match="use one of p2p, all_gather, a2a"):
        context_parallel_attention(q, q, q, cp_group(CP_SIZES[0]), comm_type)


def test_heads_must_be_a_multiple_of_groups():
    q, k = torch.randn(B, 3, 4, D), torch.randn(B, 2, 4, D)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"):
        context_parallel_attention(q, k, k, cp_group(CP_SIZES[0]), "p2p")


def test_odd_local_sequence():
    q = torch.randn(B, HEADS, 3, D)
    with pytest.raises(ValueError, match="local sequence length 3 is odd"):
        context_parallel_attention(q, q, q, cp_group(CP_SIZES[0]), "p2p")
