"""Runs more than one test file reads: the reference DDP and MFSDP runs of MODEL_ARGS are
made once per session."""

import pytest

from test_pretrain_gpt import MODEL_ARGS, run_ranks


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """MODEL_ARGS with DDP at 2 ranks: (output directory, stdout)."""
    out = tmp_path_factory.mktemp("ddp")
    proc = run_ranks(MODEL_ARGS + ["--log-dir", str(out / "logs")])
    return out, proc.stdout


@pytest.fixture(scope="session")
def mfsdp_run(tmp_path_factory):
    """MODEL_ARGS with MFSDP ZeRO-3 at 2 ranks and every metric sink on: (output directory, stdout)."""
    out = tmp_path_factory.mktemp("mfsdp")
    proc = run_ranks(MODEL_ARGS + [
        "--use-mfsdp", "--log-dir", str(out / "logs"), "--tensorboard-dir", str(out / "tb"),
        "--wandb-project", "mfsdp-functional", "--wandb-exp-name", "zero3", "--wandb-save-dir", str(out / "wandb"),
        "--log-throughput",
    ])
    return out, proc.stdout
