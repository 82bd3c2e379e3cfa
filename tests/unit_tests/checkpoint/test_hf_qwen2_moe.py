"""tools/checkpoint/convert.py with a gated shared expert: MFSDP <-> Hugging Face Qwen2-MoE
(``qkv_bias`` false, and true: our --add-qkv-bias).

Ours -> Qwen2-MoE: ``Qwen2MoeForCausalLM`` built from the written config gives our logits
(fp32), for both softmax routings (``norm_topk_prob`` false = --moe-router-pre-softmax).
Qwen2-MoE -> ours -> Qwen2-MoE: every tensor comes back bit for bit, and our model built
from the config gives its logits.
"""

import argparse
import json

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.training.checkpointing import load_checkpoint, save_checkpoint

from _hf_round_trip import assert_round_trip_is_bit_exact, run_convert
from tools.checkpoint.hf_conversion import ConversionError, config_from_hf, config_from_tensors, from_hf

VOCAB, SEQ = 61, 16
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=20,
           moe_shared_expert_gate=True)
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=40,
              normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope",
              rotary_base=500.0, layernorm_epsilon=1e-6, **MOE)


def _ours(pre_softmax, seed=0):
    torch.manual_seed(seed)
    model = GPTModel(TransformerConfig(**CONFIG, moe_router_pre_softmax=pre_softmax), VOCAB, SEQ,
                     share_embeddings_and_output_weights=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _ids(seed):
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(seed))


def max_abs_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("pre_softmax", (True, False))
def test_to_qwen2_moe_gives_the_same_logits(tmp_path, pre_softmax):
    from transformers import AutoModelForCausalLM

    model = _ours(pre_softmax)
    args = argparse.Namespace(save=str(tmp_path / "ckpt"), num_layers=2, hidden_size=32, num_attention_heads=4,
                              num_query_groups=2, ffn_hidden_size=40, norm_epsilon=1e-6, rotary_base=500.0,
                              num_experts=4, moe_router_topk=2, moe_router_pre_softmax=pre_softmax,
                              tokenizer_type="NullTokenizer", vocab_size=VOCAB, padded_vocab_size=VOCAB)
    save_checkpoint(5, model, None, None, args)
    run_convert(["--input", str(tmp_path / "ckpt"), "--to", "hf", "--output", str(tmp_path / "hf")])
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["architectures"] == ["Qwen2MoeForCausalLM"] and config["norm_topk_prob"] is (not pre_softmax)
    assert (config["num_experts"], config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (
        4, 24, 20)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        diff = max_abs_diff(hf(_ids(1)).logits, model(_ids(1)))
    print(f"ours -> Qwen2-MoE (pre_softmax={pre_softmax}) logits max |diff| {diff:.3g}")
    assert diff <= 1e-5


def _qwen2_moe(seed=0, **overrides):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-6, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20,
                  qkv_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    fields.update(overrides)
    hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(**fields))
    with torch.no_grad():
        hf.model.layers[0].mlp.gate.weight.normal_(0, 0.5)  # Qwen2-MoE initializes the router to zero
        hf.model.layers[1].mlp.gate.weight.normal_(0, 0.5)
    return hf.eval()


def _ours_from_config(cfg):
    return GPTModel(TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size, normalization="RMSNorm",
        gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", rotary_base=cfg.rotary_base,
        layernorm_epsilon=cfg.norm_epsilon, num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size, moe_router_pre_softmax=cfg.moe_router_pre_softmax,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size, moe_shared_expert_gate=True,
        add_qkv_bias=cfg.add_qkv_bias),
        128, cfg.max_position_embeddings, share_embeddings_and_output_weights=False).eval()


def test_qwen2_moe_round_trip_is_bit_exact_and_loads_into_our_model(tmp_path):
    hf = _qwen2_moe()
    assert_round_trip_is_bit_exact(hf, tmp_path)
    cfg = config_from_hf(json.load(open(tmp_path / "hf" / "config.json")))
    assert cfg.style == "qwen2_moe" and cfg.moe_router_pre_softmax
    assert "--moe-shared-expert-gate" in " ".join(cfg.command_line())
    ours = _ours_from_config(cfg)
    load_checkpoint(ours, None, None, argparse.Namespace(load=str(tmp_path / "mfsdp")))
    with torch.no_grad():
        diff = max_abs_diff(ours(_ids(2))[..., :VOCAB], hf(_ids(2)).logits)
    print(f"Qwen2-MoE -> ours logits max |diff| {diff:.3g}")
    assert diff <= 1e-5
    # transformers' in-memory 3-D expert tensors convert too.
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    again = _ours_from_config(cfg)
    again.load_state_dict(from_hf(state, cfg, 128))
    with torch.no_grad():
        assert max_abs_diff(again(_ids(2)), ours(_ids(2))) == 0


def test_what_qwen2_moe_cannot_express_is_refused():
    base = _qwen2_moe().config.to_dict()
    for overrides, match in ((dict(decoder_sparse_step=2), "dense layers"),
                             (dict(mlp_only_layers=[1]), "dense layers"), (dict(use_sliding_window=True), "sliding")):
        with pytest.raises(ConversionError, match=match):
            config_from_hf(dict(base, **overrides))
    ungated = {k: v.shape for k, v in _ours(True).state_dict().items() if not k.endswith("gate_weight")}
    with pytest.raises(ConversionError, match="ungated shared expert"):
        config_from_tensors(ungated, dict(num_attention_heads=4, num_query_groups=2))


def test_qwen2_moe_with_qkv_bias_converts_both_ways(tmp_path):
    """qkv_bias true (Qwen2-MoE's default) is our --add-qkv-bias: q/k/v biases in linear_qkv's
    row order, no other linear bias. Round trip bit for bit, logits equal both ways; a
    Mixtral-style model with it is refused."""
    from transformers import AutoModelForCausalLM

    hf = _qwen2_moe(qkv_bias=True)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)  # Hugging Face initializes them to zero
    assert_round_trip_is_bit_exact(hf, tmp_path)
    cfg = config_from_hf(json.load(open(tmp_path / "hf" / "config.json")))
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and "--add-qkv-bias" in cfg.command_line()
    ours = _ours_from_config(cfg)
    assert ours.decoder.layers[0].self_attention.linear_qkv.bias is not None
    assert ours.decoder.layers[0].self_attention.linear_proj.bias is None
    load_checkpoint(ours, None, None, argparse.Namespace(load=str(tmp_path / "mfsdp")))
    with torch.no_grad():
        diff = max_abs_diff(ours(_ids(2))[..., :VOCAB], hf(_ids(2)).logits)
    print(f"Qwen2-MoE (qkv_bias) -> ours logits max |diff| {diff:.3g}")
    assert diff <= 1e-5
    args = argparse.Namespace(save=str(tmp_path / "ckpt"), num_layers=2, hidden_size=32, num_attention_heads=4,
                              num_query_groups=2, ffn_hidden_size=40, norm_epsilon=1e-6, rotary_base=500.0,
                              num_experts=4, moe_router_topk=2, moe_router_pre_softmax=True, add_qkv_bias=True,
                              tokenizer_type="NullTokenizer", vocab_size=VOCAB, padded_vocab_size=VOCAB)
    save_checkpoint(5, ours, None, None, args)
    run_convert(["--input", str(tmp_path / "ckpt"), "--to", "hf", "--output", str(tmp_path / "hf2")])
    assert json.load(open(tmp_path / "hf2" / "config.json"))["qkv_bias"] is True
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"), attn_implementation="eager",
                                                dtype=torch.float32).eval()
    with torch.no_grad():
        diff = max_abs_diff(back(_ids(3)).logits[..., :VOCAB], ours(_ids(3))[..., :VOCAB])
    print(f"ours (--add-qkv-bias) -> Qwen2-MoE logits max |diff| {diff:.3g}")
    assert diff <= 1e-5
    shapes = {k: v.shape for k, v in ours.state_dict().items() if "shared_experts" not in k}
    with pytest.raises(ConversionError, match="--add-qkv-bias"):
        config_from_tensors(shapes, dict(num_attention_heads=4, num_query_groups=2)).style
