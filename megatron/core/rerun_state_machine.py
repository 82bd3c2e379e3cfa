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
  checkpoint at the step before and stops with ``EXIT_CODE_RESUME_TO_DISAMBIGUATE`` (16), to be
  re-run on other devices; a non-fatal one continues.

Modes (Megatron's): ``disabled`` (no validation here: a NaN/Inf gradient skips the step, as
before), ``validate_results`` (the above), ``report_stats`` (every step runs twice and the
relative difference of each validated result between the two runs is reported every
``REPORTING_INTERVAL_ITERATIONS`` steps: how deterministic the computation is).

``--error-injection-rate N`` / ``--error-injection-type`` make the machine testable: about
once every N validations (every one with N=1) a result is declared wrong, and the re-run's
comparison is made to match or not as the injected type says.

Flow in the trainer (``should_run_forward_backward`` is the loop's condition)::

    while machine.should_run_forward_backward(data_iterator):
        zero grads; forward/backward (the loss function calls machine.validate_result)
    save, exit, code = machine.should_checkpoint_and_exit()

The first step of a run is not validated (as upstream: a checkpoint of the step before must
be possible). Re-running from the checkpoint on other devices (upstream's second re-run, with
the machine's state in the checkpoint) is not implemented: a job stopped with 16 is resumed
like any other.
"""

from __future__ import annotations

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


class _State(Enum):
    IDLE = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    STOPPING = 3  # the re-run decided the job stops (code in ``exit_code``)


def _where() -> str:
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return f"Rank {_rank()}, node {os.uname()[1]}, device {device}"


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


class RerunDataIterator:
    """Wraps the training iterator so that a step's micro-batches can be served again."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.served: List[Any] = []  # this step's batches, in order
        self.replay: List[Any] = []

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.replay.pop(0) if self.replay else next(self.iterator)
        self.served.append(batch)
        return batch

    def advance(self) -> None:
        """A new step: forget the last one's batches."""
        self.served, self.replay = [], []

    def rewind(self) -> None:
        """Serve this step's batches again, from its first."""
        self.replay, self.served = self.served + self.replay, []


class ErrorInjector:
    """Declares about one validation in ``rate`` wrong (its own RNG: the training RNG stream
    stays as without injection), then makes the re-run agree or not per ``kind``."""

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

    def comparison_on_rerun(self, measured: float) -> float:
        """The re-run's comparison: the measured one unless an error was injected."""
        injected, self.injected = self.injected, None
        if injected is None:
            return measured
        return MISMATCH if injected == RerunDiagnostic.TRANSIENT_ERROR else MATCH


class RerunStateMachine:
    """One per run (see the module docstring). ``extra_state`` saves, and
    ``restore_extra_state`` restores, whatever else a step changes before validation."""

    REPORTING_INTERVAL_ITERATIONS = 2

    def __init__(self, mode: RerunMode = RerunMode.DISABLED, injector: Optional[ErrorInjector] = None,
                 extra_state: Optional[Callable[[], Any]] = None,
                 restore_extra_state: Optional[Callable[[Any], None]] = None):
        self.mode = RerunMode(mode)
        self.injector = injector or ErrorInjector()
        self.extra_state, self.restore_extra_state = extra_state, restore_extra_state
        self.state = _State.IDLE
        self.iteration = 0  # 1-based number of the step being run
        self.first_step_done = False
        self.saved: Optional[Dict[str, Any]] = None
        self.calls: Dict[str, int] = defaultdict(int)  # this run's validations so far, per message
        self.failed_call: Optional[Tuple[str, int]] = None
        self.initial_result = None
        self.rerun_requested = self.continue_requested = self.checkpoint_requested = False
        self.exit_code = 0
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
        if self.state == _State.IDLE:
            return self._start_step(data_iterator)
        if self.state == _State.INITIAL_RUN:
            if not self.enabled or not self._any_rank(self.rerun_requested):
                self.state = _State.IDLE
                return False
            return self._rerun(data_iterator)
        if self.state == _State.RERUNNING_IN_PLACE:
            return self._after_rerun()
        raise RuntimeError(f"the re-run state machine cannot run a step in state {self.state.name}")

    def _start_step(self, data_iterator) -> bool:
        self.iteration += 1
        self.state = _State.INITIAL_RUN
        if self.enabled:
            self._save_state()
            if data_iterator is not None:
                data_iterator.advance()
            self.rerun_requested = self.continue_requested = self.checkpoint_requested = False
            self.failed_call, self.initial_result = None, None
            self.initial_results = {}
        return True

    def _rerun(self, data_iterator) -> bool:
        if self.mode == RerunMode.VALIDATE_RESULTS:
            _say(f"iteration {self.iteration}: re-running the step to check whether the result is reproducible")
        self.reruns += 1
        self.state = _State.RERUNNING_IN_PLACE
        self._restore_state()
        if data_iterator is not None:
            data_iterator.rewind()
        return True

    def _after_rerun(self) -> bool:
        if self.mode == RerunMode.REPORT_STATS:
            self.state = _State.IDLE
            self._maybe_report_stats()
            return False
        will_continue, will_checkpoint = self._any_rank(self.continue_requested, self.checkpoint_requested)
        if will_continue:
            _say("Continuing normal execution because failed validation was not fatal")
            self.state = _State.IDLE
        else:
            self.state = _State.STOPPING
            self.exit_code = (EXIT_CODE_RESUME_TO_DISAMBIGUATE if will_checkpoint
                              else EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
        return False

    def should_checkpoint_and_exit(self) -> Tuple[bool, bool, int]:
        """(save a checkpoint, stop the job, exit code) once the step's runs are done."""
        self.first_step_done = True
        if self.state != _State.STOPPING:
            return False, False, 0
        if self.exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE:
            _say("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the "
                 "last iteration and establish a diagnostic")
            return True, True, self.exit_code
        _say("Exiting now. The job can be resumed from a previous checkpoint")
        return False, True, self.exit_code

    # ---------------------------------------------------------------- validation
    def validate_result(self, result: torch.Tensor, rejection_func: Callable[[torch.Tensor], Any], message: str,
                        tolerance: float = 0.0, fatal: bool = True) -> None:
        """Check ``result`` (a 0-dim tensor) where it is computed; see the module docstring."""
        if not self.enabled or self.state not in (_State.INITIAL_RUN, _State.RERUNNING_IN_PLACE):
            return
        self.calls[message] += 1
        call = (message, self.calls[message])
        if self.mode == RerunMode.REPORT_STATS:
            self._record_for_stats(call, result)
        elif self.state == _State.INITIAL_RUN:
            self._validate_initial(call, result, rejection_func)
        elif call == self.failed_call:
            self._judge_rerun(result, tolerance, fatal)

    def _validate_initial(self, call, result, rejection_func) -> None:
        if self.rerun_requested or not self.first_step_done:
            return  # one suspicious result per step is enough; the first step is trusted
        if self.injector.maybe_inject() or bool(rejection_func(result)):
            self.failed_call, self.initial_result, self.rerun_requested = call, result.detach().clone(), True
            _say(f"{_where()}: Unexpected result {float(result)} at iteration #{self.iteration} "
                 f"invocation #{call[1]} (message='{call[0]}')", every_rank=True)

    def _judge_rerun(self, result, tolerance: float, fatal: bool) -> None:
        comparison = self.injector.comparison_on_rerun(relative_difference(self.initial_result, result))
        level = "ERROR" if fatal else "WARNING"
        if comparison > tolerance:
            self.continue_requested = not fatal
            _say(f"{level} {_where()}, iteration #{self.iteration}: First rerun: unexpected result is not "
                 f"reproducible within the tolerance ({float(result)} != {float(self.initial_result)})",
                 every_rank=True)
            _say(f"{level} {_where()}, iteration #{self.iteration}: Possible transient error!", every_rank=True)
        else:
            self.checkpoint_requested, self.continue_requested = fatal, not fatal
            _say(f"{level} {_where()}, iteration #{self.iteration}: First rerun: unexpected result is "
                 f"reproducible within the tolerance ({float(result)} = {float(self.initial_result)}). "
                 "Need to rerun on a different GPU to verify correctness.", every_rank=True)

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

    # ---------------------------------------------------------------- report_stats
    def _record_for_stats(self, call, result) -> None:
        if self.state == _State.INITIAL_RUN:
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
    return RerunStateMachine(RerunMode(args.rerun_mode), injector)
