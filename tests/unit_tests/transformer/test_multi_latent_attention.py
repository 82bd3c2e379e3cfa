"""Multi-latent attention against a straightforward reference written from the DeepSeek-V2
paper's equations (section 2.1.2-2.1.3), forward and backward, fp32.

The reference loops over heads, uses the paper's names (W^DQ, W^UQ, W^QR, W^DKV, W^UK,
W^UV, W^KR, W^O) cut from the module's weights by the documented row layouts, RMS-normalises
the latents by the formula, rotates the decoupled part as complex numbers
(x_2i + j x_2i+1) e^{j pos theta_i} in the interleaved layout, and masks and normalises the
scores by hand in float64. The module keeps the rotated part in a different (permuted)
order; the scores do not depend on it, which the comparison checks.
"""

import math

import pytest
import torch

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.rope import RotaryEmbedding

H, HIDDEN, D_N, D_R, D_V, R_Q, R_KV, B, S = 4, 32, 8, 4, 6, 12, 10, 2, 7


def config(**overrides):
    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=H, multi_latent_attention=True,
                  q_lora_rank=R_Q, kv_lora_rank=R_KV, qk_head_dim=D_N, qk_pos_emb_head_dim=D_R, v_head_dim=D_V,
                  qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False, rotary_base=100.0)
    fields.update(overrides)
    return TransformerConfig(**fields)


def rms(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rope_complex(x, positions, base):
    """x [s, d] -> rotated, interleaved layout: pair (2i, 2i + 1) times e^{j pos theta_i}."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[:, 0::2], x[:, 1::2]) * torch.polar(torch.ones_like(theta), positions[:, None] * theta)
    return torch.stack((z.real, z.imag), dim=-1).reshape(x.shape)


def reference(w, x, positions, cfg):
    """The paper's equations, per sequence and per head, in float64; ``w``: the module's
    weights by name."""
    eps = cfg.layernorm_epsilon
    out = torch.zeros(x.shape[0], x.shape[1], HIDDEN, dtype=torch.float64)
    for b in range(x.shape[0]):
        h = x[b].double()
        if cfg.q_lora_rank is None:
            q_all = h @ w["linear_q_proj.weight"].T
        else:
            c_q = h @ w["linear_q_down_proj.weight"].T  # c^Q = W^DQ h
            if cfg.qk_layernorm:
                c_q = rms(c_q, w["q_layernorm.weight"], eps)
            q_all = c_q @ w["linear_q_up_proj.weight"].T  # rows per head: W^UQ then W^QR
        down = w["linear_kv_down_proj.weight"]
        c_kv = h @ down[:R_KV].T  # c^KV = W^DKV h
        if cfg.qk_layernorm:
            c_kv = rms(c_kv, w["kv_layernorm.weight"], eps)
        k_r = rope_complex(h @ down[R_KV:].T, positions, cfg.rotary_base)  # k^R = RoPE(W^KR h), shared
        up = w["linear_kv_up_proj.weight"].view(H, D_N + D_V, R_KV)
        heads = []
        for i in range(H):
            q_i = q_all[:, i * (D_N + D_R):(i + 1) * (D_N + D_R)]
            q = torch.cat((q_i[:, :D_N], rope_complex(q_i[:, D_N:], positions, cfg.rotary_base)), dim=-1)
            k = torch.cat((c_kv @ up[i, :D_N].T, k_r), dim=-1)  # [k^C_i ; k^R]
            v = c_kv @ up[i, D_N:].T  # v^C_i = W^UV_i c^KV
            scores = q @ k.T / math.sqrt(D_N + D_R)
            scores = scores.masked_fill(torch.ones(len(h), len(h)).triu(1).bool(), float("-inf"))
            p = torch.exp(scores - scores.max(-1, keepdim=True).values)
            heads.append((p / p.sum(-1, keepdim=True)) @ v)
        out[b] = torch.cat(heads, dim=-1) @ w["linear_proj.weight"].T  # u = W^O [o_1; ...; o_H]
    return out


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}, {"qk_layernorm": False}],
                         ids=["q-lora+norms", "no-q-lora", "no-latent-norms"])
def test_mla_matches_the_papers_equations_forward_and_backward(overrides):
    torch.manual_seed(0)
    cfg = config(**overrides)
    module = MLASelfAttention(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)  # norms too: the reference must use their weights
    names = {n for n, _ in module.named_parameters()}
    assert ("q_layernorm.weight" in names) == (cfg.qk_layernorm and cfg.q_lora_rank is not None)
    assert ("linear_q_proj.weight" in names) == (cfg.q_lora_rank is None)
    positions = torch.arange(S).repeat(B, 1)
    x = torch.randn(B, S, HIDDEN, requires_grad=True)
    out = module(x, rotary_pos_emb=RotaryEmbedding(D_R, cfg.rotary_base)(positions))

    x_ref = x.detach().double().requires_grad_(True)
    weights = {n: p.detach().double().requires_grad_(True) for n, p in module.named_parameters()}
    ref = reference(weights, x_ref, positions[0].double(), cfg)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)

    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref.backward(grad_out.double())
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=1e-5, atol=1e-5)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad.double(), weights[name].grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_rope_permutation_does_not_change_the_scores():
    """The module's rotated layout ([evens, odds]) differs from the interleaved one, but q.k does not."""
    from megatron.core.transformer.multi_latent_attention import apply_mla_rotary_pos_emb

    positions = torch.arange(S).repeat(1, 1)
    tables = RotaryEmbedding(D_R, 100.0)(positions)
    q, k = torch.randn(1, S, 1, D_R), torch.randn(1, S, 1, D_R)
    mine = (apply_mla_rotary_pos_emb(q, tables)[0, :, 0] @ apply_mla_rotary_pos_emb(k, tables)[0, :, 0].T).double()
    ref = rope_complex(q[0, :, 0].double(), positions[0].double(), 100.0) @ \
        rope_complex(k[0, :, 0].double(), positions[0].double(), 100.0).T
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides,message", [
    ({"qk_pos_emb_head_dim": 3}, "must be even"),
    ({"kv_lora_rank": 0}, "--kv-lora-rank must be a positive integer"),
    ({"q_lora_rank": -1}, "--q-lora-rank must be a positive integer"),
    ({"attention_output_gate": True}, "--attention-output-gate is not supported with --multi-latent-attention"),
])
def test_mla_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


PARSE_BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
              "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --train-iters 1 --lr 1e-3 "
              "--multi-latent-attention").split()


@pytest.mark.parametrize("flags,world,message", [
    ("--tensor-model-parallel-size 8", 8, r"--num-attention-heads \(4\) must be divisible by --tensor-model-parallel"),
    ("--qk-pos-emb-head-dim 5", 1, r"--qk-pos-emb-head-dim \(5\) must be even"),
    ("--context-parallel-size 2", 2, "--multi-latent-attention with --context-parallel-size > 1 is not supported"),
    ("--kv-lora-rank 0", 1, "--kv-lora-rank must be a positive integer for multi-latent attention"),
    ("--attention-output-gate", 1, "--attention-output-gate is not supported with --multi-latent-attention"),
])
def test_mla_parse_time_errors(flags, world, message):
    from megatron.training.arguments import parse_args

    with pytest.raises(ValueError, match=message):
        parse_args(PARSE_BASE + flags.split(), world_size=world, cuda_available=False)


@pytest.mark.parametrize("q_lora_rank", [R_Q, None], ids=["q-lora", "no-q-lora"])
def test_mla_up_proj_recompute_runs_the_up_projections_again_with_the_same_gradients(q_lora_rank):
    """--recompute-modules mla_up_proj: the up projections run again in backward (and only
    they: not the down projections), and every gradient is bitwise the plain run's."""
    torch.manual_seed(0)
    plain = MLASelfAttention(config(q_lora_rank=q_lora_rank))
    again = MLASelfAttention(config(q_lora_rank=q_lora_rank, recompute_granularity="selective",
                                    recompute_modules=["mla_up_proj"]))
    again.load_state_dict(plain.state_dict())
    calls = {}

    def count(name):
        return lambda module, inputs, output: calls.__setitem__(name, calls.get(name, 0) + 1)

    up = "linear_q_up_proj" if q_lora_rank else "linear_q_proj"
    for name in ("linear_kv_up_proj", "linear_kv_down_proj", up):
        getattr(again, name).register_forward_hook(count(name))
    positions = torch.arange(S).repeat(B, 1)
    rope = RotaryEmbedding(D_R, 100.0)(positions)
    x = torch.randn(B, S, HIDDEN)
    grads = []
    for module in (plain, again):
        inp = x.clone().requires_grad_(True)
        module(inp, rotary_pos_emb=rope).square().sum().backward()
        grads.append([inp.grad] + [p.grad for p in module.parameters()])
    assert calls["linear_kv_up_proj"] == 2 and calls["linear_kv_down_proj"] == 1
    assert calls[up] == (2 if q_lora_rank else 1)  # without a q latent, q is the input of the recomputed part
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_mla_up_proj_needs_multi_latent_attention():
    with pytest.raises(ValueError, match="mla_up_proj needs --multi-latent-attention"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, recompute_granularity="selective",
                          recompute_modules=["mla_up_proj"])
