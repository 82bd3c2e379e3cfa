"""Lazy loading of the optional fused backends: Transformer Engine and NVIDIA apex.

Neither is importable on a CPU-only machine, so both are imported only when a config
asks for them, never at module import time.

* Transformer Engine (``transformer_impl="transformer_engine"``) is a hard request: when
  it cannot be imported we raise a ``RuntimeError`` instead of silently training a
  different model than the one asked for.
* apex (``use_apex_fused=True``) is a soft request for faster norms: when the real
  ``apex.normalization`` module is missing we log one line and use the local norms. The
  PyPI package called ``apex`` is an unrelated web toolkit, so "import apex" succeeding
  proves nothing; we look for the module path NVIDIA apex provides.
"""

import functools
import importlib
import logging

import torch

logger = logging.getLogger(__name__)

TE_NOT_INSTALLED = (
    "transformer_impl='transformer_engine' was requested but Transformer Engine is not "
    "installed or cannot be imported ({error}). Install transformer-engine[pytorch] on a CUDA "
    "machine, or use --transformer-impl local (TransformerConfig(transformer_impl='local'))."
)


def import_transformer_engine():
    """Return the ``transformer_engine.pytorch`` module or raise a RuntimeError saying what to do."""
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # TE can also fail with OSError when its CUDA libraries are missing
        raise RuntimeError(TE_NOT_INSTALLED.format(error=f"{type(error).__name__}: {error}")) from error


def te_device() -> torch.device:
    """Device for TE parameters: follow the default device (meta for deferred init, an
    explicit CUDA device), but use CUDA where the default is CPU, because TE kernels are
    CUDA only (and CUDA is also TE's own default)."""
    device = torch.get_default_device()
    return torch.device("cuda") if device.type == "cpu" else device


@functools.lru_cache(maxsize=None)
def apex_norm_class(normalization: str):
    """Return apex's FusedLayerNorm / FusedRMSNorm class, or None (logged once) if apex is missing.

    Cached so that building a many-layer model logs the fallback once, not per norm.
    """
    class_name = {"LayerNorm": "FusedLayerNorm", "RMSNorm": "FusedRMSNorm"}[normalization]
    try:
        module = importlib.import_module("apex.normalization")
        norm_class = getattr(module, class_name)
    except Exception as error:
        logger.warning(
            "use_apex_fused=True but NVIDIA apex (apex.normalization.%s) is not available (%s: %s); "
            "using the local %s implementation instead.",
            class_name, type(error).__name__, error, normalization,
        )
        return None
    logger.info("using apex.normalization.%s for %s", class_name, normalization)
    return norm_class
