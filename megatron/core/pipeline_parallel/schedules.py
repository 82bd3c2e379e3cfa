"""Forward/backward schedules: no pipelining, 1F1B, and interleaved 1F1B (virtual stages).

Loss normalization: the gradient of a training step is the gradient of
``sum(per-token loss over the whole global batch) / (number of loss tokens in the global
batch)``, whatever the micro-batch size and the data-parallel size. To get that, the
schedule first reads all of this rank's microbatches, counts their loss tokens and
all-reduces the count over the data-parallel group; then every microbatch's loss *sum* is
scaled by ``dp_size / global_token_count`` before backward. The ``dp_size`` factor undoes
the averaging over data-parallel ranks that DDP and the MFSDP engine apply to gradients.
So 4 microbatches of 2 give the same gradient as 1 of 8, and so do 2 ranks x 4.
Under context parallelism the trainer passes the data- and context-parallel ranks as
``dp_group``: each CP rank counts and sums its own tokens, the engine averages over
dp x cp, so the factor is ``dp_size * cp_size / global_token_count``.

Pipelined schedules (``pipeline_order`` says which step a rank runs when): every stage
reads the same microbatches as the others of its data-parallel rank, so every stage
counts the same loss tokens and no count needs to travel from the last stage. Only the
last chunk computes the loss and reports it. Each chunk's backwards run inside
``microbatch(context, is_last=..., module=chunk)``: a chunk reduces its once-per-step
gradients on its own last microbatch, whatever other chunks of the same context do.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from megatron.core import parallel_state
from megatron.core.distributed.comm_device import comm_device
from megatron.core.distributed.ranks import world_size
from megatron.core.step_phases import phase_range

from .p2p_communication import ACTIVATION, GRADIENT, PipelineP2P


def get_forward_backward_func():
    """The schedule to use (Megatron API), from the parallel state: no pipelining, 1F1B,
    or 1F1B with interleaving when the pipeline has virtual stages."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining
    if parallel_state.get_parallel_state().vp_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


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
    if isinstance(model, FSDPModule):
        # PyTorch FSDP2: accumulate unsharded gradients locally; reduce-scatter once, in
        # the last microbatch's backward (every unit of the model, recursively).
        model.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()
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
    token_scale_hook: Optional[Callable[[float], None]] = None,
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
    and ``backward-compute`` (Megatron's level-2 timers). ``token_scale_hook(factor)``, when
    given, is called before the first forward of a step with backward with the factor
    every loss sum gets (``dp_size / global_token_count``), for losses that join the
    backward by other paths (multi-token prediction's, with per-token loss).

    Returns the ``report`` dicts of every microbatch, detached.
    """
    del seq_length, micro_batch_size
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}.")
    model = _single(model, "model")
    data_iterator = _single(data_iterator, "data_iterator")

    timers = timers or _no_timer
    batches, scale = _read_microbatches(data_iterator, num_microbatches, forward_only, dp_group,
                                        count_loss_tokens_func, timers)
    if token_scale_hook is not None and scale is not None:
        token_scale_hook(scale)
    reports: List[Dict[str, torch.Tensor]] = []
    for i, batch in enumerate(batches):
        with _microbatch_context(model, context, i, num_microbatches, forward_only):
            with timers("forward-compute", 2):
                with phase_range("forward"):
                    output_tensor, loss_func = forward_step_func(iter([batch]), model)
                with phase_range("loss"):
                    loss_for_backward, report = _loss_of(loss_func(output_tensor), scale, num_microbatches)
            if not forward_only:
                with timers("backward-compute", 2), phase_range("backward"):
                    loss_for_backward.backward()
        reports.append(report)
    return reports


def _read_microbatches(data_iterator, num_microbatches: int, forward_only: bool, dp_group, count_loss_tokens_func,
                       timers) -> Tuple[List[Any], Optional[float]]:
    """Every microbatch of the step, and the factor each microbatch's loss sum gets.

    All are read first: the global token count is needed before the first backward.
    Microbatches are small (token ids), so holding them is cheap."""
    with timers("batch-generator", 2), phase_range("data"):
        batches = [next(data_iterator) for _ in range(num_microbatches)]
    if forward_only:
        return batches, None
    local_tokens = sum(count_loss_tokens_func(b).to(torch.int64).reshape(()).cpu() for b in batches)
    dp_size = world_size(dp_group)
    global_tokens = local_tokens.clone()
    if dp_size > 1:
        global_tokens = global_tokens.to(comm_device(dp_group))
        dist.all_reduce(global_tokens, group=dp_group)
    # A global batch with no loss token contributes no gradient (not NaN).
    return batches, float(dp_size) / float(max(int(global_tokens.item()), 1))


def _loss_of(result, scale: Optional[float], num_microbatches: int):
    """``loss_func``'s result -> (the loss to differentiate, or None without a backward; the report, detached)."""
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
    return loss_for_backward, {k: (v.detach() if torch.is_tensor(v) else v) for k, v in report.items()}


def _no_timer(name: str, log_level: int):
    del name, log_level
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------
# Pipelined schedules
# ---------------------------------------------------------------------------------------

Step = Tuple[str, int, int]  # ("F" or "B", model chunk, microbatch)


def pipeline_order(num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 1,
                   group_size: Optional[int] = None, forward_only: bool = False) -> List[Step]:
    """The steps pipeline rank ``pp_rank`` runs, in order (Megatron's schedules).

    One chunk (1F1B): ``p - rank - 1`` warmup forwards, then one forward and one backward
    at a time, then the remaining backwards. Several chunks (interleaved): microbatches go
    through the chunks in groups of ``group_size`` (default ``p``): the forwards of a
    group on chunk 0, then on chunk 1, ...; the backwards in the same table with the
    chunks reversed; ``2 (p - rank - 1) + (v - 1) group_size`` warmup forwards. Raises
    ValueError for a group size the interleaved schedule cannot run without stalls."""
    m, p, v = int(num_microbatches), int(pp_size), int(num_chunks)
    if m < 1:
        raise ValueError(f"num_microbatches must be at least 1, got {m}.")
    if v == 1:
        table = [(i, 0) for i in range(m)]
        warmup = p - pp_rank - 1
    else:
        n = p if group_size is None else int(group_size)
        if not p <= n <= m:
            raise ValueError(
                f"the interleaved schedule runs groups of {n} microbatches per virtual stage, which must lie in "
                f"[pipeline size {p}, microbatches {m}]: use at least {p} microbatches per step (raise "
                "--global-batch-size) or --microbatch-group-size-per-virtual-pipeline-stage within that range."
            )
        if 0 < m % n < p:
            raise ValueError(
                f"{m} microbatches leave a last group of {m % n} < pipeline size {p} per virtual stage, which "
                f"stalls the interleaved schedule; use a number of microbatches that is a multiple of {n} "
                f"(or leaves at least {p} over)."
            )
        table = []
        for start in range(0, m, n):
            end = min(start + n, m)
            table += [(i, c) for c in range(v) for i in range(start, end)]
        warmup = 2 * (p - pp_rank - 1) + (v - 1) * n
    forwards = [("F", c, i) for i, c in table]
    if forward_only:
        return forwards
    backwards = [("B", v - 1 - c, i) for i, c in table]
    total = len(forwards)
    warmup = min(warmup, total)
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


def forward_backward_pipelining_without_interleaving(forward_step_func: Callable, data_iterator, model,
                                                     num_microbatches: int, context: Any = None, **kwargs):
    """1F1B over this rank's one pipeline stage (Megatron's API); the arguments are those of
    :func:`forward_backward_no_pipelining`. Returns the reports of the last stage's
    microbatches ([] on the other stages)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 1:
        raise ValueError(f"1F1B runs one model chunk per rank, got {len(chunks)}; use "
                         "forward_backward_pipelining_with_interleaving for virtual stages.")
    return _forward_backward_pipelined(forward_step_func, data_iterator, chunks, num_microbatches, context, **kwargs)


def forward_backward_pipelining_with_interleaving(forward_step_func: Callable, data_iterator, model,
                                                  num_microbatches: int, context: Any = None, **kwargs):
    """Interleaved 1F1B over this rank's model chunks (virtual stages), in Megatron's
    order; ``microbatch_group_size`` sets the group size (default: the pipeline size)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    return _forward_backward_pipelined(forward_step_func, data_iterator, chunks, num_microbatches, context, **kwargs)


def _unwrap_chunk(chunk):
    return chunk.module if _is_ddp(chunk) else chunk


def _forward_backward_pipelined(
    forward_step_func: Callable,
    data_iterator,
    chunks: List[torch.nn.Module],
    num_microbatches: int,
    context: Any = None,
    *,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    forward_only: bool = False,
    dp_group: Optional[dist.ProcessGroup] = None,
    count_loss_tokens_func: Callable = count_loss_tokens,
    timers: Optional[Callable] = None,
    microbatch_group_size: Optional[int] = None,
    p2p=None,
    token_scale_hook: Optional[Callable[[float], None]] = None,
) -> List[Dict[str, torch.Tensor]]:

    state = parallel_state.get_parallel_state()
    p, r, v, m = state.pp_size, state.pp_rank, len(chunks), num_microbatches
    if any(_is_ddp(chunk) for chunk in chunks):
        # DDP's reducer would fire on the first backward after the last microbatch's
        # forward, whichever microbatch that backward belongs to; the trainer averages
        # gradients over data-parallel ranks after the schedule instead.
        raise ValueError("pipeline schedules take plain model chunks, not DDP-wrapped ones; average the gradients "
                         "over data-parallel ranks after the schedule (the trainer does), or use MFSDP.")
    config = _unwrap_chunk(chunks[0]).config
    if p2p is None:
        if seq_length is None or micro_batch_size is None:
            raise ValueError("pipelined schedules need seq_length and micro_batch_size (the shape of the hidden "
                             "states that stages exchange).")
        # The CP split comes first (each rank's 2 chunks), then SP cuts the local sequence over TP.
        sequence = seq_length // getattr(config, "context_parallel_size", 1)
        sequence //= config.tensor_model_parallel_size if config.sequence_parallel else 1
        p2p = PipelineP2P(state.pp_group, state.pp_grad_group, (micro_batch_size, sequence, config.hidden_size),
                          config.params_dtype, comm_device(state.pp_group))
    if isinstance(data_iterator, (list, tuple)):
        data_iterator = data_iterator[0]  # every chunk reads the same microbatches
    timers = timers or _no_timer
    batches, scale = _read_microbatches(data_iterator, m, forward_only, dp_group, count_loss_tokens_func, timers)
    if token_scale_hook is not None and scale is not None:
        token_scale_hook(scale)
    order = pipeline_order(m, p, r, v, microbatch_group_size, forward_only)

    def first(c):
        return r == 0 and c == 0

    def last(c):
        return r == p - 1 and c == v - 1

    # The receive each step needs, to post the next one while the current step computes.
    needs = [ACTIVATION if kind == "F" and not first(c) else GRADIENT if kind == "B" and not last(c) else None
             for kind, c, _ in order]
    inputs: Dict[Tuple[int, int], Optional[torch.Tensor]] = {}
    outputs: Dict[Tuple[int, int], torch.Tensor] = {}
    reports: List[Dict[str, torch.Tensor]] = []
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_mode:
        for k, (kind, c, i) in enumerate(order):
            received = p2p.recv(needs[k]) if needs[k] is not None else None
            if needs[k] is not None and not p2p.posted(needs[k]):
                later = next((j for j in range(k + 1, len(order)) if needs[j] == needs[k]), None)
                if later is not None:
                    p2p.post_recv(needs[k])  # overlaps with this step's compute
            chunk = chunks[c]
            if kind == "F":
                if received is not None:
                    received.requires_grad_(not forward_only)
                    _unwrap_chunk(chunk).set_input_tensor(received)
                with timers("forward-compute", 2):
                    output, loss_func = forward_step_func(iter([batches[i]]), chunk)
                    if last(c):
                        output, report = _loss_of(loss_func(output), scale, m)
                        reports.append(report)
                if not last(c):
                    p2p.send(ACTIVATION, output)
                if not forward_only:
                    inputs[(c, i)], outputs[(c, i)] = received, output
                continue
            output, input_tensor = outputs.pop((c, i)), inputs.pop((c, i))
            sync = (microbatch(context, is_last=i == m - 1, module=chunk) if context is not None
                    else contextlib.nullcontext())
            with sync, timers("backward-compute", 2):
                if received is None:
                    output.backward()
                else:
                    torch.autograd.backward(output, grad_tensors=received.to(output.dtype))
            if input_tensor is not None:
                if input_tensor.grad is None:
                    raise RuntimeError(f"model chunk {c}'s output does not depend on its input hidden states; "
                                       "a pipeline chunk must pass them on.")
                p2p.send(GRADIENT, input_tensor.grad)
    p2p.finish()
    return reports


def microbatch(context, is_last: bool, module):
    # Imported lazily: the schedule must not need the engine when it is not used.
    from megatron.core.distributed.mfsdp_v2 import microbatch as engine_microbatch

    return engine_microbatch(context, is_last=is_last, module=module)
