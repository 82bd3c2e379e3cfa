"""tools/checkpoint/convert.py with q/k norms: MFSDP <-> Hugging Face Qwen3.

Ours (--qk-layernorm) -> Qwen3: ``Qwen3ForCausalLM`` built from the written config gives
our logits (fp32). Qwen3 -> ours -> Qwen3: every tensor comes back bit for bit, and our
model built from the config gives Qwen3's logits. What Qwen3 cannot express is refused.
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
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16,
              ffn_hidden_size=48, normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
              position_embedding_type="rope", rotary_base=500.0, layernorm_epsilon=1e-6, qk_layernorm=True)


def _ours(seed=0):
    torch.manual_seed(seed)
    model = GPTModel(TransformerConfig(**CONFIG), VOCAB, SEQ, share_embeddings_and_output_weights=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norm weights away from one too
    return model.eval()


def _ids(seed):
    return torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(seed))


def _save(model, path, **extra):
    args = argparse.Namespace(save=str(path), num_layers=2, hidden_size=32, num_attention_heads=4,
                              num_query_groups=2, norm_epsilon=1e-6, rotary_base=500.0, qk_layernorm=True,
                              tokenizer_type="NullTokenizer", vocab_size=VOCAB, padded_vocab_size=VOCAB, **extra)
    save_checkpoint(5, model, None, None, args)


def max_abs_diff(a, b):
    return (a - b).abs().max().item()


def test_to_qwen3_gives_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _ours()
    _save(model, tmp_path / "ckpt")
    run_convert(["--input", str(tmp_path / "ckpt"), "--to", "hf", "--output", str(tmp_path / "hf")])
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 16
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        diff = max_abs_diff(hf(_ids(1)).logits, model(_ids(1)))
    print(f"ours -> Qwen3 logits max |diff| {diff:.3g}")
    assert diff <= 1e-5


def _qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)  # Qwen3 initializes norm weights to one
    return hf.eval()


def test_qwen3_round_trip_is_bit_exact_and_loads_into_our_model(tmp_path):
    hf = _qwen3()
    assert_round_trip_is_bit_exact(hf, tmp_path)
    cfg = config_from_hf(json.load(open(tmp_path / "hf" / "config.json")))
    assert cfg.style == "qwen3" and cfg.to_megatron_args()["qk_layernorm"] and "--qk-layernorm" in cfg.command_line()
    ours = GPTModel(TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope",
        rotary_base=cfg.rotary_base, layernorm_epsilon=cfg.norm_epsilon, qk_layernorm=cfg.qk_layernorm),
        128, cfg.max_position_embeddings, share_embeddings_and_output_weights=False).eval()
    load_checkpoint(ours, None, None, argparse.Namespace(load=str(tmp_path / "mfsdp")))
    with torch.no_grad():
        diff = max_abs_diff(ours(_ids(2))[..., :VOCAB], hf(_ids(2)).logits)
    print(f"Qwen3 -> ours logits max |diff| {diff:.3g}")
    assert diff <= 1e-5


def test_what_qwen3_cannot_express_is_refused(tmp_path):
    shapes = {k: v.shape for k, v in _ours().state_dict().items()}
    args = dict(num_attention_heads=4, num_query_groups=2)
    assert config_from_tensors(shapes, args).style == "qwen3"
    with pytest.raises(ConversionError, match="attention-output-gate"):
        config_from_tensors(shapes, dict(args, attention_output_gate=True))
    base = _qwen3().config.to_dict()
    with pytest.raises(ConversionError, match="attention_bias"):
        config_from_hf(dict(base, attention_bias=True))
    with pytest.raises(ConversionError, match="sliding-window"):
        config_from_hf(dict(base, use_sliding_window=True))
    gpt2_with_qk = {k: v for k, v in shapes.items()}
    gpt2_with_qk["embedding.position_embeddings.weight"] = (SEQ, 32)
    with pytest.raises(ConversionError, match="qk-layernorm"):
        config_from_tensors(gpt2_with_qk, args).style
