"""``pretrain``: Megatron's training driver, for GPT under MFSDP v2, PyTorch FSDP2 or DDP.

parse + validate args -> distributed init -> tokenizer -> model (MFSDP units inside one
fully_shard_context, or DDP) -> optimizer (+ fully_shard_optimizer) and LR schedule ->
optional resume -> data iterators -> loop {schedule with the context, clip, step, LR step,
log, eval, save} -> final checkpoint and evaluation.

The step and the loop are here (``_Trainer``); what the loop reports is
``training_log.py``, evaluation ``evaluation.py``, and the loss arithmetic both share
``loss_reports.py``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import signal
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.comm_device import comm_device
from megatron.core.distributed.ranks import max_over_ranks, min_over_ranks, world_size
from megatron.core.distributed.weight_hash import WeightHashMismatch, check_weight_hashes_across_dp_replicas
from megatron.core.global_slices import global_slices_by_name
from megatron.core.optimizer import ConstantGradScaler, DynamicGradScaler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import SPIKY_LOSS_FACTOR, RerunDataIterator, rerun_state_machine_from_args
from megatron.core.step_phases import phase_range
from megatron.core.tokenizer import build_tokenizer, padded_vocab_size
from megatron.core.transformer.attention import cpu_fast_path_note
from megatron.core.transformer.moe.expert_bias import update_expert_biases
from megatron.core.transformer.moe.router import set_aux_loss_backward_scale
from megatron.core.transformer.multi_token_prediction import mtp_token_scale_hook, set_mtp_loss_backward_scale
from megatron.training.batch_size_schedule import batch_size_schedule_from_args, train_samples_needed
from megatron.training.checkpointing import (
    exit_signal_received,
    finalize_async_save,
    install_exit_signal_handler,
    load_checkpoint,
    save_checkpoint,
)
from megatron.training.data import DeviceIterator, build_pretraining_data_loader
from megatron.training.evaluation import Evaluator
from megatron.training.fault_tolerance_arguments import fault_tolerance_enabled
from megatron.training.fim_arguments import fim_transform_from_args
from megatron.training.initialize import initialize_distributed, set_deterministic_mode, set_random_seed
from megatron.training.log_utils import MetricsWriter, jsonable_config, print_rank_0
from megatron.training.memory_report import memory_line
from megatron.training.loss_reports import mean_loss, reduce_reports
from megatron.training.model_builder import (
    BuiltModel,
    build_model,
    build_optimizer,
    count_zeros_of,
    finalize_model_grads,
    get_grad_norm_and_clip,
)
from megatron.training.profiling import StepProfiler
from megatron.training.shutdown import shutdown_distributed
from megatron.training.step_counters import StepCounters, restore_step_counters
from megatron.training.timers import Timers
from megatron.training.training_log import TrainingLog
from megatron.training.user_errors import user_errors


def build_tokenizer_from_args(args):
    tokenizer = build_tokenizer(
        args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        tiktoken_pattern=getattr(args, "tiktoken_pattern", None),
        tiktoken_num_special_tokens=getattr(args, "tiktoken_num_special_tokens", 1000),
        special_tokens=getattr(args, "special_tokens", None),
    )
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by)
    # The model gives the padding rows -inf logits (out of the loss and of sampling).
    args.unpadded_vocab_size = tokenizer.vocab_size
    fim_transform_from_args(args, tokenizer)  # --fim-data: the FIM tokens exist, before the model is built
    return tokenizer


def _earliest(timestamp: float) -> float:
    """The smallest ``timestamp`` over ranks (Megatron times --exit-duration-in-mins from the
    first rank to start)."""
    return min_over_ranks(timestamp)


def _sum_over(value: torch.Tensor, group) -> torch.Tensor:
    """``value`` summed over ``group`` (no gradient), back on ``value``'s device."""
    reduced = value.reshape(()).to(comm_device(group)).clone()
    dist.all_reduce(reduced, group=group)
    return reduced.to(value.device)


def run_pretraining(args, start_time, train_valid_test_datasets_provider, model_provider, forward_step_func):
    """Train after the command line was parsed (see :func:`megatron.training.entry.pretrain`).
    A problem with the files the arguments name raises :class:`UserError`."""
    if args.deterministic_mode:
        set_deterministic_mode()
    with user_errors("distributed initialization"):
        device = initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes)
        parallel = _initialize_parallel_state(args, device)
    if args.exit_signal_handler:
        install_exit_signal_handler(signal.Signals[args.exit_signal])
    writer = MetricsWriter()
    finished = False
    ft = None  # the fault-tolerance side (fault_tolerance.py) with the ft flags
    try:
        set_random_seed(args.seed)
        rank = dist.get_rank()
        print_rank_0(_format_args(args))
        with user_errors("tokenizer"):
            tokenizer = build_tokenizer_from_args(args)
        print_rank_0(
            f"> tokenizer {args.tokenizer_type}: vocab size {tokenizer.vocab_size} padded to {args.padded_vocab_size}"
        )

        if fault_tolerance_enabled(args):
            from megatron.training.fault_tolerance import FaultTolerance  # imports torchft, an optional extra

            with user_errors("torchft"):
                ft = FaultTolerance(args)
        built = build_model(model_provider, args, device, replica_reducer=ft.reducer if ft else None)
        optimizer, scheduler = build_optimizer(args, built)
        # Saved and loaded with the optimizer state (checkpointing.py reads this attribute).
        optimizer.grad_scaler = _build_grad_scaler(args)
        n_params = _model_parameter_count(built)
        replicas = args.data_parallel_size * args.context_parallel_size  # DDP averages over DP x CP
        strategy = "DDP" if (not built.use_mfsdp and replicas > 1) else ("single rank" if not built.use_mfsdp else
                   f"MFSDP {args.data_parallel_sharding_strategy}" + (
                       f", {args.dp_outer_size} instances ({'HFSDP' if args.outer_dp_sharding_strategy == 'optim' else 'HSDP'})"
                       if args.dp_outer_size > 1 else ""))
        if built.torch_fsdp2:
            strategy = "PyTorch FSDP2" + ("" if args.torch_fsdp2_reshard_after_forward else ", no reshard after forward")
        if args.tensor_model_parallel_size > 1:
            strategy += (f", tensor parallel {args.tensor_model_parallel_size} x data parallel "
                         f"{args.data_parallel_size}" + (", sequence parallel" if args.sequence_parallel else ""))
        if args.pipeline_model_parallel_size > 1:
            vp = args.virtual_pipeline_model_parallel_size or 1
            strategy += (f", pipeline parallel {args.pipeline_model_parallel_size}"
                         + (f" x {vp} virtual stages (interleaved 1F1B)" if vp > 1 else " (1F1B)"))
        if args.context_parallel_size > 1:
            strategy += f", context parallel {args.context_parallel_size} ({' '.join(args.cp_comm_type)})"
        if args.num_experts and args.expert_model_parallel_size > 1:
            strategy += (f", expert parallel {args.expert_model_parallel_size} x expert tensor parallel "
                         f"{args.expert_tensor_parallel_size or args.tensor_model_parallel_size}")
        print_rank_0(
            f"> model: {n_params:,} parameters ({n_params / 1e6:.2f}M), {strategy}, world size {world_size()}, "
            f"device {device.type}, {args.num_microbatches} microbatch(es) of {args.micro_batch_size} per rank per step"
        )
        if device.type == "cpu":
            kernel_note = cpu_fast_path_note(args.attention_dropout, args.attention_backend)
            if kernel_note:
                print_rank_0(kernel_note)

        # Before the load: a checkpoint may carry the re-run state machine's state.
        rerun = rerun_state_machine_from_args(args)
        with user_errors(f"--load {args.load}"):
            iteration, consumed = load_checkpoint(
                _checkpointed(built), optimizer, scheduler, args,
                load_optim=not args.no_load_optim, load_rng=not args.no_load_rng, rerun_state_machine=rerun,
            )
        if iteration:
            print_rank_0(f"> resumed from {args.load} at iteration {iteration} ({consumed} samples consumed)")
        if iteration >= args.train_iters:
            print_rank_0(f"> checkpoint is at iteration {iteration} >= --train-iters {args.train_iters}; nothing to train")

        # Sinks on rank 0 only (every rank computes the same reduced metrics).
        if rank == 0:
            jsonl = None
            if args.log_dir:
                jsonl = os.path.join(args.log_dir, "metrics.jsonl")
            elif args.tensorboard_dir:
                jsonl = os.path.join(args.tensorboard_dir, "metrics.jsonl")
            with user_errors("logging"):
                writer = MetricsWriter(
                    jsonl_path=jsonl,
                    tensorboard_dir=args.tensorboard_dir,
                    wandb_project=args.wandb_project,
                    wandb_exp_name=args.wandb_exp_name,
                    wandb_save_dir=args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None),
                    config=jsonable_config(args),
                    wandb_entity=args.wandb_entity,
                )

        with user_errors("data"):
            train_ds, valid_ds, test_ds = _build_datasets(args, tokenizer, train_valid_test_datasets_provider)
        print_rank_0(f"> initialization done in {time.time() - start_time:.1f} s")

        trainer = _Trainer(args, built, optimizer, scheduler, forward_step_func, device, writer,
                           start_time=_earliest(start_time), rerun=rerun)
        # A fault-tolerant group's data-parallel ranks are ranks R x dp .. of G x dp (fault_tolerance.py).
        groups, group_id = (args.ft_num_replica_groups, args.ft_replica_group_id) if ft else (1, 0)
        dp_rank, dp_size = group_id * parallel.dp_size + parallel.dp_rank, groups * parallel.dp_size

        def make_train_iter(consumed_samples: int):
            # Every TP, PP and CP rank of a data-parallel rank reads the same samples; each
            # CP rank keeps its tokens of them.
            loader = build_pretraining_data_loader(
                train_ds, consumed_samples, args.micro_batch_size, dp_rank, dp_size, args.num_workers,
                pin_memory=device.type == "cuda",
            )
            # Starting the iterator draws a seed from the torch RNG; keep it out of the RNG
            # stream of the training steps, so that a resumed run (RNG from the checkpoint)
            # continues exactly like an uninterrupted one.
            with torch.random.fork_rng(devices=[]):
                return DeviceIterator(loader, device, parallel.cp_size, parallel.cp_rank)

        train_iter = None
        if train_ds is not None and iteration < args.train_iters:
            train_iter = make_train_iter(consumed)
        if ft is not None:
            trainer.ft, trainer.make_train_iter = ft, make_train_iter
            ft.attach(trainer, iteration)
        trainer.valid_ds = valid_ds
        trainer.evaluator.tokenizer = tokenizer

        print_rank_0("> training ...")
        iteration = trainer.train(train_iter, iteration, consumed)
        print_rank_0(f"> training done at iteration {iteration}")

        if args.save and trainer.last_saved_iteration != iteration and iteration > 0:
            trainer.save(iteration)
        finalize_async_save()
        if args.eval_iters > 0:
            if valid_ds is not None and trainer.evaluator.last_eval_iteration != iteration:
                trainer.evaluate_and_print(iteration, f"iteration {iteration} on validation set", valid_ds, "validation")
            if test_ds is not None:
                trainer.evaluate_and_print(iteration, f"iteration {iteration} on test set", test_ds, "test")
        print_rank_0(f"> total time {time.time() - start_time:.1f} s")
        finished = True
        return trainer.log.last_metrics
    finally:
        if ft is not None:
            ft.shutdown()
        writer.close()
        # In order: the save in flight and its thread, a barrier (only when every rank
        # finished), the groups (see shutdown.py).
        shutdown_distributed(barrier=finished)


def _initialize_parallel_state(args, device):
    """The one named mesh (pipeline, data-, context- and tensor-parallel axes, and the
    expert view for a MoE model), once per process."""
    parallel_state.destroy_model_parallel()  # a previous pretrain() in this process
    return parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size, args.dp_outer_size, device.type,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size if args.num_experts else None,
        # A dense model has no expert view: upstream builds its groups and never uses them.
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None) if args.num_experts else None)


def _model_parameter_count(built: BuiltModel) -> int:
    """The whole model's parameters, whatever the layout: each name once (the tied
    embedding's two pipeline copies, replicas), at its global size (TP and EP pieces, and
    MFSDP's DTensors, which are global over the data-parallel ranks)."""
    pieces = global_slices_by_name(built.unwrapped)
    sizes = {name: (math.prod(pieces[name].global_shape) if name in pieces else p.numel())
             for name, p in built.unwrapped.named_parameters()}
    if world_size() > 1:
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, sizes)
        for part in gathered:
            sizes.update(part)
    return sum(sizes.values())


def _checkpointed(built: BuiltModel) -> torch.nn.Module:
    """What checkpoints save and load: the model (DDP unwraps itself in checkpointing.py),
    or with virtual pipeline stages the ModelChunks whose names are the whole model's."""
    return built.model if isinstance(built.model, torch.nn.Module) else built.unwrapped


def _build_grad_scaler(args):
    """--fp16 only: static with --loss-scale, else dynamic (Megatron's defaults)."""
    if not args.fp16:
        return None
    if args.loss_scale is not None:
        return ConstantGradScaler(args.loss_scale)
    return DynamicGradScaler(initial_scale=args.initial_loss_scale, min_scale=args.min_loss_scale,
                             growth_interval=args.loss_scale_window, hysteresis=args.hysteresis)


def _format_args(args) -> str:
    lines = ["------------------------ arguments ------------------------"]
    for key in sorted(vars(args)):
        lines.append(f"  {key} {'.' * max(1, 48 - len(key))} {getattr(args, key)}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def _build_datasets(args, tokenizer, provider):
    eval_gbs = getattr(args, "eval_global_batch_size", args.global_batch_size)
    # The validation set is evaluated from its start at every --eval-interval (so the
    # numbers are comparable across evaluations); it needs eval_iters evaluation batches.
    num_samples = [train_samples_needed(args), args.eval_iters * eval_gbs, args.eval_iters * eval_gbs]
    # Rank 0 first: it prepares corpora and writes index caches; the others then read them.
    datasets = None
    if dist.get_rank() == 0:
        datasets = provider(args, tokenizer, num_samples)
    dist.barrier()
    if dist.get_rank() != 0:
        datasets = provider(args, tokenizer, num_samples)
    dist.barrier()
    if not isinstance(datasets, (tuple, list)) or len(datasets) != 3:
        raise TypeError("train_valid_test_datasets_provider must return (train, valid, test).")
    return tuple(datasets)


class _Trainer:
    """The training loop: steps (forward-backward under the re-run state machine, clipping,
    the optimizer and LR steps), and between them the log, evaluation, checkpoints, the
    weight-hash check and the exit conditions."""
    def __init__(self, args, built: BuiltModel, optimizer, scheduler, forward_step_func, device, writer,
                 start_time: float, rerun=None):
        self.args = args
        self.start_time = start_time  # the earliest rank's: --exit-duration-in-mins counts from it
        self.profiler = StepProfiler(args, dist.get_rank() if dist.is_initialized() else 0)
        self.built = built
        self.optimizer = optimizer
        self.memory_reported = False  # memory_report.py's line, once after the first iteration run
        self.scheduler = scheduler
        self.forward_step_func = forward_step_func
        self.device = device
        self.forward_backward = get_forward_backward_func()
        if args.pipeline_model_parallel_size > 1:
            self.forward_backward = functools.partial(
                self.forward_backward, microbatch_group_size=args.microbatch_group_size_per_virtual_pipeline_stage)
        self.grad_scaler = getattr(optimizer, "grad_scaler", None)
        self.timers = Timers(args.timing_log_level, args.timing_log_option, device)
        self.params = [p for p in built.unwrapped.parameters() if p.requires_grad]
        self.log = TrainingLog(args, built, optimizer, device, writer, self.timers, self.params)
        self.evaluator = Evaluator(args, built, self.forward_backward, forward_step_func, device, writer,
                                   self._autocast)
        self.valid_ds = None
        self.last_saved_iteration = None
        self.consumed = 0
        self.iteration = 0  # the last completed step's number
        self.batch_schedule = batch_size_schedule_from_args(args)
        self.rerun = rerun if rerun is not None else rerun_state_machine_from_args(args)
        self.rerun.extra_state = StepCounters(built.unwrapped).save
        self.rerun.restore_extra_state = restore_step_counters
        # Fault tolerance (fault_tolerance.py): the torchft side, and how to read the data
        # from a given position again (after a step that did not commit, or a recovery).
        self.ft = None
        self.make_train_iter = None
        self.train_iter = None
        self.step_committed = True

    def _autocast(self):
        if self.args.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.args.autocast_dtype)

    # One step ---------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        """The user's forward step, with Megatron's loss normalization and the fp16 loss scale."""
        output_tensor, loss_func = self.forward_step_func(data_iterator, model)
        per_token = self.args.calculate_per_token_loss
        scale = self.grad_scaler.scale if self.grad_scaler is not None else None
        parallel = parallel_state.get_parallel_state()

        def scaled_loss_func(output):
            result = loss_func(output)
            self._validate_loss(result[0])
            if len(result) == 3 and not per_token:
                # Megatron's default: each microbatch's mean loss, averaged over microbatches
                # (the schedule divides 2-tuples by their number) and data-parallel ranks.
                loss_sum, num_tokens, report = result
                num_tokens = torch.as_tensor(num_tokens, device=loss_sum.device)
                if parallel.cp_size > 1:
                    # The microbatch's mean is over all its CP pieces' tokens; the engine
                    # averages gradients over dp x cp, so x cp turns that into a sum over CP.
                    num_tokens = _sum_over(num_tokens.detach().float(), parallel.cp_group)
                    loss_sum = loss_sum * parallel.cp_size
                result = (loss_sum / torch.clamp(num_tokens, min=1), report)
            if scale is not None:
                result = (result[0] * scale,) + tuple(result[1:])
            return result

        return output_tensor, scaled_loss_func

    def _validate_loss(self, loss: torch.Tensor) -> None:
        """Megatron's checks of a micro-batch's local loss (before any reduction), for the
        re-run state machine: NaN and Inf (fatal), and with --check-for-spiky-loss a spike."""
        if not self.rerun.enabled and self.rerun.tracker_filename is None:
            return  # disabled, the checks only feed --result-rejected-tracker-filename
        loss = loss.detach().float()
        if not self.args.no_check_for_nan_in_loss_and_grad:
            self.rerun.validate_result(loss, torch.isnan, "found NaN in local forward loss calculation")
            self.rerun.validate_result(loss, torch.isinf, "found Inf in local forward loss calculation")
        if self.args.check_for_spiky_loss:
            spiky = functools.partial(self.rerun.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss")
            self.rerun.validate_result(loss, spiky, "Spiky loss", fatal=False)

    def _forward_backward(self, data_iterator):
        """One run of the step's forward-backward from zeroed gradients: its loss reports."""
        args = self.args
        self.optimizer.zero_grad(set_to_none=True)
        # The router losses' gradients get the factor each micro-batch's loss gets.
        loss_scale = self.grad_scaler.scale if self.grad_scaler is not None else 1.0
        set_aux_loss_backward_scale(self.built.unwrapped, loss_scale / args.num_microbatches)
        set_mtp_loss_backward_scale(self.built.unwrapped, loss_scale / args.num_microbatches)
        extra = {}
        if args.calculate_per_token_loss and getattr(args, "mtp_num_layers", None):
            # The MTP sums get the factor the schedule gives the loss sums (upstream's per-token semantics).
            extra["token_scale_hook"] = mtp_token_scale_hook(self.built.unwrapped, loss_scale)
        with self.timers("forward-backward", 1), self._autocast():
            reports = self.forward_backward(
                self._forward_step, data_iterator, self.built.model, args.num_microbatches,
                context=self.built.context, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                timers=self.timers, dp_group=parallel_state.get_parallel_state().dp_cp_group, **extra,
            )
            with phase_range("grad-finalize"):
                finalize_model_grads(args, self.built)
        return reports

    def train_step(self, data_iterator):
        """One step: (loss, grad norm, whether the update was skipped)."""
        args = self.args
        timers = self.timers
        # The re-run state machine runs the forward-backward again (same batches and RNG)
        # when a result failed validation; nothing before the optimizer step outlives a run
        # but the gradients, zeroed at each run's start, and the counters it restores.
        while self.rerun.should_run_forward_backward(data_iterator if self.rerun.enabled else None):
            reports = self._forward_backward(data_iterator)
        self._stop_if_rerun_says_so()
        with phase_range("logging"):
            loss = mean_loss(reduce_reports(reports))
        with timers("optimizer", 1), phase_range("optimizer"):
            if self.grad_scaler is not None:
                with timers("optimizer-unscale-and-check-inf", 1):
                    _scale_grads(self.params, 1.0 / self.grad_scaler.scale)
            with timers("optimizer-clip-main-grad", 1):
                grad_norm = float(get_grad_norm_and_clip(args, self.built, self.optimizer))
            # With fault tolerance, a step that the replica groups did not all complete is
            # dropped here: nothing below (optimizer, LR, counters) runs.
            self.step_committed = self.ft.should_commit() if self.ft is not None else True
            if not self.step_committed:
                self.optimizer.zero_grad(set_to_none=True)
                return loss, grad_norm, False
            # A non-finite global norm means some rank's gradients overflowed.
            skipped = not math.isfinite(grad_norm)
            if self.grad_scaler is not None:
                self.grad_scaler.update(skipped)
            if args.log_num_zeros_in_grad:
                with timers("optimizer-count-zeros", 1):
                    self.log.num_zeros = count_zeros_of(args, self.built, self.params)
            if skipped:
                # Megatron skips the update (and the LR step) rather than writing NaN/inf weights.
                self.optimizer.zero_grad(set_to_none=True)
            else:
                with timers("optimizer-inner-step", 1):
                    self.optimizer.step()
                update_expert_biases(self.built.unwrapped)  # aux-loss-free balancing, once per step taken
                self.scheduler.step(increment=args.global_batch_size)
        return loss, grad_norm, skipped

    def _stop_if_rerun_says_so(self) -> None:
        """After a step's runs, before the optimizer: the re-run state machine may stop the
        job (a checkpoint of the step before first, when it asks for one)."""
        save, stop, code = self.rerun.should_checkpoint_and_exit()
        if not stop:
            return
        if save and self.args.save and self.last_saved_iteration != self.iteration:
            self.save(self.iteration)
        finalize_async_save()
        print_rank_0(f"> exiting with code {code} (--rerun-mode {self.args.rerun_mode}) at iteration "
                     f"{self.iteration + 1}, before its optimizer step")
        sys.exit(code)

    # The loop ---------------------------------------------------------------------------
    def train(self, train_iter, iteration: int, consumed: int) -> int:
        """Train from ``iteration`` to --train-iters (or an exit condition); the last iteration."""
        args = self.args
        self.consumed = consumed
        if train_iter is None:
            return iteration
        self.built.unwrapped.train()
        if self.rerun.enabled:
            # A step's micro-batches can be served again (or, resumed for a re-run, the saved ones).
            train_iter = RerunDataIterator(train_iter, self.device)
        self.iteration = iteration
        self.rerun.resume_at(iteration, optimizer_loaded=not (args.no_load_optim or args.finetune))
        self._check_weight_hashes(iteration, force=True)
        self.log.restart_interval()
        if args.manual_gc:
            # Collect at the same points on every rank instead of whenever the allocator decides.
            gc.disable()
            gc.collect()
        self.train_iter = train_iter
        try:
            while self.iteration < args.train_iters:
                with self.profiler.step(self.iteration):
                    self._train_one_iteration()
                self.profiler.after_step(self.iteration)
                reason = self._exit_reason()
                if reason:
                    if args.save and self.last_saved_iteration != self.iteration:
                        self.save(self.iteration)
                    finalize_async_save()
                    print_rank_0(f"> exiting {reason}")
                    sys.exit(0)
            return self.iteration
        finally:
            self.profiler.stop()
            if args.manual_gc:
                gc.enable()

    def _train_one_iteration(self) -> None:
        """A step and what is due after it: weight hashes, the log, evaluation, a checkpoint."""
        args = self.args
        if self.ft is not None:
            self.ft.start_step()  # the quorum; a recovering group gets its peer's state and counters here
            if self.iteration >= args.train_iters:  # recovered at the end of training
                return
        if self.batch_schedule is not None:
            self.batch_schedule.apply(args, self.consumed)  # --rampup-batch-size etc.: this step's batch
        loss, grad_norm, skipped = self.train_step(self.train_iter)
        if not self.step_committed:
            self.reposition_data()  # the same batch again
            return
        self.iteration += 1
        iteration = self.iteration
        self._check_weight_hashes(iteration)
        self.consumed += args.global_batch_size
        with phase_range("logging"):
            self.log.record_step(iteration, loss, grad_norm, skipped, self.consumed)
        if not self.memory_reported:  # upstream's first memory report; rank 0's bytes, as the planner's
            print_rank_0(memory_line(self.built, self.optimizer, self.device, iteration))
            self.memory_reported = True
        if self.ft is not None and iteration % args.log_interval == 0:
            self.ft.log_weights(iteration)
        if args.eval_iters > 0 and self.valid_ds is not None and iteration % args.eval_interval == 0:
            self.evaluate_and_print(iteration, f"iteration {iteration}", self.valid_ds, "validation")
            self.log.restart_clock()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            self.save(iteration)
            self.log.restart_clock()
        if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
            gc.collect()

    def reposition_data(self) -> None:
        """Read the training data from ``self.consumed`` on (fault tolerance: the committed steps' position)."""
        self.train_iter = self.make_train_iter(self.consumed)

    def _exit_reason(self) -> Optional[str]:
        """Why training stops after this iteration before --train-iters, or None."""
        args, iteration = self.args, self.iteration
        minutes = self._minutes_run_on_any_rank() if args.exit_duration_in_mins else None
        if args.exit_signal_handler and exit_signal_received():
            return f"on signal after iteration {iteration} ({args.exit_signal})"
        if minutes is not None and minutes > args.exit_duration_in_mins:
            return (f"after {minutes:.2f} minutes (--exit-duration-in-mins {args.exit_duration_in_mins}) "
                    f"at iteration {iteration}")
        if args.exit_interval and iteration % args.exit_interval == 0:
            return f"at --exit-interval {args.exit_interval} after iteration {iteration}"
        return None

    def _minutes_run_on_any_rank(self) -> float:
        """Minutes since the earliest rank's pretrain() started; the maximum over ranks, so
        every rank takes the same exit decision although each reads its own clock."""
        return max_over_ranks((time.time() - self.start_time) / 60.0)

    def _check_weight_hashes(self, iteration: int, force: bool = False) -> None:
        """--check-weight-hash-across-dp-replicas-interval: every N iterations (and when
        training starts) the data-parallel replicas must hold equal weights; a mismatch stops
        every rank with one line naming the diverging rank(s)."""
        interval = self.args.check_weight_hash_across_dp_replicas_interval
        if interval is None or not (force or iteration % interval == 0):
            return
        try:
            compared = check_weight_hashes_across_dp_replicas(
                self.built.unwrapped, parallel_state.get_parallel_state().dp_cp_group, self.built.context)
        except WeightHashMismatch as error:
            print_rank_0(f"error: after iteration {iteration}: {error}; stop and check those ranks' devices")
            sys.exit(1)
        if compared == 0:
            print_rank_0(f"> weight hashes after iteration {iteration}: nothing to compare (no parameter piece "
                         "is held by more than one data-parallel rank)")
        else:
            print_rank_0(f"> weight hashes match across data-parallel replicas after iteration {iteration} "
                         f"({compared} parameter pieces compared)")

    # Between steps ----------------------------------------------------------------------
    def evaluate_and_print(self, iteration: int, prefix: str, dataset, split: str) -> float:
        loss = self.evaluator.evaluate_and_print(iteration, prefix, dataset, split)
        if split == "validation":
            self.log.last_metrics["validation_lm_loss"] = loss
        return loss

    def save(self, iteration: int) -> None:
        start = time.time()
        with user_errors(f"--save {self.args.save}"):
            path = save_checkpoint(
                iteration, _checkpointed(self.built), self.optimizer, self.scheduler, self.args,
                consumed_train_samples=self.consumed, rerun_state=self.rerun.state_dict(self.train_iter),
            )
        self.last_saved_iteration = iteration
        print_rank_0(f"> saved checkpoint at iteration {iteration} to {path} in {time.time() - start:.1f} s")


def _scale_grads(params, factor: float) -> None:
    """Multiply every (possibly sharded) gradient in place: the fp16 loss scale comes off here."""
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grad.mul_(factor)
