"""The trainer: arguments, distributed initialization, model building, the training loop,
checkpointing and logging. Entry point: :func:`pretrain` (see ``pretrain_gpt.py``)."""

from megatron.training.training import pretrain, print_rank_0

__all__ = ["pretrain", "print_rank_0"]
