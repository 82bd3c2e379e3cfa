"""--profile with --use-pytorch-profiler on 2 ranks (a trace of the chosen steps, from the
chosen rank only, with the step's phase ranges) and --grad-reduce-in-bf16 under MFSDP with
--bf16, in one run."""

import glob
import json
import math

from test_pretrain_gpt import MODEL_ARGS, read_metrics, run_ranks


def _set(args, flag, value):
    i = args.index(flag)
    return args[:i + 1] + [value] + args[i + 2:]


def test_profile_window_and_bf16_grad_reduce(tmp_path):
    args = _set(_set(MODEL_ARGS, "--train-iters", "3"), "--eval-iters", "0")
    proc = run_ranks(args + [
        "--use-mfsdp", "--bf16", "--grad-reduce-in-bf16",
        "--profile", "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "2",
        "--profile-ranks", "0", "--tensorboard-dir", str(tmp_path / "tb"), "--log-dir", str(tmp_path / "logs"),
    ])
    train, _ = read_metrics(str(tmp_path / "logs"))
    assert sorted(train) == [1, 2, 3] and all(math.isfinite(r["lm_loss"]) for r in train.values())
    traces = glob.glob(str(tmp_path / "tb" / "*.pt.trace.json"))
    assert [p.split("/")[-1].split(".")[0] for p in traces] == ["rank0"], (traces, proc.stdout[-2000:])
    with open(traces[0]) as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    # Step 1 (0-based) is the second iteration: only it is in the window.
    assert "iteration 2" in names and "iteration 1" not in names and "iteration 3" not in names
    # Each phase of the step is a range (megatron/core/step_phases.py), read back by
    # benchmarks/profile_vs_torchtitan.py.
    phases = {"step/data", "step/forward", "step/loss", "step/backward", "step/grad-finalize", "step/optimizer",
              "step/logging"}
    assert phases <= names, phases - names
