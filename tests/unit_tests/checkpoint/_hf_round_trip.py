"""Shared by the Hugging Face conversion tests: run convert.py, and a bit-exact round trip."""

import torch

from tools.checkpoint import convert


def run_convert(argv):
    assert convert.main(argv + ["--quiet"]) == 0


def assert_round_trip_is_bit_exact(hf, tmp_path) -> None:
    """Save ``hf``, convert it to MFSDP (``tmp_path/"mfsdp"``) and back (``tmp_path/"back"``):
    the same tensor names, dtypes and bits."""
    from safetensors.torch import load_file

    hf.save_pretrained(str(tmp_path / "hf"))
    run_convert(["--input", str(tmp_path / "hf"), "--to", "mfsdp", "--output", str(tmp_path / "mfsdp")])
    run_convert(["--input", str(tmp_path / "mfsdp"), "--to", "hf", "--output", str(tmp_path / "back")])
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
