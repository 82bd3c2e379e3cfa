"""The tokenizer a checkpoint was trained with, recorded in it: its type and its files,
copied into the checkpoint with their sha256.

``common.json["tokenizer"]``::

    {"type": "GPT2BPETokenizer",
     "args": {"vocab_file": "encoder.json", "merge_file": "vocab.bpe"},  # flag -> name in tokenizer/
     "files": {"encoder.json": {"bytes": 1042301, "sha256": "..."}, ...},
     "vocab_size": null,                                                 # NullTokenizer's size
     "settings": {...}}        # only for a type with SETTINGS: TikTokenizer's pattern, special tokens

The files live in ``<iteration dir>/tokenizer/``, so a checkpoint is sampled
(``tools/generate.py``), exported (``convert.py --to hf``) and moved without the paths it
was trained with. Every type is recorded the same way: its files are the flags it already
takes (``--vocab-file``, ``--merge-file``, ``--tokenizer-model``), a directory (a saved
Hugging Face tokenizer) contributing its tokenizer files only, never a model's weights
saved next to them. A new tokenizer type needs nothing here (``FLAGS_READ`` only keeps a
known type from copying a file flag it ignores; ``SETTINGS`` names a type's flags that are
not files).

``pretrain_gpt.py --load`` reads the record too (megatron/training/arguments.py): without
tokenizer flags a resumed run uses the recorded tokenizer; with them, :func:`mismatch` says
how they differ from it (type, file contents by sha256, vocabulary size, settings).
"""

import os
import shutil
from typing import Any, Dict, Mapping, Optional

from megatron.core.distributed.mfsdp_v2.checkpoint import manifest
from megatron.core.tokenizer.tiktoken_tokenizer import DEFAULT_VOCAB_SIZE, SPECIAL_TOKENS

TOKENIZER_DIRNAME = "tokenizer"
# The flags that name a tokenizer's files or directory, in the trainer's argument names.
FILE_FLAGS = ("vocab_file", "merge_file", "tokenizer_model")
# What a saved Hugging Face tokenizer consists of (whichever of them exist).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                      "chat_template.json")
# A directory flag's entry in "args": the tokenizer/ directory itself.
WHOLE_DIRECTORY = "."
# The file flags each known type reads (a flag it ignores may name anything, or nothing
# that exists); a type not listed here is recorded with every file flag given.
FLAGS_READ = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "HuggingFaceTokenizer": ("tokenizer_model",),
              "GPTSentencePieceTokenizer": ("tokenizer_model",), "NullTokenizer": (),
              "TikTokenizer": ("tokenizer_model",)}
# A type's flags that change its ids without naming a file (the trainer's argument names).
SETTINGS = {"TikTokenizer": ("tiktoken_pattern", "tiktoken_num_special_tokens", "special_tokens")}
# Every flag a recorded tokenizer stands for (pretrain_gpt.py --load: given or taken from the record).
TOKENIZER_FLAGS = ("tokenizer_type",) + FILE_FLAGS + ("vocab_size",) + tuple(
    sorted({flag for flags in SETTINGS.values() for flag in flags}))


def _sources(args: Mapping[str, Any]) -> Dict[str, str]:
    """{flag: path} of the tokenizer's files, GPT-2's defaults resolved."""
    read = FLAGS_READ.get(args.get("tokenizer_type"), FILE_FLAGS)
    sources = {flag: args[flag] for flag in read if args.get(flag)}
    if args.get("tokenizer_type") == "GPT2BPETokenizer" and not sources:
        from megatron.core.tokenizer import default_gpt2_vocab_files  # imported here: finds a package's data

        sources = dict(zip(("vocab_file", "merge_file"), default_gpt2_vocab_files()))
    return sources


def _copy(source: str, directory: str, name: str, files: Dict[str, Any]) -> None:
    target = os.path.join(directory, name)
    shutil.copyfile(source, target)
    size, digest = manifest.file_digest(target)
    files[name] = {"bytes": size, "sha256": digest}


def record_tokenizer(args: Mapping[str, Any], checkpoint_dir: str) -> Optional[Dict[str, Any]]:
    """Copy the tokenizer that ``args`` (the trainer's arguments, as a dict) names into
    ``checkpoint_dir/tokenizer/`` and return its record; None when ``args`` names none."""
    kind = args.get("tokenizer_type")
    if not kind:
        return None
    directory = os.path.join(checkpoint_dir, TOKENIZER_DIRNAME)
    os.makedirs(directory, exist_ok=True)
    recorded_args: Dict[str, str] = {}
    files: Dict[str, Any] = {}
    for flag, source in _sources(args).items():
        if os.path.isdir(source):
            names = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(source, n))]
            if not names:
                raise FileNotFoundError(f"--{flag.replace('_', '-')} {source} holds no tokenizer files "
                                        f"({', '.join(HF_TOKENIZER_FILES[:3])}, ...); "
                                        "pass a saved tokenizer's directory.")
            for name in names:
                _copy(os.path.join(source, name), directory, name, files)
            recorded_args[flag] = WHOLE_DIRECTORY
        else:
            name = os.path.basename(source)
            if name in files:  # two flags naming files of the same name
                name = f"{flag}_{name}"
            _copy(source, directory, name, files)
            recorded_args[flag] = name
    record = {"type": kind, "args": recorded_args, "files": files, "vocab_size": args.get("vocab_size")}
    if kind in SETTINGS:
        record["settings"] = _settings(args)
    return record


def _settings(args: Mapping[str, Any]) -> Dict[str, Any]:
    return {flag: (list(args[flag]) if isinstance(args.get(flag), (list, tuple)) else args.get(flag))
            for flag in SETTINGS.get(args.get("tokenizer_type"), ())}


def tokenizer_args(checkpoint_dir: str, record: Mapping[str, Any]) -> Dict[str, Any]:
    """The trainer's tokenizer arguments that rebuild the recorded tokenizer from the copies
    in ``checkpoint_dir/tokenizer/`` (each checked against its sha256 first)."""
    directory = os.path.join(checkpoint_dir, TOKENIZER_DIRNAME)
    for name, expected in sorted(record.get("files", {}).items()):
        message = manifest.check_file(directory, name, expected)
        if message:
            raise ValueError(f"the checkpoint's tokenizer: {message} (or pass --tokenizer-type and its files)")
    return recorded_paths(checkpoint_dir, record)


def recorded_paths(checkpoint_dir: str, record: Mapping[str, Any]) -> Dict[str, Any]:
    """:func:`tokenizer_args` without the checks (for a checkpoint not yet in place)."""
    directory = os.path.join(checkpoint_dir, TOKENIZER_DIRNAME)
    out: Dict[str, Any] = {flag: None for flag in FILE_FLAGS}
    for flag, name in record.get("args", {}).items():
        out[flag] = directory if name == WHOLE_DIRECTORY else os.path.join(directory, name)
    out["tokenizer_type"] = record["type"]
    out["vocab_size"] = record.get("vocab_size")
    out.update(record.get("settings") or {})
    return out


def _file_digests(args: Mapping[str, Any]) -> Dict[str, Any]:
    """{flag: sha256 of its file, or {name: sha256} of a directory's tokenizer files}."""
    out: Dict[str, Any] = {}
    for flag, source in _sources(args).items():
        if os.path.isdir(source):
            out[flag] = {n: manifest.file_digest(os.path.join(source, n))[1] for n in HF_TOKENIZER_FILES
                         if os.path.isfile(os.path.join(source, n))}
        elif os.path.isfile(source):
            out[flag] = manifest.file_digest(source)[1]
        else:
            out[flag] = f"missing ({source})"
    return out


def mismatch(args: Mapping[str, Any], checkpoint_dir: str, record: Mapping[str, Any]) -> Optional[str]:
    """How the tokenizer ``args`` names differs from the one ``record`` recorded in
    ``checkpoint_dir`` (its copies, checked against their sha256), or None when they are the same."""
    recorded = tokenizer_args(checkpoint_dir, record)
    if args.get("tokenizer_type") != recorded["tokenizer_type"]:
        return f"--tokenizer-type {args.get('tokenizer_type')}, the checkpoint's is {recorded['tokenizer_type']}"
    ours, theirs = _file_digests(args), _file_digests(recorded)
    for flag in sorted(set(ours) | set(theirs)):
        if ours.get(flag) != theirs.get(flag):
            return (f"{_flag(flag)} {args.get(flag)} is not the file the checkpoint was trained with "
                    f"(sha256 differs from its copy in {os.path.join(checkpoint_dir, TOKENIZER_DIRNAME)})")
    kind = recorded["tokenizer_type"]
    for flag in ("vocab_size",) + SETTINGS.get(kind, ()):
        given, theirs = _effective(kind, flag, args.get(flag)), _effective(kind, flag, recorded.get(flag))
        if given != theirs:
            return f"{_flag(flag)} {given}, the checkpoint's is {theirs}"
    return None


def _effective(kind: str, flag: str, value: Any) -> Any:
    """A setting as the tokenizer uses it (a flag left out means its default)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if value is None and kind == "TikTokenizer":
        return {"tiktoken_pattern": "v2", "special_tokens": list(SPECIAL_TOKENS),
                "vocab_size": DEFAULT_VOCAB_SIZE}.get(flag)
    return value


def _flag(name: str) -> str:
    return "--tokenizer-special-tokens" if name == "special_tokens" else "--" + name.replace("_", "-")
