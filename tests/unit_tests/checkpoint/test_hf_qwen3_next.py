"""Qwen3-Next (hybrid gated delta net + gated attention + MoE with a gated shared expert)
<-> ours, in memory: a tiny ``Qwen3NextForCausalLM`` (random weights everywhere, no
download) converted with ``qwen3_next_from_hf`` gives the same logits in our GPTModel built
from ``qwen3_next_config_kwargs``, and ``qwen3_next_to_hf`` gives back every tensor (bit for
bit but the zero-centered norms: (w + 1) - 1 rounds in fp32), which a fresh Hugging Face
model loads (strict) to give our logits. convert.py --to mfsdp imports a saved Qwen3-Next
(same logits, its fine-tuning flags parse); its --to hf does not write Qwen3-Next yet (it
refuses such checkpoints)."""

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from tools.checkpoint.hf_conversion import qwen3_next_config_kwargs, qwen3_next_from_hf, qwen3_next_to_hf

VOCAB, SEQ = 61, 40
HF = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
          rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
          tie_word_embeddings=False, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
          linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
          moe_intermediate_size=12, shared_expert_intermediate_size=20, norm_topk_prob=True, decoder_sparse_step=1,
          mlp_only_layers=[1], layer_types=["linear_attention", "linear_attention", "full_attention",
                                            "linear_attention"], hidden_act="silu", bos_token_id=0, eos_token_id=0)


def _qwen3_next(seed=0):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(**HF))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif p.dim() == 1:  # norms (zero-centered or not), dt_bias: away from their init
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    return hf.eval()


def test_qwen3_next_logits_and_round_trip():
    hf = _qwen3_next()
    hf_config = hf.config.to_dict()
    fields = qwen3_next_config_kwargs(hf_config)
    assert fields["linear_attention_freq"] == [1, 1, 0, 1] and fields["moe_layer_freq"] == [1, 0, 1, 1]
    ours = GPTModel(TransformerConfig(**fields), VOCAB, SEQ, share_embeddings_and_output_weights=False).eval()
    theirs = {n: t.detach().clone() for n, t in hf.state_dict().items()}
    converted = qwen3_next_from_hf(theirs, hf_config)
    ours.load_state_dict(converted, strict=True)
    ids = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    diff = (got - expected).abs().max().item()
    print(f"Qwen3-Next -> ours logits max |diff| {diff:.3g}")
    assert diff <= 1e-5
    back = qwen3_next_to_hf({n: t.detach() for n, t in ours.state_dict().items()}, hf_config)
    assert set(back) == set(theirs)
    for name, t in theirs.items():
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            # Stored as gamma - 1 there, gamma here: (w + 1) - 1 rounds in fp32.
            assert (back[name] - t).abs().max().item() <= 6e-8, name
        else:
            assert torch.equal(back[name], t), name
    again = _qwen3_next(seed=5)
    again.load_state_dict(back, strict=True)
    with torch.no_grad():
        diff = (again(ids).logits - got).abs().max().item()
    print(f"ours -> Qwen3-Next logits max |diff| {diff:.3g}")
    assert diff <= 1e-5


def test_norm_topk_prob_false_routes_without_renormalizing():
    fields = qwen3_next_config_kwargs({**HF, "norm_topk_prob": False})
    assert fields["moe_router_pre_softmax"] is True
    with pytest.raises(Exception, match="rope_type"):
        qwen3_next_config_kwargs({**HF, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})


def test_convert_imports_qwen3_next_and_its_flags_parse(tmp_path):
    """convert.py --to mfsdp from a saved Qwen3-Next: our model loads the checkpoint and gives
    its logits; the printed fine-tuning flags parse to the same hybrid layout."""
    import argparse
    import json
    import shlex

    from _hf_round_trip import run_convert

    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import load_checkpoint
    from tools.checkpoint.hf_conversion import config_from_hf

    hf = _qwen3_next()
    hf.save_pretrained(str(tmp_path / "hf"))
    run_convert(["--input", str(tmp_path / "hf"), "--to", "mfsdp", "--output", str(tmp_path / "mfsdp")])
    hf_config = json.load(open(tmp_path / "hf" / "config.json"))
    cfg = config_from_hf(hf_config)
    assert cfg.style == "qwen3_next"
    args = cfg.to_megatron_args()
    assert args["linear_attention_freq"] == [1, 1, 0, 1] and args["moe_layer_freq"] == [1, 0, 1, 1]
    ours = GPTModel(TransformerConfig(**qwen3_next_config_kwargs(hf_config)), 128, SEQ,
                    share_embeddings_and_output_weights=False).eval()
    load_checkpoint(ours, None, None, argparse.Namespace(load=str(tmp_path / "mfsdp")))
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (ours(ids)[..., :VOCAB] - hf(ids).logits).abs().max().item()
    print(f"Qwen3-Next -> ours (convert.py) logits max |diff| {diff:.3g}")
    assert diff <= 1e-5
    flags = shlex.split(" ".join(cfg.command_line())) + (
        "--seq-length 32 --micro-batch-size 1 --mock-data --tokenizer-type NullTokenizer --vocab-size 61 "
        "--train-iters 1 --lr 1e-3").split()
    parsed = parse_args(flags, world_size=1, cuda_available=False)
    assert parsed.linear_attention_freq == [1, 1, 0, 1] and parsed.moe_layer_freq == [1, 0, 1, 1]
    assert parsed.attention_output_gate and parsed.rotary_percent == 0.25 and parsed.linear_num_value_heads == 4
