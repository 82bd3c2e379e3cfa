"""megatron/training/memory_report.py: the first iteration's line counts the bytes a rank
keeps (weights, gradients, optimizer state) from the tensors themselves. With MFSDP the
README's estimate_memory.py block checks it against the planner (the doc-test's agree=)."""

import torch

from megatron.training.memory_report import memory_line, persistent_bytes
from megatron.training.model_builder import BuiltModel


def test_plain_model_counts_weights_grads_and_adam_state():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False))
    numel = 8 * 16 + 16 + 16 * 4
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    built = BuiltModel(model=model, unwrapped=model)
    assert persistent_bytes(built, optimizer) == {"weights": 4 * numel, "grads": 0, "optimizer state": 0,
                                                  "total": 4 * numel}
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    # Adam: exp_avg and exp_avg_sq per weight (fp32), plus a step counter per parameter.
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    got = persistent_bytes(built, optimizer)
    assert got == {"weights": 4 * numel, "grads": 4 * numel, "optimizer state": 8 * numel + steps,
                   "total": 16 * numel + steps}
    line = memory_line(built, optimizer, torch.device("cpu"), 1)
    assert line.startswith("> memory after iteration 1 (MiB, rank 0): persistent ") and "| mem (max RSS MB) " in line
