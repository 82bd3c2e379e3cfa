"""The re-run state machine on one process, driven by a fake step whose loss is a random
draw (so a re-run that did not restore the RNG would see another value): the flows of
validate_results and report_stats, the data iterator's replay, the machine's state through a
checkpoint (the re-run from it), the result-rejected tracker file, and the flags' checks."""

import json
import math
import os
import re

import pytest
import torch

from megatron.core import rerun_state_machine
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    ErrorInjector,
    RerunDataIterator,
    RerunDiagnostic,
    RerunMode,
    RerunStateMachine,
    relative_difference,
)
from megatron.training.arguments import parse_args
from megatron.training.step_counters import restore_step_counters, save_step_counters


def run_step(machine, data, poison=None, fatal=True):
    """One training step: (runs, losses seen, the machine's decision). ``poison(run)``
    makes a run's loss NaN."""
    runs, losses = 0, []
    while machine.should_run_forward_backward(data):
        batch = next(data)
        loss = torch.rand(()) + batch
        if poison is not None and poison(runs):
            loss = torch.tensor(math.nan)
        machine.validate_result(loss, torch.isnan, "NaN loss", fatal=fatal)
        losses.append(float(loss))
        runs += 1
    return runs, losses, machine.should_checkpoint_and_exit()


def machine_after_first_step(mode, injector=None):
    machine = RerunStateMachine(RerunMode(mode), injector)
    data = RerunDataIterator(iter(range(100)))
    # validate_results trusts the first step; report_stats runs every step twice.
    assert run_step(machine, data)[0] == (1 if mode == "validate_results" else 2)
    return machine, data


def test_data_iterator_replays_the_step():
    data = RerunDataIterator(iter(range(10)))
    data.advance()
    assert [next(data), next(data)] == [0, 1]
    data.rewind()
    assert [next(data), next(data), next(data)] == [0, 1, 2]
    data.advance()
    assert next(data) == 3


def test_relative_difference():
    assert relative_difference(torch.tensor(2.0), torch.tensor(2.0)) == 0.0
    assert relative_difference(torch.tensor(math.nan), torch.tensor(math.nan)) == 0.0
    assert relative_difference(torch.tensor(math.nan), torch.tensor(1.0)) == math.inf
    assert relative_difference(torch.tensor(1.0), torch.tensor(3.0)) == pytest.approx(1.0)


def test_clean_step_runs_once():
    machine, data = machine_after_first_step("validate_results")
    runs, losses, decision = run_step(machine, data)
    assert runs == 1 and decision == (False, False, 0) and machine.reruns == 0


def test_reproducible_nan_saves_and_exits_16():
    machine, data = machine_after_first_step("validate_results")
    runs, losses, decision = run_step(machine, data, poison=lambda run: True)
    assert runs == 2 and decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)


def test_transient_nan_exits_17_and_a_non_fatal_one_continues():
    machine, data = machine_after_first_step("validate_results")
    runs, losses, decision = run_step(machine, data, poison=lambda run: run == 0)
    assert runs == 2 and decision == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    machine, data = machine_after_first_step("validate_results")
    runs, losses, decision = run_step(machine, data, poison=lambda run: run == 0, fatal=False)
    assert runs == 2 and decision == (False, False, 0)
    assert not math.isnan(losses[-1])


def test_rerun_sees_the_same_batch_and_random_draws():
    machine, data = machine_after_first_step("report_stats")
    runs, losses, decision = run_step(machine, data)
    assert runs == 2 and losses[0] == losses[1] and decision == (False, False, 0)
    assert list(machine.stats["NaN loss"]) == [0.0, 0.0]  # the first step's comparison too
    runs, losses, _ = run_step(machine, data)
    assert runs == 2 and losses[0] == losses[1] and losses[0] >= 2  # batch 2: steps did not skip data


@pytest.mark.parametrize("kind, code", [("transient_error", EXIT_CODE_FAILED_ON_RESULT_VALIDATION),
                                        ("persistent_error", EXIT_CODE_RESUME_TO_DISAMBIGUATE),
                                        ("correct_result", EXIT_CODE_RESUME_TO_DISAMBIGUATE)])
def test_injected_errors_are_classified(kind, code):
    machine, data = machine_after_first_step("validate_results", ErrorInjector(1, RerunDiagnostic(kind)))
    runs, losses, decision = run_step(machine, data)
    assert runs == 2 and decision[1:] == (True, code)


def test_disabled_never_reruns():
    machine = RerunStateMachine(RerunMode.DISABLED, ErrorInjector(1))
    data = RerunDataIterator(iter(range(10)))
    for _ in range(3):
        runs, losses, decision = run_step(machine, data, poison=lambda run: True)
        assert runs == 1 and math.isnan(losses[0]) and decision == (False, False, 0)
    assert machine.reruns == 0


BASE = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 " \
       "--train-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --lr 1e-3"


@pytest.mark.parametrize("extra, message", [
    ("--rerun-mode disabled --error-injection-rate 5", "add --rerun-mode validate_results"),
    ("--rerun-mode validate_results --error-injection-rate -1", "--error-injection-rate must be >= 0"),
    ("--check-weight-hash-across-dp-replicas-interval 0", "must be >= 1"),
    ("--rerun-mode disabled --check-for-spiky-loss", "add --rerun-mode validate_results"),
    ("--result-rejected-tracker-filename /nonexistent-dir/rejected.txt", "cannot append to it"),
])
def test_bad_flags_are_one_line_errors(extra, message):
    with pytest.raises((ValueError, SystemExit)) as info:
        parse_args(argv=(BASE + " " + extra).split(), world_size=1, cuda_available=False)
    assert message in str(info.value)


def test_flags_parse_with_upstream_values():
    args = parse_args(argv=(BASE + " --rerun-mode report_stats --error-injection-type persistent_error "
                            "--check-weight-hash-across-dp-replicas-interval 10").split(),
                      world_size=1, cuda_available=False)
    assert (args.rerun_mode, args.error_injection_type, args.error_injection_rate) == \
        ("report_stats", "persistent_error", 0)
    assert args.check_weight_hash_across_dp_replicas_interval == 10


def test_test_mode_checks_the_weight_hashes_every_iteration():
    parse = lambda extra: parse_args(argv=(BASE + extra).split(), world_size=1, cuda_available=False)
    assert parse(" --test-mode").check_weight_hash_across_dp_replicas_interval == 1
    assert parse(" --test-mode --check-weight-hash-across-dp-replicas-interval 5") \
        .check_weight_hash_across_dp_replicas_interval == 5
    assert parse("").check_weight_hash_across_dp_replicas_interval is None


def test_step_counters_come_back_to_where_the_step_started():
    """What a re-run restores besides the RNG: the routers' token counts (plain tensor
    attributes) and the MoE/MTP metrics objects, as copies (a state may serve twice)."""

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.local_tokens_per_expert = torch.zeros(4)
            self.metrics = {"records": 0}

    model = torch.nn.Sequential(Router(), torch.nn.Linear(2, 2))
    saved = save_step_counters(model)
    for _ in range(2):  # a forward counts, the re-run restores; twice
        model[0].local_tokens_per_expert += 3
        model[0].metrics["records"] += 1
        restore_step_counters(saved)
        assert model[0].local_tokens_per_expert.tolist() == [0.0] * 4 and model[0].metrics == {"records": 0}


# ------------------------------------------------------------------ through a checkpoint
def through_checkpoint(state, tmp_path):
    """The machine's state as a checkpoint holds it: its per-rank part written with torch.save
    and read back with weights_only=True (what checkpointing.py does), its common part as JSON."""
    path = tmp_path / "rerun_rank.pt"
    torch.save(state["rank"], path)
    return {"common": json.loads(json.dumps(state["common"])), "rank": torch.load(path, weights_only=True)}


def stopped_with_code_16(kind, tracker=None):
    """A job whose step 2 hit an injected error that the in-place re-run reproduced: the
    machine, its data iterator (already past step 2's batches) and step 2's losses."""
    machine = RerunStateMachine(RerunMode.VALIDATE_RESULTS, ErrorInjector(1, RerunDiagnostic(kind)),
                                result_rejected_tracker_filename=tracker)
    data = RerunDataIterator(iter(range(100)))
    run_step(machine, data)
    rng_at_start = torch.get_rng_state()
    runs, losses, decision = run_step(machine, data)
    assert runs == 2 and decision == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    # The checkpoint is taken at the step's start: its RNG, its batches served again.
    assert torch.equal(torch.get_rng_state(), rng_at_start)
    return machine, data, losses


def resume(state, tmp_path, kind):
    """A new job (data read from the checkpoint's position: step 2's batch is 1), from the state."""
    machine = RerunStateMachine(RerunMode.VALIDATE_RESULTS, ErrorInjector(1, RerunDiagnostic(kind)))
    machine.load_state_dict(through_checkpoint(state, tmp_path))
    machine.resume_at(1)
    return machine, RerunDataIterator(iter(range(1, 100)))


@pytest.mark.parametrize("kind, verdict", [("persistent_error", "Possible persistent error!"),
                                           ("correct_result", "Correct result (but possible Application error)")])
def test_resumed_after_code_16_the_step_is_rerun_on_another_device(kind, verdict, tmp_path, monkeypatch, capsys):
    machine, data, losses = stopped_with_code_16(kind)
    state = machine.state_dict(data)
    assert state["common"] == {"mode": "validate_results", "state": "WILL_RERUN_FROM_CHECKPOINT", "iteration": 2}
    assert state["rank"]["data_iterator"] == {"replay": [1]} and state["rank"]["failed_call"] == ["NaN loss", 1]
    rng = torch.get_rng_state()
    monkeypatch.setattr(rerun_state_machine, "node_and_device", lambda: ("another-node", "0"))
    machine, data = resume(state, tmp_path, kind)
    torch.set_rng_state(rng)  # the checkpoint's RNG
    runs, again, decision = run_step(machine, data)
    # One more run, of the same batch with the same draws; a fatal check then stops (17).
    assert runs == 1 and again == losses[:1] and decision == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert verdict in capsys.readouterr().out
    assert next(data) == 2  # the replayed batch stood for the wrapped iterator's first


def test_resumed_on_the_same_device_asks_to_resume_again(tmp_path):
    machine, data, _ = stopped_with_code_16("persistent_error")
    machine, data = resume(machine.state_dict(data), tmp_path, "persistent_error")
    runs, _, decision = run_step(machine, data)
    assert runs == 1 and decision == (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)


def test_between_steps_the_spike_statistics_and_the_injector_are_kept(tmp_path):
    machine = RerunStateMachine(RerunMode.VALIDATE_RESULTS, ErrorInjector(1000, RerunDiagnostic.CORRECT_RESULT))
    data = RerunDataIterator(iter(range(100)))
    spiky = lambda loss: machine.is_unexpectedly_large(loss, 10, "loss")
    for _ in range(5):  # the first step is not validated
        while machine.should_run_forward_backward(data):
            machine.validate_result(torch.rand(()) + next(data), spiky, "Spiky loss", fatal=False)
        machine.should_checkpoint_and_exit()
    state = machine.state_dict(data)
    assert state["common"]["state"] == "NOT_RUNNING_YET" and state["rank"]["data_iterator"] is None
    resumed = RerunStateMachine(RerunMode.VALIDATE_RESULTS, ErrorInjector(1000, RerunDiagnostic.CORRECT_RESULT))
    resumed.load_state_dict(through_checkpoint(state, tmp_path))
    assert resumed.value_counts == machine.value_counts == {"loss": 4} and resumed.max_values == machine.max_values
    assert resumed.injector.random.getstate() == machine.injector.random.getstate()
    assert resumed.state.name == "NOT_RUNNING_YET"
    assert RerunStateMachine(RerunMode.DISABLED).state_dict(data) is None  # disabled: nothing saved


def test_tracker_file_gets_upstreams_lines(tmp_path, monkeypatch):
    tracker = tmp_path / "rejected.txt"
    monkeypatch.setenv("SLURM_JOBID", "77")
    machine, data, _ = stopped_with_code_16("persistent_error", tracker=str(tracker))
    machine, data = resume(machine.state_dict(data), tmp_path, "persistent_error")
    machine.tracker_filename = str(tracker)  # the resumed job names the same file
    monkeypatch.setattr(rerun_state_machine, "node_and_device", lambda: ("another-node", "0"))
    run_step(machine, data)
    lines = tracker.read_text().splitlines()
    pattern = (r"ts=\S+ \S+ node=(\S+) device=(\S+) jobID=77 rank=0 iteration=2 "
               r"status=RerunValidationStatus\.(\w+) result=[\d.]+ message='NaN loss'")
    parsed = [re.fullmatch(pattern, line).groups() for line in lines]
    node = os.uname()[1]
    assert parsed == [(node, "cpu", "INITIAL_RUN"), (node, "cpu", "FIRST_RERUN_REPRODUCIBLE"),
                      ("another-node", "0", "SECOND_RERUN_NOT_REPRODUCIBLE")]
    # Disabled: no re-run, a rejected result is still recorded.
    machine = RerunStateMachine(RerunMode.DISABLED, result_rejected_tracker_filename=str(tracker))
    run_step(machine, RerunDataIterator(iter(range(10))), poison=lambda run: True)
    assert "status=RerunValidationStatus.RERUN_DISABLED result=nan " in tracker.read_text().splitlines()[-1]
