"""The gated delta net (megatron/core/transformer/gated_delta_net.py): the chunked rule
against a per-token recurrence written here from the equations (forward and backward), the
whole layer against Hugging Face's Qwen3NextGatedDeltaNet with the same weights, the hybrid
layer pattern, layout-invariant init and the config's refusals."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.gated_delta_net import GatedDeltaNet, chunk_gated_delta_rule, linear_attention_pattern
from megatron.core.transformer.initialization import initialize_parameters_
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


def recurrence(q, k, v, g, beta):
    """S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T, o_t = S_t^T q_t,
    one token at a time ([b, s, h, d] inputs, [b, s, h] gates)."""
    b, s, h, dk = q.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    outputs = []
    for t in range(s):
        decayed = state * torch.exp(g[:, t])[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", decayed, k[:, t])
        written = beta[:, t, :, None] * (v[:, t] - predicted)
        state = decayed + torch.einsum("bhk,bhv->bhkv", k[:, t], written)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def _inputs(seq, b=2, h=3, dk=8, dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, seq, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(b, seq, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, seq, h, dv, generator=gen)
    g = -F.softplus(torch.randn(b, seq, h, generator=gen))  # log-decays <= 0
    beta = torch.sigmoid(torch.randn(b, seq, h, generator=gen))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("seq", [1, 7, 16, 37, 48])
def test_chunked_rule_equals_per_token_recurrence(seq):
    inputs = _inputs(seq)
    out, state = chunk_gated_delta_rule(*inputs, chunk_size=16)
    ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    ref, ref_state = recurrence(*ref_inputs)
    assert (out - ref).abs().max().item() <= 1e-5
    assert (state - ref_state).abs().max().item() <= 1e-5
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    for name, a, r in zip("q k v g beta".split(), inputs, ref_inputs):
        diff = (a.grad - r.grad).abs().max().item()
        assert diff <= 2e-5, f"d{name}: max |diff| {diff}"


def test_chunk_size_does_not_matter():
    inputs = [x.detach() for x in _inputs(70)]
    a, _ = chunk_gated_delta_rule(*inputs, chunk_size=64)
    b, _ = chunk_gated_delta_rule(*inputs, chunk_size=8)
    assert (a - b).abs().max().item() <= 1e-5


def _config(**overrides):
    fields = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
                  layernorm_epsilon=1e-6, add_bias_linear=False, gated_linear_unit=True,
                  experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                  linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
                  linear_num_key_heads=2, linear_num_value_heads=4)
    fields.update(overrides)
    return TransformerConfig(**fields)


def test_layer_pattern_and_names():
    config = _config(linear_attention_freq=[1, 1, 0, 1])
    assert linear_attention_pattern(config) == [1, 1, 0, 1]
    assert linear_attention_pattern(_config(linear_attention_freq=2)) == [1, 0, 1, 0]
    kinds = [type(TransformerLayer(config, layer_number=i + 1).self_attention).__name__ for i in range(4)]
    assert kinds == ["GatedDeltaNet", "GatedDeltaNet", "SelfAttention", "GatedDeltaNet"]
    shapes = {n: tuple(p.shape) for n, p in GatedDeltaNet(config).named_parameters()}
    assert shapes == {"in_proj.weight": (2 * 16 + 2 * 24 + 2 * 4, 32), "conv1d.weight": (16 * 2 + 24, 1, 4),
                      "A_log": (4,), "dt_bias": (4,), "out_norm.weight": (6,), "out_proj.weight": (32, 24)}


def test_invariant_init_rules():
    module = GatedDeltaNet(_config())
    initialize_parameters_(module, seed=3, prefix="decoder.layers.0.self_attention.")
    assert torch.all(module.dt_bias == 1)
    a = module.A_log.exp()
    assert torch.all((a >= 1) & (a <= 16))
    bound = 1 / math.sqrt(4)
    assert module.conv1d.weight.abs().max() <= bound and module.conv1d.weight.std() > bound / 4
    again = GatedDeltaNet(_config())
    initialize_parameters_(again, seed=3, prefix="decoder.layers.0.self_attention.")
    for (name, p), q in zip(module.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name


def _hf_module(config):
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hf_config = Qwen3NextConfig(hidden_size=config.hidden_size, linear_num_key_heads=config.linear_num_key_heads,
                                linear_num_value_heads=config.linear_num_value_heads,
                                linear_key_head_dim=config.linear_key_head_dim,
                                linear_value_head_dim=config.linear_value_head_dim,
                                linear_conv_kernel_dim=config.linear_conv_kernel_dim, rms_norm_eps=1e-6,
                                num_hidden_layers=1, layer_types=["linear_attention"], hidden_act="silu")
    return Qwen3NextGatedDeltaNet(hf_config, layer_idx=0)


@pytest.mark.parametrize("seq", [5, 70, 130])
def test_layer_equals_hugging_face_qwen3_next(seq):
    from tools.checkpoint.hf_conversion import qwen3_next_gdn_from_hf, qwen3_next_gdn_to_hf

    torch.manual_seed(0)
    config = _config()
    hf = _hf_module(config)
    with torch.no_grad():
        # Random everywhere (HF's init has ones and zeros that would hide a permutation).
        # Projections at std 0.1: much larger ones make some heads' core output tiny, and the
        # gated RMSNorm then amplifies fp32 rounding of either implementation (both match a
        # float64 recurrence to ~1e-6 before the norm).
        for name, p in hf.named_parameters():
            if name.endswith("proj_qkvz.weight") or name.endswith("proj_ba.weight") or name == "out_proj.weight":
                p.normal_(0, 0.1)
            elif name in ("norm.weight", "dt_bias"):
                p.normal_(1, 0.1)
        hf.A_log.copy_(torch.empty_like(hf.A_log).uniform_(1, 16).log())
    ours = GatedDeltaNet(config)
    hf_state = {n: p.detach().clone() for n, p in hf.state_dict().items()}
    ours.load_state_dict(qwen3_next_gdn_from_hf(hf_state, config))
    back = qwen3_next_gdn_to_hf(ours.state_dict(), config)
    assert set(back) == set(hf_state) and all(torch.equal(back[n], hf_state[n]) for n in hf_state)
    x = torch.randn(2, seq, config.hidden_size)
    with torch.no_grad():
        expected = hf(x)
        got = ours(x)
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-5, diff
    assert expected.abs().max() > 0.1  # not trivially zero


def test_gdn_norm_out_recompute_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = GatedDeltaNet(_config())
    recomputed = GatedDeltaNet(_config(recompute_granularity="selective", recompute_modules=["gdn_norm_out"]))
    recomputed.load_state_dict(plain.state_dict())
    assert recomputed.recompute_norm_out and not plain.recompute_norm_out
    x = torch.randn(2, 9, 32)
    grads = []
    for module in (plain, recomputed):
        module.train()
        module(x).square().sum().backward()
        grads.append({n: p.grad for n, p in module.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


@pytest.mark.parametrize("overrides, message", [
    (dict(linear_attention_freq=None), "needs --linear-attention-freq"),
    (dict(linear_attention_freq=[1, 0]), "has 2 entries but --num-layers is 4"),
    (dict(linear_attention_freq=[1, 2, 0, 1]), "entries must be 0"),
    (dict(linear_num_value_heads=3), "must be a multiple of --linear-num-key-heads"),
    (dict(experimental_attention_variant="dsa"), "dsa is not implemented here"),
    (dict(experimental_attention_variant=None), "needs --experimental-attention-variant gdn"),
    (dict(gated_linear_unit=False), "needs the silu activation"),
    (dict(recompute_granularity="selective", recompute_modules=["gdn_norm_out"],
          experimental_attention_variant=None, linear_attention_freq=None), "gdn_norm_out needs"),
])
def test_config_refusals(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


PARSE_BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --swiglu "
              "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --train-iters 1 --lr 1e-3 "
              "--experimental-attention-variant gated_delta_net --linear-key-head-dim 8 --linear-value-head-dim 8 "
              "--linear-num-key-heads 2 --linear-num-value-heads 4").split()


@pytest.mark.parametrize("flags, expected", [
    ("--linear-attention-freq 4", 4),
    ("--linear-attention-freq ([1]*3+[0]*1)", [1, 1, 1, 0]),
    ("--linear-attention-freq [0,1,1,1]", [0, 1, 1, 1]),
])
def test_flags_parse_like_upstream(flags, expected):
    from megatron.training.arguments import parse_args
    from megatron.training.linear_attention_arguments import linear_attention_config_kwargs

    args = parse_args(PARSE_BASE + flags.split(), world_size=1, cuda_available=False)
    assert args.linear_attention_freq == expected
    config = _config(**{k: v for k, v in linear_attention_config_kwargs(args).items()}, hidden_size=64)
    assert config.experimental_attention_variant == "gated_delta_net" and config.linear_num_value_heads == 4


@pytest.mark.parametrize("flags, world, message", [
    ("", 1, "needs --linear-attention-freq"),
    ("--linear-attention-freq [1,0]", 1, "has 2 entries but --num-layers is 4"),
    ("--linear-attention-freq 2 --tensor-model-parallel-size 4", 4,
     r"--linear-num-key-heads \(2\) must be a multiple of --tensor-model-parallel-size \(4\)"),
    ("--linear-attention-freq 2 --linear-num-value-heads 3", 1, "must be a multiple of --linear-num-key-heads"),
    ("--linear-attention-freq 2 --context-parallel-size 2", 2, "with --context-parallel-size > 1 is not supported"),
    ("--linear-attention-freq 2 --linear-conv-kernel-dim 0", 1, "--linear-conv-kernel-dim must be a positive"),
    ("--linear-attention-freq 2 --experimental-attention-variant dsa", 1, "dsa is not implemented here"),
    ("--linear-attention-freq 2 --openai-gelu", 1, "needs the silu activation"),
    ("--linear-attention-freq 2 --recompute-granularity selective --recompute-modules gdn_norm_out "
     "--experimental-attention-variant gdn2", 1, "gdn2 is not implemented here"),
])
def test_parse_time_errors(flags, world, message):
    from megatron.training.arguments import parse_args

    base = [f for f in PARSE_BASE if not ("gelu" in flags and f == "--swiglu")]
    with pytest.raises(ValueError, match=message):
        parse_args(base + flags.split(), world_size=world, cuda_available=False)


def test_bad_pattern_expression_is_refused_without_evaluating_it():
    from megatron.training.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match="--linear-attention-freq .* is not a list of 0/1"):
        parse_args(PARSE_BASE + ["--linear-attention-freq", "[1]*__import__('os').getpid()"], world_size=1,
                   cuda_available=False)


def test_hf_export_of_a_hybrid_checkpoint_is_refused():
    from tools.checkpoint.hf_conversion import ConversionError, config_from_tensors

    model_shapes = {"embedding.word_embeddings.weight": (128, 32),
                    "decoder.layers.0.self_attention.in_proj.weight": (88, 32)}
    with pytest.raises(ConversionError, match="gated delta-net layers"):
        config_from_tensors(model_shapes, {"num_attention_heads": 4})
    with pytest.raises(ConversionError, match="gated delta-net layers"):
        config_from_tensors({"embedding.word_embeddings.weight": (128, 32)},
                            {"num_attention_heads": 4, "experimental_attention_variant": "gdn"})


def test_pipeline_stage_layers_keep_their_global_kind():
    """A pipeline stage's block holds global layers: the pattern is read at their numbers."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = _config(linear_attention_freq=[1, 0, 0, 1])
    block = TransformerBlock(config, layer_numbers=[2, 3], post_layer_norm=True)
    assert [type(layer.self_attention).__name__ for layer in block.layers] == ["SelfAttention", "GatedDeltaNet"]


def test_full_recompute_gives_the_same_gradients():
    from megatron.core.transformer.transformer_block import TransformerBlock

    torch.manual_seed(0)
    plain = TransformerBlock(_config())
    recomputed = TransformerBlock(_config(recompute_granularity="full", recompute_method="uniform",
                                          recompute_num_layers=2))
    recomputed.load_state_dict(plain.state_dict())
    x = torch.randn(2, 11, 32)
    grads = []
    for block in (plain, recomputed):
        block.train()
        block(x).square().sum().backward()
        grads.append({n: p.grad for n, p in block.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


def test_chunked_rule_stays_fp32_under_autocast():
    inputs = [x.detach() for x in _inputs(40)]
    expected, _ = recurrence(*(x.double() for x in inputs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = chunk_gated_delta_rule(*inputs, chunk_size=16)
    assert got.dtype == torch.float32 and (got.double() - expected).abs().max().item() <= 1e-5


def test_projections_have_no_bias_even_with_add_bias_linear():
    module = GatedDeltaNet(_config(add_bias_linear=True))
    assert module.in_proj.bias is None and module.out_proj.bias is None
