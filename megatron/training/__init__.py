"""The trainer: arguments, distributed initialization, model building, the training loop,
checkpointing and logging. Entry point: :func:`pretrain` (see ``pretrain_gpt.py``); it
parses the command line before importing the training loop and the engine."""

from megatron.training.entry import pretrain
from megatron.training.log_utils import print_rank_0

__all__ = ["pretrain", "print_rank_0"]
