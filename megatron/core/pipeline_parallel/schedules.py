"""Forward/backward schedules. Only the no-pipelining schedule exists (no PP in this project).

Loss normalization: the gradient of a training step is the gradient of
``sum(per-token loss over the whole global batch) / (number of loss tokens in the global
batch)``, whatever the micro-batch size and the data-parallel size. To get that, the
schedule first reads all of this rank's microbatches, counts their loss tokens and
all-reduces the count over the data-parallel group; then every microbatch's loss *sum* is
scaled by ``dp_size / global_token_count`` before backward. The ``dp_size`` factor undoes
the averaging over data-parallel ranks that DDP and the MFSDP engine apply to gradients.
So 4 microbatches of 2 give the same gradient as 1 of 8, and so do 2 ranks x 4.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist


def get_forward_backward_func():
    """The schedule to use (Megatron API). Without pipeline parallelism it is always
    :func:`forward_backward_no_pipelining`."""
    return forward_backward_no_pipelining


def count_loss_tokens(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Default token counter: the number of positions with a non-zero ``loss_mask``."""
    if not isinstance(batch, dict) or "loss_mask" not in batch:
        raise ValueError(
            "the data iterator must yield dicts with a 'loss_mask' entry for per-token loss "
            "normalization; pass count_loss_tokens_func= to count tokens another way."
        )
    return (batch["loss_mask"] != 0).sum()


def _single(obj, what: str):
    # Megatron passes model and data_iterator as lists of one chunk per virtual stage.
    if isinstance(obj, (list, tuple)):
        if len(obj) != 1:
            raise ValueError(
                f"{what} is a list of {len(obj)} chunks, but the no-pipelining schedule takes "
                "exactly one; interleaved pipelining is not supported."
            )
        return obj[0]
    return obj


def _is_ddp(model) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def _microbatch_context(model, context, index: int, num_microbatches: int, forward_only: bool):
    is_last = index == num_microbatches - 1
    if forward_only:
        return torch.no_grad()
    if context is not None:
        # Imported lazily: the schedule must not need the engine when it is not used.
        from megatron.core.distributed.mfsdp_v2 import microbatch

        return microbatch(context, is_last=is_last)
    if _is_ddp(model) and not is_last:
        # Accumulate locally; DDP all-reduces once, in the last microbatch's backward.
        return model.no_sync()
    return contextlib.nullcontext()


def forward_backward_no_pipelining(
    forward_step_func: Callable,
    data_iterator: Iterator,
    model: torch.nn.Module,
    num_microbatches: int,
    context: Any = None,
    *,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    forward_only: bool = False,
    dp_group: Optional[dist.ProcessGroup] = None,
    count_loss_tokens_func: Callable = count_loss_tokens,
    timers: Optional[Callable] = None,
) -> List[Dict[str, torch.Tensor]]:
    """Run ``num_microbatches`` forward (and backward, unless ``forward_only``) passes.

    ``forward_step_func(data_iterator, model)`` returns ``(output_tensor, loss_func)``;
    ``loss_func(output_tensor)`` returns either ``(loss_sum, num_tokens, report)`` (per-token
    losses summed over the microbatch: normalized here over the global batch) or
    ``(loss, report)`` (a loss already averaged over the microbatch: divided by
    ``num_microbatches``). ``context`` is the MFSDP ``FsdpContext``; each microbatch then
    runs inside ``microbatch(context, is_last=...)``. With DDP (no context) all but the
    last microbatch run under ``model.no_sync()``. ``seq_length`` and ``micro_batch_size``
    are accepted for Megatron compatibility and unused. ``timers(name, log_level)``, when
    given, is a context manager factory that times ``batch-generator``, ``forward-compute``
    and ``backward-compute`` (Megatron's level-2 timers).

    Returns the ``report`` dicts of every microbatch, detached.
    """
    del seq_length, micro_batch_size
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}.")
    model = _single(model, "model")
    data_iterator = _single(data_iterator, "data_iterator")

    # Read every microbatch first: the global token count is needed before the first
    # backward. Microbatches are small (token ids), so holding them is cheap.
    timers = timers or _no_timer
    with timers("batch-generator", 2):
        batches = [next(data_iterator) for _ in range(num_microbatches)]
    scale = None
    if not forward_only:
        local_tokens = sum(count_loss_tokens_func(b).to(torch.int64).reshape(()).cpu() for b in batches)
        dp_size = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        global_tokens = local_tokens.clone()
        if dp_size > 1:
            comm_device = _comm_device(dp_group)
            global_tokens = global_tokens.to(comm_device)
            dist.all_reduce(global_tokens, group=dp_group)
        # A global batch with no loss token contributes no gradient (not NaN).
        scale = float(dp_size) / float(max(int(global_tokens.item()), 1))

    reports: List[Dict[str, torch.Tensor]] = []
    for i, batch in enumerate(batches):
        with _microbatch_context(model, context, i, num_microbatches, forward_only):
            with timers("forward-compute", 2):
                output_tensor, loss_func = forward_step_func(iter([batch]), model)
                result = loss_func(output_tensor)
            if len(result) == 3:
                loss, _num_tokens, report = result
                loss_for_backward = loss * scale if scale is not None else None
            elif len(result) == 2:
                loss, report = result
                loss_for_backward = loss / num_microbatches if scale is not None else None
            else:
                raise ValueError(
                    "loss_func must return (loss_sum, num_tokens, report) or (loss, report), "
                    f"got a tuple of {len(result)}."
                )
            if not forward_only:
                with timers("backward-compute", 2):
                    loss_for_backward.backward()
        reports.append({k: (v.detach() if torch.is_tensor(v) else v) for k, v in report.items()})
    return reports


def _no_timer(name: str, log_level: int):
    del name, log_level
    return contextlib.nullcontext()


def _comm_device(group) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
