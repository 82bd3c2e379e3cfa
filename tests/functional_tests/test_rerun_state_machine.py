"""The re-run state machine and the weight hash check in pretrain_gpt.py at 2 ranks (MFSDP
ZeRO-1, 2 micro-batches per rank per step), with injected faults:

* a transient fault on a non-fatal check (spiky loss) is detected, the step is re-run on the
  same micro-batches and RNG, and training continues with the losses and grad norms of a run
  without injection (which also checks the weight hashes every iteration: they match), under
  MFSDP ZeRO-1 and ZeRO-3 and under DDP;
* a persistent fault on the fatal NaN check is reproduced by the re-run: a checkpoint of the
  step before is saved and the job stops with exit code 16 and upstream's message;
* a transient fault on the fatal NaN check is not reproduced: the rank is flagged and the
  job stops with exit code 17;
* report_stats runs every step twice, reports zero differences gathered from both ranks, and
  keeps the losses.
"""

import re
import subprocess
import sys

import pytest

from test_pretrain_gpt import REPO, TIMEOUT, _env, read_metrics, run_torchrun

ARGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--train-iters", "4",
    "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--num-workers", "0", "--seed", "3",
    "--use-mfsdp", "--data-parallel-sharding-strategy", "optim",
]
INJECT = ["--rerun-mode", "validate_results", "--error-injection-rate", "1"]


def launch(args):
    """pretrain_gpt.py under torchrun at 2 ranks, whatever its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "pretrain_gpt.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """No injection, the weight hashes checked every iteration: (train metrics, stdout)."""
    log_dir = tmp_path_factory.mktemp("reference") / "logs"
    proc = run_torchrun(ARGS + ["--log-dir", str(log_dir), "--check-weight-hash-across-dp-replicas-interval", "1"])
    return read_metrics(str(log_dir))[0], proc.stdout


def test_weight_hashes_match_every_iteration(reference):
    _, out = reference
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
    proc = run_torchrun(layout + INJECT + ["--error-injection-type", "transient_error", "--log-dir", str(log_dir),
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


def test_persistent_fault_saves_and_stops_with_code_16(tmp_path):
    proc = launch(ARGS + INJECT + ["--error-injection-type", "persistent_error", "--save", str(tmp_path / "ckpt")])
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    assert "exiting with code 16" in out, out[-3000:]
    assert "Result validation enabled (--rerun-mode validate_results)" in out
    assert "Injecting error type Persistent error" in out
    assert "First rerun: unexpected result is reproducible within the tolerance" in out
    assert ("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
            "iteration and establish a diagnostic") in out
    assert "iteration        2/" not in out  # stopped before step 2's optimizer step
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_transient_fault_on_a_fatal_check_flags_the_rank_and_stops_with_code_17(tmp_path):
    proc = launch(ARGS + INJECT + ["--error-injection-type", "transient_error"])
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    assert "exiting with code 17" in out, out[-3000:]
    assert "message='found NaN in local forward loss calculation'" in out
    for rank in (0, 1):
        assert re.search(rf"ERROR Rank {rank}, node \S+, device cpu, iteration #2: Possible transient error!", out)
    assert "Exiting now. The job can be resumed from a previous checkpoint" in out
    assert "iteration        2/" not in out


def test_report_stats_runs_every_step_twice_and_reports_no_difference(reference, tmp_path):
    log_dir = tmp_path / "logs"
    out = run_torchrun(ARGS + ["--rerun-mode", "report_stats", "--log-dir", str(log_dir)]).stdout
    for iteration in (2, 4):
        assert f"iteration {iteration}: Stats on computation determinism in validation calls" in out, out[-3000:]
    # Steps 1-2, then 1-4: 2 micro-batches on each of 2 ranks, each run twice; CPU is deterministic.
    for samples in (8, 16):
        assert (f"From validation call 'found NaN in local forward loss calculation': {samples} samples (0 inf), "
                "min 0.000e+00, median 0.000e+00, mean 0.000e+00, max 0.000e+00") in out, out[-3000:]
    train, ref = read_metrics(str(log_dir))[0], reference[0]
    assert [train[it]["lm_loss"] for it in ref] == [ref[it]["lm_loss"] for it in ref]
