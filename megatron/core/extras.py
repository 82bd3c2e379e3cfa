"""Optional packages and the setup.py extra that installs each (scripts/setup_env.sh's
``MEGATRON_EXTRAS``): a feature whose package is missing says so in one line, naming the
command that installs it, instead of failing later or silently doing less."""

import importlib.util
from typing import Sequence

# Import name -> the extra (setup.py extras_require) that installs it.
EXTRAS = {"tensorboard": "logging", "wandb": "logging", "transformers": "hf", "safetensors": "hf",
          "sentencepiece": "hf", "google.protobuf": "hf"}


def install_command(extra: str) -> str:
    return f"MEGATRON_EXTRAS={extra} source scripts/setup_env.sh"


class MissingExtra(ValueError):
    """``needed_by`` (a flag or a feature) needs ``package``, which is not installed.
    ``flags``: the command-line flags to drop to run without it (tools that replay command
    lines count them apart instead of failing every line)."""

    def __init__(self, package: str, needed_by: str, flags: Sequence[str] = ()):
        self.package, self.extra, self.flags = package, EXTRAS[package], tuple(flags)
        super().__init__(f"{needed_by} needs the {package} package, which is not installed: install the "
                         f"'{self.extra}' extra with `{install_command(self.extra)}` (or pip install {package}).")


def require(package: str, needed_by: str, flags: Sequence[str] = ()) -> None:
    """Raise :class:`MissingExtra` unless ``package`` can be imported."""
    try:
        found = importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # the parent of a dotted name (google of google.protobuf) is missing
        found = False
    if not found:
        raise MissingExtra(package, needed_by, flags)
