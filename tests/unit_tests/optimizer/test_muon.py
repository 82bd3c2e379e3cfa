"""Muon against straightforward references written here from its equations.

Newton-Schulz: X0 = G / ||G||_F (transposed when tall), then X <- a X + b (X X^T) X +
c (X X^T)^2 X per step, in float64. Muon (upstream Megatron-LM / emerging-optimizers):
W <- W (1 - lr wd); M <- beta M + (1 - beta) G; U <- (1 - beta) G + beta M (Nesterov) or M;
W <- W - lr * scale * NS(U), each matrix of U on its own (the query, key and value rows of
linear_qkv; each expert); AdamW for the word embedding, the output layer, norms, biases.
"""

import math

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.muon import Muon
from megatron.core.optimizer.newton_schulz import COEFFICIENT_SETS, coefficient_schedule, muon_scale_factor, newton_schulz
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.initialization import initialize_parameters_


def reference_ns(g: torch.Tensor, schedule) -> torch.Tensor:
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm()
    for a, b, c in schedule:
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if tall else x


@pytest.mark.parametrize("kind", sorted(COEFFICIENT_SETS))
@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (16, 16)])
def test_newton_schulz_follows_the_polynomial(kind, shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    steps = 5 if kind == "cubic5" else 7
    expected = reference_ns(g, coefficient_schedule(kind, steps))
    torch.testing.assert_close(newton_schulz(g, steps, kind, "high").double(), expected, rtol=1e-4, atol=1e-5)


def test_batched_newton_schulz_is_each_matrix_apart():
    g = torch.randn(3, 6, 10, generator=torch.Generator().manual_seed(4))
    out = newton_schulz(g, 5, "quintic", "high")
    for j in range(3):
        torch.testing.assert_close(out[j].double(), reference_ns(g[j], coefficient_schedule("quintic", 5)),
                                   rtol=1e-4, atol=1e-5)


def test_quintic_output_is_nearly_orthogonal_and_medium_precision_close():
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(5))
    singular = torch.linalg.svdvals(newton_schulz(g, 5, "quintic", "high"))
    assert 0.6 < float(singular.min()) and float(singular.max()) < 1.25
    bf16 = newton_schulz(g, 5, "quintic", "medium")
    assert not torch.equal(bf16, newton_schulz(g, 5, "quintic", "high"))  # the steps ran in bf16
    torch.testing.assert_close(bf16, newton_schulz(g, 5, "quintic", "high"), rtol=0.1, atol=0.05)


def test_coefficient_schedules_extend_as_upstream():
    quintic = COEFFICIENT_SETS["quintic"][0]
    assert coefficient_schedule("quintic", 7) == quintic + quintic[:2]  # cycles
    polar = COEFFICIENT_SETS["polar_express"][0]
    assert coefficient_schedule("polar_express", 10) == polar + [polar[-1]] * 2  # repeats the last
    assert coefficient_schedule("polar_express", 3) == polar[:3]
    with pytest.raises(ValueError, match="fixed 5-step"):
        coefficient_schedule("cubic5", 6)
    with pytest.raises(ValueError, match="unknown"):
        coefficient_schedule("custom", 5)


def test_scale_modes():
    assert muon_scale_factor(8, 32, "spectral") == math.sqrt(32)
    assert muon_scale_factor(32, 8, "unit_rms_norm") == 2.0 and muon_scale_factor(8, 32, "unit_rms_norm") == 0.5
    assert muon_scale_factor(32, 8, "shape_scaling") == 2.0 and muon_scale_factor(8, 32, "shape_scaling") == 1.0


# --------------------------------------------------------------------------------------
# The optimizer on a GPT with GQA attention and a MoE layer
# --------------------------------------------------------------------------------------

HEADS, GROUPS, KV, HIDDEN, EXPERTS, FFN = 4, 2, 4, 16, 2, 8


def _model():
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                               num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_layer_freq=[0, 1],
                               moe_router_topk=2, ffn_hidden_size=32, gated_linear_unit=True,
                               normalization="RMSNorm", position_embedding_type="rope",
                               add_bias_linear=False)  # key biases: zero gradients up to rounding, which Adam amplifies
    model = GPTModel(config, vocab_size=32, max_sequence_length=8, share_embeddings_and_output_weights=False)
    initialize_parameters_(model, 7)
    return model


def _matrices(name: str, w: torch.Tensor):
    """Index lists of rows, one per matrix of the parameter (the reference's own cut)."""
    rows = torch.arange(w.shape[0])
    if name.endswith("linear_qkv.weight"):
        per_group = (HEADS // GROUPS + 2) * KV
        q = HEADS // GROUPS * KV
        by_group = rows.view(GROUPS, per_group)
        return [by_group[:, :q].reshape(-1), by_group[:, q:q + KV].reshape(-1), by_group[:, q + KV:].reshape(-1)]
    if ".experts." in name:
        return list(rows.view(EXPERTS, -1))
    return [rows]


class ReferenceMuon:
    def __init__(self, params, lr, wd, beta, nesterov, schedule, scale_mode, extra):
        self.params, self.lr, self.wd, self.beta, self.nesterov = params, lr, wd, beta, nesterov
        self.schedule, self.scale_mode, self.extra = schedule, scale_mode, extra
        self.momentum = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in params}

    @torch.no_grad()
    def step(self):
        for name, p in self.params:
            g = p.grad.double()
            w = p.double() * (1 - self.lr * self.wd)
            m = self.momentum[name] = self.beta * self.momentum[name] + (1 - self.beta) * g
            u = (1 - self.beta) * g + self.beta * m if self.nesterov else m
            update = torch.zeros_like(u)
            for index in _matrices(name, p):
                piece = u[index]
                scale = muon_scale_factor(piece.shape[0], piece.shape[1], self.scale_mode) * self.extra
                update[index] = scale * reference_ns(piece, self.schedule)
            p.copy_(w - self.lr * update)


def _batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 32, (2, 8), generator=generator), torch.randint(0, 32, (2, 8), generator=generator)


@pytest.mark.parametrize("nesterov,scale_mode", [(False, "spectral"), (True, "unit_rms_norm")])
def test_muon_step_equals_the_equations(nesterov, scale_mode):
    lr, wd, beta, extra = 0.02, 0.1, 0.9, 0.2
    model, reference = _model(), _model()
    config = OptimizerConfig(optimizer="muon", lr=lr, weight_decay=wd, muon_momentum=beta, muon_nesterov=nesterov,
                             muon_scale_mode=scale_mode, muon_extra_scale_factor=extra, muon_fp32_matmul_prec="high")
    opt = get_megatron_optimizer(config, model)
    assert isinstance(opt, Muon)
    muon_names = {n for n, p in model.named_parameters() if any(p is q for g in opt.param_groups if g["use_muon"]
                                                                for q in g["params"])}
    # Upstream's split: every 2-D weight but the embedding and output layer (the router's too).
    expected = {n for n, p in model.named_parameters() if p.dim() == 2
                and not n.startswith(("embedding.", "output_layer."))}
    assert muon_names == expected and any(".router." in n for n in muon_names)
    assert any(".experts." in n for n in muon_names) and any("linear_qkv" in n for n in muon_names)

    ref_params = dict(reference.named_parameters())
    ref_muon = ReferenceMuon([(n, ref_params[n]) for n in sorted(muon_names)], lr, wd, beta, nesterov,
                             coefficient_schedule("quintic", 5), scale_mode, extra)
    others = [ref_params[n] for n in ref_params if n not in muon_names]
    decay = [p for p in others if p.dim() > 1]  # Megatron's rule: no decay on biases and 1-D weights
    ref_adam = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                                  {"params": [p for p in others if p.dim() <= 1], "weight_decay": 0.0}], lr=lr)
    for step in range(3):
        ids, labels = _batch(step)
        for m in (model, reference):
            m.zero_grad()
            m(ids, labels=labels).mean().backward()
        opt.step()
        ref_muon.step()
        ref_adam.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    # The momentum is the checkpointed state of each Muon parameter.
    state_keys = {k for p in opt.state for k in opt.state[p]}
    assert "momentum_buffer" in state_keys and "exp_avg" in state_keys


def test_muon_refuses_vectors_in_a_muon_group():
    with pytest.raises(ValueError, match="matrices only"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": True}], {})


def test_torch_state_dict_round_trip_keeps_adamw_on_the_live_groups():
    """After torch's load_state_dict (new group dicts and state), the AdamW part still
    steps with the scheduler's learning rate."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.1), model)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    for group in opt.param_groups:
        group["lr"] = 0.0
    norm = model[1].weight.detach().clone()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert torch.equal(model[1].weight.detach(), norm)  # lr 0 reached the AdamW group
    assert "exp_avg" in opt.state[model[1].weight] and opt.state[model[1].weight]["step"] == 2
