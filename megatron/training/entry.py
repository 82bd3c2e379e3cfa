"""The trainer's entry point: parse the command line, then train.

The command line is parsed before the training loop, the engine and their dependencies
(DTensor, checkpointing) are imported, so a mistyped flag or a missing file named on the
command line is reported in about the time Python and torch take to start.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, Optional

from megatron.training.arguments import apply_max_train_iters, parse_args
from megatron.training.recipe_arguments import setup_logging
from megatron.training.user_errors import UserError, report_user_error


def pretrain(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    forward_step_func: Callable,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[dict] = None,
    argv=None,
) -> Dict[str, float]:
    """Train a model end to end. Returns the last logged metrics (for tests and tools).

    * ``model_provider(args) -> nn.Module`` builds the unwrapped GPTModel;
    * ``train_valid_test_datasets_provider(args, tokenizer, [n_train, n_valid, n_test])``
      returns three map-style datasets (or None) of dicts with ``tokens``, ``labels``,
      ``loss_mask``, ``position_ids``;
    * ``forward_step_func(data_iterator, model) -> (output_tensor, loss_func)``, where
      ``loss_func(output_tensor) -> (loss_sum, num_tokens, {"lm loss": [sum, count]})``.
    """
    start_time = time.time()
    try:
        args = parse_args(argv, extra_args_provider=extra_args_provider, args_defaults=args_defaults)
        apply_max_train_iters(args, os.environ)  # documented runs, shortened by the doc-test stage
    except ValueError as e:
        report_user_error(str(e), 2, e)
    setup_logging(args, os.environ)  # --logging-level / MEGATRON_LOGGING_LEVEL, before anything logs
    from megatron.training.training import run_pretraining  # the heavy part

    try:
        return run_pretraining(args, start_time, train_valid_test_datasets_provider, model_provider, forward_step_func)
    except UserError as e:
        report_user_error(str(e), 1, e)
