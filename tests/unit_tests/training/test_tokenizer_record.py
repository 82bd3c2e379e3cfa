"""megatron/training/tokenizer_record.py: what a checkpoint copies of its tokenizer, and
the checks on reading it back (the end-to-end round trips are in
tests/unit_tests/checkpoint/test_tokenizer_travels.py)."""

import os

import pytest

from megatron.training.tokenizer_record import record_tokenizer, tokenizer_args


def test_a_directory_gives_its_tokenizer_files_only(tmp_path):
    source = tmp_path / "hf"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                 "model.safetensors"):
        (source / name).write_text(name)
    record = record_tokenizer({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(source)},
                              str(tmp_path / "ckpt"))
    assert sorted(record["files"]) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(os.listdir(tmp_path / "ckpt" / "tokenizer")) == sorted(record["files"])
    assert record["args"] == {"tokenizer_model": "."}
    args = tokenizer_args(str(tmp_path / "ckpt"), record)
    assert args["tokenizer_type"] == "HuggingFaceTokenizer"
    assert args["tokenizer_model"] == str(tmp_path / "ckpt" / "tokenizer") and args["vocab_file"] is None


def test_flags_a_type_ignores_are_not_copied(tmp_path):
    # An upstream-style command may carry --vocab-file with NullTokenizer; it is not read.
    record = record_tokenizer({"tokenizer_type": "NullTokenizer", "vocab_size": 64, "vocab_file": "/gone/vocab.json"},
                              str(tmp_path))
    assert record == {"type": "NullTokenizer", "args": {}, "files": {}, "vocab_size": 64}
    assert record_tokenizer({"tokenizer_type": None}, str(tmp_path)) is None


def test_a_changed_copy_is_refused(tmp_path):
    (tmp_path / "sp.model").write_bytes(b"model bytes")
    record = record_tokenizer({"tokenizer_type": "GPTSentencePieceTokenizer",
                               "tokenizer_model": str(tmp_path / "sp.model")}, str(tmp_path / "ckpt"))
    assert tokenizer_args(str(tmp_path / "ckpt"), record)["tokenizer_model"] == str(
        tmp_path / "ckpt" / "tokenizer" / "sp.model")
    (tmp_path / "ckpt" / "tokenizer" / "sp.model").write_bytes(b"other bytes")
    with pytest.raises(ValueError, match="the checkpoint's tokenizer: .*sp.model is corrupt"):
        tokenizer_args(str(tmp_path / "ckpt"), record)
