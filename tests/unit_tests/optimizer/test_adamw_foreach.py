"""--optimizer adam is torch's AdamW on its multi-tensor (foreach) path, chosen for speed on
CPU (benchmarks/results/profile_vs_torchtitan.md): the same bits as torch's per-parameter
loop, which torch would pick off CUDA."""

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig


def _model():
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config, 64, 8, share_embeddings_and_output_weights=False)


def test_adamw_takes_the_foreach_path_with_the_loops_bits():
    ours_model, loop_model = _model(), _model()
    ours = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1), ours_model)
    assert all(g["foreach"] is True for g in ours.param_groups)
    # The same groups (decay / no decay) on torch's per-parameter loop.
    by_id = dict(zip(map(id, ours_model.parameters()), loop_model.parameters()))
    loop_groups = [{**{k: v for k, v in g.items() if k not in ("params", "foreach")},
                    "params": [by_id[id(p)] for p in g["params"]]} for g in ours.param_groups]
    loop = torch.optim.AdamW(loop_groups, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(3):
        for model in (ours_model, loop_model):
            torch.manual_seed(step)
            model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).sum().backward()
        ours.step()
        loop.step()
        ours.zero_grad()
        loop.zero_grad()
    for a, b in zip(ours_model.parameters(), loop_model.parameters()):
        assert torch.equal(a, b)
