"""scripts/doc_figures.py: the figures the docs quote match the result files that measured
them (the upstream replay counts are checked where the replay runs:
tests/upstream_lines/test_upstream_replay.py)."""

import os
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import doc_figures  # noqa: E402

FILE_FIGURES = set(doc_figures.FIGURES) - doc_figures.LIVE


def _all_figures():
    found = []
    for path in doc_figures.documents():
        with open(path, encoding="utf-8") as f:
            found += [name for name, _ in doc_figures.figures_in(f.read())]
    return found


def test_the_docs_quote_the_benchmark_result_files():
    assert doc_figures.stale(FILE_FIGURES) == []


def test_every_figure_is_known_and_quoted():
    found = _all_figures()
    assert set(found) <= set(doc_figures.FIGURES), sorted(set(found) - set(doc_figures.FIGURES))
    assert set(doc_figures.FIGURES) <= set(found), "a figure no document quotes"


def test_a_figure_typed_by_hand_is_caught_and_rewritten(tmp_path):
    (tmp_path / "docs").mkdir()
    good = doc_figures.compare_50m()
    text = f"Intro.\n<!-- figure: compare-50m -->{good.replace('0.69', '0.59')}<!-- /figure -->\n"
    (tmp_path / "README.md").write_text(text)
    problems = doc_figures.stale(FILE_FIGURES, repo=str(tmp_path))
    assert len(problems) == 1 and "compare-50m" in problems[0]
    assert doc_figures.render(text) == f"Intro.\n<!-- figure: compare-50m -->{good}<!-- /figure -->\n"


def test_a_generated_page_keeps_the_figures_of_the_file_it_replaces():
    old = "a <!-- figure: replay-gpt -->151 of 161<!-- /figure --> b"
    new = "A <!-- figure: replay-gpt -->x<!-- /figure --> B"
    assert doc_figures.keep_figures(new, old) == "A <!-- figure: replay-gpt -->151 of 161<!-- /figure --> B"


def test_an_unknown_figure_is_an_error():
    with pytest.raises(KeyError, match="unknown figure"):
        doc_figures.render("<!-- figure: no-such -->1<!-- /figure -->")
