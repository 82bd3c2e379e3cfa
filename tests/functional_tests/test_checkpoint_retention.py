"""--save-retain-interval: every N-th checkpoint is kept, the others are deleted only once
a newer one is complete, so a run killed during a save still has its latest good
checkpoint, and resumes from it."""

import os
import signal
import subprocess

from test_checkpoint_trainer import _command, _env, _losses, _train, _wait_for

from megatron.training.checkpoint_retention import prune_after_commit

TRACKER = "latest_checkpointed_iteration.txt"


def test_kill_during_a_save_keeps_the_latest_checkpoint_and_resume_prunes(tmp_path):
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "killed.log"
    args = ["--train-iters", "7", "--save", str(ckpt), "--save-interval", "1", "--save-retain-interval", "3"]
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(1, *args, "--log-dir", str(tmp_path / "killed")), cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, env=_env(MEGATRON_TEST_CHECKPOINT_COMMIT_DELAY_S="120@5"))
        try:
            # Iteration 5 is written but not yet in place: 4 (the latest) and 3 (kept) must be there.
            _wait_for(log, "iter_0000005.tmp complete", proc)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert open(ckpt / TRACKER).read() == "4"
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000004", "iter_0000005.tmp", TRACKER]
    killed = _losses(tmp_path, "killed")

    text = _train(tmp_path, "resumed", 1, *args, "--load", str(ckpt))
    assert "resumed from" in text and "at iteration 4" in text
    resumed = _losses(tmp_path, "resumed")
    assert resumed[5] == killed[5]  # the latest checkpoint was the good one
    # 4 and 5 went once 5 and 6 were in place; 6 is a multiple of 3; 7 is the latest.
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000006", "iter_0000007", TRACKER]
    assert open(ckpt / TRACKER).read() == "7"


def test_prune_deletes_only_the_previous_unkept_checkpoint(tmp_path):
    for i in (2, 3, 4, 5):
        (tmp_path / f"iter_{i:07d}").mkdir()
    (tmp_path / "iter_0000001.del").mkdir()  # a deletion killed midway
    assert prune_after_commit(str(tmp_path), previous=4, latest=5, retain=3) == [4]
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000003", "iter_0000005"]
    assert prune_after_commit(str(tmp_path), previous=3, latest=5, retain=3) == []  # kept
    assert prune_after_commit(str(tmp_path), previous=5, latest=5, retain=3) == []  # the same iteration again
    assert prune_after_commit(str(tmp_path), previous=2, latest=5, retain=None) == []
    (tmp_path / "elsewhere").mkdir()
    os.rename(tmp_path / "iter_0000002", tmp_path / "elsewhere" / "2")
    os.symlink(tmp_path / "elsewhere" / "2", tmp_path / "iter_0000002")
    assert prune_after_commit(str(tmp_path), previous=2, latest=5, retain=3) == []  # a link: not ours
