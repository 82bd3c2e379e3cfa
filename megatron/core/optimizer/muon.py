"""Muon (MomentUm Orthogonalized by Newton-Schulz) with AdamW for what Muon does not take.

One ``torch.optim.Optimizer`` holds both kinds of parameter groups (``use_muon`` says
which), so the trainer, the LR scheduler, ``fully_shard_optimizer`` and checkpoints see one
optimizer with one ``state``. For a Muon parameter ``W`` with gradient ``G``, as upstream
Megatron-LM's Muon (NVIDIA emerging-optimizers' ``OrthogonalizedOptimizer``):

    W <- W - lr * wd * W                          (decoupled weight decay)
    M <- beta * M + (1 - beta) * G                (momentum, an EMA: ``lerp``)
    U <- (1 - beta) * G + beta * M  if nesterov else M
    W <- W - lr * s * NS(U)                       (each matrix of U on its own)

with ``NS`` the Newton-Schulz orthogonalization (``newton_schulz.py``) and ``s`` the scale
of ``--muon-scale-mode`` times ``--muon-extra-scale-factor``. The AdamW groups are stepped
by a ``torch.optim.AdamW`` that shares the group dicts and the state.

Sharded parameters: the momentum is elementwise, so each data-parallel rank updates its
own rows; ``NS`` needs the whole matrix, so the rows of ``U`` are gathered over the ranks
that shard it (``sharded_matrix.py``), every rank orthogonalizes the same whole matrix, and
keeps its rows: the update equals single-process Muon's. TP pieces follow
``--muon-tp-mode`` (``muon_matrices.py``).
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch

from .muon_matrices import MuonMatrix
from .newton_schulz import muon_scale_factor, newton_schulz
from .sharded_matrix import RowLayout, gather_along, local_of

TP_MODES = ("blockwise", "duplicated", "distributed")


class Muon(torch.optim.Optimizer):
    """``groups``: parameter groups, each with ``use_muon``; ``matrices``: the
    ``MuonMatrix`` of each Muon parameter (by id; absent: one plain matrix)."""

    def __init__(self, groups: List[dict], matrices: Dict[int, MuonMatrix], lr: float = 1e-3,
                 weight_decay: float = 0.0, momentum: float = 0.9, nesterov: bool = False,
                 num_ns_steps: int = 5, coefficient_type: str = "quintic", scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, fp32_matmul_prec: str = "medium", tp_mode: str = "duplicated",
                 adam_betas=(0.9, 0.999), adam_eps: float = 1e-8):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon's momentum must be in [0, 1), got {momentum}.")
        if tp_mode not in TP_MODES:
            raise ValueError(f"unknown Muon TP mode {tp_mode!r}; use one of {TP_MODES}.")
        newton_schulz(torch.zeros(2, 2), num_ns_steps, coefficient_type, fp32_matmul_prec)  # validates them
        muon_scale_factor(1, 1, scale_mode)
        groups = [dict(g) for g in groups]
        for g in groups:
            if g.get("use_muon"):
                bad = [tuple(p.shape) for p in g["params"] if len(p.shape) != 2]
                if bad:
                    raise ValueError(f"Muon takes matrices only; a Muon group holds parameters of shape {bad[0]}.")
        scalar_groups = [g for g in groups if not g.get("use_muon")]
        # Built first: AdamW fills its defaults into the same group dicts this optimizer keeps.
        self._scalar = (torch.optim.AdamW(scalar_groups, lr=lr, betas=adam_betas, eps=adam_eps,
                                          weight_decay=weight_decay) if scalar_groups else None)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, use_muon=False)
        super().__init__(groups, defaults)
        self.matrices = dict(matrices)
        self.ns_steps, self.coefficient_type = num_ns_steps, coefficient_type
        self.scale_mode, self.extra_scale_factor = scale_mode, extra_scale_factor
        self.precision, self.tp_mode = fp32_matmul_prec, tp_mode
        self._layouts: Dict[int, RowLayout] = {}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError("Muon.step(closure) is not supported; run forward/backward, then step().")
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
        if self._scalar is not None:
            # The same groups and state objects: torch's load_state_dict replaces both.
            self._scalar.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._scalar.state = self.state
            self._scalar.step()
        return None

    def _muon_step(self, group: dict) -> None:
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            weight, grad, momentum = local_of(p), local_of(p.grad), local_of(state["momentum_buffer"])
            if wd != 0.0:
                weight.add_(weight, alpha=-wd * lr)
            momentum.lerp_(grad.to(momentum.dtype), 1.0 - beta)
            update = grad.to(momentum.dtype).lerp(momentum, beta) if group["nesterov"] else momentum
            layout = self._layouts.get(id(p))
            if layout is None:
                layout = self._layouts[id(p)] = RowLayout(p)
            whole = layout.gather(update)
            orthogonal = self.orthogonalize(whole, self.matrices.get(id(p), MuonMatrix()))
            weight.add_(layout.mine(orthogonal).to(weight.dtype), alpha=-lr)

    def orthogonalize(self, x: torch.Tensor, spec: MuonMatrix) -> torch.Tensor:
        """The scaled orthogonalized update of ``x`` (one rank's TP piece of the whole value)."""
        rows, cols = x.shape
        if spec.experts:
            return self._scaled(x.reshape(spec.experts, rows // spec.experts, cols), spec).reshape(rows, cols)
        if spec.qkv_split is not None and rows % sum(spec.qkv_split) == 0:
            groups = rows // sum(spec.qkv_split)
            parts = torch.split(x.reshape(groups, sum(spec.qkv_split), cols), list(spec.qkv_split), dim=1)
            done = [self._scaled(part.reshape(-1, cols), spec).reshape(groups, -1, cols) for part in parts]
            return torch.cat(done, dim=1).reshape(rows, cols)
        return self._scaled(x, spec)

    def _scaled(self, x: torch.Tensor, spec: MuonMatrix) -> torch.Tensor:
        """Orthogonalize the matrix (or batch) ``x``, gathering TP pieces unless blockwise.
        Row or column order does not matter: NS(P X Q) = P NS(X) Q for permutations."""
        gathered = spec.tp_group is not None and self.tp_mode != "blockwise"
        if gathered:
            dim = x.dim() - 2 + spec.tp_dim
            x, start, size = gather_along(x, dim, spec.tp_group)
        out = newton_schulz(x, self.ns_steps, self.coefficient_type, self.precision)
        out = out * (muon_scale_factor(x.shape[-2], x.shape[-1], self.scale_mode) * self.extra_scale_factor)
        return out.narrow(dim, start, size) if gathered else out


def muon_and_adamw_groups(groups: Iterable[dict], takes_muon) -> List[dict]:
    """Each of Megatron's parameter groups split into its Muon part (``muon_<name>``) and
    its AdamW part (the group's own name), empty parts dropped."""
    out = []
    for group in groups:
        muon = [p for p in group["params"] if takes_muon(p)]
        rest = [p for p in group["params"] if not takes_muon(p)]
        if muon:
            out.append(dict(group, params=muon, use_muon=True, name="muon_" + group["name"]))
        if rest:
            out.append(dict(group, params=rest, use_muon=False))
    return out
