"""One seed, one global batch: the same loss curve at 1, 2 and 4 ranks, MFSDP or DDP.

pretrain_gpt.py end to end (fp32, gloo, no dropout). The initial weights are bitwise the
same at every world size (each parameter seeded by its name), the data order depends only
on the global batch, and the loss is normalized over the global batch, so the curves
differ only by reduction order.
"""

import pytest

from test_pretrain_gpt import MODEL_ARGS, read_metrics, run_ranks

ITERS = 10  # MODEL_ARGS' run, so the 2-rank MFSDP and DDP curves are the session's shared runs
assert MODEL_ARGS[MODEL_ARGS.index("--train-iters") + 1] == str(ITERS)

RUNS = {
    "mfsdp-1": (1, ["--use-mfsdp"]),
    "mfsdp-4": (4, ["--use-mfsdp"]),
    "mfsdp-2-no-meta": (2, ["--use-mfsdp", "--no-init-model-with-meta-device"]),
    "zero1-4": (4, ["--use-mfsdp", "--data-parallel-sharding-strategy", "optim"]),
}


def _curve(log_dir):
    train, _ = read_metrics(str(log_dir))
    return [train[it]["lm_loss"] for it in range(1, ITERS + 1)]


@pytest.fixture(scope="module")
def curves(tmp_path_factory, mfsdp_run, ddp_run):
    # mfsdp-2 also writes TensorBoard/W&B files and logs throughput: none of it touches the losses.
    out = {"mfsdp-2": _curve(mfsdp_run[0] / "logs"), "ddp-2": _curve(ddp_run[0] / "logs")}
    for name, (nproc, flags) in RUNS.items():
        log_dir = tmp_path_factory.mktemp(name) / "logs"
        run_ranks(MODEL_ARGS + flags + ["--log-dir", str(log_dir)], nproc=nproc)
        out[name] = _curve(log_dir)
    return out


def test_loss_curves_match_across_world_sizes_and_strategies(curves):
    reference = curves["mfsdp-1"]
    for name, curve in curves.items():
        assert curve == pytest.approx(reference, rel=2e-5, abs=1e-6), name
    # Same world size and strategy, meta build or not: bitwise the same run.
    assert curves["mfsdp-2"] == curves["mfsdp-2-no-meta"]
    print("\nloss curves (seed 7):")
    for name, curve in curves.items():
        print(f"  {name:16s} " + " ".join(f"{v:.6f}" for v in curve))
