"""Files that must survive a crash and prove their own integrity.

The engine's ``mfsdp_manifest.json`` (the index of a checkpoint directory, written last,
with the size and sha256 of every data file and a checksum of itself), and the tools the
trainer and the converters use for their own files: atomic writes (temporary file, fsync,
rename, fsync of the directory), sha256 digests of files and of canonical JSON, and the
checks that name a missing, truncated or corrupt file.

Nothing here imports ``torch.distributed.checkpoint``: reading a manifest needs no DCP.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .errors import CheckpointError

MANIFEST_NAME = "mfsdp_manifest.json"
FORMAT_NAME = "mfsdp_v2.dcp"
FORMAT_VERSION = 1

_DTYPES = {
    str(dtype).replace("torch.", ""): dtype
    for dtype in (
        torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    )
}
_HASH_BLOCK = 1 << 22


# --------------------------------------------------------------------------------------
# Names of dtypes in JSON
# --------------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, as the manifest writes dtypes."""
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return _DTYPES[name]


# --------------------------------------------------------------------------------------
# Digests and durable writes
# --------------------------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """The one byte string a JSON value hashes as (sorted keys, no whitespace)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def json_digest(obj: Any) -> str:
    """sha256 (hex) of ``canonical_json(obj)``."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def file_digest(path: str) -> Tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in blocks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_HASH_BLOCK)
            if not block:
                break
            size += len(block)
            digest.update(block)
    return size, digest.hexdigest()


def fsync_dir(path: str) -> None:
    """Make a rename or removal inside ``path`` durable (best effort: some filesystems
    refuse to open or fsync a directory, and then there is nothing more to do)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync, rename, fsync the
    directory: a crash leaves the old file or the new one, never a mix."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path: str, obj: Any) -> None:
    """``write_text_atomic`` of ``obj`` as indented JSON with sorted keys."""
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------
# File checks
# --------------------------------------------------------------------------------------


def digest_files(directory: str, names: Iterable[str]) -> Dict[str, Dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": digest}}`` of files in ``directory``: the form
    ``check_file`` and ``verify_files`` check against."""
    out = {}
    for name in names:
        size, digest = file_digest(os.path.join(directory, name))
        out[name] = {"bytes": size, "sha256": digest}
    return out


def check_file(directory: str, name: str, expected: Dict[str, Any]) -> Optional[str]:
    """A message naming what is wrong with ``directory/name`` (missing, wrong size,
    sha256 mismatch), or None if it is as ``expected`` (``{"bytes", "sha256"}``)."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"checkpoint file {path} is missing; the checkpoint is incomplete."
    actual_size = os.path.getsize(path)
    if actual_size != expected["bytes"]:
        return (f"checkpoint file {path} has {actual_size} bytes but {expected['bytes']} were written "
                "(truncated or overwritten); restore it or load an older checkpoint.")
    _, digest = file_digest(path)
    if digest != expected["sha256"]:
        return f"checkpoint file {path} is corrupt (sha256 mismatch); restore it or load an older checkpoint."
    return None


def verify_files(checkpoint_dir: str, manifest: Dict[str, Any], *, share: Tuple[int, int] = (0, 1)) -> List[str]:
    """Check size and sha256 of the manifest's files (``share=(i, n)``: every n-th from i).
    Returns the error messages (empty when all is well)."""
    index, count = share
    names = sorted(manifest["files"])
    errors = []
    for name in names[index::count]:
        message = check_file(checkpoint_dir, name, manifest["files"][name])
        if message:
            errors.append(message)
    return errors


def check_sizes(checkpoint_dir: str, manifest: Dict[str, Any]) -> List[str]:
    """The cheap check: every file of the manifest exists with its size (no hashing)."""
    errors = []
    for name, expected in manifest["files"].items():
        path = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(path) or os.path.getsize(path) != expected["bytes"]:
            errors.append(f"checkpoint file {path} is missing or truncated; restore it or load an older checkpoint.")
    return errors


# --------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------


def write_manifest(checkpoint_dir: str, body: Dict[str, Any]) -> None:
    """Write ``body`` plus its own checksum (``manifest_sha256``) as the manifest, atomically."""
    write_json_atomic(os.path.join(checkpoint_dir, MANIFEST_NAME), dict(body, manifest_sha256=json_digest(body)))


def read_manifest(checkpoint_dir: str) -> Dict[str, Any]:
    """The parsed manifest of an MFSDP checkpoint directory, checked against its own
    checksum. Raises CheckpointError naming the problem."""
    path = os.path.join(checkpoint_dir, MANIFEST_NAME)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint directory {checkpoint_dir!r} does not exist; check the path.")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} is missing: {checkpoint_dir!r} is not a complete MFSDP checkpoint (the save did not "
            "finish, or the path points at the wrong directory)."
        )
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt or truncated ({e}); restore the checkpoint or use an older one.") from None
    if not isinstance(data, dict) or "manifest_sha256" not in data:
        raise CheckpointError(f"{path} is not an MFSDP checkpoint manifest (no manifest_sha256 field).")
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    if json_digest(body) != data["manifest_sha256"]:
        raise CheckpointError(f"{path} is corrupt: its content does not match its checksum; restore the checkpoint.")
    if body.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} has format {body.get('format')!r}, expected {FORMAT_NAME!r}.")
    if int(body.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} was written by a newer version (format {body['format_version']} > {FORMAT_VERSION}); "
            "upgrade this code to load it."
        )
    return body


def checkpoint_tensors(manifest: Dict[str, Any]) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """``{key: (global shape, dtype)}`` of every tensor in a checkpoint."""
    return {
        key: (tuple(md["shape"]), dtype_from_name(md["dtype"]))
        for key, md in manifest["dcp"]["tensors"].items() if not md.get("bytes")
    }
