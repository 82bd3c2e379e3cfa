"""Cross-entropy over vocabulary-parallel logits, without gathering them.

Rank r holds the logits of vocabulary ids ``[r * V/tp, (r + 1) * V/tp)``. Three
all-reduces over TP of ``[b, s]`` tensors (the max, the target's logit, the sum of
exponentials) give every rank the exact loss of every token; no rank ever holds more
than its ``[b, s, V/tp]`` logits. The backward is local: ``softmax - one_hot`` on the
rank's own columns. Megatron-LM's ``vocab_parallel_cross_entropy``, for ``[b, s, V/tp]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits = logits.float()
        # The max over the whole vocabulary keeps exp() finite.
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        local_vocab = logits.shape[-1]
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        own = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -own.unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: Optional[dist.ProcessGroup], vocab_start: int) -> torch.Tensor:
    """Per-token loss [b, s] (fp32) of local logits [b, s, V/tp] whose first column is
    vocabulary id ``vocab_start``; ``target`` holds global ids. At TP size 1 it is
    ``F.cross_entropy(logits.float(), target, reduction="none")``."""
    if group is None or dist.get_world_size(group) == 1:
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), target.reshape(-1).long(),
                                                 reduction="none")
        return loss.view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target.long(), group, vocab_start)
