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
from _cp_helpers import CP_SIZES, HIERARCHIES, cp_group, default_a2a_size, hierarchical_groups
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


def run_cp(q, k, v, weight, cp, comm_type, a2a_size=None, **kwargs):
    """Output and q/k/v gradients of this rank's split."""
    group = cp_group(cp)
    if comm_type == "a2a+p2p":
        kwargs["hierarchical_groups"] = hierarchical_groups(cp, a2a_size or default_a2a_size(cp))
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
    compare_with_reference(comm_type, heads, groups, cp)


@pytest.mark.parametrize("cp, a2a_size", HIERARCHIES)
def test_hierarchical_matches_full_causal_attention(cp, a2a_size):
    compare_with_reference("a2a+p2p", 2 * HEADS, HEADS, cp, a2a_size)


def compare_with_reference(comm_type, heads, groups, cp, a2a_size=None):
    q, k, v, weight = global_inputs(groups, heads=heads)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*leaves)
    (expected * weight).sum().backward()

    out, grads, group, rank = run_cp(q, k, v, weight, cp, comm_type, a2a_size)
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
@pytest.mark.parametrize("comm_type", ["p2p", "a2a+p2p"])
def test_ring_dropout_backward_replays_the_forward_masks(comm_type, cp):
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
    kwargs = {}
    if comm_type == "a2a+p2p":
        kwargs["hierarchical_groups"] = hierarchical_groups(cp, default_a2a_size(cp))

    def value(eps):
        torch.manual_seed(99)
        inputs = [(t + eps * dt).requires_grad_() for t, dt in zip(split, dsplit)]
        out = context_parallel_attention(*inputs, group, comm_type, dropout_p=0.3, **kwargs)
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
    no_dropout = context_parallel_attention(*split, group, comm_type, **kwargs)
    check(bool((out.detach() - no_dropout).abs().max() > 1e-2), "dropout changed nothing")


def test_a2a_needs_heads_divisible_by_cp():
    cp = CP_SIZES[0]
    if cp == 1:
        pytest.skip("every head count is divisible by 1")
    q = torch.randn(B, cp + 1, 4, D)
    k = torch.randn(B, cp + 1, 4, D)
    message = rf"cp_comm_type 'a2a' scatters heads over {cp} ranks: attention heads \({cp + 1}\) and query groups"
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(q, k, k, cp_group(cp), "a2a")
    with pytest.raises(ValueError, match="'a2a\\+p2p' scatters heads over 2 ranks"):
        context_parallel_attention(q, k, k, cp_group(cp), "a2a+p2p", hierarchical_groups=hierarchical_groups(cp, 2))


def test_hierarchical_needs_groups_that_tile_the_cp_group():
    cp = CP_SIZES[0]
    q = torch.randn(B, HEADS, 4, D)
    with pytest.raises(ValueError, match="'a2a\\+p2p' needs the hierarchical CP groups"):
        context_parallel_attention(q, q, q, cp_group(cp), "a2a+p2p")
    if cp == 1:
        return
    with pytest.raises(ValueError, match=f"do not tile the CP group of {cp}"):
        context_parallel_attention(q, q, q, cp_group(cp), "a2a+p2p", hierarchical_groups=(cp_group(cp),) * 2)


@pytest.mark.parametrize("comm_type", ["p2p+a2a", "allgather"])
def test_unsupported_comm_type(comm_type):
    q = torch.randn(B, HEADS, 4, D)
    with pytest.raises(ValueError, match="use one of p2p, all_gather, a2a, a2a\\+p2p"):
        context_parallel_attention(q, q, q, cp_group(CP_SIZES[0]), comm_type)


def test_heads_must_be_a_multiple_of_groups():
    q, k = torch.randn(B, 3, 4, D), torch.randn(B, 2, 4, D)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of key/value heads \(2\)"):
        context_parallel_attention(q, k, k, cp_group(CP_SIZES[0]), "p2p")


def test_odd_local_sequence():
    q = torch.randn(B, HEADS, 3, D)
    with pytest.raises(ValueError, match="local sequence length 3 is odd"):
        context_parallel_attention(q, q, q, cp_group(CP_SIZES[0]), "p2p")
