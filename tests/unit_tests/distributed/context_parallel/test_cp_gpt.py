"""A GPTModel under context parallelism equals the same model on the whole sequence.

Every CP rank is fed its split of the tokens, labels and position ids; its per-token
losses, un-split, equal the CP=1 model's on the whole sequence, and its parameter
gradients, summed over the CP group, equal the CP=1 model's (the loss is the sum of all
tokens' losses). Llama-style (RoPE, GQA) and GPT-2-style (learned absolute positions,
MHA); every communication type; selective recompute of the attention core.
"""

import pytest
import torch
import torch.distributed as dist
from _cp_helpers import CP_SIZES, WORLD, cp_config, cp_group, hierarchical_groups
from _dist_helpers import check, kept_groups, module_cache

from megatron.core.global_slices import global_slices_of
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.context_parallel import (
    SUPPORTED_CP_COMM_TYPES,
    context_parallel_positions,
    gather_from_context_parallel,
    split_for_context_parallel,
)
from megatron.core.transformer.initialization import initialize_parameters_

B, S, VOCAB = 2, 16, 64
ARCHITECTURES = {
    # 8 heads in 4 groups: 'a2a' scatters whole groups at cp=4.
    "llama": dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64,
                  normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                  position_embedding_type="rope"),
    "gpt2": dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64),
}


def build(arch, **config_kwargs):
    torch.manual_seed(3)  # the same weights at every CP size
    config = TransformerConfig(**ARCHITECTURES[arch], **config_kwargs)
    return GPTModel(config, VOCAB, max_sequence_length=S, share_embeddings_and_output_weights=arch == "gpt2")


def run_pair(arch, cp, comm_type, **config_kwargs):
    group = cp_group(cp)
    rank = dist.get_rank(group)
    reference = build(arch, **config_kwargs)
    model = build(arch, **cp_config(cp, comm_type), **config_kwargs)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    positions = torch.arange(S).expand(B, S)

    ref_loss = reference(tokens, positions, labels=labels)
    ref_loss.sum().backward()

    local = [split_for_context_parallel(t, cp, rank) for t in (tokens, positions, labels)]
    check(torch.equal(local[1][0], context_parallel_positions(S, cp, rank)), "split positions")
    loss = model(local[0], local[1], labels=local[2])
    loss.sum().backward()
    grads = [p.grad for p in model.parameters()]
    for grad in grads:  # every token's loss: sum the pieces over the CP group
        dist.all_reduce(grad, group=group)

    whole = gather_from_context_parallel(loss, group)
    check(torch.allclose(whole, ref_loss.detach(), rtol=1e-5, atol=1e-5),
          f"losses differ by {(whole - ref_loss).abs().max():.3g}")
    errors = [name for (name, ref), grad in zip(reference.named_parameters(), grads)
              if not torch.allclose(grad, ref.grad, rtol=1e-4, atol=1e-6)]
    check(not errors, f"gradients differ: {errors}")


@pytest.mark.parametrize("cp", CP_SIZES)
@pytest.mark.parametrize("comm_type", SUPPORTED_CP_COMM_TYPES)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_gpt_under_context_parallel_matches_whole_sequence(arch, comm_type, cp):
    run_pair(arch, cp, comm_type)


@pytest.mark.parametrize("cp", CP_SIZES)
def test_selective_recompute_under_context_parallel(cp):
    run_pair("llama", cp, "p2p", recompute_granularity="selective")


@pytest.mark.parametrize("comm_type", SUPPORTED_CP_COMM_TYPES)
def test_selective_recompute_replays_attention_dropout(comm_type):
    """With attention dropout, recomputing the attention core in backward gives the same
    gradients as keeping it: the replay draws the same masks."""
    cp = max(CP_SIZES)
    group = cp_group(cp)
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(6)
    tokens = split_for_context_parallel(torch.randint(0, VOCAB, (B, S), generator=g), cp, rank)
    positions = split_for_context_parallel(torch.arange(S).expand(B, S), cp, rank)
    grads = []
    for recompute in (None, "selective"):
        model = build("llama", attention_dropout=0.3, recompute_granularity=recompute, **cp_config(cp, comm_type))
        torch.manual_seed(8)
        model(tokens, positions, labels=tokens).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    check(all(torch.equal(a, b) for a, b in zip(*grads)), "recompute changed the gradients")
    dropout_free = build("llama", **cp_config(cp, comm_type))
    dropout_free(tokens, positions, labels=tokens).sum().backward()
    check(not all(torch.allclose(a, p.grad) for a, p in zip(grads[0], dropout_free.parameters())),
          "the dropout did nothing")


_TP_CP_GROUPS = module_cache()


def tp_cp_groups():
    """At 4 ranks: TP groups {0, 1}, {2, 3} and CP groups {0, 2}, {1, 3} (TP innermost)."""
    if not _TP_CP_GROUPS:
        rank = dist.get_rank()
        with kept_groups():
            for name, members in (("tp", [[0, 1], [2, 3]]), ("cp", [[0, 2], [1, 3]])):
                for ranks in members:
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        _TP_CP_GROUPS[name] = group
    return _TP_CP_GROUPS["tp"], _TP_CP_GROUPS["cp"]


@pytest.mark.skipif(WORLD != 4, reason="TP=2 x CP=2 needs 4 ranks")
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_tensor_parallel_times_context_parallel(comm_type):
    """TP=2 x CP=2: each rank's TP piece of every gradient, summed over CP, is the piece of
    the single-process model's gradient; the un-split losses are its losses."""
    tp_group, group = tp_cp_groups()
    rank = dist.get_rank(group)
    reference = build("llama")
    model = build("llama", tensor_model_parallel_size=2, tp_group=tp_group, context_parallel_size=2, cp_group=group,
                  cp_comm_type=comm_type)
    for m in (reference, model):  # the same global weights at every TP size
        initialize_parameters_(m, 13)
    g = torch.Generator().manual_seed(5)
    tokens, labels = (torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(2))
    positions = torch.arange(S).expand(B, S)
    ref_loss = reference(tokens, positions, labels=labels)
    ref_loss.sum().backward()
    local = [split_for_context_parallel(t, 2, rank) for t in (tokens, positions, labels)]
    loss = model(local[0], local[1], labels=local[2])
    loss.sum().backward()
    check(torch.allclose(gather_from_context_parallel(loss, group), ref_loss.detach(), rtol=1e-5, atol=1e-5),
          "losses differ")
    ref = dict(reference.named_parameters())
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0] * 2 == \
        reference.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]  # really TP-split
    errors = []
    for module_name, module in model.named_modules():
        slices = global_slices_of(module)
        for attr, param in module.named_parameters(recurse=False):
            grad = param.grad.clone()
            dist.all_reduce(grad, group=group)
            expected = ref[f"{module_name}.{attr}"].grad
            if attr in slices:
                expected = slices[attr].take(expected)
            if not torch.allclose(grad, expected, rtol=1e-4, atol=1e-6):
                errors.append(f"{module_name}.{attr}")
    check(not errors, f"gradients differ: {errors}")


def test_attention_mask_is_refused():
    cp = max(CP_SIZES)
    if cp == 1:
        pytest.skip("a world of one rank has no context parallelism")
    model = build("gpt2", context_parallel_size=cp, cp_group=cp_group(cp))
    tokens = torch.zeros(B, S // cp, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask is not supported with context parallelism"):
        model(tokens, tokens, attention_mask=torch.zeros(S // cp, S // cp, dtype=torch.bool))


@pytest.mark.parametrize("kwargs, message", [
    (dict(context_parallel_size=0), "context_parallel_size must be a positive integer"),
    (dict(context_parallel_size=WORLD + 1), f"context_parallel_size {WORLD + 1} needs cp_group"),
    (dict(cp_comm_type="p2p+a2a"), "use one of p2p, all_gather, a2a, a2a\\+p2p"),
    (dict(cp_comm_type=["p2p"]), "cp_comm_type lists 1 types for 2 layers"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**ARCHITECTURES["gpt2"], cp_group=dist.group.WORLD, **kwargs)


def test_config_a2a_needs_divisible_heads():
    cp = max(CP_SIZES)
    if cp == 1:
        pytest.skip("every head count is divisible by 1")
    with pytest.raises(ValueError, match=rf"attention heads \({2 * cp}\) and query groups \(1\) per rank must be "
                                         rf"divisible by {cp}"):
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2 * cp, num_query_groups=1,
                          context_parallel_size=cp, cp_group=cp_group(cp), cp_comm_type="a2a")
    with pytest.raises(ValueError, match="'a2a\\+p2p' scatters heads over 2 ranks"):
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2 * cp, num_query_groups=1,
                          **cp_config(cp, "a2a+p2p", a2a_size=2))


def test_config_a2a_p2p_needs_hierarchical_groups():
    cp = max(CP_SIZES)
    if cp == 1:
        pytest.skip("a world of one rank has no context parallelism")
    with pytest.raises(ValueError, match="'a2a\\+p2p' needs the hierarchical CP groups"):
        TransformerConfig(**ARCHITECTURES["gpt2"], context_parallel_size=cp, cp_group=cp_group(cp),
                          cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match=f"do not tile the CP group of {cp}"):
        TransformerConfig(**ARCHITECTURES["gpt2"], context_parallel_size=cp, cp_group=cp_group(cp),
                          cp_comm_type="a2a+p2p", hierarchical_cp_groups=(cp_group(cp), cp_group(cp)))


def test_per_layer_comm_types():
    cp = max(CP_SIZES)
    config = TransformerConfig(**ARCHITECTURES["gpt2"], context_parallel_size=cp, cp_group=cp_group(cp),
                               cp_comm_type=["all_gather", "p2p"])
    assert [config.layer_cp_comm_type(n) for n in (1, 2)] == ["all_gather", "p2p"]
