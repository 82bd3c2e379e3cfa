"""Newton-Schulz orthogonalization, the heart of Muon, and Muon's update scale.

``newton_schulz(x)`` maps a matrix ``G = U S V^T`` to approximately ``U V^T``: it normalizes
``X = G / ||G||_F`` (so every singular value is at most 1), then applies the odd polynomial
``X <- a X + b (X X^T) X + c (X X^T)^2 X`` once per step, with the step's ``(a, b, c)``
from a named coefficient schedule. The iteration works on the smaller side (a tall matrix
is transposed first, so ``X X^T`` is the small Gram matrix). A 3-D input is a batch of
matrices, each orthogonalized on its own (a MoE layer's stacked experts).

The schedules and the way they extend to more steps are those of NVIDIA's
emerging-optimizers package that upstream Megatron-LM's ``--muon-coefficient-type`` names:
``cycle`` repeats the list from its start, ``repeat_last`` keeps its last entry.

``--muon-fp32-matmul-prec medium`` (upstream's default) runs the steps in bf16 after the
normalization; ``high`` keeps fp32 (TF32 allowed on GPUs).
"""

from __future__ import annotations

import contextlib
from typing import List, Tuple

import torch

Coefficients = Tuple[float, float, float]

# name -> (coefficients, how they extend past their length)
COEFFICIENT_SETS = {
    "simple": ([(3.4445, -4.7750, 2.0315)], "cycle"),
    # Keller Jordan's modded-nanogpt quintic schedule.
    "quintic": ([(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                 (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)], "cycle"),
    # Polar Express (arXiv:2505.16932), its 1.01 safety factor folded in.
    "polar_express": ([(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                       (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                       (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)], "repeat_last"),
    # CANS (arXiv:2506.10935).
    "cans": ([(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
              (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)], "repeat_last"),
    # flash-newton-schulz's AOL schedule.
    "aol": ([(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
             (2.7215, -3.0494, 1.3169)], "cycle"),
    "deepseekv4": ([(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2, "repeat_last"),
    # A fixed five-step cubic schedule (c = 0: no Gram-square product), arXiv:2606.00371.
    "cubic5": ([(3.3656576, -3.3420992, 0.0), (2.5744352, -1.4957376, 0.0), (2.5368962, -1.4312570, 0.0),
                (2.4418906, -1.2764040, 0.0), (2.2230472, -0.9630650, 0.0)], "fixed"),
}
COEFFICIENT_TYPES = tuple(COEFFICIENT_SETS)
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MATMUL_PRECISIONS = ("medium", "high")
EPS = 1e-15


def coefficient_schedule(kind: str, steps: int) -> List[Coefficients]:
    """The ``(a, b, c)`` of each of ``steps`` steps; ValueError for an unknown kind or a
    step count the kind does not allow."""
    if kind not in COEFFICIENT_SETS:
        raise ValueError(f"unknown Newton-Schulz coefficient type {kind!r}; use one of {', '.join(COEFFICIENT_TYPES)}.")
    if steps < 1:
        raise ValueError(f"the Newton-Schulz step count must be at least 1, got {steps}.")
    sets, extend = COEFFICIENT_SETS[kind]
    if extend == "fixed" and steps != len(sets):
        raise ValueError(f"{kind} is a fixed {len(sets)}-step schedule; use {len(sets)} steps.")
    if extend == "cycle":
        return [sets[i % len(sets)] for i in range(steps)]
    return [sets[min(i, len(sets) - 1)] for i in range(steps)]


@contextlib.contextmanager
def _fp32_matmul_precision(precision: str):
    # torch's setting is process-wide; restored so that the model's own matmuls keep theirs.
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def newton_schulz(x: torch.Tensor, steps: int = 5, kind: str = "quintic", precision: str = "high") -> torch.Tensor:
    """The orthogonalized ``x`` (2-D, or 3-D: a batch of matrices), fp32."""
    if x.dim() not in (2, 3):
        raise ValueError(f"Newton-Schulz takes a matrix or a batch of matrices, got {x.dim()} dims.")
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"unknown fp32 matmul precision {precision!r}; use one of {MATMUL_PRECISIONS}.")
    schedule = coefficient_schedule(kind, steps)
    x = x.float()
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=EPS)
    if precision == "medium":
        X = X.to(torch.bfloat16)  # bf16 in and out of every step, as upstream's "medium"
    batched = X.dim() == 3
    with _fp32_matmul_precision(precision):
        for a, b, c in schedule:
            A = X @ X.mT
            if c != 0.0:
                B = torch.baddbmm(A, A, A, beta=b, alpha=c) if batched else torch.addmm(A, A, A, beta=b, alpha=c)
                X = torch.baddbmm(X, B, X, beta=a) if batched else torch.addmm(X, B, X, beta=a)
            else:
                X = torch.baddbmm(X, A, X, beta=a, alpha=b) if batched else torch.addmm(X, A, X, beta=a, alpha=b)
    X = X.float()
    return X.mT if transpose else X


def muon_scale_factor(rows: int, cols: int, mode: str = "spectral") -> float:
    """The factor on the orthogonalized update of a ``rows x cols`` matrix: ``spectral``
    sqrt(max(rows, cols)), ``unit_rms_norm`` sqrt(rows / cols), ``shape_scaling``
    sqrt(max(1, rows / cols))."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r}; use one of {', '.join(SCALE_MODES)}.")
