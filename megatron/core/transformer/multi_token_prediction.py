"""Multi-token prediction (DeepSeek-V3; Megatron-LM's ``--mtp-num-layers``,
``--mtp-loss-scaling-factor``, its module names).

Depth k = 1..D predicts token i + k + 1 at position i. With h^0 the decoder's output (after
its final norm, as upstream) and the input ids, position ids, labels and loss mask rolled
left by k (the vacated last k positions zero, so masked)::

    h^k = final_layernorm(mtp_model_layer(eh_proj(cat(enorm(embedding(ids_k)), hnorm(h^{k-1})))))
    L^k = sum(mask_k * CE(output_layer(h^k), labels_k)) / sum(mask_k)

The embedding and the output layer are the model's own (shared, so tied or untied, and
vocab-parallel under TP, as the main head). ``mtp_model_layer`` is a transformer layer of
the last decoder layer's kind (MoE or dense) using the main sequence's rotary tables.
The losses ``scaling_factor / D * L^k`` join the backward through the main hidden states
(``MoEAuxLossAutoScaler``, the router losses' mechanism) with the factor the trainer sets
per step (``set_mtp_loss_backward_scale``: 1/num_microbatches times the fp16 loss scale),
so they are per micro-batch per rank like upstream's.

With ``calculate_per_token_loss`` (upstream's semantics) the language-model loss is a sum
over tokens that the schedule divides by the global batch's token count; a depth's term
is then ``scaling_factor / D * sum(mask_k * CE_k) * N / N_k`` (N the micro-batch's loss
tokens, N_k those left after k rolls: each depth weighs as much as the main loss per
token), and the backward factor is the one the loss sums get (the trainer passes the
schedule's ``dp / global tokens`` times the fp16 loss scale).

Each depth's L^k (the masked mean, in both modes) is recorded for the log line
(``collect_mtp_metrics``: ``mtp_{k} loss``, the mean over the ranks that run MTP and
the interval's forwards). Evaluation computes no MTP loss (it would not change the
language-model loss).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .layers import build_linear
from .moe.config import is_moe_layer
from .moe.router import MoEAuxLossAutoScaler
from .norms import build_norm
from .transformer_layer import TransformerLayer


def roll_left(tensor: torch.Tensor) -> torch.Tensor:
    """[b, s] -> position i holds position i + 1's value; the last is 0 (upstream's roll_tensor)."""
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    rolled[..., -1] = 0
    return rolled


class MultiTokenPredictionLayer(nn.Module):
    def __init__(self, config, depth: int, expert_parallel=None):
        super().__init__()
        h = config.hidden_size
        self.enorm = build_norm(config, h)
        self.hnorm = build_norm(config, h)
        # Replicated over TP (upstream splits its columns and gathers the output: same numbers).
        self.eh_proj = build_linear(config, 2 * h, h, bias=False, init_std=config.hidden_init_std)
        self.mtp_model_layer = TransformerLayer(config, layer_number=config.num_layers + depth,
                                                expert_parallel=expert_parallel,
                                                moe=is_moe_layer(config, config.num_layers))
        self.final_layernorm = build_norm(config, h)

    def forward(self, hidden_states, embeddings, attention_mask=None, rotary_pos_emb=None):
        # Upstream's order: the embedding first.
        mixed = self.eh_proj(torch.cat((self.enorm(embeddings), self.hnorm(hidden_states)), dim=-1))
        return self.final_layernorm(self.mtp_model_layer(mixed, attention_mask, rotary_pos_emb))


class MultiTokenPredictionBlock(nn.Module):
    def __init__(self, config, expert_parallel=None):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MultiTokenPredictionLayer(config, k + 1, expert_parallel)
                                    for k in range(config.mtp_num_layers))
        self.loss_backward_scale = 1.0  # set by the trainer each step (set_mtp_loss_backward_scale)
        self.reset_metrics()

    def reset_metrics(self) -> None:
        self.loss_sums = torch.zeros(len(self.layers), dtype=torch.float64)
        self.records = 0

    def attach_losses(self, main_hidden, input_ids, position_ids, labels, loss_mask, embedding, loss_of_hidden,
                      attention_mask=None, rotary_pos_emb=None):
        """Runs the depths; returns ``main_hidden`` carrying their scaled losses for backward."""
        scale = self.config.mtp_loss_scaling_factor / len(self.layers)
        hidden, ids, positions = main_hidden, input_ids, position_ids
        labels = labels.clone()
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        tokens = mask.sum()  # before the rolls: the count the main loss is normalized with
        losses = []
        for layer in self.layers:
            ids, positions = roll_left(ids), roll_left(positions)
            labels, mask = roll_left(labels), roll_left(mask)
            hidden = layer(hidden, embedding(ids, positions), attention_mask, rotary_pos_emb)
            loss_sum = (loss_of_hidden(hidden, labels) * mask).sum()
            depth_tokens = mask.sum().clamp(min=1)
            losses.append((loss_sum / depth_tokens).detach())
            if self.config.calculate_per_token_loss:
                term = scale * loss_sum * (tokens / depth_tokens)  # a sum, weighted as the main loss's tokens
            else:
                term = scale * loss_sum / depth_tokens
            main_hidden = MoEAuxLossAutoScaler.apply(main_hidden, term, self.loss_backward_scale)
        self.loss_sums += torch.stack(losses).to("cpu", torch.float64)
        self.records += 1
        return main_hidden


def mtp_blocks(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, MultiTokenPredictionBlock)]


def set_mtp_loss_backward_scale(model: nn.Module, scale: float) -> None:
    """The factor the MTP losses' gradients get in the next backward passes (the one each
    micro-batch's language-model loss gets); the trainer sets it every step (with
    ``calculate_per_token_loss``, once the schedule has counted the step's tokens)."""
    for block in mtp_blocks(model):
        block.loss_backward_scale = float(scale)


def mtp_token_scale_hook(model: nn.Module, loss_scale: float = 1.0):
    """The schedules' ``token_scale_hook`` with ``calculate_per_token_loss``: the MTP sums'
    backward factor becomes the loss sums' (``dp / global tokens``) times ``loss_scale``
    (the fp16 loss scale)."""
    return lambda factor: set_mtp_loss_backward_scale(model, loss_scale * factor)


def collect_mtp_metrics(model: nn.Module, device: torch.device = torch.device("cpu"), group=None,
                        depths: Optional[int] = None) -> Dict[str, float]:
    """``{"mtp_1 loss": ..., ...}``: each depth's loss, the mean over the forwards recorded
    since the last call and over the ranks of ``group`` that run MTP (None: the default
    group; every rank of it calls this, so under pipeline parallelism the stages without
    MTP pass ``depths``, the number of depths, and add nothing), then reset. ``{}``
    without MTP or records."""
    blocks = mtp_blocks(model)
    if blocks:
        block = blocks[0]
        row = torch.cat([block.loss_sums, torch.tensor([float(block.records)], dtype=torch.float64)])
        block.reset_metrics()
    elif depths:
        row = torch.zeros(depths + 1, dtype=torch.float64)
    else:
        return {}
    row = row.to(device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(row, group=group)
    row = row.cpu()
    if row[-1] == 0:
        return {}
    return {f"mtp_{k + 1} loss": float(row[k] / row[-1]) for k in range(len(row) - 1)}
