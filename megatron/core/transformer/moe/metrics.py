"""What the MoE layers report: router losses and token loads, summed until collected.

Each ``MoELayer`` records, for every training forward pass, the tokens this rank routed
to each expert (after dropping), the dropped assignments, and the router losses divided
by their coefficients (Megatron's logged values). ``collect_moe_metrics`` sums the
records over the data-parallel ranks (of one TP coordinate), turns them into means per forward pass and resets
them. A recomputed forward (activation recompute) records again; the means are unchanged.

Per layer (1-based ``n``): ``moe/layer{n}/max_tokens_per_expert`` and
``.../mean_tokens_per_expert`` (tokens of one micro-batch of the whole data-parallel
world, i.e. summed over ranks), ``.../dropped_tokens`` with capacity dropping, and the
losses; over all MoE layers (their mean): ``load_balancing_loss``, ``seq_load_balancing_loss``,
``global_load_balancing_loss`` (each of the configured types), ``z_loss``,
``moe_max_over_mean_load`` (the worst layer's max/mean) and ``moe_dropped_tokens``.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core.distributed.ranks import world_size

LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")


class MoELayerMetrics:
    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.float64)
        self.dropped_tokens = 0.0
        self.losses = {name: 0.0 for name in LOSS_NAMES}
        self.loss_records = {name: 0 for name in LOSS_NAMES}
        self.records = 0

    def record(self, tokens_per_expert: torch.Tensor, dropped_tokens, losses: Dict[str, torch.Tensor]) -> None:
        self.tokens_per_expert += tokens_per_expert.detach().to("cpu", torch.float64)
        self.dropped_tokens += float(dropped_tokens)
        for name, value in losses.items():
            self.losses[name] += float(value)
            self.loss_records[name] += 1
        self.records += 1

    def as_row(self) -> List[float]:
        return (self.tokens_per_expert.tolist() + [self.dropped_tokens, float(self.records)]
                + [self.losses[n] for n in LOSS_NAMES] + [float(self.loss_records[n]) for n in LOSS_NAMES])


def collect_moe_metrics(model: torch.nn.Module, device: torch.device = torch.device("cpu"),
                        group=None) -> Dict[str, float]:
    """The metrics above, reduced over ``group`` (the data-parallel ranks of this TP
    coordinate; None: the default process group), then reset; every rank of the group
    calls it (a collective). Under TP every rank of a TP group records the same whole
    micro-batch, so the data-parallel group counts each token once. ``{}`` for a model
    without MoE layers or without records."""
    # The layers that record (MoELayer's ``metrics``), found by what they carry: importing
    # MoELayer here would close an import cycle (moe_layer imports this module).
    layers = [m for m in model.modules() if isinstance(getattr(m, "metrics", None), MoELayerMetrics)]
    if not layers:
        return {}
    rows = torch.tensor([layer.metrics.as_row() for layer in layers], dtype=torch.float64, device=device)
    for layer in layers:
        layer.metrics.reset()
    world = world_size(group)
    if world > 1:
        dist.all_reduce(rows, group=group)
    rows = rows.cpu()
    experts = layers[0].metrics.num_experts
    out: Dict[str, float] = {}
    ratios, dropped, loss_sums = [], [], {n: [] for n in LOSS_NAMES}
    for layer, row in zip(layers, rows):
        records = float(row[experts + 1])
        if records == 0:
            continue
        forwards = records / world  # forward passes per rank
        tokens = row[:experts] / forwards
        prefix = f"moe/layer{layer.layer_number}/"
        out[prefix + "max_tokens_per_expert"] = float(tokens.max())
        out[prefix + "mean_tokens_per_expert"] = float(tokens.mean())
        ratios.append(float(tokens.max() / tokens.mean()) if float(tokens.mean()) > 0 else 0.0)
        if layer.config.moe_expert_capacity_factor is not None:
            out[prefix + "dropped_tokens"] = float(row[experts]) / forwards
            dropped.append(out[prefix + "dropped_tokens"])
        for i, name in enumerate(LOSS_NAMES):
            count = float(row[experts + 2 + len(LOSS_NAMES) + i])
            if count:
                out[prefix + name] = float(row[experts + 2 + i]) / count
                loss_sums[name].append(out[prefix + name])
    for name, values in loss_sums.items():
        if values:
            out[name] = sum(values) / len(values)
    if ratios:
        out["moe_max_over_mean_load"] = max(ratios)
    if dropped:
        out["moe_dropped_tokens"] = sum(dropped)
    return out


def format_moe_metrics(metrics: Dict[str, float]) -> str:
    """The log line's MoE part: per-layer max/mean tokens per expert, dropped tokens."""
    loads = []
    keys = sorted((k for k in metrics if k.endswith("/max_tokens_per_expert")),
                  key=lambda k: int(k.split("/")[1][len("layer"):]))
    for key in keys:
        prefix = key[: -len("max_tokens_per_expert")]
        loads.append(f"{prefix.split('/')[1]} {metrics[key]:.1f}/{metrics[prefix + 'mean_tokens_per_expert']:.1f}")
    text = ""
    if loads:
        text += " tokens per expert max/mean: " + ", ".join(loads) + " |"
    if "moe_dropped_tokens" in metrics:
        text += f" dropped tokens: {metrics['moe_dropped_tokens']:.1f} |"
    return text
