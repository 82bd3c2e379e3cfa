"""--optimizer adam is torch's AdamW on its multi-tensor (foreach) path, chosen for speed on
CPU (benchmarks/results/profile_vs_torchtitan.md): the same bits as torch's per-parameter
loop, which torch would pick off CUDA; a group too large for foreach's temporaries stays on
the loop. --optimizer-implementation picks the loop or torch's fused kernel instead."""

import pytest
import torch

import megatron.core.optimizer as optimizer_module

from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig


def _model():
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, 64, 8, share_embeddings_and_output_weights=False)


def _step_both(implementation, reference_kwargs):
    """Three steps of ours (--optimizer-implementation ``implementation``) and of torch's AdamW
    over the same groups with ``reference_kwargs``; returns (ours, both models)."""
    ours_model, loop_model = _model(), _model()
    ours = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1,
                                                  adam_implementation=implementation), ours_model)
    # The same groups (decay / no decay) on torch's implementation chosen explicitly.
    by_id = dict(zip(map(id, ours_model.parameters()), loop_model.parameters()))
    loop_groups = [{**{k: v for k, v in g.items() if k not in ("params", "foreach", "fused")},
                    "params": [by_id[id(p)] for p in g["params"]]} for g in ours.param_groups]
    loop = torch.optim.AdamW(loop_groups, lr=1e-2, weight_decay=0.1, **reference_kwargs)
    for step in range(3):
        for model in (ours_model, loop_model):
            torch.manual_seed(step)
            model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).sum().backward()
        ours.step()
        loop.step()
        ours.zero_grad()
        loop.zero_grad()
    return ours, ours_model, loop_model


def test_adamw_takes_the_foreach_path_with_the_loops_bits():
    ours, ours_model, loop_model = _step_both("foreach", dict(foreach=False))
    assert all(g["foreach"] is True for g in ours.param_groups)
    for a, b in zip(ours_model.parameters(), loop_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("implementation, reference", [("fused", dict(fused=True)), ("for-loop", dict(foreach=False))])
def test_the_implementation_flag_picks_torchs_kernel(implementation, reference):
    ours, ours_model, loop_model = _step_both(implementation, reference)
    assert all(bool(g.get("fused")) == (implementation == "fused") for g in ours.param_groups)
    assert all(g.get("foreach") in (None, False) for g in ours.param_groups)
    for a, b in zip(ours_model.parameters(), loop_model.parameters()):
        assert torch.equal(a, b)
    if implementation == "fused":
        # Not the loop's bits: the kernel rounds differently, and Adam's g / (sqrt(v) + eps)
        # magnifies that where a gradient is near eps; still well inside one step (lr 1e-2).
        _, _, plain = _step_both("foreach", dict(foreach=False))
        diffs = [(a - b).abs().max().item() for a, b in zip(ours_model.parameters(), plain.parameters())]
        assert 0 < max(diffs) < 1e-3


def test_the_implementation_flag_is_adams_only():
    with pytest.raises(ValueError, match="--optimizer-implementation fused"):
        OptimizerConfig(optimizer="sgd", adam_implementation="fused")


def test_a_group_past_the_limit_stays_on_the_loop(monkeypatch):
    """foreach's temporaries are a copy of the group: past FOREACH_MAX_ELEMENTS, the loop."""
    model = _model()
    groups = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1), model).param_groups
    sizes = sorted(sum(p.numel() for p in g["params"]) for g in groups)
    assert len(sizes) == 2 and sizes[0] < sizes[1]
    monkeypatch.setattr(optimizer_module, "FOREACH_MAX_ELEMENTS", sizes[0])
    groups = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1), model).param_groups
    chosen = {sum(p.numel() for p in g["params"]): g["foreach"] for g in groups}
    assert chosen == {sizes[0]: True, sizes[1]: False}
