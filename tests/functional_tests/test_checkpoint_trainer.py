"""End to end: pretrain_gpt.py saves, is interrupted (stop, SIGKILL mid-save, SIGTERM),
resumes; the checkpoints convert with the command-line tools.

* 10 + 10 iterations (2 ranks, MFSDP ZeRO-3, dropout on, --async-save on the first half)
  give exactly the losses of 20 uninterrupted iterations (fp32 on CPU, bitwise).
* A run killed with SIGKILL while its iteration-10 checkpoint is written (after all
  data, before the rename; held there by a test hook) leaves iteration 5 intact and
  tracked; the resumed run repeats the killed run's losses bit for bit.
* SIGTERM to one rank of two: both finish the iteration, save, and exit with status 0.
* The 2-rank checkpoint converts to Hugging Face (transformers loads it and gives our
  logits) and to one consolidated safetensors file, through the CLI scripts.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_pretrain_gpt import launch_ranks

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --lr-decay-iters 20 --lr-warmup-iters 2 "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 100 --log-interval 1 --eval-iters 0 "
         "--num-workers 0 --use-mfsdp").split()
TIMEOUT = 600
# A resumed run without tokenizer flags takes the checkpoint's recorded one (NullTokenizer, 100 ids).
MODEL_WITHOUT_TOKENIZER = [a for i, a in enumerate(MODEL) if a not in ("--tokenizer-type", "--vocab-size")
                           and MODEL[i - 1] not in ("--tokenizer-type", "--vocab-size")]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _command(nproc, *args, model=MODEL):
    if nproc == 1:
        return [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *model, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            os.path.join(REPO, "pretrain_gpt.py"), *model, *args]


def _train(tmp, name, nproc, *args, expect=0, model=MODEL):
    proc = launch_ranks([*model, "--log-dir", str(tmp / name), *args], nproc=None if nproc == 1 else nproc, cwd=tmp,
                        timeout=TIMEOUT)
    assert proc.returncode == expect, f"{name}: exit status {proc.returncode}\n{proc.stdout[-4000:]}"
    return proc.stdout


def _losses(tmp, name):
    out = {}
    with open(tmp / name / "metrics.jsonl") as f:
        for line in f:
            record = json.loads(line)
            if "lm_loss" in record and record.get("kind", "train") == "train" and "iteration" in record:
                out[record["iteration"]] = record["lm_loss"]
    return out


def _wait_for(path, needle, proc, timeout=TIMEOUT):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and needle in open(path).read():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (status {proc.returncode}) before printing {needle!r}:\n"
                                 + open(path).read()[-4000:])
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {needle!r}")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    ckpt = tmp / "ckpt"
    _train(tmp, "uninterrupted", 2, "--train-iters", "20")
    first = _train(tmp, "first", 2, "--train-iters", "10", "--save", str(ckpt), "--async-save")
    second = _train(tmp, "second", 2, "--train-iters", "20", "--load", str(ckpt), "--save", str(ckpt),
                    model=MODEL_WITHOUT_TOKENIZER)
    return tmp, ckpt, first, second


def test_resume_gives_the_losses_of_an_uninterrupted_run(resumed):
    tmp, ckpt, first, second = resumed
    reference, a, b = _losses(tmp, "uninterrupted"), _losses(tmp, "first"), _losses(tmp, "second")
    assert sorted(a) == list(range(1, 11)) and sorted(b) == list(range(11, 21))
    assert "resumed from" in second and "at iteration 10" in second
    assert "the checkpoint's tokenizer (NullTokenizer" in second  # no tokenizer flags on the resumed run
    for iteration in range(1, 21):
        got = a[iteration] if iteration <= 10 else b[iteration]
        assert got == reference[iteration], f"iteration {iteration}: {got!r} != {reference[iteration]!r}"
    assert open(ckpt / "latest_checkpointed_iteration.txt").read() == "20"
    assert sorted(os.listdir(ckpt)) == ["iter_0000010", "iter_0000020", "latest_checkpointed_iteration.txt"]
    for line in (first + second).splitlines():  # timings for the report
        if "saved checkpoint" in line or "loaded checkpoint" in line or "asynchronous save" in line:
            print(line)


def test_multi_rank_checkpoint_converts_with_the_cli(resumed):
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.training.checkpointing import load_checkpoint

    tmp, ckpt, _, _ = resumed
    hf_dir, st_file = tmp / "hf", tmp / "model.safetensors"
    # The scripts as users run them (each runs from its own directory, next to inspect.py).
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools/checkpoint/convert.py"), "--input", str(ckpt),
                           "--iteration", "10", "--to", "hf", "--output", str(hf_dir)],
                          cwd=tmp, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "reading: 100%" in done.stderr  # the progress bar
    listing = subprocess.run([sys.executable, os.path.join(REPO, "tools/checkpoint/inspect.py"), str(ckpt), "--verify"],
                             cwd=tmp, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert listing.returncode == 0 and "match their size and sha256" in listing.stdout, listing.stderr
    from tools.checkpoint import convert

    assert convert.main(["--input", str(ckpt), "--iteration", "10", "--to", "safetensors", "--output", str(st_file),
                         "--quiet"]) == 0
    assert convert.main(["--input", str(ckpt), "--to", "hf", "--output", str(hf_dir), "--quiet"]) == 2

    # Our model with the iteration-10 weights (saved by 2 ranks, loaded by this one process).
    model = GPTModel(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4), 128, 16).eval()
    import argparse

    load_checkpoint(model, None, None, argparse.Namespace(load=str(ckpt / "iter_0000010")))
    consolidated = load_file(str(st_file))
    for name, p in model.named_parameters():
        assert torch.equal(consolidated[name], p.detach()), name
    hf = GPT2LMHeadModel.from_pretrained(str(hf_dir), attn_implementation="eager").eval()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # The export drops the padding rows (the tokenizer has 100 of the 128).
        torch.testing.assert_close(hf(ids).logits, model(ids)[..., :100], atol=1e-5, rtol=1e-5)


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "killed.log"
    args = ["--train-iters", "12", "--save", str(ckpt), "--save-interval", "5", "--log-dir", str(tmp_path / "killed")]
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(1, *args), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env=_env(MEGATRON_TEST_CHECKPOINT_COMMIT_DELAY_S="120@10"))
        try:
            _wait_for(log, "iter_0000010.tmp complete", proc)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert open(ckpt / "latest_checkpointed_iteration.txt").read() == "5"
    assert sorted(os.listdir(ckpt)) == ["iter_0000005", "iter_0000010.tmp", "latest_checkpointed_iteration.txt"]
    killed = _losses(tmp_path, "killed")
    assert sorted(killed) == list(range(1, 11))

    text = _train(tmp_path, "resumed", 1, "--train-iters", "12", "--load", str(ckpt), "--save", str(ckpt),
                  "--save-interval", "5")
    assert "resumed from" in text and "at iteration 5" in text
    resumed = _losses(tmp_path, "resumed")
    assert sorted(resumed) == list(range(6, 13))
    for iteration in range(6, 11):
        assert resumed[iteration] == killed[iteration], iteration
    assert sorted(os.listdir(ckpt)) == ["iter_0000005", "iter_0000010", "iter_0000012",
                                        "latest_checkpointed_iteration.txt"]


def test_sigterm_finishes_the_step_saves_and_exits_zero(tmp_path):
    import psutil

    ckpt = tmp_path / "ckpt"
    log = tmp_path / "term.log"
    args = ["--train-iters", "500", "--save", str(ckpt), "--exit-signal-handler", "--log-dir", str(tmp_path / "term")]
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(2, *args), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=_env())
        try:
            _wait_for(log, "iteration        3/", proc)
            workers = [c for c in psutil.Process(proc.pid).children() if "pretrain_gpt.py" in " ".join(c.cmdline())]
            assert len(workers) == 2
            rank1 = next(w for w in workers if w.environ().get("RANK") == "1")
            rank1.send_signal(signal.SIGTERM)  # one rank only: the ranks must agree to stop together
            proc.wait(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    last = max(_losses(tmp_path, "term"))
    assert 3 <= last < 500
    assert f"exiting on signal after iteration {last}" in text
    assert open(ckpt / "latest_checkpointed_iteration.txt").read() == str(last)
    assert os.path.isdir(ckpt / f"iter_{last:07d}")
