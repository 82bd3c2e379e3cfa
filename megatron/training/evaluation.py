"""Evaluation during and after training: ``--eval-iters`` forward-only passes over a
dataset from its start (so every evaluation of a split reads the same samples), the mean
loss over every rank, its perplexity and bits per character, Megatron's validation box."""

from __future__ import annotations

import gc
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.training.data import DeviceIterator, build_pretraining_data_loader
from megatron.training.log_utils import format_validation_box, perplexity, print_rank_0
from megatron.training.loss_reports import mean_loss, reduce_reports
from megatron.training.model_builder import reshard_torch_fsdp2
from megatron.training.text_metrics import bits_per_character, characters_and_tokens


class Evaluator:
    def __init__(self, args, built, forward_backward, forward_step_func, device, writer, autocast):
        self.args = args
        self.built = built
        self.forward_backward = forward_backward  # the schedule the training steps use
        self.forward_step_func = forward_step_func  # the user's, without the training loss scaling
        self.device = device
        self.writer = writer
        self.autocast = autocast  # a callable returning the training steps' autocast context
        self.tokenizer = None  # for bits per character
        self.last_eval_iteration: Optional[int] = None  # of the validation split
        self._text_sizes = {}

    def evaluate(self, dataset) -> float:
        """The mean per-token loss of ``--eval-iters`` batches of ``dataset``."""
        args = self.args
        parallel = parallel_state.get_parallel_state()
        loader = build_pretraining_data_loader(
            dataset, 0, args.micro_batch_size, parallel.dp_rank, parallel.dp_size, 0,
            pin_memory=self.device.type == "cuda",
        )
        data_iter = DeviceIterator(loader, self.device, parallel.cp_size, parallel.cp_rank)
        self.built.unwrapped.eval()
        total = None
        try:
            with torch.no_grad(), self.autocast():
                for _ in range(args.eval_iters):
                    reports = self.forward_backward(
                        self.forward_step_func, data_iter, self.built.model,
                        getattr(args, "eval_num_microbatches", args.num_microbatches),
                        context=self.built.context, forward_only=True, seq_length=args.seq_length,
                        micro_batch_size=args.micro_batch_size,
                    )
                    local = reduce_reports(reports)
                    total = local if total is None else total + local
        finally:
            if self.built.context is not None and hasattr(self.built.context, "reshard_all"):
                # Forward-only passes must not leave any unit holding unsharded weights.
                self.built.context.reshard_all()
            if self.built.torch_fsdp2:
                reshard_torch_fsdp2(self.built.model)
            self.built.unwrapped.train()
        return mean_loss(total)

    def evaluate_and_print(self, iteration: int, prefix: str, dataset, split: str) -> float:
        """Evaluate ``dataset`` and report it as ``split`` ("validation" or "test")."""
        if self.args.manual_gc and self.args.manual_gc_eval:
            gc.collect()
        loss = self.evaluate(dataset)
        if self.args.manual_gc and self.args.manual_gc_eval:
            gc.collect()
        if self.args.log_validation_ppl_to_tensorboard:
            self.writer.write_tensorboard(iteration, {f"lm loss {split} ppl": perplexity(loss)})
        bpc = self._bits_per_character(dataset, loss)
        print_rank_0(format_validation_box(prefix, {"lm loss": loss}, bits_per_character=bpc))
        metrics = {"lm_loss": loss, "lm_loss_ppl": perplexity(loss)}
        if bpc is not None:
            metrics["bits_per_character"] = bpc
        self.writer.write(split, iteration, metrics)
        self.writer.flush()
        if split == "validation":
            self.last_eval_iteration = iteration
        return loss

    def _bits_per_character(self, dataset, loss: float) -> Optional[float]:
        """The loss in bits per character of the evaluated text (None without text)."""
        if self.tokenizer is None:
            return None
        key = id(dataset)
        if key not in self._text_sizes:  # the same samples at every evaluation: count once
            samples = self.args.eval_iters * getattr(self.args, "eval_global_batch_size", self.args.global_batch_size)
            self._text_sizes[key] = characters_and_tokens(dataset, samples, self.tokenizer)
        sizes = self._text_sizes[key]
        return bits_per_character(loss, *sizes) if sizes else None
