"""A finished run exits 0 on every rank: a few train-save-exit cycles of pretrain_gpt.py
(fresh, then resumed from its checkpoint; data parallel with --async-save, pipeline
parallel 2) through benchmarks/exit_stress.py, whose 50-run version found one rank in 20
aborting at interpreter exit (megatron/training/shutdown.py)."""

import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import exit_stress  # noqa: E402


def test_cycles_of_train_save_resume_all_exit_0(tmp_path, capsys):
    # 4 runs at 2 ranks: --async-save (fresh, resumed), pipeline parallel 2 (fresh, resumed).
    status = exit_stress.main(["--runs", "4", "--nproc", "2", "--layouts", "dp-async", "pp2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "exit stress: 4 runs, 0 non-zero exits" in out, out
    assert status == 0
