"""tools/checkpoint/convert.py: MFSDP <-> Hugging Face (GPT-2, Llama) and consolidated safetensors.

Conversions to Hugging Face are checked by loading the output with ``transformers`` and
comparing its logits with our model's (fp32, 1e-5); HF -> MFSDP -> HF must reproduce every
tensor bit for bit. Single process, no process group.
"""

import argparse
import json
import os

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.training.checkpointing import load_checkpoint, save_checkpoint

from _hf_round_trip import assert_round_trip_is_bit_exact, run_convert
from tools.checkpoint import convert, inspect as inspect_tool
from tools.checkpoint.checkpoint_io import open_checkpoint

VOCAB, SEQ = 61, 16

STYLES = {
    # GPT-2 style as pretrain_gpt.py builds it (exact GELU), tied embeddings, biases.
    "gpt2": dict(config=dict(num_layers=2, hidden_size=32, num_attention_heads=4), tied=True, args={}),
    # GPT-2 with the tanh GELU of the original GPT-2 checkpoints ("gelu_new").
    "gpt2_tanh": dict(config=dict(num_layers=2, hidden_size=32, num_attention_heads=4, activation_func="gelu_tanh"),
                      tied=False, args={"activation_func": "gelu_tanh"}),
    # Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied, no biases.
    "llama": dict(config=dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                              normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                              ffn_hidden_size=48, position_embedding_type="rope", rotary_base=500.0,
                              layernorm_epsilon=1e-6), tied=False, args={}),
    # Llama with biases and tied embeddings.
    "llama_bias_tied": dict(config=dict(num_layers=1, hidden_size=24, num_attention_heads=3, num_query_groups=1,
                                        normalization="RMSNorm", gated_linear_unit=True, ffn_hidden_size=40,
                                        position_embedding_type="rope"), tied=True, args={}),
}


def _our_model(style, seed=0):
    spec = STYLES[style]
    torch.manual_seed(seed)
    model = GPTModel(TransformerConfig(**spec["config"]), VOCAB, SEQ, share_embeddings_and_output_weights=spec["tied"])
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and biases
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _trainer_args(style, save):
    c = STYLES[style]["config"]
    args = dict(save=str(save), load=str(save), num_layers=c["num_layers"], hidden_size=c["hidden_size"],
                num_attention_heads=c["num_attention_heads"], num_query_groups=c.get("num_query_groups"),
                norm_epsilon=c.get("layernorm_epsilon", 1e-5), rotary_base=c.get("rotary_base", 10000.0),
                tokenizer_type="NullTokenizer", vocab_size=VOCAB, padded_vocab_size=VOCAB)
    args.update(STYLES[style]["args"])
    return argparse.Namespace(**args)





@pytest.mark.parametrize("style", sorted(STYLES))
def test_to_hugging_face_gives_the_same_logits(tmp_path, style):
    from transformers import AutoModelForCausalLM

    model = _our_model(style)
    save_checkpoint(7, model, None, None, _trainer_args(style, tmp_path / "ckpt"))
    run_convert(["--input", str(tmp_path / "ckpt"), "--to", "hf", "--output", str(tmp_path / "hf")])
    config = json.load(open(tmp_path / "hf" / "config.json"))
    expected = "GPT2LMHeadModel" if style.startswith("gpt2") else "LlamaForCausalLM"
    assert config["architectures"] == [expected]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-5, rtol=1e-5)


def test_consolidated_safetensors_holds_every_weight(tmp_path):
    from safetensors.torch import load_file

    model = _our_model("llama")
    save_checkpoint(3, model, torch.optim.AdamW(model.parameters()), None, _trainer_args("llama", tmp_path / "c"))
    run_convert(["--input", str(tmp_path / "c"), "--to", "safetensors", "--output", str(tmp_path / "m.safetensors")])
    loaded = load_file(str(tmp_path / "m.safetensors"))
    expected = dict(model.named_parameters())
    assert set(loaded) == set(expected)
    for name, p in expected.items():
        assert torch.equal(loaded[name], p.detach()), name
    # The consolidated file converts on to Hugging Face (its metadata records the architecture).
    run_convert(["--input", str(tmp_path / "m.safetensors"), "--to", "hf", "--output", str(tmp_path / "hf")])
    assert json.load(open(tmp_path / "hf" / "config.json"))["num_key_value_heads"] == 2


def _hf_model(kind, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0)).eval()
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=SEQ, rms_norm_eps=1e-6,
                                        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)).eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_round_trip_is_bit_exact_and_loads_into_our_model(tmp_path, kind):
    hf = _hf_model(kind)
    assert_round_trip_is_bit_exact(hf, tmp_path)
    a = json.load(open(tmp_path / "hf" / "config.json"))
    b = json.load(open(tmp_path / "back" / "config.json"))
    for key, value in a.items():
        if key not in ("transformers_version", "n_inner", "dtype", "torch_dtype", "architectures"):
            assert b.get(key) == value, key

    # The MFSDP checkpoint is what pretrain_gpt.py --load ... --finetune reads: the same logits.
    from tools.checkpoint.hf_conversion import config_from_hf

    cfg = config_from_hf(a)
    ours = GPTModel(TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization, gated_linear_unit=cfg.gated_linear_unit, activation_func=cfg.activation,
        add_bias_linear=cfg.add_bias_linear, position_embedding_type=cfg.position_embedding_type,
        rotary_base=cfg.rotary_base, layernorm_epsilon=cfg.norm_epsilon),
        128, cfg.max_position_embeddings, share_embeddings_and_output_weights=cfg.tied_embeddings).eval()
    iteration, consumed = load_checkpoint(ours, None, None, argparse.Namespace(load=str(tmp_path / "mfsdp")))
    assert (iteration, consumed) == (0, 0)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[..., :VOCAB], hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_existing_output_is_refused_unless_forced(tmp_path, capsys):
    hf = _hf_model("gpt2")
    hf.save_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert convert.main(["--input", str(tmp_path / "hf"), "--to", "mfsdp", "--output", str(out), "--quiet"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"
    run_convert(["--input", str(tmp_path / "hf"), "--to", "mfsdp", "--output", str(out), "--force"])
    assert not (out / "keep.txt").exists()
    assert open_checkpoint(str(out)).kind == "MFSDP"
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_unsupported_style_is_explained(tmp_path, capsys):
    torch.manual_seed(0)
    model = GPTModel(TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                       position_embedding_type="rope"), VOCAB, SEQ)
    args = argparse.Namespace(save=str(tmp_path / "c"), num_attention_heads=2)
    save_checkpoint(1, model, None, None, args)
    assert convert.main(["--input", str(tmp_path / "c"), "--to", "hf", "--output", str(tmp_path / "hf"), "--quiet"]) == 2
    assert "neither GPT-2 style" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_inspect_lists_prints_and_compares(tmp_path, capsys):
    model = _our_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    save_checkpoint(1, model, optimizer, None, _trainer_args("gpt2", tmp_path / "a"))
    assert inspect_tool.main([str(tmp_path / "a")]) == 0
    listing = capsys.readouterr().out
    assert "decoder.layers.1.mlp.linear_fc1.weight" in listing and "[128, 32]" in listing and "16,384" in listing
    assert "optimizer.state.embedding.word_embeddings.weight.exp_avg" in listing
    assert inspect_tool.main([str(tmp_path / "a"), "--tensor", "decoder.final_layernorm.bias"]) == 0
    assert "shape [32], dtype float32" in capsys.readouterr().out
    assert inspect_tool.main([str(tmp_path / "a"), "--verify"]) == 0

    with torch.no_grad():
        model.decoder.final_layernorm.bias[3] += 0.25
    save_checkpoint(1, model, None, None, _trainer_args("gpt2", tmp_path / "b"))
    capsys.readouterr()
    assert inspect_tool.main([str(tmp_path / "a"), "--compare", str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("decoder.final_layernorm.bias"))
    assert float(line.split()[-1]) == pytest.approx(0.25)
    assert "largest difference 0.25" in out
    assert inspect_tool.main([str(tmp_path / "a"), "--compare", str(tmp_path / "a")]) == 0
