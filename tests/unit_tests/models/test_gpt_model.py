"""GPTModel: names, shapes, causality, loss, tying, dtypes, meta-device init, HF parity."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

VOCAB = 64
MAX_SEQ = 16


def make_model(vocab=VOCAB, max_seq=MAX_SEQ, tied=True, position_embedding_type=None, **overrides):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    base.update(overrides)
    return GPTModel(TransformerConfig(**base), vocab, max_seq, share_embeddings_and_output_weights=tied,
                    position_embedding_type=position_embedding_type)


def test_megatron_parameter_names():
    model = make_model(tied=False)
    names = {n for n, _ in model.named_parameters()}
    expected = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"}
    for i in range(2):
        prefix = f"decoder.layers.{i}."
        for module in ("input_layernorm", "pre_mlp_layernorm"):
            expected |= {prefix + module + ".weight", prefix + module + ".bias"}
        for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            expected |= {prefix + module + ".weight", prefix + module + ".bias"}
    assert names == expected
    rope = make_model(position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)
    rope_names = {n for n, _ in rope.named_parameters()}
    assert "embedding.position_embeddings.weight" not in rope_names
    assert "decoder.layers.1.mlp.linear_fc2.weight" in rope_names
    assert not any(n.endswith(".bias") for n in rope_names)


def test_output_shapes_and_loss_equals_cross_entropy():
    model = make_model(num_query_groups=2)
    ids = torch.randint(0, VOCAB, (3, 10))
    labels = torch.randint(0, VOCAB, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, VOCAB)
    loss = model(ids, labels=labels)
    assert loss.shape == (3, 10) and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(3, 10)
    torch.testing.assert_close(loss, expected)


def test_explicit_position_ids_match_default():
    model = make_model()
    ids = torch.randint(0, VOCAB, (2, 8))
    positions = torch.arange(8).unsqueeze(0).expand(2, 8)
    torch.testing.assert_close(model(ids, position_ids=positions), model(ids))
    assert not torch.allclose(model(ids, position_ids=positions + 3), model(ids))


def test_bad_inputs_raise_value_error():
    model = make_model()
    with pytest.raises(ValueError, match="exceeds max_sequence_length"):
        model(torch.zeros(1, MAX_SEQ + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, sequence\]"):
        model(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must have the shape"):
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 5, dtype=torch.long))
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    with pytest.raises(ValueError, match="vocab_size"):
        GPTModel(config, 0, 8)
    with pytest.raises(ValueError, match="position_embedding_type"):
        GPTModel(config, 8, 8, position_embedding_type="alibi")


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
@pytest.mark.parametrize("groups", [4, 1])
def test_future_tokens_never_change_earlier_logits(position_embedding_type, groups):
    model = make_model(position_embedding_type=position_embedding_type, num_query_groups=groups).eval()
    ids = torch.randint(0, VOCAB, (2, 12))
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % VOCAB
    before, after = model(ids), model(changed)
    torch.testing.assert_close(after[:, :7], before[:, :7], rtol=0, atol=1e-6)
    # ... while the changed position and everything after it do see the change.
    for t in range(7, 12):
        assert not torch.allclose(after[:, t], before[:, t], atol=1e-4), t


def test_rope_model_is_relative_position_invariant():
    # With RoPE (and no learned table) shifting all positions together changes nothing.
    model = make_model(position_embedding_type="rope").eval()
    ids = torch.randint(0, VOCAB, (1, 6))
    positions = torch.arange(6).unsqueeze(0)
    torch.testing.assert_close(model(ids, position_ids=positions + 5), model(ids, position_ids=positions),
                               atol=1e-5, rtol=1e-4)


def test_tied_embeddings_are_one_parameter_receiving_both_gradients():
    torch.manual_seed(0)
    tied = make_model(tied=True)
    untied = make_model(tied=False)
    state = tied.state_dict()
    state["output_layer.weight"] = state["embedding.word_embeddings.weight"].clone()
    untied.load_state_dict(state)

    assert list(tied.output_layer.parameters()) == []
    shared = [p for n, p in tied.named_parameters() if p is tied.embedding.word_embeddings.weight]
    assert len(shared) == 1
    assert tied.shared_embedding_or_output_weight() is tied.embedding.word_embeddings.weight
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == VOCAB * 32

    ids = torch.randint(0, VOCAB, (2, 8))
    labels = torch.randint(0, VOCAB, (2, 8))
    tied(ids, labels=labels).mean().backward()
    untied(ids, labels=labels).mean().backward()
    from_embedding = untied.embedding.word_embeddings.weight.grad
    from_output = untied.output_layer.weight.grad
    assert from_embedding.abs().sum() > 0 and from_output.abs().sum() > 0
    torch.testing.assert_close(tied.embedding.word_embeddings.weight.grad, from_embedding + from_output)


def test_bf16_model_computes_in_bf16():
    torch.manual_seed(0)
    model32 = make_model(tied=False, position_embedding_type="rope", normalization="RMSNorm", gated_linear_unit=True)
    model16 = make_model(tied=False, position_embedding_type="rope", normalization="RMSNorm", gated_linear_unit=True,
                         params_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())
    model16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model32.state_dict().items()})
    ids = torch.randint(0, VOCAB, (2, 8))
    assert model16(ids).dtype == torch.bfloat16
    loss16 = model16(ids, labels=ids)
    assert loss16.dtype == torch.float32
    loss16.mean().backward()
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all() for p in model16.parameters())
    torch.testing.assert_close(loss16, model32(ids, labels=ids).detach(), atol=0.05, rtol=0.02)


def test_meta_build_then_reset_parameters_gives_megatron_init():
    config = dict(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256)
    with torch.device("meta"):
        model = make_model(vocab=512, max_seq=64, tied=False, **config)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.reset_parameters()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if "layernorm" in name:
            expected = 1.0 if name.endswith("weight") else 0.0
            assert torch.all(p == expected), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            std = 0.02 / math.sqrt(2 * 3) if ("linear_proj" in name or "linear_fc2" in name) else 0.02
            assert abs(p.std().item() - std) < 0.08 * std, (name, p.std().item(), std)
            assert abs(p.mean().item()) < 0.1 * std, name
    out = model(torch.randint(0, 512, (1, 16)))
    assert torch.isfinite(out).all()


def test_reset_parameters_matches_fresh_construction_statistics_and_changes_values():
    torch.manual_seed(0)
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.reset_parameters()
    after = model.state_dict()
    assert not torch.equal(before["decoder.layers.0.self_attention.linear_qkv.weight"],
                           after["decoder.layers.0.self_attention.linear_qkv.weight"])
    torch.testing.assert_close(after["decoder.layers.0.input_layernorm.weight"], torch.ones(32))


# ---- parity with independent implementations (Hugging Face), which also pins the documented
# ---- QKV / gate-up layouts that the checkpoint converters rely on.

def _split_qkv(weight, heads, groups, d):
    """Our interleaved rows -> (q, k, v) rows in plain head order."""
    per_group = weight.view(groups, (heads // groups + 2) * d, *weight.shape[1:])
    q, k, v = torch.split(per_group, [heads // groups * d, d, d], dim=1)
    return (q.reshape(heads * d, *weight.shape[1:]), k.reshape(groups * d, *weight.shape[1:]),
            v.reshape(groups * d, *weight.shape[1:]))


def test_matches_hugging_face_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads, groups, d, h, f = 4, 2, 8, 32, 48
    model = make_model(tied=False, position_embedding_type="rope", normalization="RMSNorm", gated_linear_unit=True,
                       num_query_groups=groups, ffn_hidden_size=f, layernorm_epsilon=1e-6, rotary_base=500.0)
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and biases
            p.add_(torch.randn_like(p) * 0.05)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=h, intermediate_size=f, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=groups, head_dim=d, max_position_embeddings=MAX_SEQ, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, attn_implementation="eager")).eval()
    src = model.state_dict()
    dst = {"model.embed_tokens.weight": src["embedding.word_embeddings.weight"],
           "model.norm.weight": src["decoder.final_layernorm.weight"],
           "lm_head.weight": src["output_layer.weight"]}
    for i in range(2):
        m, o = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = _split_qkv(src[m + "self_attention.linear_qkv." + kind], heads, groups, d)
            dst[o + "self_attn.q_proj." + kind], dst[o + "self_attn.k_proj." + kind] = q, k
            dst[o + "self_attn.v_proj." + kind] = v
            dst[o + "self_attn.o_proj." + kind] = src[m + "self_attention.linear_proj." + kind]
            gate, up = src[m + "mlp.linear_fc1." + kind].chunk(2, dim=0)
            dst[o + "mlp.gate_proj." + kind], dst[o + "mlp.up_proj." + kind] = gate, up
            dst[o + "mlp.down_proj." + kind] = src[m + "mlp.linear_fc2." + kind]
        dst[o + "input_layernorm.weight"] = src[m + "input_layernorm.weight"]
        dst[o + "post_attention_layernorm.weight"] = src[m + "pre_mlp_layernorm.weight"]
    hf.load_state_dict(dst, strict=True)
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(ids).logits, atol=1e-5, rtol=1e-4)


def test_matches_hugging_face_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    heads, d, h = 4, 8, 32
    model = make_model(tied=True, activation_func="gelu_tanh")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf = GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_SEQ, n_embd=h, n_layer=2, n_head=heads, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
        attn_implementation="eager")).eval()
    src = model.state_dict()
    dst = {"transformer.wte.weight": src["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": src["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": src["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": src["decoder.final_layernorm.bias"],
           "lm_head.weight": src["embedding.word_embeddings.weight"]}
    for i in range(2):
        m, o = f"decoder.layers.{i}.", f"transformer.h.{i}."
        q, k, v = _split_qkv(src[m + "self_attention.linear_qkv.weight"], heads, heads, d)
        dst[o + "attn.c_attn.weight"] = torch.cat([q, k, v]).T  # Conv1D stores [in, out]
        dst[o + "attn.c_attn.bias"] = torch.cat(_split_qkv(src[m + "self_attention.linear_qkv.bias"], heads, heads, d))
        dst[o + "attn.c_proj.weight"] = src[m + "self_attention.linear_proj.weight"].T
        dst[o + "attn.c_proj.bias"] = src[m + "self_attention.linear_proj.bias"]
        dst[o + "mlp.c_fc.weight"] = src[m + "mlp.linear_fc1.weight"].T
        dst[o + "mlp.c_fc.bias"] = src[m + "mlp.linear_fc1.bias"]
        dst[o + "mlp.c_proj.weight"] = src[m + "mlp.linear_fc2.weight"].T
        dst[o + "mlp.c_proj.bias"] = src[m + "mlp.linear_fc2.bias"]
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            dst[o + theirs + ".weight"] = src[m + ours + ".weight"]
            dst[o + theirs + ".bias"] = src[m + ours + ".bias"]
    missing, unexpected = hf.load_state_dict(dst, strict=False)
    assert not unexpected and all(".attn.bias" in k or ".attn.masked_bias" in k for k in missing), missing
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(ids).logits, atol=1e-5, rtol=1e-4)
