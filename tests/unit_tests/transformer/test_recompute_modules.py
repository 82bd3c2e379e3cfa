"""--recompute-modules: each named module is really recomputed in backward (its forward
runs again), and losses and gradients equal those without recompute."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.recompute import check_recompute_modules, recompute_saved

CALLS = {"act": 0}


def counting_silu(x):
    CALLS["act"] += 1
    return F.silu(x)


def _config(modules, moe=False, **kw):
    extra = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
                 moe_shared_expert_intermediate_size=16, moe_aux_loss_coeff=0.1, moe_layer_freq=[0, 1]) if moe else {}
    selective = dict(recompute_granularity="selective", recompute_modules=modules) if modules is not None else {}
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                             normalization="RMSNorm", gated_linear_unit=True, activation_func=counting_silu,
                             add_bias_linear=False, position_embedding_type="rope", hidden_dropout=0.0,
                             attention_dropout=0.0, **selective, **extra, **kw)


def _run(modules, moe=False):
    """(loss, grads, forward calls per module kind) of one forward and backward."""
    torch.manual_seed(0)
    model = GPTModel(_config(modules, moe), vocab_size=64, max_sequence_length=16)
    model.train()
    counts = {}

    def counter(name):
        # A pre-hook: torch's checkpoint stops a recomputed forward once it has what backward needs.
        def hook(module, args):
            counts[name] = counts.get(name, 0) + 1
        return hook

    for layer in model.decoder.layers:
        layer.input_layernorm.register_forward_pre_hook(counter("layernorm"))
        layer.pre_mlp_layernorm.register_forward_pre_hook(counter("layernorm"))
        layer.mlp.register_forward_pre_hook(counter(type(layer.mlp).__name__))
        if hasattr(layer.mlp, "shared_experts"):
            layer.mlp.shared_experts.register_forward_pre_hook(counter("shared_experts"))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 16), generator=generator)
    labels = torch.randint(0, 64, (2, 16), generator=generator)
    CALLS["act"] = 0
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=labels).mean()
    forward_counts, counts = counts, {}
    act_forward, CALLS["act"] = CALLS["act"], 0
    loss.backward()
    counts["act"], forward_counts["act"] = CALLS["act"], act_forward
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}, forward_counts, counts


# modules -> what the backward must run again (per layer kind: layernorm counts both norms
# of both layers; act counts the dense MLP's and the experts' activation calls).
CASES = {
    "core_attn": (["core_attn"], False, {}),
    "layernorm": (["layernorm"], False, {"layernorm": 4}),
    "mlp": (["mlp"], False, {"MLP": 2, "act": 2}),
    "moe": (["moe"], True, {"MoELayer": 1, "shared_experts": 1, "act": 2}),
    "moe_act": (["moe_act"], True, {"act": 2}),
    "shared_experts": (["shared_experts"], True, {"shared_experts": 1, "act": 1}),
    "all": (["core_attn", "layernorm", "moe_act", "shared_experts", "mlp"], True,
            {"layernorm": 4, "MLP": 1, "shared_experts": 1, "act": 4}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recompute_reruns_the_module_and_keeps_the_gradients(case):
    modules, moe, recomputed = CASES[case]
    loss, grads, forward, backward = _run(None, moe)
    assert not {k: v for k, v in backward.items() if v}  # nothing runs forward again without recompute
    got_loss, got_grads, got_forward, got_backward = _run(modules, moe)
    assert got_forward == forward
    assert {k: v for k, v in got_backward.items() if v} == recomputed
    assert got_loss == loss
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=0, msg=name)


def test_recompute_saved_replaces_the_saved_tensor_by_its_recipe():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    recomputed = []
    y = torch.tanh(x)

    def again():
        recomputed.append(1)
        return torch.tanh(x)

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with recompute_saved(y, again):
            z = (y @ w).sum()
    assert all(t.untyped_storage().data_ptr() != y.untyped_storage().data_ptr() for t in saved)
    z.backward()
    assert recomputed == [1]
    torch.testing.assert_close(w.grad, torch.tanh(x).detach().t() @ torch.ones(4, 8))


@pytest.mark.parametrize("modules, granularity, grouped, message", [
    (["attention"], "selective", False, "unknown attention"),
    (["mla_up_proj"], "selective", False, "needs --multi-latent-attention"),
    (["mhc"], "selective", False, "hyper-connections"),
    (["gdn_norm_out"], "selective", False, "gated delta-net"),
    (["moe_act"], "selective", False, "--moe-grouped-gemm"),
])
def test_bad_recompute_modules_are_refused(modules, granularity, grouped, message):
    with pytest.raises(ValueError, match=message):
        check_recompute_modules(modules, granularity, grouped)
    with pytest.raises(ValueError, match=message):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, recompute_granularity=granularity,
                          recompute_modules=modules)


def test_default_and_non_selective():
    assert check_recompute_modules(None, "selective") == ["core_attn"]
    assert check_recompute_modules(["mla_up_proj"], None) == ["mla_up_proj"]  # upstream ignores them then


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="full"),
                                       dict(recompute_granularity="selective", recompute_modules=["moe"])])
def test_global_aux_loss_and_expert_bias_counts_are_not_moved_by_recompute(recompute):
    """A recompute in backward reuses its forward's running mean of global_aux_loss and does
    not count its tokens for the expert bias again: with two micro-batches (the second's
    forward after the first's recompute) the gradients equal those without recompute."""
    from megatron.core.transformer.moe.router import set_aux_loss_backward_scale

    def run(kw):
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                   hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=4, moe_router_topk=2,
                                   moe_ffn_hidden_size=32, moe_router_load_balancing_type="global_aux_loss",
                                   moe_aux_loss_coeff=1.0, moe_router_score_function="sigmoid",
                                   moe_router_enable_expert_bias=True, **kw)
        model = GPTModel(config, vocab_size=64, max_sequence_length=16).train()
        set_aux_loss_backward_scale(model, 0.5)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):  # two micro-batches of one step
            tokens = torch.randint(0, 64, (2, 16), generator=g)
            (model(tokens, labels=tokens).mean() / 2).backward()
        routers = [m for m in model.modules() if hasattr(m, "global_aux_steps")]
        counts = torch.stack([r.local_tokens_per_expert for r in routers])
        return {n: p.grad.clone() for n, p in model.named_parameters()}, counts

    expected, expected_counts = run({})
    got, counts = run(recompute)
    torch.testing.assert_close(counts, expected_counts, rtol=0, atol=0)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)
