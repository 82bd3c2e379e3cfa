"""The re-run state machine and the weight hash check in pretrain_gpt.py at 2 ranks (MFSDP
ZeRO-1, 2 micro-batches per rank per step), with injected faults:

* a transient fault on a non-fatal check (spiky loss) is detected, the step is re-run on the
  same micro-batches and RNG, and training continues with the losses and grad norms of a run
  without injection (which also checks the weight hashes every iteration: they match), under
  MFSDP ZeRO-1 and ZeRO-3 and under DDP;
* a persistent fault on the fatal NaN check is reproduced by the re-run: a checkpoint of the
  step before is saved, with the machine's pending re-run in it, and the job stops with exit
  code 16 and upstream's message (and upstream's lines in --result-rejected-tracker-filename);
  resumed on the same node and device, the step is re-run from the checkpoint and the job
  asks to be resumed elsewhere (16 again);
* a run resumed from a checkpoint (the default --rerun-mode validate_results, spikes
  checked) has the losses and, saved again, the machine state of an uninterrupted one;
* a transient fault on the fatal NaN check is not reproduced: the rank is flagged and the
  job stops with exit code 17;
* report_stats runs every step twice, reports zero differences gathered from both ranks, and
  keeps the losses.
"""

import json
import re

import pytest
import torch

from test_pretrain_gpt import launch_ranks, read_metrics, run_ranks

ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--train-iters", "4",
    "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--num-workers", "0", "--seed", "3",
    "--use-mfsdp", "--data-parallel-sharding-strategy", "optim",
]
INJECT = ["--rerun-mode", "validate_results", "--error-injection-rate", "1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """No injection (--rerun-mode validate_results by default, spikes checked), the weight
    hashes checked every iteration, checkpoints at 2 and 4: (train metrics, stdout, save dir)."""
    root = tmp_path_factory.mktemp("reference")
    proc = run_ranks(ARGS + ["--log-dir", str(root / "logs"), "--check-weight-hash-across-dp-replicas-interval", "1",
                                "--check-for-spiky-loss", "--save", str(root / "ckpt"), "--save-interval", "2"])
    return read_metrics(str(root / "logs"))[0], proc.stdout, root / "ckpt"


def rerun_files(checkpoint):
    """(the machine's common part, each rank's part) in a checkpoint directory."""
    common = json.loads((checkpoint / "common.json").read_text())["content"]
    ranks = [torch.load(checkpoint / "rerun" / f"rank_{r:05d}.pt", weights_only=True) for r in (0, 1)]
    return common["rerun_state_machine"], ranks


def test_resumed_run_has_the_losses_and_the_machine_state_of_an_uninterrupted_one(reference, tmp_path):
    train_ref, out, ckpt = reference
    assert "Result validation enabled (--rerun-mode validate_results)" in out  # the default
    proc = run_ranks(ARGS + ["--log-dir", str(tmp_path / "logs"), "--check-for-spiky-loss",
                                "--load", str(ckpt / "iter_0000002"), "--save", str(tmp_path / "ckpt"),
                                "--save-interval", "2"])
    assert "resumed from" in proc.stdout
    train = read_metrics(str(tmp_path / "logs"))[0]
    assert sorted(train) == [3, 4]
    for it in (3, 4):
        assert train[it]["lm_loss"] == train_ref[it]["lm_loss"] and train[it]["grad_norm"] == train_ref[it]["grad_norm"]
    common, ranks = rerun_files(tmp_path / "ckpt" / "iter_0000004")
    common_ref, ranks_ref = rerun_files(ckpt / "iter_0000004")
    assert common == common_ref == {"mode": "validate_results", "state": "NOT_RUNNING_YET", "iteration": 4}
    for mine, ref in zip(ranks, ranks_ref):
        # Steps 2-4 validated, 2 micro-batches each: the resumed run counted step 3 too.
        assert mine["value_counts"] == ref["value_counts"] == {"loss": 6}
        assert mine == ref


def test_weight_hashes_match_every_iteration(reference):
    _, out, _ = reference
    for iteration in range(5):  # at the start, then after each step
        assert f"weight hashes match across data-parallel replicas after iteration {iteration} (" in out, out[-3000:]


# ZeRO-3 reduce-scatters every micro-batch into the gradient shard: the re-run must not add
# onto the first run's (same numbers as ZeRO-1 up to fp32 summation order).
# DDP: its gradient buckets are all-reduced in each run's backward.
@pytest.mark.parametrize("strategy, rel", [("optim", 1e-6), ("optim_grads_params", 1e-5), ("ddp", 1e-5)])
def test_transient_fault_is_rerun_and_training_continues_with_the_right_loss(reference, tmp_path, strategy, rel):
    log_dir = tmp_path / "logs"
    layout = ARGS[:ARGS.index("--use-mfsdp")] if strategy == "ddp" else ARGS + [
        "--data-parallel-sharding-strategy", strategy]
    proc = run_ranks(layout + INJECT + ["--error-injection-type", "transient_error", "--log-dir", str(log_dir),
                                           "--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss"])
    assert ("DDP" in proc.stdout) == (strategy == "ddp")
    out = proc.stdout
    # Every step after the first (rate 1) is hit on both ranks, re-run once, and continues.
    assert out.count("Injecting error type Transient error") == 2 * 3, out[-4000:]
    assert out.count("re-running the step to check whether the result is reproducible") == 3
    for rank in (0, 1):  # each rank flags itself, with its node and device
        assert re.search(rf"WARNING Rank {rank}, node \S+, device cpu, iteration #2: Possible transient error!", out)
    assert out.count("Continuing normal execution because failed validation was not fatal") == 3
    train, ref = read_metrics(str(log_dir))[0], reference[0]
    assert sorted(train) == sorted(ref) == [1, 2, 3, 4]
    for it in ref:  # the re-run served the same micro-batches, from zeroed gradients
        assert train[it]["lm_loss"] == pytest.approx(ref[it]["lm_loss"], rel=rel), it
        assert train[it]["grad_norm"] == pytest.approx(ref[it]["grad_norm"], rel=10 * rel), it


def test_persistent_fault_saves_and_stops_with_code_16_and_its_resumption_reruns_the_step(tmp_path):
    tracker = tmp_path / "rejected.txt"
    flags = ARGS + INJECT + ["--error-injection-type", "persistent_error", "--save", str(tmp_path / "ckpt"),
                             "--result-rejected-tracker-filename", str(tracker)]
    proc = launch_ranks(flags)
    out = proc.stdout
    assert proc.returncode == 16, out[-3000:]
    assert "exiting with code 16" in out, out[-3000:]
    assert "Result validation enabled (--rerun-mode validate_results)" in out
    assert "Injecting error type Persistent error" in out
    assert "First rerun: unexpected result is reproducible within the tolerance" in out
    assert ("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
            "iteration and establish a diagnostic") in out
    assert "iteration        2/" not in out  # stopped before step 2's optimizer step
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    # The checkpoint holds the pending re-run: the failed call, its result, the step's batches.
    common, ranks = rerun_files(tmp_path / "ckpt" / "iter_0000001")
    assert common == {"mode": "validate_results", "state": "WILL_RERUN_FROM_CHECKPOINT", "iteration": 2}
    for part in ranks:
        assert part["failed_call"] == ["found NaN in local forward loss calculation", 1]
        assert part["checkpoint_requested"] and part["injector"]["injected"] == "persistent_error"
        assert len(part["data_iterator"]["replay"]) == 2  # 2 micro-batches per rank
    # Both ranks' rejection and verdict, in upstream's format.
    lines = tracker.read_text().splitlines()
    for rank in (0, 1):
        for status in ("INITIAL_RUN", "FIRST_RERUN_REPRODUCIBLE"):
            assert sum(bool(re.fullmatch(
                rf"ts=\S+ \S+ node=\S+ device=cpu jobID=\S+ rank={rank} iteration=2 status=RerunValidationStatus\."
                rf"{status} result=\S+ message='found NaN in local forward loss calculation'", line))
                for line in lines) == 1, lines
    # Resumed on the same node and device: the step is re-run from the checkpoint, which
    # asks for another device (exit 16 again, no new checkpoint).
    out = launch_ranks(flags + ["--load", str(tmp_path / "ckpt")]).stdout
    assert "Getting RerunStateMachine state from checkpoint. Will rerun step." in out, out[-3000:]
    assert "iteration 2: re-running the step from the checkpoint to establish a diagnostic" in out
    for rank in (0, 1):
        assert re.search(rf"Rank {rank}, node \S+, device cpu, iteration #2: Got rescheduled on the same GPU", out)
    assert "Exiting now. Please resume the job from the same checkpoint to rerun the last iteration" in out
    assert "exiting with code 16" in out and "iteration        2/" not in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_transient_fault_on_a_fatal_check_flags_the_rank_and_stops_with_code_17(tmp_path):
    proc = launch_ranks(ARGS + INJECT + ["--error-injection-type", "transient_error"])
    out = proc.stdout
    assert proc.returncode == 17, out[-3000:]
    assert "exiting with code 17" in out, out[-3000:]
    assert "message='found NaN in local forward loss calculation'" in out
    for rank in (0, 1):
        assert re.search(rf"ERROR Rank {rank}, node \S+, device cpu, iteration #2: Possible transient error!", out)
    assert "Exiting now. The job can be resumed from a previous checkpoint" in out
    assert "iteration        2/" not in out


def test_report_stats_runs_every_step_twice_and_reports_no_difference(reference, tmp_path):
    log_dir = tmp_path / "logs"
    out = run_ranks(ARGS + ["--rerun-mode", "report_stats", "--log-dir", str(log_dir)]).stdout
    for iteration in (2, 4):
        assert f"iteration {iteration}: Stats on computation determinism in validation calls" in out, out[-3000:]
    # Steps 1-2, then 1-4: 2 micro-batches on each of 2 ranks, each run twice; CPU is deterministic.
    for samples in (8, 16):
        assert (f"From validation call 'found NaN in local forward loss calculation': {samples} samples (0 inf), "
                "min 0.000e+00, median 0.000e+00, mean 0.000e+00, max 0.000e+00") in out, out[-3000:]
    train, ref = read_metrics(str(log_dir))[0], reference[0]
    assert [train[it]["lm_loss"] for it in ref] == [ref[it]["lm_loss"] for it in ref]
