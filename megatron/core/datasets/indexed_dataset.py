"""Megatron-LM's memory-mapped indexed dataset (``.bin`` + ``.idx``), byte-compatible.

``.bin``: the tokens of every sequence, back to back, in one dtype, no header.

``.idx`` (all integers little-endian)::

    9 bytes   b"MMIDIDX\\x00\\x00"
    uint64    version = 1
    uint8     dtype code (DType below)
    uint64    S = number of sequences
    uint64    D = number of entries in the document index (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence pointers: byte offset of each sequence in the .bin
    int64[D]  document index: 0, then one past the last sequence of each document

A document is one or more sequences (GPT preprocessing writes one sequence per
document). Files written here are read by upstream Megatron-LM and vice versa.
"""

import os
import struct
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# header + version + dtype code + sequence count + document count
_INDEX_PREFIX_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8

# Megatron's dtype codes; the numbers are part of the file format.
_CODE_TO_DTYPE = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_DTYPE_TO_CODE = {np.dtype(v): k for k, v in _CODE_TO_DTYPE.items()}

SUPPORTED_DTYPES = tuple(np.dtype(v) for v in _CODE_TO_DTYPE.values())


def dtype_code(dtype) -> int:
    """Megatron's code for ``dtype``."""
    key = np.dtype(dtype)
    if key not in _DTYPE_TO_CODE:
        raise ValueError(
            f"dtype {key} cannot be stored in a Megatron indexed dataset; use one of "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}."
        )
    return _DTYPE_TO_CODE[key]


def dtype_from_code(code: int) -> np.dtype:
    if code not in _CODE_TO_DTYPE:
        raise ValueError(
            f"unknown dtype code {code} in the .idx file (known codes: {sorted(_CODE_TO_DTYPE)}); "
            "the file is corrupt or not a Megatron index."
        )
    return np.dtype(_CODE_TO_DTYPE[code])


def optimal_dtype(vocab_size: Optional[int]) -> np.dtype:
    """uint16 when every id fits (with Megatron's margin below 65536), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def _temp_path(final_path: str) -> str:
    # Same directory as the final file so the rename is atomic (same filesystem); the pid
    # keeps two concurrent writers from sharing a temp file.
    directory, name = os.path.split(os.path.abspath(final_path))
    return os.path.join(directory, f".{name}.tmp-{os.getpid()}")


def _remove_quietly(path: Optional[str]) -> None:
    if path is not None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


class IndexedDatasetBuilder:
    """Writes a ``.bin`` (streamed) and, on :meth:`finalize`, its ``.idx``.

    Both files are written under temporary names and renamed into place only by
    ``finalize``; if the process dies or :meth:`discard` is called (also done when a
    ``with`` block exits with an exception), nothing appears under the final names.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)  # validate before creating any file
        directory = os.path.dirname(os.path.abspath(bin_path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"the output directory {directory} does not exist; create it first."
            )
        self._bin_path = bin_path
        # A forked child (e.g. a tokenizer pool worker) inherits this object; only the
        # creating process may delete the temp file.
        self._owner_pid = os.getpid()
        self._bin_temp_path = _temp_path(bin_path)
        self._bin_file = open(self._bin_temp_path, "wb")
        self._sequence_lengths: List[int] = []
        self._document_indices: List[int] = [0]
        self._closed = False
        if np.issubdtype(self._dtype, np.integer):
            info = np.iinfo(self._dtype)
            self._value_range = (int(info.min), int(info.max))
        else:
            self._value_range = None

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this IndexedDatasetBuilder was already finalized or discarded.")

    def _to_array(self, tokens) -> np.ndarray:
        if hasattr(tokens, "detach"):  # torch.Tensor, without importing torch
            tokens = tokens.detach().cpu().numpy()
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"add_item() takes a 1-D sequence of tokens, got shape {array.shape}.")
        if array.size and self._value_range is not None:
            if not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
                if not np.all(np.mod(array, 1) == 0):
                    raise ValueError(
                        f"tokens must be integers to be stored as {self._dtype}; got {array.dtype}."
                    )
            low, high = int(array.min()), int(array.max())
            if low < self._value_range[0] or high > self._value_range[1]:
                raise ValueError(
                    f"token values {low}..{high} do not fit in {self._dtype}; build the dataset "
                    "with a wider dtype (e.g. optimal_dtype(vocab_size) or int32)."
                )
        return array.astype(self._dtype, copy=False)

    def add_item(self, tokens) -> None:
        """Append one sequence (list, numpy array or torch tensor of token ids)."""
        self._check_open()
        array = self._to_array(tokens)
        self._bin_file.write(array.tobytes(order="C"))
        self._sequence_lengths.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form it."""
        self._check_open()
        self._document_indices.append(len(self._sequence_lengths))

    def add_document(self, tokens, lengths: Optional[Sequence[int]] = None) -> None:
        """Append a whole document: ``tokens`` split into sequences of ``lengths``
        (one sequence when ``lengths`` is None, even an empty one, so that sequence ``i``
        stays document ``i``), then :meth:`end_document`."""
        self._check_open()
        array = self._to_array(tokens)
        if lengths is None:
            lengths = [array.size]
        lengths = [int(n) for n in lengths]
        if any(n < 0 for n in lengths) or sum(lengths) != array.size:
            raise ValueError(
                f"sequence lengths {lengths} must be non-negative and sum to the {array.size} "
                "tokens of the document."
            )
        self._bin_file.write(array.tobytes(order="C"))
        self._sequence_lengths.extend(lengths)
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Append every document of the dataset at ``path_prefix`` (merging shards)."""
        self._check_open()
        other = IndexedDataset(path_prefix)
        if other.dtype != self._dtype:
            raise ValueError(
                f"cannot merge {path_prefix} (dtype {other.dtype}) into a {self._dtype} dataset; "
                "preprocess all shards with the same tokenizer."
            )
        offset = len(self._sequence_lengths)
        self._sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self._document_indices.extend(int(i) + offset for i in other.document_indices[1:])
        with open(get_bin_path(path_prefix), "rb") as src:
            while True:
                chunk = src.read(1 << 24)
                if not chunk:
                    break
                self._bin_file.write(chunk)

    def finalize(self, idx_path: str) -> None:
        """Write the ``.idx`` and move both files to their final names."""
        self._check_open()
        idx_temp_path = _temp_path(idx_path)
        try:
            self._bin_file.flush()
            os.fsync(self._bin_file.fileno())
            self._bin_file.close()
            write_index(idx_temp_path, self._dtype, self._sequence_lengths, self._document_indices)
            # .bin first: readers need both files, so a crash between the renames leaves a
            # complete .bin and no .idx, which reads as "not there yet", never as corrupt.
            os.replace(self._bin_temp_path, self._bin_path)
            os.replace(idx_temp_path, idx_path)
        except BaseException:
            _remove_quietly(idx_temp_path)
            self.discard()
            raise
        self._closed = True

    def discard(self) -> None:
        """Drop everything written so far; the final paths are left untouched."""
        if not self._bin_file.closed:
            self._bin_file.close()
        if os.getpid() == self._owner_pid:
            _remove_quietly(self._bin_temp_path)
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and not self._closed:
            self.discard()
        return None

    def __del__(self):
        # A builder dropped without finalize() must not leave its temp file behind.
        try:
            if not self._closed:
                self.discard()
        except Exception:
            pass


def write_index(
    idx_path: str,
    dtype,
    sequence_lengths: Iterable[int],
    document_indices: Iterable[int],
) -> None:
    """Write a ``.idx`` file (see the module docstring for the layout)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64).reshape(-1)
    documents = np.asarray(document_indices, dtype=np.int64).reshape(-1)
    if lengths.size and lengths.max() > np.iinfo(np.int32).max:
        raise ValueError("a sequence longer than 2**31-1 tokens cannot be indexed; split the document.")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", lengths.size))
        f.write(struct.pack("<Q", documents.size))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(documents.astype("<i8").tobytes(order="C"))
        f.flush()
        os.fsync(f.fileno())


class IndexedDataset:
    """Read-only, memory-mapped view of ``path_prefix.bin`` / ``path_prefix.idx``.

    ``dataset[i]`` is sequence ``i`` as a numpy array (a read-only view into the map).
    Picklable: a copy reopens the files (DataLoader workers each map them themselves).

    ``mmap_bin_files=False`` (Megatron's ``--no-mmap-bin-files``) reads each sequence from
    the .bin with a file read instead (a fresh, writable array), for file systems where
    memory maps are slow or unavailable. The index is mapped either way.
    """

    def __init__(self, path_prefix: str, mmap_bin_files: bool = True):
        self._path_prefix = path_prefix
        self._mmap_bin_files = mmap_bin_files
        self._open()

    def _open(self):
        bin_path, idx_path = get_bin_path(self._path_prefix), get_idx_path(self._path_prefix)
        missing = [p for p in (bin_path, idx_path) if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"indexed dataset {self._path_prefix!r} is incomplete: {' and '.join(missing)} "
                "not found. Expected both PREFIX.bin and PREFIX.idx, as written by "
                "tools/preprocess_data.py; check the prefix (without .bin/.idx)."
            )
        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            prefix = f.read(_INDEX_PREFIX_BYTES)
        if len(prefix) < _INDEX_PREFIX_BYTES or prefix[: len(INDEX_HEADER)] != INDEX_HEADER:
            raise ValueError(
                f"{idx_path} is not a Megatron mmap index (bad header); rebuild it with "
                "tools/preprocess_data.py."
            )
        offset = len(INDEX_HEADER)
        (version,) = struct.unpack_from("<Q", prefix, offset)
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path} has index version {version}; only version 1 is supported.")
        (code,) = struct.unpack_from("<B", prefix, offset + 8)
        self._dtype = dtype_from_code(code)
        sequence_count, document_count = struct.unpack_from("<QQ", prefix, offset + 9)
        expected = _INDEX_PREFIX_BYTES + sequence_count * (4 + 8) + document_count * 8
        if idx_size < expected:
            raise ValueError(
                f"{idx_path} is truncated ({idx_size} bytes, its header promises {expected}); "
                "rebuild it with tools/preprocess_data.py."
            )
        self._idx_map = np.memmap(idx_path, dtype=np.uint8, mode="r")
        buffer = memoryview(self._idx_map)
        pos = _INDEX_PREFIX_BYTES
        self._sequence_lengths = np.frombuffer(buffer, dtype="<i4", count=sequence_count, offset=pos)
        pos += sequence_count * 4
        self._sequence_pointers = np.frombuffer(buffer, dtype="<i8", count=sequence_count, offset=pos)
        pos += sequence_count * 8
        self._document_indices = np.frombuffer(buffer, dtype="<i8", count=document_count, offset=pos)

        bin_size = os.path.getsize(bin_path)
        needed = 0
        if sequence_count:
            needed = int(self._sequence_pointers[-1]) + int(self._sequence_lengths[-1]) * self._dtype.itemsize
        if bin_size < needed:
            raise ValueError(
                f"{bin_path} is truncated ({bin_size} bytes, the index needs {needed}); "
                "rebuild the dataset with tools/preprocess_data.py."
            )
        self._bin_file = None
        # numpy cannot map an empty file; an empty dataset needs no map at all.
        if bin_size and not self._mmap_bin_files:
            self._bin_map = None
            self._bin_buffer = None
            self._bin_file = open(bin_path, "rb", buffering=0)
        elif bin_size:
            self._bin_map = np.memmap(bin_path, dtype=np.uint8, mode="r")
            self._bin_buffer = memoryview(self._bin_map)
        else:
            self._bin_map = None
            self._bin_buffer = memoryview(b"")

    def __getstate__(self):
        return {"path_prefix": self._path_prefix, "mmap_bin_files": self._mmap_bin_files}

    def __setstate__(self, state):
        self._path_prefix = state["path_prefix"]
        self._mmap_bin_files = state.get("mmap_bin_files", True)
        self._open()

    @property
    def uses_mmap(self) -> bool:
        return self._bin_file is None

    @property
    def path_prefix(self) -> str:
        return self._path_prefix

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 [num_sequences]."""
        return self._sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 [num_sequences]: byte offsets into the .bin."""
        return self._sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 [num_documents + 1]: document ``d`` is sequences ``[di[d], di[d+1])``."""
        return self._document_indices

    @property
    def num_documents(self) -> int:
        return max(len(self._document_indices) - 1, 0)

    def __len__(self) -> int:
        return len(self._sequence_lengths)

    def _check_index(self, idx: int) -> int:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for a dataset of {n} sequences")
        return idx

    def __getitem__(self, idx: Union[int, np.integer, slice]):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        raise TypeError(f"indices must be integers or slices, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if no length)."""
        idx = self._check_index(int(idx))
        sequence_length = int(self._sequence_lengths[idx])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or length < 0 or offset + length > sequence_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) are outside sequence {idx} "
                f"of length {sequence_length}"
            )
        pointer = int(self._sequence_pointers[idx]) + offset * self._dtype.itemsize
        if self._bin_file is not None:
            data = os.pread(self._bin_file.fileno(), length * self._dtype.itemsize, pointer)
            return np.frombuffer(bytearray(data), dtype=self._dtype, count=length)
        return np.frombuffer(self._bin_buffer, dtype=self._dtype, count=length, offset=pointer)
