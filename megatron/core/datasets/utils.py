"""Small helpers shared by the dataset modules: split strings, cache files, hashing."""

import hashlib
import json
import os
import re
from typing import Dict, List, Optional, Sequence

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> List[float]:
    """Megatron's split string ("969,30,1", "98/2/0", "1") -> three fractions summing to 1.

    Missing trailing parts are zero, so "90,10" means no test split.
    """
    if not isinstance(split, str) or not split.strip():
        raise ValueError(
            f"--split must be a string of up to three non-negative numbers like '969,30,1', got {split!r}."
        )
    parts = [p.strip() for p in re.split(r"[,/]", split.strip())]
    if len(parts) > 3 or any(p == "" for p in parts):
        raise ValueError(
            f"--split {split!r} must have one to three comma-separated numbers (train,valid,test), "
            "e.g. '969,30,1'."
        )
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"--split {split!r} must contain only numbers, e.g. '969,30,1'."
        ) from None
    if any(not np.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"--split {split!r} must contain only finite non-negative numbers.")
    total = sum(values)
    if total <= 0:
        raise ValueError(f"--split {split!r} sums to zero; give at least one positive part.")
    values += [0.0] * (3 - len(values))
    return [v / total for v in values]


def split_boundaries(fractions: Sequence[float], num_elements: int) -> List[int]:
    """Megatron's split of ``num_elements`` into contiguous ranges: [0, b1, b2, num_elements].

    Each part is rounded independently; the rounding error is then taken off every
    boundary so the last one lands exactly on ``num_elements`` (Megatron's behaviour, kept
    so that a given --split selects the same documents as upstream).
    """
    boundaries = [0]
    for fraction in fractions:
        boundaries.append(boundaries[-1] + int(round(fraction * float(num_elements))))
    excess = boundaries[-1] - num_elements
    for i in range(1, len(boundaries)):
        boundaries[i] -= excess
    # With several tiny parts the shift could push a boundary below zero; clamp so ranges
    # stay ordered (empty rather than negative).
    for i in range(1, len(boundaries)):
        boundaries[i] = min(max(boundaries[i], boundaries[i - 1]), num_elements)
    boundaries[-1] = num_elements
    return boundaries


def array_digest(array: np.ndarray) -> str:
    """md5 of an array's dtype, shape and bytes (identifies index inputs in cache keys)."""
    array = np.ascontiguousarray(array)
    h = hashlib.md5()
    h.update(str(array.dtype).encode())
    h.update(str(array.shape).encode())
    h.update(array.tobytes())
    return h.hexdigest()


def description_hash(description: Dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode("utf-8")).hexdigest()


def check_cache_name(name: str) -> str:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ValueError(
            f"dataset name {name!r} is used in cache file names; use only letters, digits, '.', '_' and '-'."
        )
    return name


def _atomic_write(path: str, mode: str, write) -> None:
    """``write(file)`` into a temp file in the same directory, then rename into place.

    Several ranks may build the same index at once; each writes its own temp file and
    the rename is atomic, so a reader sees either no file or a complete one.
    """
    directory, filename = os.path.split(path)
    temp = os.path.join(directory, f".{filename}.tmp-{os.getpid()}")
    try:
        with open(temp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
        os.replace(temp, path)
    except BaseException:
        try:
            os.remove(temp)
        except FileNotFoundError:
            pass
        raise


def atomic_save_npy(path: str, array: np.ndarray) -> None:
    _atomic_write(path, "wb", lambda f: np.save(f, array, allow_pickle=False))


def atomic_write_text(path: str, text: str) -> None:
    _atomic_write(path, "w", lambda f: f.write(text))


def load_cached_arrays(paths: Dict[str, str]) -> Optional[Dict[str, np.ndarray]]:
    """All arrays memory-mapped, or None if any file is missing or unreadable."""
    if not all(os.path.isfile(p) for p in paths.values()):
        return None
    try:
        return {key: np.load(p, mmap_mode="r", allow_pickle=False) for key, p in paths.items()}
    except (OSError, ValueError):
        # A damaged cache file (e.g. from another tool) is rebuilt, not fatal.
        return None


def prepare_cache_dir(cache_dir: str) -> None:
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"cannot create the dataset index cache directory {cache_dir!r} ({e}); pass a writable "
            "directory."
        ) from None
