"""Autoregressive text generation for GPTModel (or anything with the same call signature).

``generate`` interacts with the model only through ``model(input_ids)`` -> logits
[b, s, vocab], so it works unchanged when the model is wrapped by the FSDP engine (whose
hooks run inside that call). There is no KV cache: every step re-runs the whole context,
which is simple and adequate for samples during training, not for serving.

Under pipeline parallelism each rank holds one stage: :class:`PipelinedModel` wraps it so
that ``model(input_ids)`` runs the stages in turn and hands every rank the last stage's
logits (the tokens, hence every decision, are then the same on every stage).
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron.core.distributed.ranks import all_ranks


@torch.no_grad()  # no_grad, not inference_mode: inference tensors could leak into engine buffers
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, top_k: Optional[int] = None,
             temperature: float = 1.0, eod: Optional[int] = None,
             generator: Optional[torch.Generator] = None, process_group=None) -> torch.Tensor:
    """Extend ``input_ids`` [b, s] by up to ``max_new_tokens`` tokens; returns [b, s + n].

    * Greedy (argmax) when ``top_k`` is None or 1; otherwise samples from the ``top_k``
      most likely tokens after dividing the logits by ``temperature``.
    * ``eod``: a sequence that has produced this token keeps producing it (padding), and
      generation stops early once every sequence has it.
    * The context fed to the model is cropped to the model's ``max_sequence_length`` when
      it has that attribute (sliding window).
    * ``process_group``: when the model is sharded across ranks, every rank must run the
      same number of forwards. Pass the group and the early-stop decision is agreed on with
      an all-reduce (stop only when all ranks are done); without it, give every rank the
      same prompt or no ``eod``.
    * The model is put in eval mode (no dropout) during generation and restored afterwards.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, sequence], got {tuple(input_ids.shape)}.")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be None (greedy) or a positive integer, got {top_k}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}; use top_k=None for greedy decoding.")

    max_context = getattr(model, "max_sequence_length", None)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        tokens = input_ids
        done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for _ in range(max_new_tokens):
            context = tokens if max_context is None else tokens[:, -max_context:]
            logits = model(context)[:, -1, :].float()
            if top_k is None or top_k == 1:
                next_token = logits.argmax(dim=-1)
            else:
                logits = logits / temperature
                top_values, top_indices = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
                probs = torch.softmax(top_values, dim=-1)
                choice = torch.multinomial(probs, num_samples=1, generator=generator)
                next_token = top_indices.gather(-1, choice).squeeze(-1)
            if eod is not None:
                next_token = torch.where(done, torch.full_like(next_token, eod), next_token)
                done = done | (next_token == eod)
            tokens = torch.cat([tokens, next_token.to(tokens.dtype).unsqueeze(-1)], dim=-1)
            if eod is not None and _all_done(done, process_group):
                break
        return tokens
    finally:
        if was_training and hasattr(model, "train"):
            model.train()


def _all_done(done: torch.Tensor, process_group) -> bool:
    finished = bool(done.all())
    # Stop only when every rank has finished.
    return all_ranks(finished, process_group) if process_group is not None else finished


class PipelinedModel:
    """This rank's pipeline stage of a GPT model (a chunk built with ``pre_process`` /
    ``post_process``), called like the whole model by :func:`generate`: ``model(tokens)``
    runs the stages in turn (each receives the previous stage's hidden states [b, s, h]
    and sends its own to the next) and returns, on every rank, the last position's logits
    [b, 1, vocab] of the last stage (broadcast over the pipeline group). Every rank holds
    the same tokens, so greedy and seeded sampling pick the same token everywhere.

    ``pp_group``: the pipeline's process group, stages in rank order (parallel_state's)."""

    def __init__(self, chunk, pp_group, hidden_size: int, vocab_size: int):
        self.chunk, self.group = chunk, pp_group
        self.ranks = dist.get_process_group_ranks(pp_group)
        self.stage = self.ranks.index(dist.get_rank())
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.max_sequence_length = getattr(chunk, "max_sequence_length", None)

    @property
    def training(self) -> bool:
        return self.chunk.training

    def eval(self):
        self.chunk.eval()
        return self

    def train(self, mode: bool = True):
        self.chunk.train(mode)
        return self

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        first, last = self.stage == 0, self.stage == len(self.ranks) - 1
        dtype = next(self.chunk.parameters()).dtype
        if not first:
            hidden = torch.empty(*tokens.shape, self.hidden_size, dtype=dtype, device=tokens.device)
            dist.recv(hidden, src=self.ranks[self.stage - 1], group=self.group)
            self.chunk.set_input_tensor(hidden)
        out = self.chunk(tokens)
        if not last:
            dist.send(out.contiguous(), dst=self.ranks[self.stage + 1], group=self.group)
            logits = torch.empty(tokens.shape[0], 1, self.vocab_size, dtype=torch.float32, device=tokens.device)
        else:
            logits = out[:, -1:, :].float().contiguous()
        dist.broadcast(logits, src=self.ranks[-1], group=self.group)
        return logits
