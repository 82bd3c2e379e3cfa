"""checkpoint/manifest.py: atomic writes survive failures and kills, digests and the
manifest's checksum catch corruption (single process)."""

import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from megatron.core.distributed.mfsdp_v2.checkpoint import manifest
from megatron.core.distributed.mfsdp_v2.checkpoint.errors import CheckpointError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def flip_byte(path, where=None):
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2 if where is None else where] ^= 0x01
    open(path, "wb").write(bytes(blob))


def write_checkpoint_like(directory, files):
    """Data files plus a manifest that records their digests (as a save does)."""
    for name, content in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(content)
    body = {"format": manifest.FORMAT_NAME, "format_version": manifest.FORMAT_VERSION,
            "dcp": {"tensors": {"model.w": {"dtype": "bfloat16", "shape": [3, 2], "chunks": []}}, "storage": []},
            "files": manifest.digest_files(directory, sorted(files))}
    manifest.write_manifest(directory, body)
    return body


# ----------------------------------------------------------------------------------------
# Atomic writes
# ----------------------------------------------------------------------------------------


def test_write_json_atomic_round_trip_and_format(tmp_path):
    path = str(tmp_path / "a.json")
    manifest.write_json_atomic(path, {"b": [1, 2.5], "a": None})
    text = open(path).read()
    assert text == '{\n "a": null,\n "b": [\n  1,\n  2.5\n ]\n}\n'
    assert json.loads(text) == {"a": None, "b": [1, 2.5]}
    assert os.listdir(tmp_path) == ["a.json"]  # no temporary file left behind


def test_failing_write_leaves_the_old_file_intact(tmp_path):
    path = str(tmp_path / "common.json")
    manifest.write_json_atomic(path, {"iteration": 1})
    before = open(path, "rb").read()
    with pytest.raises(TypeError):
        manifest.write_json_atomic(path, {"iteration": 2, "bad": object()})
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["common.json"]


_KILLED_WRITER = """
import os, signal, sys
from megatron.core.distributed.mfsdp_v2.checkpoint import manifest

def killed(src, dst):  # the process dies with the new content fully written, before the rename
    os.kill(os.getpid(), signal.SIGKILL)

os.replace = killed
manifest.write_json_atomic(sys.argv[1], {"iteration": 2, "payload": "x" * 100000})
"""


def test_process_killed_during_write_leaves_the_old_file_intact(tmp_path):
    path = str(tmp_path / "latest.json")
    manifest.write_json_atomic(path, {"iteration": 1})
    before = open(path, "rb").read()
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, path], env=env, timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert open(path, "rb").read() == before
    leftovers = [n for n in os.listdir(tmp_path) if n != "latest.json"]
    assert len(leftovers) == 1 and leftovers[0].startswith("latest.json.tmp.")  # the new copy, never renamed
    assert json.load(open(tmp_path / leftovers[0]))["iteration"] == 2
    # The next write replaces the file; the stale temporary file does not get in its way.
    manifest.write_json_atomic(path, {"iteration": 3})
    assert json.load(open(path)) == {"iteration": 3}


def test_write_text_atomic_replaces_the_whole_file(tmp_path):
    path = str(tmp_path / "tracker.txt")
    manifest.write_text_atomic(path, "1000")
    manifest.write_text_atomic(path, "20")
    assert open(path).read() == "20"


# ----------------------------------------------------------------------------------------
# Digests
# ----------------------------------------------------------------------------------------


def test_json_digest_is_canonical():
    assert manifest.json_digest({"a": 1, "b": [1, 2]}) == manifest.json_digest({"b": [1, 2], "a": 1})
    assert manifest.json_digest({"a": 1}) != manifest.json_digest({"a": 2})
    assert manifest.json_digest({"b": 1, "a": 2}) == hashlib.sha256(b'{"a":2,"b":1}').hexdigest()


def test_file_digest_across_read_blocks(tmp_path):
    content = os.urandom((1 << 22) + 3)  # one block and 3 bytes
    path = tmp_path / "blob"
    path.write_bytes(content)
    assert manifest.file_digest(str(path)) == (len(content), hashlib.sha256(content).hexdigest())


# ----------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    files = {f"__{i}_0.distcp": os.urandom(1000 + i) for i in range(4)}
    files[".metadata"] = b"index"
    write_checkpoint_like(str(tmp_path), files)
    return str(tmp_path)


def test_intact_checkpoint_verifies(checkpoint):
    saved = manifest.read_manifest(checkpoint)
    assert manifest.verify_files(checkpoint, saved) == []
    assert manifest.check_sizes(checkpoint, saved) == []
    assert manifest.checkpoint_tensors(saved) == {"model.w": ((3, 2), torch.bfloat16)}


def test_corrupt_data_file_is_named_by_exactly_one_share(checkpoint):
    flip_byte(os.path.join(checkpoint, "__2_0.distcp"))
    saved = manifest.read_manifest(checkpoint)
    errors = manifest.verify_files(checkpoint, saved)
    assert len(errors) == 1 and "__2_0.distcp is corrupt (sha256 mismatch)" in errors[0]
    shares = [manifest.verify_files(checkpoint, saved, share=(i, 3)) for i in range(3)]
    assert sorted(len(s) for s in shares) == [0, 0, 1]
    assert manifest.check_sizes(checkpoint, saved) == []  # same size: only the hash sees it


def test_truncated_and_missing_files(checkpoint):
    with open(os.path.join(checkpoint, "__1_0.distcp"), "r+b") as f:
        f.truncate(10)
    os.remove(os.path.join(checkpoint, "__3_0.distcp"))
    saved = manifest.read_manifest(checkpoint)
    errors = manifest.verify_files(checkpoint, saved)
    assert len(errors) == 2
    assert "__1_0.distcp has 10 bytes but 1001 were written" in errors[0]
    assert "__3_0.distcp is missing" in errors[1]
    assert len(manifest.check_sizes(checkpoint, saved)) == 2


def test_corrupted_digest_in_the_manifest(checkpoint):
    path = os.path.join(checkpoint, manifest.MANIFEST_NAME)
    data = json.load(open(path))
    good = data["files"]["__0_0.distcp"]["sha256"]
    # A digest altered on disk: the manifest no longer matches its own checksum.
    data["files"]["__0_0.distcp"]["sha256"] = good[:-1] + ("0" if good[-1] != "0" else "1")
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        manifest.read_manifest(checkpoint)
    # A wrong digest recorded consistently (checksum recomputed): the file check catches it.
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    manifest.write_manifest(checkpoint, body)
    saved = manifest.read_manifest(checkpoint)
    errors = manifest.verify_files(checkpoint, saved)
    assert len(errors) == 1 and "__0_0.distcp is corrupt (sha256 mismatch)" in errors[0]


def test_check_file_for_a_file_outside_the_manifest(tmp_path):
    (tmp_path / "rng").mkdir()
    path = tmp_path / "rng" / "rank_00000.pt"
    path.write_bytes(b"state" * 100)
    size, digest = manifest.file_digest(str(path))
    expected = {"bytes": size, "sha256": digest}
    assert manifest.check_file(str(tmp_path), "rng/rank_00000.pt", expected) is None
    flip_byte(str(path), where=3)
    assert "corrupt (sha256 mismatch)" in manifest.check_file(str(tmp_path), "rng/rank_00000.pt", expected)


# ----------------------------------------------------------------------------------------
# Reading the manifest
# ----------------------------------------------------------------------------------------


def test_read_manifest_names_each_problem(tmp_path, checkpoint):
    with pytest.raises(CheckpointError, match="does not exist"):
        manifest.read_manifest(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="not a complete MFSDP checkpoint"):
        manifest.read_manifest(str(empty))
    path = os.path.join(checkpoint, manifest.MANIFEST_NAME)
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        manifest.read_manifest(checkpoint)
    open(path, "w").write(json.dumps({"files": {}}))
    with pytest.raises(CheckpointError, match="no manifest_sha256"):
        manifest.read_manifest(checkpoint)
    body = json.loads(text)
    body.pop("manifest_sha256")
    manifest.write_manifest(checkpoint, dict(body, format="other"))
    with pytest.raises(CheckpointError, match="has format 'other'"):
        manifest.read_manifest(checkpoint)
    manifest.write_manifest(checkpoint, dict(body, format_version=manifest.FORMAT_VERSION + 1))
    with pytest.raises(CheckpointError, match="written by a newer version"):
        manifest.read_manifest(checkpoint)


def test_dtype_names():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        assert manifest.dtype_from_name(manifest.dtype_name(dtype)) is dtype
    with pytest.raises(CheckpointError, match="unknown dtype 'float7'"):
        manifest.dtype_from_name("float7")
