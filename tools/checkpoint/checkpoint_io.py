"""Open any checkpoint the tools understand, in one CPU process, without a cluster.

* an MFSDP / trainer checkpoint: the ``--save`` directory (latest iteration, or
  ``iteration=``), one ``iter_XXXXXXX`` directory, or a bare engine directory
  (``mfsdp_manifest.json``). Keys: model tensors under their parameter names, optimizer
  state as ``optimizer.state.<name>.<key>``.
* a safetensors file (e.g. written by ``convert.py --to safetensors``);
* a Hugging Face model directory (``config.json`` + ``model.safetensors``, sharded
  ``model.safetensors.index.json``, or ``pytorch_model.bin`` read with weights_only=True).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from megatron.core.distributed.mfsdp_v2 import checkpoint as engine
from megatron.core.distributed.mfsdp_v2.checkpoint import manifest

MODEL_PREFIX = engine.MODEL_PREFIX


class Checkpoint:
    kind = "?"
    path = ""

    def keys(self) -> List[str]:
        raise NotImplementedError

    def shape_dtype(self, key: str) -> Tuple[Tuple[int, ...], torch.dtype]:
        raise NotImplementedError

    def load(self, keys: Iterable[str]) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def describe(self) -> List[str]:
        return [f"{self.kind} checkpoint at {self.path}"]


class MfsdpCheckpoint(Checkpoint):
    kind = "MFSDP"

    def __init__(self, path: str, iteration: Optional[int] = None):
        from megatron.training import checkpointing

        self.common: Optional[Dict[str, Any]] = None
        if os.path.isfile(os.path.join(path, manifest.MANIFEST_NAME)) and iteration is None:
            self.path = path
            if os.path.isfile(os.path.join(path, checkpointing.COMMON_FILENAME)):
                self.path, self.common = checkpointing.load_common(path)
        else:
            self.path, self.common = checkpointing.load_common(path, iteration)
        self.manifest = manifest.read_manifest(self.path)
        self._tensors = manifest.checkpoint_tensors(self.manifest)

    @property
    def args(self) -> Dict[str, Any]:
        return dict((self.common or {}).get("args") or {})

    def _name(self, key: str) -> str:
        return key[len(MODEL_PREFIX):] if key.startswith(MODEL_PREFIX) else key

    def _key(self, name: str) -> str:
        return name if name.startswith(engine.OPTIMIZER_PREFIX) else MODEL_PREFIX + name

    def keys(self) -> List[str]:
        return [self._name(k) for k in self._tensors]

    def model_keys(self) -> List[str]:
        return [self._name(k) for k in self._tensors if k.startswith(MODEL_PREFIX)]

    def shape_dtype(self, key: str):
        return self._tensors[self._key(key)]

    def verify(self) -> None:
        """The size and sha256 of every file the manifest lists, and of the tokenizer's copies."""
        from megatron.training.tokenizer_record import tokenizer_args  # imported here, as checkpointing above

        errors = manifest.verify_files(self.path, self.manifest)
        if errors:
            raise engine.CheckpointError(errors[0])
        record = (self.common or {}).get("tokenizer")
        if record:
            tokenizer_args(self.path, record)  # a ValueError naming a changed copy

    def file_count(self) -> int:
        """How many files :meth:`verify` checks."""
        return len(self.manifest["files"]) + len(((self.common or {}).get("tokenizer") or {}).get("files", {}))

    def load(self, keys: Iterable[str]) -> Dict[str, torch.Tensor]:
        keys = list(keys)
        loaded = engine.load_tensors(self.path, [self._key(k) for k in keys], manifest=self.manifest)
        return {k: loaded[self._key(k)] for k in keys}

    def describe(self) -> List[str]:
        lines = [f"MFSDP checkpoint {self.path}"]
        m = self.manifest
        lines.append(f"  saved {m.get('saved_at')} by {m.get('world_size')} rank(s), torch {m.get('torch_version')}")
        strategies = sorted(set((m.get("strategies") or {}).values()))
        if strategies:
            lines.append(f"  strategies: {', '.join(strategies)}")
        if m.get("optimizer"):
            groups = m["optimizer"]["param_groups"]
            lr = ", ".join(f"{g.get('lr')}" for g in groups)
            lines.append(f"  optimizer: {m['optimizer']['class']}, {len(groups)} group(s), lr {lr}")
        else:
            lines.append("  optimizer: none (model weights only)")
        if self.common:
            c = self.common
            lines.append(f"  iteration {c.get('iteration')}, consumed samples {c.get('consumed_train_samples')}"
                         + (", model only" if c.get("model_only") else ""))
        data_bytes = sum(f["bytes"] for f in m["files"].values())
        lines.append(f"  {len(m['files'])} data/index files, {data_bytes:,} bytes")
        return lines


class SafetensorsCheckpoint(Checkpoint):
    kind = "safetensors"

    def __init__(self, files: List[str], path: str):
        from safetensors import safe_open

        self.path = path
        self.files = files
        self._where: Dict[str, str] = {}
        self._meta: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        self.metadata: Dict[str, str] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                self.metadata.update(f.metadata() or {})
                for key in f.keys():
                    sl = f.get_slice(key)
                    self._where[key] = file
                    self._meta[key] = (tuple(sl.get_shape()), _st_dtype(sl.get_dtype()))

    def keys(self):
        return list(self._where)

    def shape_dtype(self, key):
        return self._meta[key]

    def load(self, keys):
        from safetensors import safe_open

        out = {}
        by_file: Dict[str, List[str]] = {}
        for key in keys:
            by_file.setdefault(self._where[key], []).append(key)
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    out[name] = f.get_tensor(name)
        return out

    def describe(self):
        lines = [f"safetensors {self.path} ({len(self.files)} file(s))"]
        if self.metadata:
            lines.append("  metadata: " + ", ".join(f"{k}={v}" for k, v in sorted(self.metadata.items())
                                                    if len(v) < 200))
        return lines


class TorchBinCheckpoint(Checkpoint):
    """pytorch_model.bin, read with weights_only=True (nothing else is unpickled)."""

    kind = "torch"

    def __init__(self, files: List[str], path: str):
        self.path = path
        self._tensors: Dict[str, torch.Tensor] = {}
        for file in files:
            state = torch.load(file, map_location="cpu", weights_only=True)
            self._tensors.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})

    def keys(self):
        return list(self._tensors)

    def shape_dtype(self, key):
        t = self._tensors[key]
        return tuple(t.shape), t.dtype

    def load(self, keys):
        return {k: self._tensors[k] for k in keys}


class HuggingFaceCheckpoint(Checkpoint):
    kind = "Hugging Face"

    def __init__(self, path: str):
        self.path = path
        with open(os.path.join(path, "config.json")) as f:
            self.config = json.load(f)
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(single):
            self.inner: Checkpoint = SafetensorsCheckpoint([single], path)
        elif os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            self.inner = SafetensorsCheckpoint([os.path.join(path, n) for n in files], path)
        elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
            self.inner = TorchBinCheckpoint([os.path.join(path, "pytorch_model.bin")], path)
        else:
            raise FileNotFoundError(f"{path} has a config.json but no model.safetensors, "
                                    "model.safetensors.index.json or pytorch_model.bin.")

    def keys(self):
        return self.inner.keys()

    def shape_dtype(self, key):
        return self.inner.shape_dtype(key)

    def load(self, keys):
        return self.inner.load(keys)

    def describe(self):
        c = self.config
        return [f"Hugging Face {c.get('model_type')} model {self.path} ({', '.join(c.get('architectures') or [])})"]


def _st_dtype(name: str) -> torch.dtype:
    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
    return table.get(name, torch.float32)


def open_checkpoint(path: str, iteration: Optional[int] = None) -> Checkpoint:
    """The checkpoint at ``path``, whatever its kind (raises FileNotFoundError / ValueError)."""
    from megatron.training import checkpointing

    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist.")
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return SafetensorsCheckpoint([path], path)
        if path.endswith((".bin", ".pt", ".pth")):
            return TorchBinCheckpoint([path], path)
        raise ValueError(f"{path!r}: unknown file type (expected .safetensors, .bin or .pt).")
    if os.path.isfile(os.path.join(path, "config.json")):
        return HuggingFaceCheckpoint(path)
    if (os.path.isfile(os.path.join(path, manifest.MANIFEST_NAME))
            or os.path.isfile(os.path.join(path, checkpointing.TRACKER_FILENAME)) or iteration is not None):
        return MfsdpCheckpoint(path, iteration)
    raise ValueError(
        f"{path!r} is not a checkpoint: no {checkpointing.TRACKER_FILENAME}, {manifest.MANIFEST_NAME} or "
        "config.json (an incomplete save leaves no manifest)."
    )


# ----------------------------------------------------------------------------------------
# Writing outputs atomically
# ----------------------------------------------------------------------------------------


def prepare_output(path: str, force: bool) -> str:
    """Refuse an existing ``path`` unless ``force``; return a temporary sibling to write into."""
    if os.path.lexists(path) and not force:
        raise FileExistsError(f"{path!r} already exists; pass --force to overwrite it, or choose another output.")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    if os.path.lexists(tmp):
        shutil.rmtree(tmp) if os.path.isdir(tmp) else os.remove(tmp)
    return tmp


def commit_output(tmp: str, path: str) -> None:
    """Move the finished temporary output into place (replacing an old one)."""
    if os.path.lexists(path):
        old = f"{tmp}.old"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    else:
        os.replace(tmp, path)
    manifest.fsync_dir(os.path.dirname(os.path.abspath(path)))
