"""tools/checkpoint/convert.py with a mixture of experts: MFSDP <-> Hugging Face Mixtral.

Ours -> Mixtral: ``MixtralForCausalLM`` built from the written config gives our logits
(fp32). Mixtral -> ours -> Mixtral: every tensor comes back bit for bit, and our model
built from the config gives Mixtral's logits. Mixtral's in-memory 3-D expert tensors convert too.
"""

import argparse
import json

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.training.checkpointing import load_checkpoint, save_checkpoint

from _hf_round_trip import assert_round_trip_is_bit_exact, run_convert
from tools.checkpoint.hf_conversion import config_from_hf, from_hf

VOCAB, SEQ = 61, 16
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, normalization="RMSNorm",
              gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope", rotary_base=500.0,
              layernorm_epsilon=1e-6, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)





def _ours(config=CONFIG, vocab=VOCAB, seed=0):
    torch.manual_seed(seed)
    model = GPTModel(TransformerConfig(**config), vocab, SEQ, share_embeddings_and_output_weights=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _ids(seed):
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(seed))


def test_to_mixtral_gives_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _ours()
    args = argparse.Namespace(save=str(tmp_path / "ckpt"), num_layers=2, hidden_size=32, num_attention_heads=4,
                              num_query_groups=2, norm_epsilon=1e-6, rotary_base=500.0, num_experts=4,
                              moe_router_topk=2, tokenizer_type="NullTokenizer", vocab_size=VOCAB,
                              padded_vocab_size=VOCAB)
    save_checkpoint(5, model, None, None, args)
    run_convert(["--input", str(tmp_path / "ckpt"), "--to", "hf", "--output", str(tmp_path / "hf")])
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 24)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(_ids(1)).logits, model(_ids(1)), atol=1e-5, rtol=1e-5)


def _mixtral(seed=0):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ, rms_norm_eps=1e-6, num_local_experts=4,
        num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0}, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)).eval()


def _ours_from_config(cfg):
    return GPTModel(TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, normalization=cfg.normalization, gated_linear_unit=True,
        add_bias_linear=False, position_embedding_type="rope", rotary_base=cfg.rotary_base,
        layernorm_epsilon=cfg.norm_epsilon, num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size), 128, cfg.max_position_embeddings,
        share_embeddings_and_output_weights=False).eval()


def test_mixtral_round_trip_is_bit_exact_and_loads_into_our_model(tmp_path):
    hf = _mixtral()
    assert_round_trip_is_bit_exact(hf, tmp_path)
    ours = _ours_from_config(config_from_hf(json.load(open(tmp_path / "hf" / "config.json"))))
    load_checkpoint(ours, None, None, argparse.Namespace(load=str(tmp_path / "mfsdp")))
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids(2))[..., :VOCAB], hf(_ids(2)).logits, atol=1e-5, rtol=1e-5)


def test_in_memory_3d_mixtral_tensors_convert():
    """transformers 5 keeps each layer's experts as 3-D tensors in memory (its files hold
    one tensor per expert): a state dict with those names converts too."""
    hf = _mixtral(seed=3)
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    cfg = config_from_hf(hf.config.to_dict())
    ours = _ours_from_config(cfg)
    ours.load_state_dict(from_hf(state, cfg, 128))
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids(4))[..., :VOCAB], hf(_ids(4)).logits, atol=1e-5, rtol=1e-5)
