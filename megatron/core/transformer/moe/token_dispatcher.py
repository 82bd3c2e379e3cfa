"""Tokens to their experts and back: permute / unpermute, and the all-to-all dispatcher.

``permute`` lays the (token, expert) assignments of ``routing_map`` out expert-major, each
expert's tokens in token order; ``unpermute`` adds each row back to its token. Both are
exact (gathers and one scatter-add, no arithmetic beyond the sum of a token's k rows).

With expert parallelism of size P, EP rank r holds the global experts
``[r * L, (r + 1) * L)`` (L = E / P). ``MoEAlltoAllTokenDispatcher`` sends each rank the
rows of its experts (one ``all_to_all_single`` of the token counts, one of the rows and
one of their weights), regroups the received rows from (source rank, local expert) to
(local expert, source rank) order so that each local expert's rows are contiguous, and
undoes all of it in ``combine``. Megatron's ``allgather`` dispatcher gives the same
results; this project runs the all-to-all one for both.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist


def permute(tokens: torch.Tensor, routing_map: torch.Tensor,
            probs: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(permuted_tokens [N, H], permuted_probs [N] or None, sorted_indices [N]) for the N
    assignments of ``routing_map`` [T, E]; ``sorted_indices[i]`` is the token of row i."""
    num_tokens, num_experts = routing_map.shape
    expert_major = routing_map.t()
    token_ids = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, num_tokens)
    sorted_indices = token_ids.masked_select(expert_major)
    permuted_probs = probs.t().masked_select(expert_major) if probs is not None else None
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_tokens, H]: the sum of each token's rows (zero for a token with none)."""
    out = permuted_tokens.new_zeros((num_tokens,) + tuple(permuted_tokens.shape[1:]))
    return out.index_add(0, sorted_indices, permuted_tokens)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, tensor, output_splits: List[int], input_splits: List[int], group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = tensor.new_empty((sum(output_splits),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), input_splits, output_splits, ctx.group), None, None, None


def all_to_all(tensor: torch.Tensor, output_splits: List[int], input_splits: List[int], group) -> torch.Tensor:
    return _AllToAll.apply(tensor, output_splits, input_splits, group)


def sort_chunks_by_idxs(tensor: torch.Tensor, split_sizes: List[int], order: List[int]) -> torch.Tensor:
    """Cut ``tensor`` along dim 0 into chunks of ``split_sizes`` and concatenate them in ``order``."""
    chunks = torch.split(tensor, split_sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


class MoEAlltoAllTokenDispatcher:
    """``dispatch`` -> (rows for this rank's experts, grouped by local expert, their
    weights, tokens per local expert, handle); ``combine(output, handle)`` -> the experts'
    outputs back on their tokens. The handle carries what ``combine`` must undo, so the
    dispatcher keeps no state between calls (a recomputed forward is just another call).
    ``expert_parallel``: size, rank and group (``expert_parallel.py``)."""

    def __init__(self, num_experts: int, expert_parallel):
        self.num_experts = num_experts
        self.ep = expert_parallel
        self.num_local_experts = num_experts // expert_parallel.size

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """``hidden_states`` [T, H], ``probs`` and ``routing_map`` [T, E]."""
        tokens_per_expert = routing_map.sum(dim=0)  # [E], this rank's assignments
        permuted, permuted_probs, sorted_indices = permute(hidden_states, routing_map, probs)
        size, local = self.ep.size, self.num_local_experts
        state = {"sorted_indices": sorted_indices, "num_tokens": hidden_states.shape[0],
                 "tokens_per_expert": tokens_per_expert}
        if size == 1:
            return permuted, permuted_probs, tokens_per_expert.tolist(), state
        # received[s, l]: rows source rank s sends to local expert l of this rank.
        received = torch.empty_like(tokens_per_expert)
        dist.all_to_all_single(received, tokens_per_expert, group=self.ep.group)
        send_counts = tokens_per_expert.view(size, local)
        received = received.view(size, local)
        input_splits = send_counts.sum(dim=1).tolist()
        output_splits = received.sum(dim=1).tolist()
        rows = all_to_all(permuted, output_splits, input_splits, self.ep.group)
        row_probs = all_to_all(permuted_probs, output_splits, input_splits, self.ep.group)
        # (source, local expert) -> (local expert, source), so each expert's rows are contiguous.
        chunk_sizes = received.reshape(-1).tolist()
        by_expert = [s * local + l for l in range(local) for s in range(size)]
        rows = sort_chunks_by_idxs(rows, chunk_sizes, by_expert)
        row_probs = sort_chunks_by_idxs(row_probs, chunk_sizes, by_expert)
        state.update(input_splits=input_splits, output_splits=output_splits,
                     expert_chunk_sizes=received.t().reshape(-1).tolist(),
                     by_source=[l * size + s for s in range(size) for l in range(local)])
        return rows, row_probs, received.sum(dim=0).tolist(), state

    def combine(self, expert_output: torch.Tensor, state: dict) -> torch.Tensor:
        """The rows ``dispatch`` returned, processed, back as [T, H] (each token's k rows summed)."""
        if self.ep.size > 1:
            expert_output = sort_chunks_by_idxs(expert_output, state["expert_chunk_sizes"], state["by_source"])
            expert_output = all_to_all(expert_output, state["input_splits"], state["output_splits"], self.ep.group)
        return unpermute(expert_output, state["sorted_indices"], state["num_tokens"])
