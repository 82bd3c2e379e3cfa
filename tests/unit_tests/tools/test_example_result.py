"""tools/example_result.py: an example run's result file, from its metrics.jsonl (what
scripts/doc_figures.py renders the quickstart's figures from)."""

import json

from tools import example_result


def test_result_file_from_metrics(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"kind": "train", "iteration": i, "lm_loss": 8.0 - i / 100} for i in range(1, 201)]
    records += [{"kind": "validation", "iteration": 100, "lm_loss": 6.0, "bits_per_character": 2.56789},
                {"kind": "validation", "iteration": 200, "lm_loss": 5.0, "bits_per_character": 2.38912}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "result.json"
    assert example_result.main(["--metrics", str(metrics), "--output", str(out), "--nproc", "2",
                                "--load-average", "0.12", "--seconds", "training=80", "--seconds", "whole=90"]) == 0
    result = json.loads(out.read_text())
    assert result["iterations"] == 200 and result["nproc"] == 2 and result["load_average_at_start"] == 0.12
    assert result["validation_bits_per_character"] == {"100": 2.5679, "200": 2.3891}
    assert result["bits_per_character"] == 2.3891 and result["seconds"] == {"training": 80.0, "whole": 90.0}
    assert len(result["date"]) == 10 and result["commit"]
    assert "> validation loss 2.389 bits per character after 200 iterations" in capsys.readouterr().out


def test_a_run_without_evaluation_is_one_error_line(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "train", "iteration": 1, "lm_loss": 8.0}) + "\n")
    assert example_result.main(["--metrics", str(metrics), "--output", str(tmp_path / "r.json"), "--nproc", "1"]) == 2
    assert "has no validation record with bits_per_character; run with --eval-iters > 0" in capsys.readouterr().err
