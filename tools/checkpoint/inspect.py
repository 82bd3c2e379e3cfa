#!/usr/bin/env python
"""Look inside a checkpoint (MFSDP / trainer, safetensors, Hugging Face), in one CPU process.

    python tools/checkpoint/inspect.py checkpoints/run                 # list tensors
    python tools/checkpoint/inspect.py checkpoints/run --tensor embedding.word_embeddings.weight
    python tools/checkpoint/inspect.py checkpoints/run --compare other/  # max |a - b| per tensor
    python tools/checkpoint/inspect.py checkpoints/run --verify          # checksums of every file

The listing gives name, shape, dtype and bytes of every tensor (optimizer state included
for MFSDP checkpoints, as ``optimizer.state.<param>.<key>``). ``--compare`` exits with
status 1 when a tensor differs by more than ``--atol`` or the two tensor sets differ; a
Hugging Face directory compares with one of ours under our names (GPT-2 and Llama).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's directory comes first on sys.path, where this module would
# shadow the standard library's ``inspect`` (which torch imports). Drop it before any import.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]
_REPO_ROOT = os.path.abspath(os.path.join(_HERE, os.pardir, os.pardir))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import argparse  # noqa: E402
import fnmatch  # noqa: E402
import re  # noqa: E402


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="List, print and compare checkpoint tensors.", allow_abbrev=False)
    p.add_argument("path", help="--save directory, iteration directory, .safetensors file or Hugging Face directory")
    p.add_argument("--iteration", type=int, default=None, help="MFSDP: this iteration instead of the latest")
    p.add_argument("--filter", default=None, help="only tensors whose name matches this glob or regex")
    p.add_argument("--tensor", default=None, help="print this tensor")
    p.add_argument("--full", action="store_true", help="with --tensor: print every value")
    p.add_argument("--compare", default=None, metavar="OTHER", help="max abs difference per tensor against OTHER")
    p.add_argument("--other-iteration", type=int, default=None, help="iteration of OTHER (MFSDP)")
    p.add_argument("--atol", type=float, default=0.0, help="--compare: differences above this fail (exit 1)")
    p.add_argument("--verify", action="store_true", help="MFSDP: check the size and sha256 of every file")
    return p


def _matches(name: str, pattern) -> bool:
    if pattern is None:
        return True
    return fnmatch.fnmatchcase(name, pattern) or re.search(pattern, name) is not None


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def list_tensors(ckpt, pattern, out=None) -> None:
    out = out or sys.stdout
    import torch

    for line in ckpt.describe():
        print(line, file=out)
    rows = []
    for name in ckpt.keys():
        if not _matches(name, pattern):
            continue
        shape, dtype = ckpt.shape_dtype(name)
        numel = 1
        for s in shape:
            numel *= s
        rows.append((name, shape, dtype, numel * torch.empty((), dtype=dtype).element_size()))
    width = max([len(r[0]) for r in rows] + [4])
    print(f"{'name':<{width}}  {'shape':<22} {'dtype':<9} {'bytes':>12}", file=out)
    total = {}
    for name, shape, dtype, nbytes in rows:
        print(f"{name:<{width}}  {str(list(shape)):<22} {str(dtype).replace('torch.', ''):<9} {nbytes:>12,}", file=out)
        group = "optimizer" if name.startswith("optimizer.") else "model"
        count, size, elements = total.get(group, (0, 0, 0))
        numel = nbytes // torch.empty((), dtype=dtype).element_size()
        total[group] = (count + 1, size + nbytes, elements + numel)
    for group, (count, size, elements) in total.items():
        print(f"{group}: {count} tensors, {elements:,} elements, {size:,} bytes ({_human(size)})", file=out)


def print_tensor(ckpt, name, full, out=None) -> int:
    out = out or sys.stdout
    import torch

    if name not in ckpt.keys():
        close = [k for k in ckpt.keys() if name in k][:5]
        hint = f" Similar names: {', '.join(close)}." if close else ""
        print(f"inspect.py: error: no tensor {name!r} in {ckpt.path}.{hint}", file=sys.stderr)
        return 2
    t = ckpt.load([name])[name]
    print(f"{name}: shape {list(t.shape)}, dtype {str(t.dtype).replace('torch.', '')}", file=out)
    if t.is_floating_point() and t.numel():
        f = t.double()
        print(f"  min {f.min().item():.6g}  max {f.max().item():.6g}  mean {f.mean().item():.6g}  "
              f"std {f.std().item() if f.numel() > 1 else 0.0:.6g}  norm {f.norm().item():.6g}", file=out)
    if full:
        torch.set_printoptions(threshold=sys.maxsize, precision=8)
    print(t, file=out)
    return 0


def compare(a, b, pattern, atol, out=None) -> int:
    out = out or sys.stdout
    names_a = {n for n in a.keys() if _matches(n, pattern)}
    names_b = {n for n in b.keys() if _matches(n, pattern)}
    has_optimizer = [any(n.startswith("optimizer.") for n in names) for names in (names_a, names_b)]
    if has_optimizer[0] != has_optimizer[1]:
        print("note: only one side holds optimizer state; comparing model tensors", file=out)
        names_a = {n for n in names_a if not n.startswith("optimizer.")}
        names_b = {n for n in names_b if not n.startswith("optimizer.")}
    status = 0
    for label, missing in (("only in " + a.path, names_a - names_b), ("only in " + b.path, names_b - names_a)):
        if missing:
            status = 1
            shown = sorted(missing)
            more = f" and {len(shown) - 10} more" if len(shown) > 10 else ""
            print(f"{label}: {', '.join(shown[:10])}{more}", file=out)
    common = sorted(names_a & names_b)
    width = max([len(n) for n in common] + [4])
    print(f"{'name':<{width}}  {'max abs diff':>14}", file=out)
    worst = 0.0
    for name in common:
        sa, da = a.shape_dtype(name)
        sb, db = b.shape_dtype(name)
        if tuple(sa) != tuple(sb):
            print(f"{name:<{width}}  shape {list(sa)} vs {list(sb)}", file=out)
            status = 1
            continue
        ta = a.load([name])[name]
        tb = b.load([name])[name]
        if ta.numel() == 0:
            diff = 0.0
        elif ta.is_floating_point() or tb.is_floating_point():
            diff = (ta.double() - tb.double()).abs().max().item()
        else:
            diff = float((ta != tb).any().item())
        note = "" if da == db else f"  (dtype {da} vs {db})"
        print(f"{name:<{width}}  {diff:>14.6g}{note}", file=out)
        worst = max(worst, diff)
        if diff > atol or diff != diff:
            status = 1
    print(f"{len(common)} tensors compared, largest difference {worst:.6g}"
          + (" (identical)" if worst == 0 and status == 0 else ""), file=out)
    return status


class HuggingFaceAsOurs:
    """A Hugging Face checkpoint seen under our tensor names (converted in memory)."""

    kind = "Hugging Face (our names)"

    def __init__(self, hf_checkpoint):
        from tools.checkpoint import hf_conversion as hf

        self.path = hf_checkpoint.path
        self.vocab_size = hf_checkpoint.config["vocab_size"]
        config = hf.config_from_hf(hf_checkpoint.config)
        self._tensors = hf.from_hf(hf_checkpoint.load(hf_checkpoint.keys()), config)

    def keys(self):
        return list(self._tensors)

    def shape_dtype(self, key):
        return tuple(self._tensors[key].shape), self._tensors[key].dtype

    def load(self, keys):
        return {k: self._tensors[k] for k in keys}


class VocabularyRows:
    """Our checkpoint with the vocabulary matrices cut to their first ``rows`` rows: the
    padding rows have no counterpart in a Hugging Face model."""

    _VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")

    def __init__(self, checkpoint, rows):
        self.inner, self.rows, self.path, self.kind = checkpoint, rows, checkpoint.path, checkpoint.kind

    def keys(self):
        return self.inner.keys()

    def shape_dtype(self, key):
        shape, dtype = self.inner.shape_dtype(key)
        return ((self.rows,) + tuple(shape[1:]) if key in self._VOCAB else shape), dtype

    def load(self, keys):
        out = self.inner.load(keys)
        return {k: (v[:self.rows] if k in self._VOCAB else v) for k, v in out.items()}


def in_common_names(a, b):
    """(a, b) with a Hugging Face side renamed to ours when the other side is ours."""
    from tools.checkpoint.checkpoint_io import HuggingFaceCheckpoint

    if isinstance(a, HuggingFaceCheckpoint) == isinstance(b, HuggingFaceCheckpoint):
        return a, b
    theirs, ours = (a, b) if isinstance(a, HuggingFaceCheckpoint) else (b, a)
    mapped = HuggingFaceAsOurs(theirs)
    print(f"note: {theirs.path} is compared under our tensor names; vocabulary rows beyond its "
          f"{mapped.vocab_size} (padding) are not compared")
    ours = VocabularyRows(ours, mapped.vocab_size)
    return (mapped, ours) if theirs is a else (ours, mapped)


def main(argv=None) -> int:
    opts = get_parser().parse_args(argv)
    from tools.checkpoint.checkpoint_io import MfsdpCheckpoint, open_checkpoint

    try:
        ckpt = open_checkpoint(opts.path, opts.iteration)
        if opts.verify:
            if not isinstance(ckpt, MfsdpCheckpoint):
                print("inspect.py: error: --verify applies to MFSDP checkpoints (they record checksums).",
                      file=sys.stderr)
                return 2
            ckpt.verify()
            print(f"{ckpt.path}: all {ckpt.file_count()} files match their size and sha256")
            return 0
        if opts.tensor is not None:
            return print_tensor(ckpt, opts.tensor, opts.full)
        if opts.compare is not None:
            other = open_checkpoint(opts.compare, opts.other_iteration)
            ckpt, other = in_common_names(ckpt, other)
            return compare(ckpt, other, opts.filter, opts.atol)
        list_tensors(ckpt, opts.filter)
        return 0
    except (FileNotFoundError, ValueError, RuntimeError, KeyError) as e:
        print(f"inspect.py: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # an optional package: safetensors / transformers
        print(f"inspect.py: error: {e}; install the conversion extras: pip install -e '.[hf]' "
              "(or MEGATRON_EXTRAS=hf source scripts/setup_env.sh).", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
