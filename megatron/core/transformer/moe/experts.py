"""This rank's experts: SwiGLU or plain MLPs of ``moe_ffn_hidden_size``, weights stacked.

Each of ``linear_fc1`` / ``linear_fc2`` is an ``ExpertLinear`` whose ``weight`` stacks its
L local experts along dim 0: ``[L * out_features, in_features]``, expert j's rows being
``[j * out, (j + 1) * out)`` (``bias`` likewise ``[L * out]``). The global tensor stacks all
E experts the same way, so this rank's weight is one contiguous row range of it (its
``global_slices``, ``megatron/core/global_slices.py``): the invariant initializer draws the
global tensor, and the names do not depend on the EP size. With a gated unit, expert j's
``linear_fc1`` rows are ``[gate; up]`` as in the dense MLP, which is also Hugging Face
Mixtral's ``gate_up_proj[j]``; ``linear_fc2`` is its ``down_proj[j]``.

We chose stacked weights over one module per expert named by its global index because a
stacked weight is what a grouped GEMM takes (a view ``[L, out, in]``, no copy), and 2-D
storage lets MFSDP cut shards at any row rather than at whole experts.

Under tensor parallelism (the expert tensor-parallel size is the TP size, Megatron's
default) each expert is split like the dense MLP: ``linear_fc1`` column-parallel (each
expert's gate and up blocks split on their own, so a rank's gate and up rows match) and
``linear_fc2`` row-parallel. The global tensor is unchanged; ``global_slices`` cuts this
rank's experts, then (``inner``) its TP rows or columns of them. The layer computes a
partial output (fc2's bias added on TP rank 0 only); ``MoELayer`` sums it over TP.

With ``--expert-tensor-parallel-size`` apart from the TP size the same split runs over
the expert mesh's ``tp`` axis (``expert_parallel.tp_group``) instead of the TP group.
Its linears then say ``expert_tensor_parallel_split`` instead of ``tensor_parallel_split``
and ``tensor_parallel_apart``: the dense TP machinery (``finalize_grads``, the norms'
TP pieces) leaves them alone, since their ranks are not the TP group's. ``MoELayer``
hands the experts the same rows on every rank of the expert TP group, so fc2's bias
gradient is summed over that group by the copy into it (no sequence parallelism here).

The rows of each expert's tokens are contiguous (``tokens_per_expert``); with
``moe_grouped_gemm`` one ``torch.nn.functional.grouped_mm`` per linear runs them all, else
a loop of ``F.linear``. The router weight of each row multiplies the activation before
``linear_fc2``, and its bias, as in Megatron (so the output is weight * expert(x)).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron.core.global_slices import partition
from megatron.core.tensor_parallel.layers import divide, tp_rank_and_size
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from ..layers import normal_weight_zero_bias_, output_init_std
from ..recompute import recompute_saved, recomputes
from ..swiglu import gated_linear_unit


class ExpertLinear(nn.Module):
    """L stacked linears ``weight`` [L * out, in], ``bias`` [L * out]; rows of global experts
    ``first_expert ... first_expert + L - 1`` of ``num_experts``. With ``tp_split``
    ("column" or "row") and a TP group of size T, each expert's weight is this rank's
    piece of it: [out / T, in] (``blocks`` row blocks per expert, each split on its own)
    or [out, in / T]."""

    def __init__(self, num_local_experts: int, in_features: int, out_features: int, bias: bool, init_std: float,
                 num_experts: int, ep_rank: int, ep_size: int, dtype: torch.dtype, grouped_gemm: bool,
                 tp_split: Optional[str] = None, tp_group=None, sequence_parallel: bool = False, blocks: int = 1,
                 tensor_parallel_apart: bool = False):
        super().__init__()
        self.tensor_parallel_apart = tensor_parallel_apart
        self.num_local_experts = num_local_experts
        self.in_features = in_features
        self.out_features = out_features
        self.init_std = init_std
        self.grouped_gemm = grouped_gemm
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.tp_rank, tp_size = tp_rank_and_size(tp_group)
        self.tp_split = tp_split if tp_size > 1 else None
        L = num_local_experts
        self.global_slices = {"weight": partition((num_experts * out_features, in_features), 0, ep_rank, ep_size)}
        if bias:
            self.global_slices["bias"] = partition((num_experts * out_features,), 0, ep_rank, ep_size)
        if self.tp_split == "column":  # each expert's (block's) rows split over TP
            divide(out_features, tp_size * blocks, "an expert's linear_fc1 output size")
            for name, ep_piece in self.global_slices.items():
                self.global_slices[name] = dataclasses.replace(
                    ep_piece, inner=partition(ep_piece.outer_shape, 0, self.tp_rank, tp_size, blocks=L * blocks))
        elif self.tp_split == "row":  # each expert's columns split; the bias stays whole
            divide(in_features, tp_size, "an expert's linear_fc2 input size")
            ep_piece = self.global_slices["weight"]
            self.global_slices["weight"] = dataclasses.replace(
                ep_piece, inner=partition(ep_piece.outer_shape, 1, self.tp_rank, tp_size))
        local_out, local_in = self.global_slices["weight"].local_shape
        self.local_out, self.local_in = local_out // L, local_in
        self.weight = nn.Parameter(torch.empty(local_out, local_in, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.global_slices["bias"].local_shape, dtype=dtype)) if bias else None
        self.reset_parameters()

    @property
    def tensor_parallel_split(self):
        """The parameters split over TP (read by ``tensor_parallel.tensor_parallel_parameters``)."""
        return () if self.tensor_parallel_apart else self._split_names()

    @property
    def expert_tensor_parallel_split(self):
        """The parameters split over an expert TP group that is not the TP group."""
        return self._split_names() if self.tensor_parallel_apart else ()

    def _split_names(self):
        return tuple(name for name, piece in self.global_slices.items() if piece.inner is not None)

    def reset_parameters(self) -> None:
        normal_weight_zero_bias_(self)

    def forward(self, x: torch.Tensor, tokens_per_expert: List[int],
                row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x`` [N, in] grouped by local expert -> [N, out]. ``row_scale`` [N, 1] multiplies
        the bias only (the caller has scaled the input)."""
        weights = self.weight.view(self.num_local_experts, self.local_out, self.local_in)
        if self.grouped_gemm:
            offsets = torch.tensor(tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
            out = F.grouped_mm(x, weights.transpose(-2, -1), offs=offsets)
        else:
            pieces = torch.split(x, tokens_per_expert, dim=0)
            out = torch.cat([F.linear(piece, weights[j]) for j, piece in enumerate(pieces)], dim=0)
        if self.bias is not None:
            counts = torch.tensor(tokens_per_expert, device=x.device)
            bias = self._bias_of_partial_output().view(self.num_local_experts, -1).repeat_interleave(counts, dim=0)
            out = out + (bias if row_scale is None else bias * row_scale)
        return out

    def _bias_of_partial_output(self) -> torch.Tensor:
        """A row-parallel output is summed over TP afterwards, so TP rank 0 alone adds the
        bias. Without sequence parallelism the bias's gradient is then summed over TP by
        the copy (the trainer expects TP-replicated gradients whole on every rank); with
        it, ``finalize_grads`` sums every TP-replicated gradient anyway."""
        if self.tp_split != "row":
            return self.bias
        bias = self.bias if self.sequence_parallel else copy_to_tensor_model_parallel_region(self.bias, self.tp_group)
        return bias * (1.0 if self.tp_rank == 0 else 0.0)

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}, in={self.in_features}, out={self.out_features}, "
                f"bias={self.bias is not None}, grouped_gemm={self.grouped_gemm}, tp_split={self.tp_split}")


class GroupedMLP(nn.Module):
    """``linear_fc1`` -> activation (gated: act(gate) * up) -> x router weight -> ``linear_fc2``
    (under TP: this rank's partial output, see the module docstring)."""

    def __init__(self, config, expert_parallel):
        super().__init__()
        self.config = config
        experts = config.num_moe_experts
        self.num_local_experts = experts // expert_parallel.size
        self.gated = config.gated_linear_unit
        self.activation = config.activation
        ffn = config.moe_ffn_hidden_size
        if getattr(expert_parallel, "tensor_parallel_apart", False):
            tensor_parallel = dict(tp_group=expert_parallel.tp_group, sequence_parallel=False,
                                   tensor_parallel_apart=True)
        else:
            tensor_parallel = dict(tp_group=config.tp_group if config.tensor_model_parallel_size > 1 else None,
                                   sequence_parallel=config.sequence_parallel)
        common = dict(num_experts=experts, ep_rank=expert_parallel.rank, ep_size=expert_parallel.size,
                      dtype=config.params_dtype, grouped_gemm=config.moe_grouped_gemm, bias=config.add_bias_linear,
                      **tensor_parallel)
        self.linear_fc1 = ExpertLinear(self.num_local_experts, config.hidden_size, ffn * (2 if self.gated else 1),
                                       init_std=config.hidden_init_std, tp_split="column",
                                       blocks=2 if self.gated else 1, **common)
        self.linear_fc2 = ExpertLinear(self.num_local_experts, ffn, config.hidden_size,
                                       init_std=output_init_std(config), tp_split="row", **common)
        self.recompute_activation = recomputes(config, "moe_act")

    def forward(self, permuted_tokens: torch.Tensor, tokens_per_expert: List[int],
                permuted_probs: torch.Tensor) -> torch.Tensor:
        intermediate = self.linear_fc1(permuted_tokens, tokens_per_expert)
        weight = permuted_probs.unsqueeze(-1).to(intermediate.dtype)
        if self.recompute_activation and self.training and torch.is_grad_enabled():
            # "moe_act" (recompute.py): the activation keeps only its inputs, and linear_fc2
            # keeps a recipe for its input instead of the [rows, ffn] tensor.
            scaled = checkpoint(self._activation_times_probs, intermediate, weight, use_reentrant=False)
            with recompute_saved(scaled, lambda: self._activation_times_probs(intermediate, weight)):
                return self.linear_fc2(scaled, tokens_per_expert, row_scale=weight)
        return self.linear_fc2(self._activation_times_probs(intermediate, weight), tokens_per_expert,
                               row_scale=weight)

    def _activation_times_probs(self, intermediate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.gated:
            intermediate = gated_linear_unit(self.config, intermediate)
        else:
            intermediate = self.activation(intermediate)
        return intermediate * weight
