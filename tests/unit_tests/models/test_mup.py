"""muP (--use-mup, upstream's rules) on a tiny GPT: the width multiplier's effect on the init
std of each weight, the attention's softmax scale, the embedding and logit multipliers, and
the optimizer's per-group LR / eps, each against values computed by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, OptimizerParamScheduler, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig

VOCAB, SEQ = 64, 8
# hidden 64 over a base of 16: width multiplier 4; 4 heads of d = 16.
MUP = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_mup=True, mup_base_hidden_size=16)


def make(tied=False, **config):
    torch.manual_seed(0)
    return GPTModel(TransformerConfig(**config), VOCAB, SEQ, share_embeddings_and_output_weights=tied)


def test_derived_config_values():
    c = TransformerConfig(**MUP)
    assert c.mup_width_mult == 4.0
    assert c.softmax_scale == 1 / 16  # 1 / d_head
    assert c.mup_output_mult == 0.25  # 1 / width multiplier
    assert c.hidden_init_std == pytest.approx(0.02 / 2)
    c = TransformerConfig(**MUP, mup_base_head_dim=16, mup_output_mult=3.0)
    assert c.softmax_scale == pytest.approx(4 / 16) and c.mup_output_mult == 3.0
    c = TransformerConfig(**MUP, mup_attn_scale_power=0.5)
    assert c.softmax_scale == pytest.approx(1 / 4)
    base = TransformerConfig(**dict(MUP, mup_base_hidden_size=None))
    assert (base.mup_width_mult, base.mup_output_mult) == (1.0, 1.0)  # the base model itself
    plain = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert (plain.softmax_scale, plain.hidden_init_std) == (None, 0.02)


def test_init_std_of_each_weight():
    model = make(**MUP)
    hidden, residual = 0.02 / math.sqrt(4), 0.02 / math.sqrt(4) / math.sqrt(2 * 2)
    expected = {"embedding.word_embeddings": 0.02, "embedding.position_embeddings": 0.02, "output_layer": 0.02,
                "self_attention.linear_qkv": hidden, "mlp.linear_fc1": hidden,
                "self_attention.linear_proj": residual, "mlp.linear_fc2": residual}
    seen = set()
    for name, module in model.named_modules():
        for suffix, std in expected.items():
            if name.endswith(suffix):
                assert module.init_std == pytest.approx(std), name
                seen.add(suffix)
    assert seen == set(expected)
    # drawn with that std (64 x 192 values: within 5 %)
    w = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert abs(w.std().item() / hidden - 1) < 0.05


def test_attention_uses_the_softmax_scale():
    """One attention layer against softmax(q k^T * scale) v computed by hand from its weights."""
    model = make(**MUP, add_bias_linear=False)
    attn = model.decoder.layers[0].self_attention
    x = torch.randn(2, SEQ, 64)
    q, k, v = attn.split_qkv(attn.linear_qkv(x))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / 16  # muP: 1 / d_head
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    context = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(2, SEQ, 64)
    torch.testing.assert_close(attn(x), attn.linear_proj(context), rtol=1e-5, atol=1e-6)


def test_embedding_and_output_multipliers():
    """Same weights with and without muP (power 0.5 keeps 1/sqrt(d)): the logits differ by
    exactly the output multiplier; the embedding output by the embedding multiplier."""
    plain = make(num_layers=2, hidden_size=64, num_attention_heads=4)
    mup = make(**MUP, mup_attn_scale_power=0.5, mup_base_head_dim=None)
    mup.load_state_dict(plain.state_dict())
    ids = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(mup(ids), plain(ids) * 0.25)
    scaled = make(**MUP, mup_embedding_mult=3.0)
    scaled.load_state_dict(plain.state_dict())
    positions = torch.arange(SEQ).expand(2, SEQ)
    torch.testing.assert_close(scaled.embedding(ids, positions), plain.embedding(ids, positions) * 3.0)


def _groups(optimizer, model):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g for g in optimizer.param_groups for p in g["params"]}


def test_adam_hidden_matrices_get_lr_and_eps_over_width():
    model = make(**MUP)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, adam_eps=1e-8, mup_width_mult=4.0)
    opt = get_megatron_optimizer(config, model)
    by_name = _groups(opt, model)
    for name, group in by_name.items():
        matrix = name.endswith("weight") and "layernorm" not in name and "embedding" not in name \
            and name != "output_layer.weight"
        if matrix:
            assert (group["max_lr"], group["min_lr"], group["eps"]) == pytest.approx((2.5e-4, 2.5e-5, 2.5e-9)), name
        else:
            assert "max_lr" not in group and group["eps"] == 1e-8, name
    assert opt.param_groups[0]["name"] == "decay" and "max_lr" not in opt.param_groups[0]
    # The scheduler runs each group's own schedule: after warmup, at the peak, lr = max_lr.
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
                                    lr_decay_steps=10, lr_decay_style="cosine")
    sched.step(2)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["decay"] == pytest.approx(1e-3) and lrs["mup_decay"] == pytest.approx(2.5e-4)
    sched.step(8)  # at the end of the decay: min_lr
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["decay"] == pytest.approx(1e-4) and lrs["mup_decay"] == pytest.approx(2.5e-5)


def test_sgd_vector_like_params_get_lr_times_width():
    model = make(**MUP)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1e-2, min_lr=0.0, mup_width_mult=4.0), model)
    by_name = _groups(opt, model)
    assert by_name["embedding.word_embeddings.weight"]["max_lr"] == pytest.approx(4e-2)
    assert by_name["decoder.layers.0.input_layernorm.weight"]["max_lr"] == pytest.approx(4e-2)
    assert "max_lr" not in by_name["decoder.layers.0.mlp.linear_fc1.weight"]


def test_width_one_changes_nothing_in_the_optimizer():
    model = make(**dict(MUP, mup_base_hidden_size=64))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", mup_width_mult=1.0), model)
    assert [g["name"] for g in opt.param_groups] == ["decay", "no_decay"]


def test_muon_keeps_its_own_scaling_for_its_matrices():
    model = make(**MUP)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-3, mup_width_mult=4.0), model)
    by_name = _groups(opt, model)
    qkv = by_name["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv["use_muon"] and "max_lr" not in qkv  # Muon's matrices: no muP LR override
    emb = by_name["embedding.word_embeddings.weight"]
    assert not emb["use_muon"] and "max_lr" not in emb and emb["eps"] == 1e-8  # vector-like: base LR/eps
