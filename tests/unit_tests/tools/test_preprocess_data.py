import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.datasets import IndexedDataset
from megatron.core.tokenizer import build_tokenizer
from tools import preprocess_data

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))

TEXTS = [
    "First document. To be, or not to be.",
    "Second one:\n\tunicode naïve café 🤖, numbers 12345, it's fine.",
    "",  # an empty document stays empty (no lone EOD)
    "  whitespace   runs  \n\n",
    "Fifth.",
    "x" * 5000,
    "The last one, with a literal <|endoftext|> inside.",
]


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer")


def write_jsonl(path, texts, key="text", extra=None):
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            record = {key: text, "id": i}
            if extra:
                record.update(extra(i))
            f.write(json.dumps(record) + "\n")
        f.write("\n")  # trailing blank line: ignored
    return str(path)


def run(argv):
    return preprocess_data.preprocess(preprocess_data.get_parser().parse_args(argv))


def test_end_to_end_two_workers(tmp_path, gpt2, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    prefix = str(tmp_path / "out" / "corpus")
    stats = run(["--input", source, "--output-prefix", prefix, "--json-keys", "text",
                 "--tokenizer-type", "GPT2BPETokenizer", "--append-eod", "--workers", "2",
                 "--chunk-size", "1", "--log-interval", "2"])
    out = capsys.readouterr().out
    assert "Processed 2 documents" in out and "docs/s" in out and "MB/s" in out
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    ds = IndexedDataset(prefix + "_text_document")
    assert ds.dtype == np.uint16
    assert len(ds) == len(TEXTS) == ds.num_documents
    assert stats["text"]["documents"] == len(TEXTS)
    assert stats["text"]["tokens"] == int(ds.sequence_lengths.sum())
    for i, text in enumerate(TEXTS):
        ids = ds[i].tolist()
        if text == "":
            assert ids == []
            continue
        assert ids == gpt2.tokenize(text) + [gpt2.eod]
        assert gpt2.detokenize(ids) == text + "<|endoftext|>"


def test_several_keys_and_no_eod(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ["1 2 3", "4 5"], key="a",
                         extra=lambda i: {"b": f"{10 + i}"})
    prefix = str(tmp_path / "multi")
    run(["--input", source, "--output-prefix", prefix, "--json-keys", "a", "b",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "100000"])
    a = IndexedDataset(prefix + "_a_document")
    b = IndexedDataset(prefix + "_b_document")
    assert a.dtype == np.int32  # vocabulary too large for uint16
    assert [a[i].tolist() for i in range(2)] == [[1, 2, 3], [4, 5]]
    assert [b[i].tolist() for i in range(2)] == [[10], [11]]


def test_refuses_to_overwrite(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ["1 2", "3"])
    prefix = str(tmp_path / "d")
    argv = ["--input", source, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "10", "--append-eod"]
    run(argv)
    with open(prefix + "_text_document.bin", "rb") as f:
        before = f.read()
    write_jsonl(tmp_path / "in.jsonl", ["4 4 4 4"])
    with pytest.raises(FileExistsError, match="--overwrite"):
        run(argv)
    with open(prefix + "_text_document.bin", "rb") as f:
        assert f.read() == before
    run(argv + ["--overwrite"])
    assert IndexedDataset(prefix + "_text_document")[0].tolist() == [4, 4, 4, 4, 9]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_line_writes_nothing(tmp_path, workers):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "1 2"}\n{"text": "3"}\n{not json}\n{"text": "4"}\n')
    out_dir = tmp_path / "out"
    with pytest.raises(ValueError, match="line 3 is not valid JSON"):
        run(["--input", str(source), "--output-prefix", str(out_dir / "d"), "--tokenizer-type",
             "NullTokenizer", "--vocab-size", "10", "--workers", workers])
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"body": "1"}\n', "no key 'text'"),
        ('{"text": 5}\n', "must be a string"),
        ('[1, 2]\n', "not an object"),
        ('{"text": "1 x"}\n', "space-separated integers"),
    ],
)
def test_bad_documents(tmp_path, content, message):
    source = tmp_path / "in.jsonl"
    source.write_text(content)
    with pytest.raises(ValueError, match=message):
        run(["--input", str(source), "--output-prefix", str(tmp_path / "d"),
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_bad_arguments(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ["1"])
    base = ["--output-prefix", str(tmp_path / "d"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"]
    with pytest.raises(FileNotFoundError, match="--input"):
        run(["--input", str(tmp_path / "missing.jsonl")] + base)
    with pytest.raises(ValueError, match="--workers"):
        run(["--input", source, "--workers", "0"] + base)
    with pytest.raises(ValueError, match="--vocab-size"):
        run(["--input", source, "--output-prefix", str(tmp_path / "d"), "--tokenizer-type", "NullTokenizer"])
    with pytest.raises(FileNotFoundError, match="--vocab-file"):
        run(["--input", source, "--output-prefix", str(tmp_path / "d"),
             "--vocab-file", str(tmp_path / "v.json"), "--merge-file", str(tmp_path / "m.bpe")])
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_cli_script(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", ["Hello world"])
    prefix = str(tmp_path / "cli")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the repo itself
    argv = ["--input", source, "--output-prefix", prefix, "--append-eod", "--workers", "2"]
    cmd = [sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py")] + argv
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "Done: 1 documents" in result.stdout
    assert IndexedDataset(prefix + "_text_document")[0].tolist() == [15496, 995, 50256]
    # Usage errors end the CLI with a one-line message and exit status 2, not a traceback.
    assert preprocess_data.main(argv) == 2
    assert "already exist" in capsys.readouterr().err


def test_tqdm_bar_on_a_terminal():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = preprocess_data._Progress(total_bytes=1000, log_interval=1, stream=stream)
    for _ in range(4):
        progress.update(250)
    summary = progress.close()
    assert "tokenizing" in stream.getvalue() and "Processed" not in stream.getvalue()
    assert summary.startswith("Done: 4 documents")
