"""--qk-layernorm, --attention-output-gate and --moe-shared-expert-gate against
straightforward per-head references written here (fp32, forward and backward), plus the
weight-decay rule for the q/k norms, initialization and the config's errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_param_groups
from megatron.core.transformer import RotaryEmbedding, SelfAttention, TransformerConfig
from megatron.core.transformer.initialization import initialize_parameters_
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

B, S, H, HEADS, GROUPS, D = 2, 5, 16, 4, 2, 6


def _config(**overrides):
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=D,
                position_embedding_type="rope", rotary_base=100.0, layernorm_epsilon=1e-6)
    base.update(overrides)
    return TransformerConfig(**base)


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            norm_weight = p.dim() == 1 and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if norm_weight else 0.0))
    return module


def _norm(x, weight, bias, kind, eps):
    if kind == "RMSNorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def _rope(x, pos, base):
    """x [s, d] at positions pos [s]: rotate dims i and i + d/2 by pos * base^(-2i/d)."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    for i in range(half):
        angle = pos.float() * base ** (-2 * i / x.shape[-1])
        a, b = x[:, i], x[:, i + half]
        out[:, i] = a * torch.cos(angle) - b * torch.sin(angle)
        out[:, i + half] = b * torch.cos(angle) + a * torch.sin(angle)
    return out


def reference_attention(x, params, kind, qk_norm, gate, eps=1e-6, base=100.0):
    """One batch row at a time, one head at a time, from the documented row layout."""
    w, wo = params["linear_qkv.weight"], params["linear_proj.weight"]
    bq, bo = params.get("linear_qkv.bias"), params.get("linear_proj.bias")
    per = HEADS // GROUPS
    group_rows = (2 * per + 2 if gate else per + 2) * D
    outputs = []
    for row in range(x.shape[0]):
        mixed = x[row] @ w.t() + (bq if bq is not None else 0)  # [s, rows]
        heads = []
        for h in range(HEADS):
            g, j = divmod(h, per)
            start = g * group_rows
            q = mixed[:, start + j * D: start + (j + 1) * D]
            kv = start + (2 * per if gate else per) * D
            k, v = mixed[:, kv: kv + D], mixed[:, kv + D: kv + 2 * D]
            if qk_norm:
                q = _norm(q, params["q_layernorm.weight"], params.get("q_layernorm.bias"), kind, eps)
                k = _norm(k, params["k_layernorm.weight"], params.get("k_layernorm.bias"), kind, eps)
            pos = torch.arange(x.shape[1])
            q, k = _rope(q, pos, base), _rope(k, pos, base)
            scores = q @ k.t() / math.sqrt(D)
            scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            out = torch.softmax(scores, -1) @ v
            if gate:
                out = out * torch.sigmoid(mixed[:, start + (per + j) * D: start + (per + j + 1) * D])
            heads.append(out)
        outputs.append(torch.cat(heads, -1) @ wo.t() + (bo if bo is not None else 0))
    return torch.stack(outputs)


CASES = {
    "qk-rmsnorm": dict(normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False),
    "qk-layernorm+bias": dict(normalization="LayerNorm", qk_layernorm=True),
    "gate": dict(normalization="RMSNorm", attention_output_gate=True, add_bias_linear=False),
    "qk-rmsnorm+gate": dict(normalization="RMSNorm", qk_layernorm=True, attention_output_gate=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_the_per_head_reference(case):
    flags = CASES[case]
    attn = _randomize(SelfAttention(_config(**flags)))
    rows = (2 * HEADS if flags.get("attention_output_gate") else HEADS) * D + 2 * GROUPS * D
    assert attn.linear_qkv.weight.shape == (rows, H)
    if flags.get("qk_layernorm"):
        assert attn.q_layernorm.weight.shape == attn.k_layernorm.weight.shape == (D,)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    pos = torch.arange(S).unsqueeze(0).expand(B, S)
    out = attn(x, rotary_pos_emb=RotaryEmbedding(D, 100.0)(pos))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * probe).sum().backward()

    params = {n: p.detach().clone().requires_grad_(True) for n, p in attn.named_parameters()}
    x_ref = x.detach().clone().requires_grad_(True)
    ref = reference_attention(x_ref, params, flags["normalization"], flags.get("qk_layernorm", False),
                              flags.get("attention_output_gate", False))
    (ref * probe).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for name, p in attn.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-5, atol=1e-5, msg=name)


def test_the_flags_change_the_output():
    base = _randomize(SelfAttention(_config(normalization="RMSNorm")))
    normed = SelfAttention(_config(normalization="RMSNorm", qk_layernorm=True))
    normed.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        normed.q_layernorm.weight.fill_(2.0)
    x = torch.randn(B, S, H)
    assert not torch.allclose(base(x), normed(x))


def reference_shared_expert(x, params):
    fc1, fc2, gate = params["linear_fc1.weight"], params["linear_fc2.weight"], params["gate_weight"]
    g, up = (x @ fc1.t()).chunk(2, -1)
    out = (F.silu(g) * up) @ fc2.t()
    return out * torch.sigmoid(x @ gate.t())


def test_shared_expert_gate_matches_the_reference():
    config = _config(num_moe_experts=4, moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True,
                     gated_linear_unit=True, add_bias_linear=False)
    expert = _randomize(SharedExpertMLP(config))
    assert expert.gate_weight.shape == (1, H)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    out = expert(x)
    out.pow(2).sum().backward()
    params = {n: p.detach().clone().requires_grad_(True) for n, p in expert.named_parameters()}
    x_ref = x.detach().clone().requires_grad_(True)
    ref = reference_shared_expert(x_ref, params)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for name, p in expert.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-5, atol=1e-5, msg=name)
    # Megatron's name inside a MoE layer.
    model = GPTModel(config, vocab_size=32, max_sequence_length=S)
    assert "decoder.layers.0.mlp.shared_experts.gate_weight" in dict(model.named_parameters())


FULL = dict(qk_layernorm=True, attention_output_gate=True, num_moe_experts=2, moe_shared_expert_intermediate_size=8,
            moe_shared_expert_gate=True, add_bias_linear=False)


def test_invariant_initialization_and_meta_build():
    """Norm weights one, the gate rows and gate_weight normal(0, std), the same on meta."""
    config = _config(**FULL)
    model = GPTModel(config, vocab_size=32, max_sequence_length=S)
    initialize_parameters_(model, seed=3)
    with torch.device("meta"):
        meta = GPTModel(config, vocab_size=32, max_sequence_length=S)
    meta.to_empty(device="cpu")
    initialize_parameters_(meta, seed=3)
    for (name, p), q in zip(model.named_parameters(), meta.parameters()):
        assert torch.equal(p, q), name
    attn = model.decoder.layers[0].self_attention
    assert torch.equal(attn.q_layernorm.weight, torch.ones(D))
    gate = model.decoder.layers[0].mlp.shared_experts.gate_weight
    assert 0.005 < gate.std().item() < 0.05


def test_qk_layernorm_weight_decay_follows_upstream():
    model = GPTModel(_config(qk_layernorm=True), vocab_size=32, max_sequence_length=S)
    qk = {id(p) for n, p in model.named_parameters() if "_layernorm." in n and "self_attention" in n}
    assert len(qk) == 8  # weight and bias of two norms, two layers
    for apply, decayed in ((False, False), (True, True)):
        groups = {g["name"]: {id(p) for p in g["params"]} for g in get_param_groups(model.named_parameters(),
                                                                               apply_wd_to_qk_layernorm=apply)}
        assert (qk <= groups["decay"]) is decayed and (qk <= groups["no_decay"]) is not decayed
    optimizer = get_megatron_optimizer(OptimizerConfig(weight_decay=0.1, apply_wd_to_qk_layernorm=True), model)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert qk <= decayed
    # The other norms stay undecayed.
    other = id(model.decoder.layers[0].input_layernorm.weight)
    assert other in {id(p) for g in get_param_groups(model.named_parameters(), apply_wd_to_qk_layernorm=True)
                                        if g["name"] == "no_decay"
                     for p in g["params"]}


def test_shared_expert_gate_needs_a_shared_expert():
    with pytest.raises(ValueError, match="moe_shared_expert_intermediate_size"):
        _config(num_moe_experts=2, moe_shared_expert_gate=True)
    with pytest.raises(ValueError, match="num_moe_experts"):
        _config(moe_shared_expert_gate=True)


ARGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --lr 1e-3 "
        "--train-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 64")


def _parse(extra):
    from megatron.training.arguments import parse_args

    return parse_args((ARGS + " " + extra).split(), world_size=1, cuda_available=False)


def test_flags_reach_the_model_config():
    from pretrain_gpt import core_transformer_config_from_args

    args = _parse("--qk-layernorm --attention-output-gate --num-experts 2 --moe-shared-expert-intermediate-size 8 "
                  "--moe-shared-expert-gate --disable-bias-linear")
    config = core_transformer_config_from_args(args)
    assert config.qk_layernorm and config.attention_output_gate and config.moe_shared_expert_gate
    assert _parse("--qk-layernorm --apply-wd-to-qk-layernorm").apply_wd_to_qk_layernorm
    plain = core_transformer_config_from_args(_parse(""))
    assert not (plain.qk_layernorm or plain.attention_output_gate or plain.moe_shared_expert_gate)


@pytest.mark.parametrize("extra,match", [
    ("--moe-shared-expert-gate", "--moe-shared-expert-gate gates the shared expert; add --num-experts and "
                                 "--moe-shared-expert-intermediate-size"),
    ("--num-experts 2 --moe-shared-expert-gate", "add --num-experts and --moe-shared-expert-intermediate-size"),
])
def test_parse_time_errors(extra, match):
    with pytest.raises(ValueError, match=match):
        _parse(extra)
