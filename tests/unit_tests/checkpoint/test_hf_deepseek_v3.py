"""tools/checkpoint/convert.py with multi-latent attention: MFSDP <-> Hugging Face DeepSeek-V3
(default RoPE): every layer a dense SwiGLU MLP, and dense then MoE layers (sigmoid routing
with the correction bias and groups, an ungated shared expert).

Ours (--multi-latent-attention, its latent norms) -> DeepSeek-V3: ``DeepseekV3ForCausalLM``
built from the written config gives our logits (fp32, max |diff| <= 1e-5). DeepSeek-V3 ->
ours -> DeepSeek-V3: every tensor comes back bit for bit, and our model built from the
config gives its logits. With and without query compression (q_lora_rank). What the
conversion cannot express is refused.
"""

import argparse
import json

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.training.checkpointing import load_checkpoint, save_checkpoint

from _hf_round_trip import assert_round_trip_is_bit_exact, run_convert
from tools.checkpoint.hf_conversion import ConversionError, config_from_hf, config_from_tensors

VOCAB, SEQ = 61, 16
MLA = dict(kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, normalization="RMSNorm",
              gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", rotary_base=500.0,
              layernorm_epsilon=1e-6, qk_layernorm=True, multi_latent_attention=True, **MLA)


def _ours(q_lora_rank, seed=0):
    torch.manual_seed(seed)
    model = GPTModel(TransformerConfig(**CONFIG, q_lora_rank=q_lora_rank), VOCAB, SEQ,
                     share_embeddings_and_output_weights=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norm weights away from one too
    return model.eval()


def _ids(seed):
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(seed))


def _save(model, path, q_lora_rank):
    args = argparse.Namespace(save=str(path), num_layers=2, hidden_size=32, num_attention_heads=4,
                              norm_epsilon=1e-6, rotary_base=500.0, qk_layernorm=True, multi_latent_attention=True,
                              q_lora_rank=q_lora_rank, tokenizer_type="NullTokenizer", vocab_size=VOCAB,
                              padded_vocab_size=VOCAB, **MLA)
    save_checkpoint(5, model, None, None, args)


def max_abs_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("q_lora_rank", [20, None])
def test_to_deepseek_v3_gives_the_same_logits(tmp_path, q_lora_rank):
    from transformers import AutoModelForCausalLM

    model = _ours(q_lora_rank)
    _save(model, tmp_path / "ckpt", q_lora_rank)
    run_convert(["--input", str(tmp_path / "ckpt"), "--to", "hf", "--output", str(tmp_path / "hf")])
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["first_k_dense_replace"] == 2
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]) == (q_lora_rank, 12, 4)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        diff = max_abs_diff(hf(_ids(1)).logits, model(_ids(1)))
    print(f"ours -> DeepSeek-V3 (q_lora_rank {q_lora_rank}) logits max |diff| {diff:.3g}")
    assert diff <= 1e-5


def _deepseek_v3(q_lora_rank, seed=0, **overrides):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=2,
                  q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                  max_position_embeddings=SEQ, rms_norm_eps=1e-6, rope_interleave=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    fields.update(overrides)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**fields))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)  # DeepSeek initializes norm weights to one
    return hf.eval()


@pytest.mark.parametrize("q_lora_rank", [20, None])
def test_deepseek_v3_round_trip_is_bit_exact_and_loads_into_our_model(tmp_path, q_lora_rank):
    hf = _deepseek_v3(q_lora_rank)
    assert_round_trip_is_bit_exact(hf, tmp_path)
    cfg = config_from_hf(json.load(open(tmp_path / "hf" / "config.json")))
    assert cfg.style == "deepseek_v3" and "--multi-latent-attention" in " ".join(cfg.command_line())
    args = cfg.to_megatron_args()
    ours = GPTModel(TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size, normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
        position_embedding_type="rope", rotary_base=cfg.rotary_base, layernorm_epsilon=cfg.norm_epsilon,
        qk_layernorm=True, multi_latent_attention=True, q_lora_rank=args["q_lora_rank"],
        kv_lora_rank=args["kv_lora_rank"], qk_head_dim=args["qk_head_dim"],
        qk_pos_emb_head_dim=args["qk_pos_emb_head_dim"], v_head_dim=args["v_head_dim"]),
        128, cfg.max_position_embeddings, share_embeddings_and_output_weights=False).eval()
    load_checkpoint(ours, None, None, argparse.Namespace(load=str(tmp_path / "mfsdp")))
    with torch.no_grad():
        diff = max_abs_diff(ours(_ids(2))[..., :VOCAB], hf(_ids(2)).logits)
    print(f"DeepSeek-V3 (q_lora_rank {q_lora_rank}) -> ours logits max |diff| {diff:.3g}")
    assert diff <= 1e-5


def test_what_deepseek_v3_cannot_express_is_refused():
    shapes = {k: v.shape for k, v in _ours(20).state_dict().items()}
    args = dict(num_attention_heads=4, norm_epsilon=1e-6, **MLA)
    assert config_from_tensors(shapes, args).style == "deepseek_v3"
    with pytest.raises(ConversionError, match="does not record qk_head_dim; pass --qk-head-dim"):
        config_from_tensors(shapes, {k: v for k, v in args.items() if k != "qk_head_dim"})
    with pytest.raises(ConversionError, match="rows, the recorded MLA sizes give"):
        config_from_tensors(shapes, dict(args, v_head_dim=5))
    with pytest.raises(ConversionError, match="only --norm-epsilon 1e-6 converts"):
        config_from_tensors(shapes, dict(args, norm_epsilon=1e-5)).style
    no_norms = {k: v for k, v in shapes.items() if "q_layernorm" not in k and "kv_layernorm" not in k}
    with pytest.raises(ConversionError, match="the latent norms of --qk-layernorm"):
        config_from_tensors(no_norms, args).style
    base = _deepseek_v3(20).config.to_dict()
    ungated = {k: v.shape for k, v in _ours_moe().state_dict().items()}
    assert config_from_tensors(ungated, dict(args, moe_router_score_function="sigmoid")).style == "deepseek_v3"
    with pytest.raises(ConversionError, match="route by sigmoid scores"):
        config_from_tensors(ungated, args).style  # softmax routing
    with pytest.raises(ConversionError, match="rope_interleave false"):
        config_from_hf(dict(base, rope_interleave=False))
    with pytest.raises(ConversionError, match="YaRN"):
        config_from_hf(dict(base, rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}))
    with pytest.raises(ConversionError, match="rms_norm_eps other than 1e-6"):
        config_from_hf(dict(base, rms_norm_eps=1e-5))


# DeepSeek-V3 with MoE layers: layer 0 dense, layer 1 MoE (sigmoid scores with the correction
# bias, 2 groups of which 1 is chosen, routed_scaling_factor, one ungated shared expert).
MOE_HF = dict(first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
              routed_scaling_factor=2.5, n_shared_experts=1, moe_intermediate_size=16, norm_topk_prob=True)
MOE_OURS = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1],
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=2.5, moe_router_num_groups=2, moe_router_group_topk=1,
                moe_shared_expert_intermediate_size=16)


def _ours_moe(seed=0):
    torch.manual_seed(seed)
    model = GPTModel(TransformerConfig(**CONFIG, q_lora_rank=20, **MOE_OURS), VOCAB, SEQ,
                     share_embeddings_and_output_weights=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        model.decoder.layers[1].mlp.router.weight.normal_(0, 0.5)  # routing that depends on the token
        model.decoder.layers[1].mlp.router.expert_bias.normal_(0, 0.1)
    return model.eval()


def test_deepseek_v3_moe_layers_convert_both_ways(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = _deepseek_v3(20, **MOE_HF)
    with torch.no_grad():
        gate = hf.model.layers[1].mlp.gate
        gate.weight.normal_(0, 0.5)  # initialized to zero
        gate.e_score_correction_bias.normal_(0, 0.1)
    assert_round_trip_is_bit_exact(hf, tmp_path)
    cfg = config_from_hf(json.load(open(tmp_path / "hf" / "config.json")))
    assert (cfg.num_experts, cfg.moe_first_dense_layers, cfg.moe_router_num_groups) == (4, 1, 2)
    assert "--moe-router-enable-expert-bias" in " ".join(cfg.command_line())
    ours = GPTModel(TransformerConfig(**CONFIG, q_lora_rank=20, **MOE_OURS), 128, SEQ,
                    share_embeddings_and_output_weights=False).eval()
    load_checkpoint(ours, None, None, argparse.Namespace(load=str(tmp_path / "mfsdp")))
    with torch.no_grad():
        diff = max_abs_diff(ours(_ids(2))[..., :VOCAB], hf(_ids(2)).logits)
    print(f"DeepSeek-V3 (MoE) -> ours logits max |diff| {diff:.3g}")
    assert diff <= 1e-5

    model = _ours_moe()
    args = argparse.Namespace(save=str(tmp_path / "ckpt"), num_layers=2, hidden_size=32, num_attention_heads=4,
                              ffn_hidden_size=48, norm_epsilon=1e-6, rotary_base=500.0, qk_layernorm=True,
                              multi_latent_attention=True, q_lora_rank=20, tokenizer_type="NullTokenizer",
                              vocab_size=VOCAB, padded_vocab_size=VOCAB, num_experts=4, moe_router_topk=2,
                              moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
                              moe_router_num_groups=2, moe_router_group_topk=1, **MLA)
    save_checkpoint(5, model, None, None, args)
    run_convert(["--input", str(tmp_path / "ckpt"), "--to", "hf", "--output", str(tmp_path / "hf2")])
    config = json.load(open(tmp_path / "hf2" / "config.json"))
    assert (config["first_k_dense_replace"], config["n_group"], config["routed_scaling_factor"]) == (1, 2, 2.5)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"), attn_implementation="eager",
                                                dtype=torch.float32).eval()
    with torch.no_grad():
        diff = max_abs_diff(back(_ids(3)).logits, model(_ids(3)))
    print(f"ours (MoE) -> DeepSeek-V3 logits max |diff| {diff:.3g}")
    assert diff <= 1e-5
    base = hf.config.to_dict()
    with pytest.raises(ConversionError, match="norm_topk_prob false"):
        config_from_hf(dict(base, norm_topk_prob=False))
    with pytest.raises(ConversionError, match="only num_experts_per_tok = 2 x topk_group"):
        config_from_hf(dict(base, topk_group=2))
