"""The router's balancing and selection features against references written here from the
papers' equations (Switch Transformer, DeepSeek-V2/V3, S-BASE, ST-MoE), forward and
backward; the expert-bias update and where it runs; --moe-layer-freq's dense layers.

Each reference is computed from the logits with loops or plain formulas, independently of
``router.py``; the router's gradient is compared as the gradient of
``sum(probs * R) + scale * losses`` for a fixed random R.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.expert_bias import update_expert_biases
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import (
    TopKRouter, group_limited_topk, set_aux_loss_backward_scale, sinkhorn)
from megatron.training.arguments import parse_args

E, H = 8, 16


def config(**overrides):
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=2,
                moe_ffn_hidden_size=8, add_bias_linear=False)
    base.update(overrides)
    return TransformerConfig(**base)


def router_and_tokens(seed=0, tokens=12, std=1.0, **overrides):
    torch.manual_seed(seed)
    router = TopKRouter(config(**overrides))
    torch.nn.init.normal_(router.weight, std=std)  # spread-out logits: no near ties
    return router, torch.randn(tokens, H, dtype=torch.float64).float()


# --- references from the equations ----------------------------------------------------


def ref_scores(logits, score_function):
    """Scores over all experts for the balance losses: softmax, or sigmoid normalised to 1."""
    if score_function == "softmax":
        e = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
        return e / e.sum(dim=1, keepdim=True)
    s = 1 / (1 + torch.exp(-logits))
    return s / s.sum(dim=1, keepdim=True)


def ref_topk_sets(scores, k):
    return [set(row.argsort(descending=True)[:k].tolist()) for row in scores]


def ref_switch_loss(logits, k, coeff, score_function="softmax", counts_from=None, total=None):
    """coeff * E * sum_e f_e * P_e: f_e = share of the T*k assignments, P_e = mean score.
    ``counts_from`` (logits) / ``total`` give the counts and T of a larger batch."""
    p = ref_scores(logits, score_function)
    source = logits if counts_from is None else counts_from
    chosen = ref_topk_sets(ref_scores(source, score_function), k)
    t = source.shape[0] if total is None else total
    f = torch.tensor([sum(e in c for c in chosen) for e in range(E)], dtype=logits.dtype) / (t * k)
    return coeff * E * torch.sum(f * p.sum(dim=0) / t)


def ref_seq_loss(logits, sequences, k, coeff, score_function="softmax"):
    """DeepSeek-V2 (eq. 18-20): the balance loss of each sequence, averaged over sequences."""
    return torch.stack([ref_switch_loss(seq, k, coeff, score_function)
                        for seq in logits.view(sequences, -1, E)]).mean()


def ref_z_loss(logits, coeff):
    """ST-MoE: coeff * mean_t (log sum_e exp(l_te))^2."""
    return coeff * torch.log(torch.exp(logits.double()).sum(dim=1)).pow(2).mean().to(logits.dtype)


def ref_probs(logits, k, score_function="softmax", pre_softmax=False, bias=None, allowed=None, scale=None):
    """Per token: the k chosen experts (top-k of score + bias within ``allowed``) and their weights."""
    out = torch.zeros_like(logits)
    for t in range(logits.shape[0]):
        l = logits[t]
        if score_function == "sigmoid":
            s = torch.sigmoid(l)
        else:
            s = torch.softmax(l, 0) if pre_softmax else l
        key = s.detach() + (bias if bias is not None else 0)
        candidates = [e for e in range(E) if allowed is None or e in allowed[t]]
        chosen = sorted(candidates, key=lambda e: -float(key[e]))[:k]
        if score_function == "sigmoid":
            w = s[chosen] / s[chosen].sum() if k > 1 else s[chosen]
        elif pre_softmax:
            w = s[chosen]
        else:
            w = torch.softmax(l[chosen], 0)
        if scale:
            w = w * scale
        out[t] = out[t].index_put((torch.tensor(chosen),), w)
    return out


def router_grad(router, x, sequences=1, scale=1.0):
    """(probs, routing map, router weight gradient of sum(probs * R) with the losses attached)."""
    set_aux_loss_backward_scale(router, scale)
    router.weight.grad = None
    probs, routing_map = router(x, num_sequences=sequences)
    weights = torch.randn(probs.shape, generator=torch.Generator().manual_seed(9))
    (probs * weights).sum().backward()
    return probs.detach(), routing_map, router.weight.grad.clone(), weights


def ref_grad(router, x, objective):
    """Gradient of ``objective(logits)`` with respect to the router weight."""
    w = router.weight.detach().clone().requires_grad_(True)
    objective(F.linear(x, w)).backward()
    return w.grad


# --- losses -----------------------------------------------------------------------------


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_switch_aux_loss_forward_and_backward(score_function):
    router, x = router_and_tokens(moe_aux_loss_coeff=0.3, moe_router_score_function=score_function)
    probs, _, grad, weights = router_grad(router, x, scale=0.5)
    logits = F.linear(x, router.weight.detach())
    assert float(router.last_stats["load_balancing_loss"]) == pytest.approx(
        float(ref_switch_loss(logits, 2, 0.3, score_function)) / 0.3, rel=1e-5)
    expected = ref_grad(router, x, lambda l: (ref_probs(l, 2, score_function) * weights).sum()
                        + 0.5 * ref_switch_loss(l, 2, 0.3, score_function))
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_sequence_aux_loss_is_the_mean_of_per_sequence_losses(score_function):
    router, x = router_and_tokens(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.2,
                                  moe_router_score_function=score_function)
    _, _, grad, weights = router_grad(router, x, sequences=3)
    logits = F.linear(x, router.weight.detach())
    ref = ref_seq_loss(logits, 3, 2, 0.2, score_function)
    assert float(router.last_stats["seq_load_balancing_loss"]) == pytest.approx(float(ref) / 0.2, rel=1e-5)
    # Not the micro-batch loss (the test can tell them apart).
    assert float(ref) != pytest.approx(float(ref_switch_loss(logits, 2, 0.2, score_function)), rel=1e-3)
    expected = ref_grad(router, x, lambda l: (ref_probs(l, 2, score_function) * weights).sum()
                        + ref_seq_loss(l, 3, 2, 0.2, score_function))
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


def test_moe_layer_hands_the_router_its_sequences():
    """[b, s, h] in: the sequences are the b rows (token t of sequence j is row j*s + t)."""
    torch.manual_seed(1)
    layer = MoELayer(config(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1.0))
    torch.nn.init.normal_(layer.router.weight, std=1.0)
    x = torch.randn(2, 6, H)
    layer(x)
    logits = torch.stack([F.linear(x[j], layer.router.weight.detach()) for j in range(2)])
    assert float(layer.router.last_stats["seq_load_balancing_loss"]) == pytest.approx(
        float(ref_seq_loss(logits.reshape(12, E), 2, 2, 1.0)), rel=1e-5)


def test_listed_losses_add_up_and_each_is_logged():
    router, x = router_and_tokens(moe_router_load_balancing_type=["seq_aux_loss", "aux_loss", "none"],
                                  moe_aux_loss_coeff=[0.1, 0.2, 0.5], moe_z_loss_coeff=0.01)
    _, _, grad, weights = router_grad(router, x, sequences=2)
    expected = ref_grad(router, x, lambda l: (ref_probs(l, 2) * weights).sum() + ref_seq_loss(l, 2, 2, 0.1)
                        + ref_switch_loss(l, 2, 0.2) + ref_z_loss(l, 0.01))
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
    assert set(router.last_stats) == {"seq_load_balancing_loss", "load_balancing_loss", "z_loss"}


def test_z_loss_forward_and_backward():
    router, x = router_and_tokens(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.05, std=3.0)
    _, _, grad, weights = router_grad(router, x, scale=2.0)
    logits = F.linear(x, router.weight.detach())
    assert float(router.last_stats["z_loss"]) == pytest.approx(float(ref_z_loss(logits, 1.0)), rel=1e-5)
    expected = ref_grad(router, x, lambda l: (ref_probs(l, 2) * weights).sum() + 2.0 * ref_z_loss(l, 0.05))
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


def test_global_aux_loss_on_one_rank_is_the_running_mean_over_micro_batches():
    """Micro-batch 2 uses the mean counts of micro-batches 1 and 2; a new step starts afresh."""
    router, x = router_and_tokens(tokens=16, moe_router_load_balancing_type="global_aux_loss",
                                  moe_aux_loss_coeff=1.0)
    first, second = x[:8], x[8:]
    set_aux_loss_backward_scale(router, 1.0)
    router(first)
    router(second)
    logits1, logits2 = (F.linear(t, router.weight.detach()) for t in (first, second))
    counts = [torch.tensor([sum(e in c for c in ref_topk_sets(ref_scores(l, "softmax"), 2)) for e in range(E)],
                           dtype=torch.float32) for l in (logits1, logits2)]
    mean = (counts[0] + counts[1]) / 2
    ref = E / (2 * 8 * 8) * torch.sum(ref_scores(logits2, "softmax").sum(0) * mean)
    assert float(router.last_stats["global_load_balancing_loss"]) == pytest.approx(float(ref), rel=1e-5)
    set_aux_loss_backward_scale(router, 1.0)
    router(second)
    assert float(router.last_stats["global_load_balancing_loss"]) == pytest.approx(
        float(ref_switch_loss(logits2, 2, 1.0)), rel=1e-5)


# --- selection --------------------------------------------------------------------------


@pytest.mark.parametrize("k,scale", [(1, None), (3, 2.5)])
def test_sigmoid_scores_normalised_over_the_top_k(k, scale):
    router, x = router_and_tokens(moe_router_score_function="sigmoid", moe_router_topk=k,
                                  moe_router_topk_scaling_factor=scale, moe_aux_loss_coeff=0.0)
    probs, _, grad, weights = router_grad(router, x)
    logits = F.linear(x, router.weight.detach())
    torch.testing.assert_close(probs, ref_probs(logits, k, "sigmoid", scale=scale), rtol=1e-5, atol=1e-7)
    if k > 1:
        torch.testing.assert_close(probs.sum(dim=1), torch.full((12,), scale))
    expected = ref_grad(router, x, lambda l: (ref_probs(l, k, "sigmoid", scale=scale) * weights).sum())
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)


def ref_allowed_groups(scores, k, groups, group_topk):
    """DeepSeek-V3's node-limited routing: per token the ``group_topk`` groups whose best
    k/group_topk scores sum highest."""
    size = E // groups
    allowed = []
    for row in scores:
        group_score = [sum(sorted(row[g * size:(g + 1) * size].tolist(), reverse=True)[:k // group_topk])
                       for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -group_score[g])[:group_topk]
        allowed.append({e for g in best for e in range(g * size, (g + 1) * size)})
    return allowed


@pytest.mark.parametrize("score_function,pre_softmax", [("sigmoid", False), ("softmax", False), ("softmax", True)])
def test_group_limited_routing_picks_within_the_best_groups(score_function, pre_softmax):
    router, x = router_and_tokens(tokens=24, moe_router_score_function=score_function,
                                  moe_router_pre_softmax=pre_softmax, moe_router_topk=4, moe_router_num_groups=4,
                                  moe_router_group_topk=2, moe_aux_loss_coeff=0.0)
    probs, routing_map, grad, weights = router_grad(router, x)
    logits = F.linear(x, router.weight.detach())
    keys = torch.sigmoid(logits) if score_function == "sigmoid" else (
        torch.softmax(logits, 1) if pre_softmax else logits)
    allowed = ref_allowed_groups(keys, 4, 4, 2)
    assert all(set(routing_map[t].nonzero().flatten().tolist()) <= allowed[t] for t in range(24))
    # The limit changes some token's choice (else the test could not tell).
    assert any(set(row.argsort(descending=True)[:4].tolist()) - allowed[t] for t, row in enumerate(keys))

    def objective(l):
        k = torch.sigmoid(l) if score_function == "sigmoid" else (torch.softmax(l, 1) if pre_softmax else l)
        return (ref_probs(l, 4, score_function, pre_softmax, allowed=ref_allowed_groups(k.detach(), 4, 4, 2))
                * weights).sum()

    torch.testing.assert_close(probs, ref_probs(logits, 4, score_function, pre_softmax, allowed=allowed),
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad(router, x, objective), rtol=1e-4, atol=1e-6)


def ref_sinkhorn_choice(logits, k, iterations=2000):
    """S-BASE: exp(logits) scaled to a doubly stochastic plan by alternating row and column
    normalisation; each token's top-k of the plan."""
    plan = torch.exp(logits.double())
    for _ in range(iterations):
        plan = plan / plan.sum(dim=1, keepdim=True)
        plan = plan / plan.sum(dim=0, keepdim=True)
    return ref_topk_sets(plan, k)


@pytest.mark.parametrize("k", [1, 2])
def test_sinkhorn_routing_balances_and_weights_by_the_activation(k):
    torch.manual_seed(3)
    router = TopKRouter(config(moe_router_load_balancing_type="sinkhorn", moe_router_topk=k,
                               moe_router_pre_softmax=True))
    with torch.no_grad():
        router.weight.normal_(std=0.5)
        router.weight[0] += 2 * router.weight[1:].mean(0)  # make expert 0 everyone's favourite
    x = torch.randn(32, H) + 1
    probs, routing_map, grad, weights = router_grad(router, x)
    logits = F.linear(x, router.weight.detach())
    chosen = ref_sinkhorn_choice(logits, k)
    assert [set(row.nonzero().flatten().tolist()) for row in routing_map] == chosen
    plain_load = torch.zeros(E).scatter_add(0, logits.topk(k, 1).indices.flatten(), torch.ones(32 * k))
    assert int(routing_map.sum(0).max()) < int(plain_load.max())  # sinkhorn spreads the favourite's tokens
    activation = torch.sigmoid if k == 1 else (lambda l: torch.softmax(l, 1))
    mask = routing_map.float()
    torch.testing.assert_close(probs, activation(logits) * mask)
    torch.testing.assert_close(grad, ref_grad(router, x, lambda l: (activation(l) * mask * weights).sum()),
                               rtol=1e-4, atol=1e-6)
    router.eval()
    with torch.no_grad():
        _, eval_map = router(x)
    assert [set(r.nonzero().flatten().tolist()) for r in eval_map] == ref_topk_sets(activation(logits), k)


def test_sinkhorn_plan_is_doubly_stochastic():
    plan = sinkhorn(torch.randn(20, E, generator=torch.Generator().manual_seed(0)), tol=1e-8)
    torch.testing.assert_close(plan.sum(1), torch.full((20,), 1 / 20), rtol=1e-4, atol=0)
    torch.testing.assert_close(plan.sum(0), torch.full((E,), 1 / E), rtol=1e-4, atol=0)


# --- expert bias (aux-loss-free balancing) ----------------------------------------------


def bias_router(rate=0.1, **overrides):
    return router_and_tokens(tokens=40, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                             moe_router_bias_update_rate=rate, moe_aux_loss_coeff=0.0, **overrides)


def test_expert_bias_moves_the_choice_not_the_weights():
    router, x = bias_router()
    bias = torch.linspace(-0.3, 0.3, E)
    router.expert_bias.copy_(bias)
    probs, routing_map, grad, weights = router_grad(router, x)
    logits = F.linear(x, router.weight.detach())
    torch.testing.assert_close(probs, ref_probs(logits, 2, "sigmoid", bias=bias), rtol=1e-5, atol=1e-7)
    assert not torch.equal(routing_map, ref_probs(logits, 2, "sigmoid") > 0)  # the bias changed choices
    torch.testing.assert_close(grad, ref_grad(router, x, lambda l: (ref_probs(l, 2, "sigmoid", bias=bias)
                                                                   * weights).sum()), rtol=1e-4, atol=1e-6)


def test_expert_bias_update_sign_rule():
    """bias_e += rate if expert e got fewer than the mean tokens, -= rate if more, else unchanged."""
    router, x = bias_router(rate=0.25)
    router.expert_bias.copy_(torch.linspace(-1, 1, E))
    before = router.expert_bias.clone()
    _, first, _, _ = router_grad(router, x[:20])
    _, second, _, _ = router_grad(router, x[20:])
    counts = (first.sum(0) + second.sum(0)).tolist()  # the step's two micro-batches
    mean = sum(counts) / E
    update_expert_biases(router)
    expected = [b + 0.25 * (1 if c < mean else -1 if c > mean else 0) for b, c in zip(before.tolist(), counts)]
    assert router.expert_bias.tolist() == pytest.approx(expected)
    assert float(router.local_tokens_per_expert.abs().sum()) == 0  # counts start again
    update_expert_biases(router)  # nothing counted since: nothing moves
    assert router.expert_bias.tolist() == pytest.approx(expected)


def test_evaluation_and_no_grad_forwards_do_not_count():
    router, x = bias_router()
    with torch.no_grad():
        router(x)
    router.eval()
    router(x)
    assert float(router.local_tokens_per_expert.sum()) == 0


def test_expert_bias_is_a_checkpointed_buffer_under_megatrons_name():
    router, _ = bias_router()
    assert set(router.state_dict()) == {"weight", "expert_bias"}
    assert router.state_dict()["expert_bias"].dtype == torch.float32
    layer = MoELayer(config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True))
    assert "router.expert_bias" in layer.state_dict()


# --- --moe-layer-freq --------------------------------------------------------------------

BASE = ("--num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 --lr 1e-3 "
        "--train-iters 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 32 --num-experts 4 "
        "--ffn-hidden-size 48 --moe-ffn-hidden-size 8").split()


@pytest.mark.parametrize("freq,pattern", [("2", [1, 0, 1, 0]), ("([0]*1+[1]*3)", [0, 1, 1, 1]),
                                          ("[1,1,0,1]", [1, 1, 0, 1]), ("([1]*1+[0]*1)*2", [1, 0, 1, 0])])
def test_moe_layer_freq_builds_dense_and_moe_layers_of_their_sizes(freq, pattern):
    from pretrain_gpt import model_provider

    args = parse_args(BASE + ["--moe-layer-freq", freq], world_size=1, cuda_available=False)
    args.padded_vocab_size = 32
    layers = model_provider(args).decoder.layers
    assert [int(isinstance(layer.mlp, MoELayer)) for layer in layers] == pattern
    for layer, moe in zip(layers, pattern):
        fc1 = layer.mlp.experts.linear_fc1 if moe else layer.mlp.linear_fc1
        assert fc1.weight.shape == ((4 * 8, 16) if moe else (48, 16))


def test_moe_layer_freq_parse_errors():
    for freq, message in [("([0]*1+[1]*3", "is not an int or a list"), ("[0,0,0,0]", "makes no layer a MoE"),
                          ("0", "at least 1"), ("__import__('os')", "is not an int or a list")]:
        with pytest.raises(ValueError, match=message):
            parse_args(BASE + ["--moe-layer-freq", freq], world_size=1, cuda_available=False)


def test_single_type_and_coefficient_lists_mean_the_element():
    args = parse_args(BASE + ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01"],
                      world_size=1, cuda_available=False)
    assert args.moe_router_load_balancing_type == "seq_aux_loss" and args.moe_aux_loss_coeff == 0.01
    args = parse_args(BASE + ["--moe-router-load-balancing-type", "seq_aux_loss", "global_aux_loss",
                              "--moe-aux-loss-coeff", "0.01", "0.001"], world_size=1, cuda_available=False)
    assert args.moe_router_load_balancing_type == ["seq_aux_loss", "global_aux_loss"]
    assert args.moe_aux_loss_coeff == [0.01, 0.001]


def test_groups_of_all_sizes_agree_with_the_reference():
    """Group-limited routing over every (groups, group_topk, k) that fits 8 experts."""
    torch.manual_seed(5)
    scores = torch.rand(10, E)
    for groups, group_topk, k in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2, 4)):
        if group_topk > groups or group_topk * (E // groups) < k or k < group_topk:
            continue
        _, indices = group_limited_topk(scores, k, groups, group_topk)
        allowed = ref_allowed_groups(scores, k, groups, group_topk)
        for t in range(10):
            best = sorted(allowed[t], key=lambda e: -float(scores[t, e]))[:k]
            assert set(indices[t].tolist()) == set(best), (groups, group_topk, k, t)


def test_force_load_balancing_routes_by_random_logits_and_trains_the_gate():
    """--moe-router-force-load-balancing (upstream's benchmark mode): the choice ignores the
    gate (random normal logits drawn from the generator), the gate still gets a gradient."""
    router, x = router_and_tokens(moe_router_force_load_balancing=True, tokens=64)
    gate = router.weight.detach().clone()
    torch.manual_seed(5)
    probs, routing_map = router(x)
    torch.manual_seed(5)
    expected = torch.randn(64, E).topk(2, dim=1).indices.sort(dim=1).values
    assert torch.equal(routing_map.nonzero()[:, 1].view(64, 2), expected)
    (probs * torch.randn_like(probs)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert torch.equal(router.weight, gate)
