"""The memory planner under context parallelism: a CP rank's activations are those of its
S / CP tokens, with the attention core of its comm type (estimate_activations.py), checked
against the tensors the CP attention saves for backward at 2 and 4 ranks; the per-token
terms scale by 1 / CP; tools/estimate_memory.py plans CP runs (units over DP x CP ranks)."""

import dataclasses

import pytest
import torch
from _cp_helpers import CP_SIZES, cp_group, default_a2a_size, hierarchical_groups

from tools.memory_planner.estimate import plan
from tools.memory_planner.estimate_activations import (
    ActivationShape, activation_bytes, attention_core_bytes, context_parallel_buffer_bytes, context_parallel_bytes)
from megatron.core.transformer.context_parallel import context_parallel_attention

B, H, G, D, S = 2, 8, 4, 16, 256


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages ``fn``'s forward saves for backward."""
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(saved.values())


def layer_shape(cp, comm_type):
    return ActivationShape(micro_batch_size=B, seq_length=S // cp, hidden_size=H * D, num_attention_heads=H,
                           ffn_hidden_size=4 * H * D, num_layers=1, vocab_size=0, cp_size=cp,
                           cp_comm_types=(comm_type,), num_query_groups=G)


@pytest.mark.parametrize("comm_type", ["p2p", "a2a+p2p", "all_gather", "a2a"])
def test_attention_core_estimate_is_what_the_exchange_saves(comm_type):
    for cp in CP_SIZES:  # a world of one rank has no CP exchange: nothing to measure
        if cp > 1:
            check_core_against_saved_tensors(comm_type, cp)


def check_core_against_saved_tensors(comm_type, cp):
    s = S // cp
    q = torch.randn(B, H, s, D, requires_grad=True)
    k, v = (torch.randn(B, G, s, D, requires_grad=True) for _ in range(2))
    inputs = (q.numel() + k.numel() + v.numel()) * 4
    hierarchy = hierarchical_groups(cp, default_a2a_size(cp)) if comm_type == "a2a+p2p" else None
    kept = saved_bytes(lambda: context_parallel_attention(q, k, v, cp_group(cp), comm_type,
                                                          hierarchical_groups=hierarchy)) - inputs
    shape = layer_shape(cp, comm_type)
    core = attention_core_bytes(shape)
    fused = (s * B * H * D + s * B * H) * 4  # what SDPA's CPU kernel keeps: output and log-sum-exp
    if comm_type in ("p2p", "a2a+p2p"):
        assert kept == core  # the ring's own kernel: exactly its output and log-sum-exp
    elif comm_type == "all_gather":
        scores = 5 * H * s * S * B * 4 // 2
        # The gathered K/V replace the local ones; the float mask; the fused kernel's own.
        assert kept == core - scores - (k.numel() + v.numel()) * 4 + fused
    else:
        # a2a: the kernel's q, K/V of a / cp heads over S replace the inputs; besides the
        # fused kernel's own, only the two index vectors of the reordering.
        assert kept == fused // cp * cp + 2 * S * 8
        assert kept < core  # the unfused estimate is an upper bound
    assert context_parallel_buffer_bytes(shape) > 0


def test_per_token_terms_scale_with_one_over_cp():
    whole = ActivationShape(micro_batch_size=2, seq_length=2048, hidden_size=256, num_attention_heads=8,
                            ffn_hidden_size=1024, num_layers=4, vocab_size=1000, num_query_groups=4)
    for cp in (2, 4):
        for comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"):
            local = dataclasses.replace(whole, seq_length=2048 // cp, cp_size=cp, cp_comm_types=(comm_type,))
            per_token = activation_bytes(whole) - 4 * attention_core_bytes(whole)
            assert activation_bytes(local) - 4 * attention_core_bytes(local) == per_token // cp
            assert activation_bytes(local) < activation_bytes(whole)
            # Selective recompute keeps one layer's core (the one rebuilt), as at CP=1.
            assert activation_bytes(local, "selective") == per_token // cp + attention_core_bytes(local)
        # The ring keeps no scores: its core is linear in the local tokens.
        p2p = dataclasses.replace(whole, seq_length=2048 // cp, cp_size=cp)
        assert attention_core_bytes(p2p) == (1024 // cp * 2 * 256 * 2 + 1024 // cp * 2 * 8 * 2) * 4
        # all_gather and a2a keep the local queries' scores against the whole sequence.
        ag = dataclasses.replace(p2p, cp_comm_types=("all_gather",))
        assert attention_core_bytes(ag) > attention_core_bytes(whole) // cp
    # One type per layer: the core averages over the layers' types.
    mixed = dataclasses.replace(whole, seq_length=1024, cp_size=2, cp_comm_types=("p2p", "a2a", "p2p", "a2a"))
    halves = [attention_core_bytes(dataclasses.replace(mixed, cp_comm_types=(x,))) for x in ("p2p", "a2a")]
    assert attention_core_bytes(mixed) == sum(halves) // 2
    with pytest.raises(ValueError, match="are not comm types"):
        attention_core_bytes(dataclasses.replace(mixed, cp_comm_types=("ring",)))


def test_context_parallel_traffic():
    shape = ActivationShape(micro_batch_size=1, seq_length=512, hidden_size=256, num_attention_heads=8,
                            ffn_hidden_size=1024, num_layers=4, vocab_size=1000, num_query_groups=4, cp_size=4)
    kv = 2 * 512 * 128  # one rank's packed K/V elements
    assert context_parallel_bytes(shape, microbatches=2) == {"cp_send": 2 * 4 * (3 + 3 + 4) * kv * 4}
    ag = dataclasses.replace(shape, cp_comm_types=("all_gather",))
    assert context_parallel_bytes(ag) == {"cp_all_gather": 4 * kv * 4, "cp_reduce_scatter": 4 * 4 * kv * 4}
    a2a = dataclasses.replace(shape, cp_comm_types=("a2a",))
    assert context_parallel_bytes(a2a) == {"cp_all_to_all": 4 * 2 * (2 * 512 * 256 + kv) * 4}
    assert context_parallel_bytes(dataclasses.replace(shape, cp_size=1, seq_length=2048)) == {}
    # a2a+p2p as 2 x 2: the all-to-alls, and a ring of two; as 4 x 1: no ring.
    hierarchical = dataclasses.replace(a2a, cp_comm_types=("a2a+p2p",), cp_a2a_size=2)
    assert context_parallel_bytes(hierarchical) == {"cp_all_to_all": 4 * 2 * (2 * 512 * 256 + kv) * 4,
                                                    "cp_send": 4 * (1 + 1 + 2) * kv * 4}
    assert context_parallel_bytes(dataclasses.replace(hierarchical, cp_a2a_size=4)) == context_parallel_bytes(a2a)
    # The plan adds the buffers to the peak and the traffic to the bytes per step.
    zero3 = plan([], "zero3", 4, activations=shape)
    assert zero3.transient["cp_buffers"] == context_parallel_buffer_bytes(shape)
    assert zero3.comm_bytes["cp_send"] == context_parallel_bytes(shape)["cp_send"]
