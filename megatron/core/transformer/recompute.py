"""Selective recompute of named modules (Megatron-LM's ``--recompute-modules``).

With ``recompute_granularity="selective"`` the config's ``recompute_modules`` (default
``["core_attn"]``) names what is recomputed in backward instead of kept from forward:

* ``core_attn``: the attention core (softmax(q k^T) v, dropout replayed); q, k, v are kept.
* ``mlp``: a dense layer's whole MLP (only its input is kept).
* ``moe``: a MoE layer's whole forward: router, dispatch, experts, combine (its all-to-alls
  run again in backward, on every expert-parallel rank in the same order).
* ``shared_experts``: a MoE layer's shared expert.
* ``layernorm``: the output of ``input_layernorm`` and ``pre_mlp_layernorm`` is not kept
  for the linear that reads it; it is recomputed from the layer input (kept anyway) when
  that linear's backward needs it.
* ``moe_act``: the experts' activation (times the router weights): its output is not kept
  for ``linear_fc2``, and the activation keeps only its input.

``layernorm`` and ``moe_act`` are upstream's output-discarding checkpoints. Upstream frees
the output's storage after its consumer ran and refills it from a gradient hook; here the
consumer's saved tensor is replaced by a recipe through torch's saved-tensor hooks
(``recompute_saved``), which needs no storage tricks and no nested backward. Under
sequence parallelism the column-parallel linear keeps the all-gathered input, not the
norm's output: ``layernorm`` then saves nothing (same results).

* ``gdn_norm_out``: the gated delta net's gated output norm (gated_delta_net.py): its output
  is not kept for ``out_proj`` (needs ``--experimental-attention-variant gdn``).

Upstream's other names are validated as upstream does: ``mla_up_proj`` needs multi-latent
attention, ``gdp_in_proj`` / ``gdp_qkv`` a gated delta-product attention and ``mhc``
hyper-connections: none of these modules exists here, so they are refused.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, List, Optional

import torch

RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
                     "gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc")
# Upstream's names whose module this project does not have, and what upstream requires for them.
_MISSING = {
    "gdp_in_proj": "a gated delta-product attention variant, which is not implemented here",
    "gdp_qkv": "a gated delta-product attention variant, which is not implemented here",
    "mhc": "hyper-connections (enable_mhc_connections), which are not implemented here",
}


def check_recompute_modules(modules: Optional[Iterable[str]], granularity: Optional[str],
                            moe_grouped_gemm: bool = False, gated_delta_net: bool = False,
                            multi_latent_attention: bool = False) -> List[str]:
    """The modules to recompute (upstream's default ["core_attn"]), or ValueError with the fix."""
    modules = ["core_attn"] if modules is None else list(modules)
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"--recompute-modules: unknown {', '.join(unknown)}; choose from {', '.join(RECOMPUTE_MODULES)}.")
    if granularity != "selective":
        return modules  # upstream ignores them without selective recompute
    for name in modules:
        if name in _MISSING:
            raise ValueError(f"--recompute-modules {name} needs {_MISSING[name]}; drop it from the list.")
    if "mla_up_proj" in modules and not multi_latent_attention:
        raise ValueError("--recompute-modules mla_up_proj needs --multi-latent-attention (it recomputes the MLA up "
                         "projections and RoPE); add it or drop mla_up_proj from the list.")
    if "gdn_norm_out" in modules and not gated_delta_net:
        raise ValueError("--recompute-modules gdn_norm_out needs --experimental-attention-variant gdn (a gated "
                         "delta-net layer); add it or drop gdn_norm_out from the list.")
    if "moe_act" in modules and not moe_grouped_gemm:
        # Upstream's rule (its activation checkpoint lives in the grouped-GEMM experts).
        raise ValueError("--recompute-modules moe_act is only supported with --moe-grouped-gemm; add it or drop moe_act.")
    return modules


def recomputes(config, name: str) -> bool:
    """Whether ``name`` is recomputed in this config's layers."""
    if config.recompute_granularity != "selective":
        return False
    modules = config.recompute_modules
    return name in (["core_attn"] if modules is None else modules)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a is b, or a view of b covering exactly its elements in the same order."""
    return (a.dtype == b.dtype and a.numel() == b.numel() and a.device == b.device
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.is_contiguous() and b.is_contiguous())


@contextlib.contextmanager
def recompute_saved(output: torch.Tensor, recompute: Callable[[], torch.Tensor]):
    """Inside: an op that saves ``output`` (or a contiguous view of all of it) for its
    backward saves a recipe instead; the first backward that needs it calls ``recompute``
    (without grad), and the ops that saved it share that one result. ``recompute()`` must
    return the same values; the caller's closure keeps what it reads alive."""
    recipe = _Recipe(recompute)

    def pack(tensor):
        if _same_memory(tensor, output):
            return recipe, tensor.shape
        return tensor

    def unpack(saved):
        if isinstance(saved, tuple) and len(saved) == 2 and saved[0] is recipe:
            return recipe.tensor().view(saved[1])
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class _Recipe:
    """Stands for a saved tensor; recomputed once, when a backward first unpacks it (the
    result lives as long as the graph nodes that saved the recipe)."""

    __slots__ = ("recompute", "value")

    def __init__(self, recompute):
        self.recompute, self.value = recompute, None

    def tensor(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.recompute()
            self.recompute = None  # drop the closure's references
        return self.value
