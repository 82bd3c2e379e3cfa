"""MoE components on one process: routing math, dropping, losses, permute/unpermute, experts,
the layer against a per-token reference, and the parse-time errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.initialization import initialize_parameters_
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.moe.expert_parallel import ExpertParallel
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import (
    TopKRouter, apply_router_token_dropping, set_aux_loss_backward_scale, switch_load_balancing_loss_func,
    topk_routing_with_score_function, z_loss_func)
from megatron.core.transformer.moe.token_dispatcher import permute, unpermute
from megatron.training.arguments import parse_args


def moe_config(**overrides):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=8)
    base.update(overrides)
    return TransformerConfig(**base)


def test_router_is_deterministic_and_picks_the_top_k():
    torch.manual_seed(0)
    router = TopKRouter(moe_config())
    x = torch.randn(10, 16)
    probs, routing_map = router(x)
    again, again_map = router(x)
    assert torch.equal(probs, again) and torch.equal(routing_map, again_map)
    logits = x @ router.weight.t() + router.bias
    top = logits.topk(2, dim=1).indices
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, top, True))
    assert torch.allclose(probs.sum(dim=1), torch.ones(10))  # softmax over the chosen k


def test_score_functions_on_a_hand_case():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    e = torch.exp(logits[0])
    probs, _ = topk_routing_with_score_function(logits, 2)
    assert torch.allclose(probs[0, :2], torch.softmax(torch.tensor([2.0, 1.0]), 0))
    pre, _ = topk_routing_with_score_function(logits, 2, use_pre_softmax=True)
    assert torch.allclose(pre[0, :2], e[:2] / e.sum())  # not renormalised over the k
    sig, sig_map = topk_routing_with_score_function(logits, 2, score_function="sigmoid", scaling_factor=3.0)
    s = torch.sigmoid(logits[0, :2])
    assert torch.allclose(sig[0, :2], 3.0 * s / s.sum()) and sig_map[0].tolist() == [True, True, False, False]


def test_capacity_dropping_counts_by_probability_and_by_position():
    # 4 tokens, 2 experts, top-1: every token wants expert 0. capacity = ceil(4 * 1 / 2 * 1.0) = 2.
    probs = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.7, 0.0], [0.8, 0.0]])
    routing_map = probs > 0
    kept_probs, kept = apply_router_token_dropping(probs, routing_map, 1, 1.0, drop_policy="probs")
    assert kept[:, 0].tolist() == [False, True, False, True] and int(kept.sum()) == 2
    assert torch.equal(kept_probs, probs * kept)
    _, by_position = apply_router_token_dropping(probs, routing_map, 1, 1.0, drop_policy="position")
    assert by_position[:, 0].tolist() == [True, True, False, False]
    # Capacity 3 (factor 1.5) keeps three; padded to capacity, expert 1 gets 3 rows of weight 0.
    padded_probs, padded = apply_router_token_dropping(probs, routing_map, 1, 1.5, pad_to_capacity=True)
    assert padded.sum(dim=0).tolist() == [3, 3] and float(padded_probs[:, 1].sum()) == 0.0


def test_router_reports_dropped_tokens():
    torch.manual_seed(0)
    router = TopKRouter(moe_config(moe_router_topk=1, moe_router_pre_softmax=True, moe_expert_capacity_factor=0.5))
    _, routing_map = router(torch.randn(16, 16))
    capacity = math.ceil(16 * 1 / 4 * 0.5)
    assert int(routing_map.sum(dim=0).max()) <= capacity
    assert int(router.last_stats["dropped_tokens"]) == 16 - int(routing_map.sum())


def test_aux_loss_formula_and_z_loss():
    torch.manual_seed(1)
    logits = torch.randn(6, 4)
    scores = torch.softmax(logits, -1)
    top = scores.topk(2, dim=1).indices
    counts = torch.zeros(6, 4).scatter(1, top, 1.0).sum(0)
    loss = switch_load_balancing_loss_func(scores, counts, 6, 2, 4, 0.1)
    f = counts / (6 * 2)  # fraction of the assignments per expert
    p = scores.mean(0)  # mean probability per expert
    assert torch.allclose(loss, 0.1 * 4 * (f * p).sum())
    balanced = switch_load_balancing_loss_func(torch.full((4, 4), 0.25), torch.full((4,), 2.0), 4, 2, 4, 1.0)
    assert torch.allclose(balanced, torch.tensor(1.0))
    assert torch.allclose(z_loss_func(logits, 0.01), 0.01 * torch.logsumexp(logits, -1).pow(2).mean())


def test_router_losses_join_backward_with_the_set_scale():
    torch.manual_seed(2)
    config = moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    router = TopKRouter(config)
    x = torch.randn(8, 16)
    set_aux_loss_backward_scale(router, 0.5)
    probs, _ = router(x)
    probs.sum().backward()
    with_losses = router.weight.grad.clone()
    # By hand: d/dW [sum(probs) + 0.5 * (aux + z)].
    router.weight.grad = None
    logits = F.linear(x, router.weight, router.bias)
    probs, _ = topk_routing_with_score_function(logits, 2)
    scores = torch.softmax(logits, -1)
    counts = torch.zeros_like(scores).scatter(1, scores.topk(2, dim=1).indices, 1.0).sum(0)
    aux = switch_load_balancing_loss_func(scores, counts, 8, 2, 4, 0.1)
    (probs.sum() + 0.5 * (aux + z_loss_func(logits, 0.01))).backward()
    assert torch.allclose(with_losses, router.weight.grad, atol=1e-7)
    assert float(router.last_stats["load_balancing_loss"]) == pytest.approx(float(aux.detach()) / 0.1, rel=1e-6)


def test_permute_unpermute_round_trip():
    torch.manual_seed(3)
    tokens = torch.randn(5, 3)
    probs, routing_map = topk_routing_with_score_function(torch.randn(5, 4), 2)
    rows, row_probs, sorted_indices = permute(tokens, routing_map, probs)
    # Expert-major, token order inside each expert.
    expected = [t for e in range(4) for t in range(5) if routing_map[t, e]]
    assert sorted_indices.tolist() == expected and torch.equal(rows, tokens[expected])
    restored = unpermute(rows * row_probs.unsqueeze(-1), sorted_indices, 5)
    torch.testing.assert_close(restored, tokens)  # the weights of each token sum to 1
    assert torch.equal(unpermute(rows, sorted_indices, 5), 2 * tokens)


@pytest.mark.parametrize("gated", [True, False])
def test_grouped_gemm_equals_the_loop(gated):
    torch.manual_seed(4)
    loop = GroupedMLP(moe_config(gated_linear_unit=gated), ExpertParallel())
    grouped = GroupedMLP(moe_config(gated_linear_unit=gated, moe_grouped_gemm=True), ExpertParallel())
    grouped.load_state_dict(loop.state_dict())
    x, counts, weights = torch.randn(9, 16), [3, 0, 4, 2], torch.rand(9)
    out_loop, out_grouped = loop(x, counts, weights), grouped(x, counts, weights)
    torch.testing.assert_close(out_grouped, out_loop)
    out_loop.square().sum().backward()
    out_grouped.square().sum().backward()
    torch.testing.assert_close(grouped.linear_fc1.weight.grad, loop.linear_fc1.weight.grad)


@pytest.mark.parametrize("shared", [None, 8])
def test_moe_layer_equals_a_per_token_reference(shared):
    torch.manual_seed(5)
    config = moe_config(gated_linear_unit=True, moe_shared_expert_intermediate_size=shared)
    layer = MoELayer(config)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 3, 16)
    out = layer(x)
    tokens = x.reshape(-1, 16)
    probs, routing_map = layer.router(tokens)
    W1 = layer.experts.linear_fc1.weight.view(4, 16, 16)
    b1 = layer.experts.linear_fc1.bias.view(4, 16)
    W2 = layer.experts.linear_fc2.weight.view(4, 16, 8)
    b2 = layer.experts.linear_fc2.bias.view(4, 16)
    expected = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e in routing_map[t].nonzero().flatten().tolist():
            gate, up = (W1[e] @ tokens[t] + b1[e]).chunk(2)
            expected[t] += probs[t, e] * (W2[e] @ (F.silu(gate) * up) + b2[e])
    if shared is not None:
        expected += layer.shared_experts(tokens)
    torch.testing.assert_close(out.reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)
    assert layer.metrics.tokens_per_expert.sum() == 12  # 6 tokens x top-2


def test_expert_weights_of_an_ep_rank_are_rows_of_the_global_weights():
    full = GroupedMLP(moe_config(), ExpertParallel())
    initialize_parameters_(full, 7, "mlp.experts.")
    for rank in range(2):
        part = GroupedMLP(moe_config(expert_model_parallel_size=2), ExpertParallel(size=2, rank=rank))
        initialize_parameters_(part, 7, "mlp.experts.")
        rows = slice(rank * 2 * 8, (rank + 1) * 2 * 8)  # two experts of 8 fc1 rows each
        assert torch.equal(part.linear_fc1.weight, full.linear_fc1.weight[rows])


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --lr 1e-3 "
        "--train-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 64").split()


@pytest.mark.parametrize("flags,world,message", [
    ("--num-experts 6 --expert-model-parallel-size 4 --use-mfsdp", 4, "must be divisible by --expert-model-parallel-size"),
    ("--num-experts 4 --expert-model-parallel-size 4 --use-mfsdp", 6, "must divide the data-parallel size"),
    ("--num-experts 4 --moe-router-topk 5", 1, r"--moe-router-topk \(5\) must be between 1 and --num-experts"),
    ("--num-experts 4 --expert-model-parallel-size 2 --data-parallel-sharding-strategy optim", 2,
     "runs MFSDP no_shard.*add --use-mfsdp"),
    ("--num-experts 4 --moe-grouped-gemm --moe-ffn-hidden-size 12", 1, "multiples of 8"),
    # Router: load-balancing types, expert bias, group-limited routing (upstream's errors).
    ("--num-experts 4 --moe-router-load-balancing-type seq_aux_loss aux_loss --moe-aux-loss-coeff 0.1", 1,
     "lists 2 types: give --moe-aux-loss-coeff as many coefficients"),
    ("--num-experts 4 --moe-aux-loss-coeff 0.1 0.2", 1, "has 2 values for one load-balancing type"),
    ("--num-experts 4 --moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.01", 1,
     "sinkhorn routing balances without an aux loss"),
    ("--num-experts 4 --moe-router-load-balancing-type sinkhorn aux_loss --moe-aux-loss-coeff 0 0.1", 1,
     "sinkhorn is a routing, not a loss"),
    ("--num-experts 4 --moe-router-load-balancing-type sinkhorn --moe-expert-capacity-factor 1", 1,
     "does not work with sinkhorn routing"),
    ("--num-experts 4 --moe-aux-loss-coeff -0.1", 1, "must be non-negative"),
    ("--num-experts 4 --moe-router-topk 1", 1, "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax"),
    ("--num-experts 4 --moe-router-enable-expert-bias", 1, "needs sigmoid scores"),
    ("--num-experts 4 --moe-router-group-topk 1", 1, "needs --moe-router-num-groups"),
    ("--num-experts 6 --moe-router-num-groups 4 --moe-router-group-topk 1", 1,
     r"--num-experts \(6\) must be divisible by --moe-router-num-groups \(4\)"),
    ("--num-experts 4 --moe-router-num-groups 2 --moe-router-group-topk 3", 1,
     r"--moe-router-group-topk \(3\) must not exceed --moe-router-num-groups \(2\)"),
    ("--num-experts 8 --moe-router-topk 4 --moe-router-num-groups 4 --moe-router-group-topk 1", 1,
     "hold fewer than --moe-router-topk"),
    ("--num-experts 4 --moe-layer-freq [1,0,1]", 1, "one 0/1 per layer"),
    ("--num-experts 4 --moe-pad-expert-input-to-capacity", 1, "needs --moe-expert-capacity-factor"),
    # HSDP/HFSDP: every EP group inside one instance (EP | DP / instances).
    ("--num-experts 4 --expert-model-parallel-size 4 --use-mfsdp --num-distributed-optimizer-instances 2", 4,
     r"must divide the ranks of one HSDP/HFSDP instance \(2 = data-parallel size 4 / "
     r"--num-distributed-optimizer-instances 2\).*use a divisor of 2 or fewer instances"),
    ("--num-experts 4 --expert-model-parallel-size 2 --use-mfsdp --num-distributed-optimizer-instances 2 "
     "--outer-dp-sharding-strategy optim", 2, "must divide the ranks of one HSDP/HFSDP instance"),
    ("--num-experts 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 4 --use-mfsdp "
     "--num-distributed-optimizer-instances 2", 8, r"instance \(2 = data-parallel size 4 /"),
    ("--num-experts 4 --moe-enable-deepep", 1, "--moe-token-dispatcher-type flex"),
    # Experts under tensor parallelism.
    ("--num-experts 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --use-mfsdp", 2,
     r"must divide the data-parallel size \(1 = world size 2 / tensor-parallel size 2\)"),
    # Experts split apart from TP (--expert-tensor-parallel-size): the expert view of a stage's ranks.
    ("--expert-tensor-parallel-size 2", 1, r"--expert-tensor-parallel-size \(2\) x --expert-model-parallel-size \(1\) "
     r"must divide the ranks of one pipeline stage \(1 = world size 1 / --pipeline-model-parallel-size 1\)"),
    ("--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --expert-model-parallel-size 4 "
     "--use-mfsdp", 2, r"\(1\) x --expert-model-parallel-size \(4\) must divide the ranks of one pipeline stage \(2"),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --expert-tensor-parallel-size 4",
     4, r"\(4\) x --expert-model-parallel-size \(1\) must divide the ranks of one pipeline stage \(2 = world size 4"),
    ("--num-experts 4 --expert-tensor-parallel-size 2 --expert-model-parallel-size 4 --use-mfsdp "
     "--num-distributed-optimizer-instances 2", 8, r"must divide the ranks of one HSDP/HFSDP instance of a stage \(4"),
    ("--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1", 2,
     "--expert-tensor-parallel-size 1 apart from --tensor-model-parallel-size 2 needs --use-mfsdp"),
    ("--num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --use-mfsdp --seq-length 31", 2,
     r"--seq-length \(31\) must be a multiple of --tensor-model-parallel-size \(2\).*add --sequence-parallel"),
    ("--num-experts 4 --expert-tensor-parallel-size 2 --moe-ffn-hidden-size 33 --use-mfsdp", 2,
     r"--moe-ffn-hidden-size \(33\) must be divisible by --expert-tensor-parallel-size \(2\)"),
    ("--num-experts 4 --expert-tensor-parallel-size 0", 1, "must be a positive integer"),
    ("--num-experts 4 --tensor-model-parallel-size 2 --moe-ffn-hidden-size 33", 2,
     r"--moe-ffn-hidden-size \(33\) must be divisible by --tensor-model-parallel-size \(2\)"),
    ("--num-experts 4 --tensor-model-parallel-size 2 --moe-shared-expert-intermediate-size 15", 2,
     r"--moe-shared-expert-intermediate-size \(15\) must be divisible"),
    ("--num-experts 4 --tensor-model-parallel-size 2 --moe-grouped-gemm --moe-ffn-hidden-size 24", 2,
     "multiples of 8.*got --moe-ffn-hidden-size / TP 2 12"),
])
def test_parse_time_errors(flags, world, message):
    with pytest.raises(ValueError, match=message):
        parse_args(BASE + flags.split(), world_size=world, cuda_available=False)


def test_expert_parallel_without_mfsdp_runs_mfsdp_no_shard(capsys):
    """Upstream's DDP with EP: here MFSDP no_shard (torch's DDP would average different experts)."""
    args = parse_args(BASE + "--num-experts 4 --expert-model-parallel-size 2".split(), world_size=2,
                      cuda_available=False)
    assert args.use_mfsdp and args.data_parallel_sharding_strategy == "no_shard"
    assert "MFSDP runs with --data-parallel-sharding-strategy no_shard" in capsys.readouterr().out
    dense = parse_args(BASE + ["--num-experts", "4"], world_size=2, cuda_available=False)
    assert not dense.use_mfsdp  # EP 1 keeps DDP


def test_moe_layer_freq_patterns():
    args = parse_args(BASE + ["--num-layers", "4", "--num-experts", "4", "--moe-layer-freq", "([1]*1+[0]*1)*2"],
                      world_size=1, cuda_available=False)
    assert args.moe_layer_freq == [1, 0, 1, 0]
    config = moe_config(num_layers=4, moe_layer_freq=2)
    from megatron.core.transformer import TransformerLayer
    kinds = [type(TransformerLayer(config, i + 1).mlp).__name__ for i in range(4)]
    assert kinds == ["MoELayer", "MLP", "MoELayer", "MLP"]
