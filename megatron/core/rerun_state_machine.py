"""The re-run state machine (``--rerun-mode``): tell a data/model problem from a faulty rank.

A training step validates its results (the local loss of each micro-batch: NaN, Inf and, with
``--check-for-spiky-loss``, a spike) before the optimizer touches anything. When any rank
rejects a result, every rank re-runs the same step in place, with the same micro-batches and
RNG state, and the re-run's outcome classifies the fault:

* not reproducible: a transient fault on the rank that saw it ("Possible transient error!",
  logged by that rank with its node and device). A fatal check (NaN/Inf) then stops the job
  with ``EXIT_CODE_FAILED_ON_RESULT_VALIDATION`` (17): resume from an earlier checkpoint,
  elsewhere; a non-fatal one (spiky loss) continues with the re-run's gradients.
* reproducible: the data or the model (or a persistent fault). A fatal check saves a
  checkpoint of the step before, with this machine's state in it, and stops with
  ``EXIT_CODE_RESUME_TO_DISAMBIGUATE`` (16); a non-fatal one continues.

Resumed from that checkpoint, the job re-runs the step a second time (its saved
micro-batches, the RNG of the step's start), on whatever node and device it now has: the
same device as the suspicious rank's -> exit 16 again (resume elsewhere); otherwise a result
that differs now was a persistent fault of the first device ("Possible persistent error!"),
an equal one was right ("Correct result (but possible Application error)"); both stop with
17 for a fatal check (the checkpoint is there to examine), a non-fatal one continues.

Modes (Megatron's): ``disabled`` (no re-run: a NaN/Inf gradient skips the step, as
before), ``validate_results`` (the above, the default as upstream), ``report_stats`` (every
step runs twice and the relative difference of each validated result between the two runs
is reported every ``REPORTING_INTERVAL_ITERATIONS`` steps: how deterministic the
computation is).

``--error-injection-rate N`` / ``--error-injection-type`` make the machine testable: about
once every N validations (every one with N=1) a result is declared wrong, and the re-runs'
comparisons are made to match or not as the injected type says. ``--result-rejected-tracker-filename``
appends one line per rejected result and per re-run's verdict (upstream's format).

Flow in the trainer (``should_run_forward_backward`` is the loop's condition)::

    while machine.should_run_forward_backward(data_iterator):
        zero grads; forward/backward (the loss function calls machine.validate_result)
    save, exit, code = machine.should_checkpoint_and_exit()

The first step of a fresh job is not validated (as upstream: a checkpoint of the step before
must be possible; a job resumed with its optimizer state is validated from its first step). ``state_dict`` / ``load_state_dict`` carry the machine through checkpoints.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import statistics
from collections import defaultdict, deque
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.core.distributed.ranks import rank as _rank
from megatron.core.distributed.ranks import sum_over_ranks

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
SPIKY_LOSS_FACTOR = 10  # a loss >= 10x the largest of the first samples is a spike
STATS_MAX_SAMPLES = 100_000  # per validation call and rank, the latest kept (report_stats)
MATCH, MISMATCH = 0.0, math.inf


class RerunMode(str, Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_STATS = "report_stats"


class RerunDiagnostic(str, Enum):
    """What an injected error pretends to be: a right result, a fault that a re-run does not
    reproduce, or one that it does."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunState(Enum):
    """Upstream's states. NOT_RUNNING_YET: between steps. INITIAL_RUN, RERUNNING_IN_PLACE: the
    step's first run and its re-run. WILL_RERUN_FROM_CHECKPOINT: a reproduced fatal result,
    saved in the checkpoint the job stops with; resumed, the step runs once more in
    RERUNNING_FROM_CHECKPOINT, and RERUNNING_AGAIN_FROM_CHECKPOINT when that landed on the
    suspicious device again."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunValidationStatus(str, Enum):
    """The ``status=`` of a line of the result-rejected tracker file (upstream's names)."""

    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"


def node_and_device() -> Tuple[str, str]:
    """Where this rank runs: the host name and its device (``cpu`` without CUDA). A re-run
    from a checkpoint compares it with the suspicious rank's."""
    device = str(torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return os.uname()[1], device


def _where() -> str:
    node, device = node_and_device()
    return f"Rank {_rank()}, node {node}, device {device}"


def _say(message: str, every_rank: bool = False) -> None:
    if every_rank or _rank() == 0:
        print(f"rerun state machine: {message}", flush=True)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """0 for equal results (NaN equals NaN), inf when one is NaN/Inf and the other is not,
    else |a - b| over their mean magnitude."""
    x, y = float(a), float(b)
    if x == y or (math.isnan(x) and math.isnan(y)):
        return MATCH
    if not (math.isfinite(x) and math.isfinite(y)):
        return MISMATCH
    return abs(x - y) / (abs(x + y) / 2) if x + y != 0 else MISMATCH


def _to_cpu(value: Any) -> Any:
    """A batch (tensors in dicts, lists, tuples) with its tensors on the CPU, for a checkpoint."""
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class RerunDataIterator:
    """Wraps the training iterator so that a step's micro-batches can be served again.
    ``device``: where batches loaded from a checkpoint go (the wrapped iterator's device)."""

    def __init__(self, iterator, device: Optional[torch.device] = None):
        self.iterator = iterator
        self.device = device
        self.served: List[Any] = []  # this step's batches, in order
        self.replay: List[Any] = []
        # Batches of the wrapped iterator that a replay from a checkpoint stands for: read
        # and dropped, so that the next step reads where an uninterrupted run would.
        self.skip = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.replay:
            batch = self.replay.pop(0)
            if self.skip:
                self.skip -= 1
                next(self.iterator)
        else:
            batch = next(self.iterator)
        self.served.append(batch)
        return batch

    def advance(self) -> None:
        """A new step: forget the last one's batches."""
        for _ in range(self.skip):
            next(self.iterator)
        self.served, self.replay, self.skip = [], [], 0

    def rewind(self) -> None:
        """Serve this step's batches again, from its first."""
        self.replay, self.served = self.served + self.replay, []

    def state_dict(self) -> Dict[str, Any]:
        """The batches the next run will be served (on the CPU): after ``rewind``, the step's."""
        return {"replay": _to_cpu(self.served + self.replay)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Serve the saved batches next. The wrapped iterator restarted where the checkpoint's
        data position is, i.e. at those same batches: as many of its batches are dropped."""
        def to(v):
            if torch.is_tensor(v):
                return v.to(self.device) if self.device is not None else v
            if isinstance(v, dict):
                return {k: to(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return type(v)(to(x) for x in v)
            return v

        self.replay = [to(b) for b in state["replay"]]
        self.served, self.skip = [], len(self.replay)


class ErrorInjector:
    """Declares about one validation in ``rate`` wrong (its own RNG: the training RNG stream
    stays as without injection), then makes the re-runs agree or not per ``kind``."""

    def __init__(self, rate: int = 0, kind: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR, seed: int = 1234):
        self.rate, self.kind = rate, RerunDiagnostic(kind)
        self.random = random.Random(seed)
        self.injected: Optional[RerunDiagnostic] = None

    def maybe_inject(self) -> bool:
        if self.rate <= 0 or self.injected is not None:
            return False
        # The rank offsets the draw, so that ranks are not all hit at the same step.
        if (self.random.randrange(self.rate) + _rank()) % self.rate != 0:
            return False
        self.injected = self.kind
        _say(f"{_where()}: Injecting error type {self.kind.value.replace('_', ' ').capitalize()}", every_rank=True)
        return True

    def comparison_on_rerun(self, measured: float, state: RerunState) -> float:
        """A re-run's comparison: the measured one unless an error was injected. In place, a
        transient error differs (and is done), the others match; from a checkpoint, a
        persistent error differs, a right result matches (and both are done)."""
        injected = self.injected
        if injected is None:
            return measured
        if state == RerunState.RERUNNING_IN_PLACE:
            if injected == RerunDiagnostic.TRANSIENT_ERROR:
                self.injected = None
                return MISMATCH
            return MATCH
        self.injected = None
        return MISMATCH if injected == RerunDiagnostic.PERSISTENT_ERROR else MATCH

    def state_dict(self) -> Dict[str, Any]:
        version, internal, gauss = self.random.getstate()
        return {"rate": self.rate, "kind": self.kind.value, "random": [version, list(internal), gauss],
                "injected": self.injected.value if self.injected is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rate, self.kind = int(state["rate"]), RerunDiagnostic(state["kind"])
        version, internal, gauss = state["random"]
        self.random.setstate((version, tuple(internal), gauss))
        self.injected = RerunDiagnostic(state["injected"]) if state["injected"] is not None else None


class RerunStateMachine:
    """One per run (see the module docstring). ``extra_state`` saves, and
    ``restore_extra_state`` restores, whatever else a step changes before validation."""

    REPORTING_INTERVAL_ITERATIONS = 2

    def __init__(self, mode: RerunMode = RerunMode.DISABLED, injector: Optional[ErrorInjector] = None,
                 extra_state: Optional[Callable[[], Any]] = None,
                 restore_extra_state: Optional[Callable[[Any], None]] = None,
                 result_rejected_tracker_filename: Optional[str] = None):
        self.mode = RerunMode(mode)
        self.injector = injector or ErrorInjector()
        self.extra_state, self.restore_extra_state = extra_state, restore_extra_state
        self.tracker_filename = result_rejected_tracker_filename
        if self.tracker_filename is not None:
            try:
                with open(self.tracker_filename, "a"):
                    pass
            except OSError as e:
                raise RuntimeError(f"--result-rejected-tracker-filename {self.tracker_filename}: cannot append to it "
                                   f"({e}); name a writable file.") from None
        self.state = RerunState.NOT_RUNNING_YET
        self.iteration = 0  # 1-based number of the step being run (the last one between steps)
        self.first_step_done = False
        self.saved: Optional[Dict[str, Any]] = None
        self.calls: Dict[str, int] = defaultdict(int)  # this run's validations so far, per message
        self.failed_call: Optional[Tuple[str, int]] = None
        self.initial_result: Optional[torch.Tensor] = None
        self.rerun_requested = self.continue_requested = self.checkpoint_requested = False
        self.restart_again_requested = False
        self.suspicious: Optional[Tuple[str, str]] = None  # (node, device) of a reproduced fault
        self.pending_data: Optional[Dict[str, Any]] = None  # a checkpoint's batches, for the re-run
        self.reruns = 0  # steps re-run in this job
        self.initial_results: Dict[Tuple[str, int], torch.Tensor] = {}
        self.stats: Dict[str, deque] = defaultdict(lambda: deque(maxlen=STATS_MAX_SAMPLES))
        self.max_values: Dict[str, float] = {}
        self.value_counts: Dict[str, int] = defaultdict(int)
        if self.enabled:  # from rank 0 here: under pipeline parallelism it validates nothing
            _say(f"Result validation enabled (--rerun-mode {self.mode.value})")

    @property
    def enabled(self) -> bool:
        return self.mode != RerunMode.DISABLED

    # ---------------------------------------------------------------- the step's loop
    def should_run_forward_backward(self, data_iterator: Optional[RerunDataIterator]) -> bool:
        """True to (re)run the step's forward-backward. A collective after each run."""
        self.calls = defaultdict(int)
        if self.state == RerunState.NOT_RUNNING_YET:
            return self._start_step(data_iterator)
        if self.state == RerunState.INITIAL_RUN:
            if not self.enabled or not self._any_rank(self.rerun_requested):
                self.state = RerunState.NOT_RUNNING_YET
                return False
            return self._rerun(data_iterator)
        if self.state == RerunState.RERUNNING_IN_PLACE:
            return self._after_rerun(data_iterator)
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            return self._rerun_from_checkpoint(data_iterator)
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            return self._after_rerun_from_checkpoint()
        raise RuntimeError(f"the re-run state machine cannot run a step in state {self.state.name}")

    def _start_step(self, data_iterator) -> bool:
        self.iteration += 1
        self.state = RerunState.INITIAL_RUN
        if self.enabled:
            self._save_state()
            if data_iterator is not None:
                data_iterator.advance()
            self.rerun_requested = self.continue_requested = self.checkpoint_requested = False
            self.restart_again_requested = False
            self.failed_call, self.initial_result = None, None
            self.initial_results = {}
        return True

    def _rerun(self, data_iterator) -> bool:
        if self.mode == RerunMode.VALIDATE_RESULTS:
            _say(f"iteration {self.iteration}: re-running the step to check whether the result is reproducible")
        self.reruns += 1
        self.state = RerunState.RERUNNING_IN_PLACE
        self._back_to_step_start(data_iterator)
        return True

    def _after_rerun(self, data_iterator) -> bool:
        if self.mode == RerunMode.REPORT_STATS:
            self.state = RerunState.NOT_RUNNING_YET
            self._maybe_report_stats()
            return False
        will_continue, will_checkpoint = self._any_rank(self.continue_requested, self.checkpoint_requested)
        if will_continue:
            _say("Continuing normal execution because failed validation was not fatal")
            self.state = RerunState.NOT_RUNNING_YET
            return False
        if will_checkpoint:
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
        # The job stops: what a checkpoint of the step before holds is the step's start (its
        # RNG, counters, and the batches it will be served again).
        self._back_to_step_start(data_iterator)
        return False

    def _rerun_from_checkpoint(self, data_iterator) -> bool:
        """The job resumed from the checkpoint of a reproduced fault: run the step once more."""
        self.iteration += 1
        if self.pending_data is not None and data_iterator is not None:
            data_iterator.load_state_dict(self.pending_data)
        self.pending_data = None
        _say(f"iteration {self.iteration}: re-running the step from the checkpoint to establish a diagnostic")
        self.reruns += 1
        self.state = RerunState.RERUNNING_FROM_CHECKPOINT
        return True

    def _after_rerun_from_checkpoint(self) -> bool:
        restart_again, will_continue = self._any_rank(self.restart_again_requested, self.continue_requested)
        if restart_again:
            _say("Need to restart job from the same checkpoint because it was scheduled on the same node/GPU")
            self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
        elif will_continue:
            _say("Continuing normal execution because failed validation was not fatal")
            self.state = RerunState.NOT_RUNNING_YET
            self.suspicious = None
        return False

    def should_checkpoint_and_exit(self) -> Tuple[bool, bool, int]:
        """(save a checkpoint, stop the job, exit code) once the step's runs are done."""
        self.first_step_done = True
        if self.mode != RerunMode.VALIDATE_RESULTS:
            return False, False, 0
        if self.state == RerunState.RERUNNING_IN_PLACE:
            _say("Exiting now. The job can be resumed from a previous checkpoint")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            _say("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the "
                 "last iteration and establish a diagnostic")
            return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            _say("Exiting now. A checkpoint at the last iteration already exists if further examination is needed")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            _say("Exiting now. Please resume the job from the same checkpoint to rerun the last iteration and "
                 "establish a diagnostic")
            return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        return False, False, 0

    # ---------------------------------------------------------------- validation
    def validate_result(self, result: torch.Tensor, rejection_func: Callable[[torch.Tensor], Any], message: str,
                        tolerance: float = 0.0, fatal: bool = True) -> None:
        """Check ``result`` (a 0-dim tensor) where it is computed; see the module docstring."""
        if not self.enabled:
            # No re-run (the trainer skips a NaN/Inf step); a rejection is still recorded.
            if self.tracker_filename is not None and bool(rejection_func(result)):
                self._track(RerunValidationStatus.RERUN_DISABLED, result, message)
            return
        if self.state not in (RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE,
                              RerunState.RERUNNING_FROM_CHECKPOINT):
            return
        self.calls[message] += 1
        call = (message, self.calls[message])
        if self.mode == RerunMode.REPORT_STATS:
            self._record_for_stats(call, result)
        elif self.state == RerunState.INITIAL_RUN:
            self._validate_initial(call, result, rejection_func)
        elif call == self.failed_call:
            self._judge_rerun(result, tolerance, fatal, message)

    def _validate_initial(self, call, result, rejection_func) -> None:
        if self.rerun_requested or not self.first_step_done:
            return  # one suspicious result per step is enough; the first step is trusted
        if self.injector.maybe_inject() or bool(rejection_func(result)):
            self.failed_call, self.initial_result, self.rerun_requested = call, result.detach().clone(), True
            self._track(RerunValidationStatus.INITIAL_RUN, result, call[0])
            _say(f"{_where()}: Unexpected result {float(result)} at iteration #{self.iteration} "
                 f"invocation #{call[1]} (message='{call[0]}')", every_rank=True)

    def _judge_rerun(self, result, tolerance: float, fatal: bool, message: str) -> None:
        comparison = self.injector.comparison_on_rerun(relative_difference(self.initial_result, result), self.state)
        level = "ERROR" if fatal else "WARNING"
        prefix = f"{level} {_where()}, iteration #{self.iteration}:"
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            if node_and_device() == self.suspicious:
                _say(f"{prefix} Got rescheduled on the same GPU. Need to resume again from the same checkpoint "
                     f"(node: {self.suspicious[0]}, gpu: {self.suspicious[1]})", every_rank=True)
                self.restart_again_requested = True
                return
            if comparison > tolerance:
                self._track(RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE, result, message)
                _say(f"{prefix} Second rerun: unexpected result is not reproducible on a different GPU, therefore "
                     f"was likely incorrect ({float(result)} != {float(self.initial_result)})", every_rank=True)
                _say(f"{prefix} Possible persistent error!", every_rank=True)
            else:
                self._track(RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, result, message)
                _say(f"{prefix} Second rerun: unexpected result is reproducible on a different GPU, therefore it "
                     f"was likely correct ({float(result)} = {float(self.initial_result)})", every_rank=True)
                _say(f"{prefix} Correct result (but possible Application error) ({message})", every_rank=True)
            self.continue_requested = not fatal
            return
        if comparison > tolerance:
            self.continue_requested = not fatal
            _say(f"{prefix} First rerun: unexpected result is not reproducible within the tolerance "
                 f"({float(result)} != {float(self.initial_result)})", every_rank=True)
            self._track(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, result, message)
            _say(f"{prefix} Possible transient error!", every_rank=True)
        else:
            self.checkpoint_requested, self.continue_requested = fatal, not fatal
            self.suspicious = node_and_device()  # a re-run from the checkpoint must run elsewhere
            self._track(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, result, message)
            _say(f"{prefix} First rerun: unexpected result is reproducible within the tolerance "
                 f"({float(result)} = {float(self.initial_result)}). "
                 "Need to rerun on a different GPU to verify correctness.", every_rank=True)

    def _track(self, status: RerunValidationStatus, result: torch.Tensor, message: str) -> None:
        """One line of --result-rejected-tracker-filename, in upstream's format."""
        if self.tracker_filename is None:
            return
        node, device = node_and_device()
        line = (f"ts={datetime.datetime.now()} node={node} device={device} "
                f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={_rank()} iteration={self.iteration} "
                f"status=RerunValidationStatus.{status.name} result={result} message='{message}'\n")
        try:
            with open(self.tracker_filename, "a") as f:
                f.write(line)
        except OSError as e:  # as upstream: the record is lost, the run goes on
            _say(f"{_where()}: could not log validation error to {self.tracker_filename} ({e})", every_rank=True)

    def is_unexpectedly_large(self, result: torch.Tensor, threshold: float, context: str,
                              num_samples: int = 100) -> bool:
        """A rejection function: the value is >= ``threshold`` x the largest of its first
        ``num_samples`` values (those are only recorded)."""
        value = abs(float(result))
        if not math.isfinite(value):
            return False  # NaN/Inf have their own checks
        if self.value_counts[context] < num_samples:
            self.value_counts[context] += 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            return False
        return value >= self.max_values[context] * threshold

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self, data_iterator: Optional[RerunDataIterator] = None) -> Optional[Dict[str, Any]]:
        """What a checkpoint keeps (None when disabled): ``common`` (the same on every rank:
        mode, state, iteration) and ``rank`` (this rank's: requests, the failed call and its
        result, the suspicious node and device, the injector, the spike statistics, and, with
        a re-run pending, the batches of the step). Plain values and tensors only (a
        ``weights_only`` load reads them)."""
        if not self.enabled:
            return None
        pending = (self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
                   and isinstance(data_iterator, RerunDataIterator))
        return {
            "common": {"mode": self.mode.value, "state": self.state.name, "iteration": self.iteration},
            "rank": {
                "rerun_requested": self.rerun_requested,
                "checkpoint_requested": self.checkpoint_requested,
                "restart_again_requested": self.restart_again_requested,
                "continue_requested": self.continue_requested,
                "injector": self.injector.state_dict(),
                "failed_call": list(self.failed_call) if self.failed_call is not None else None,
                "initial_result": self.initial_result.cpu() if self.initial_result is not None else None,
                "suspicious": list(self.suspicious) if self.suspicious is not None else None,
                "data_iterator": data_iterator.state_dict() if pending else None,
                "value_counts": dict(self.value_counts),
                "max_values": dict(self.max_values),
            },
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved (this rank's part). The spike statistics and the
        injector always (a resumed run judges like an uninterrupted one); a pending re-run
        from the checkpoint when there is one. Disabled: nothing (as upstream)."""
        if not self.enabled:
            _say("disabled via CLI, ignoring machine state saved in checkpoint")
            return
        common, mine = state["common"], state["rank"]
        self.value_counts = defaultdict(int, {str(k): int(v) for k, v in mine["value_counts"].items()})
        self.max_values = {str(k): float(v) for k, v in mine["max_values"].items()}
        self.injector.load_state_dict(mine["injector"])
        if RerunState[common["state"]] == RerunState.NOT_RUNNING_YET:
            return
        _say("Getting RerunStateMachine state from checkpoint. Will rerun step.")
        self.mode = RerunMode(common["mode"])
        self.state = RerunState[common["state"]]
        self.iteration = int(common["iteration"])
        self.rerun_requested = bool(mine["rerun_requested"])
        self.checkpoint_requested = bool(mine["checkpoint_requested"])
        self.restart_again_requested = bool(mine["restart_again_requested"])
        self.continue_requested = bool(mine["continue_requested"])
        self.failed_call = (str(mine["failed_call"][0]), int(mine["failed_call"][1])) if mine["failed_call"] else None
        self.initial_result = mine["initial_result"]
        self.suspicious = tuple(mine["suspicious"]) if mine["suspicious"] is not None else None
        self.pending_data = mine["data_iterator"]

    def resume_at(self, iteration: int, optimizer_loaded: bool = False) -> None:
        """The trainer's iteration after a load (the last completed step), as upstream
        overwrites the machine's: the next step (or the pending re-run) is ``iteration + 1``.
        Resumed with the optimizer's state, the job validates its first step too (upstream
        does not): the checkpoint of the step before, which a stop with 16 saves again, is
        the one just loaded, so the resumed run judges like an uninterrupted one."""
        self.iteration = iteration
        if iteration > 0 and optimizer_loaded:
            self.first_step_done = True

    # ---------------------------------------------------------------- report_stats
    def _record_for_stats(self, call, result) -> None:
        if self.state == RerunState.INITIAL_RUN:
            self.rerun_requested = True
            self.initial_results[call] = result.detach().clone()
        elif call in self.initial_results:
            self.stats[call[0]].append(relative_difference(self.initial_results[call], result))

    def _maybe_report_stats(self) -> None:
        if self.iteration % self.REPORTING_INTERVAL_ITERATIONS != 0:
            return
        gathered = [dict(self.stats)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, dict(self.stats))
        _say(f"iteration {self.iteration}: Stats on computation determinism in validation calls")
        for message in sorted({m for part in gathered for m in part}):
            values = [v for part in gathered for v in part.get(message, [])]
            _say(f"  From validation call '{message}': {format_stats(values)}")

    # ---------------------------------------------------------------- state of a step
    def _save_state(self) -> None:
        self.saved = {
            "random": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "extra": self.extra_state() if self.extra_state else None,
        }

    def _back_to_step_start(self, data_iterator) -> None:
        """The RNG states and counters saved at the step's start, and its batches served again."""
        self._restore_state()
        if data_iterator is not None:
            data_iterator.rewind()

    def _restore_state(self) -> None:
        random.setstate(self.saved["random"])
        np.random.set_state(self.saved["numpy"])
        torch.set_rng_state(self.saved["torch"])
        if self.saved["cuda"] is not None:
            torch.cuda.set_rng_state(self.saved["cuda"])
        if self.restore_extra_state is not None:
            self.restore_extra_state(self.saved["extra"])

    def _any_rank(self, *flags: bool):
        """Each flag OR-ed over every rank (a single flag comes back alone)."""
        result = tuple(bool(v > 0) for v in sum_over_ranks([int(f) for f in flags]).tolist())
        return result[0] if len(result) == 1 else result


def format_stats(values: List[float]) -> str:
    """Count, min, median, mean and max of relative differences (inf counted apart)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return f"{len(values)} samples, none finite"
    return (f"{len(values)} samples ({len(values) - len(finite)} inf), min {min(finite):.3e}, "
            f"median {statistics.median(finite):.3e}, mean {statistics.fmean(finite):.3e}, max {max(finite):.3e}")


def rerun_state_machine_from_args(args) -> RerunStateMachine:
    injector = ErrorInjector(args.error_injection_rate, RerunDiagnostic(args.error_injection_type), seed=args.seed)
    return RerunStateMachine(RerunMode(args.rerun_mode), injector,
                             result_rejected_tracker_filename=getattr(args, "result_rejected_tracker_filename", None))
