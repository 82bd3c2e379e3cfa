"""MixedPrecisionPolicy and the dtype rules it implies.

* main weights (optimizer-updated, checkpointed) are ``main_params_dtype``;
* compute weights keep the model's own parameter dtype; they alias the main weights when
  the two dtypes are equal;
* ``main_grads_dtype=None`` means the compute dtype;
* ``grad_comm_dtype=None`` means ``main_grads_dtype``; reductions run in it.

Whether precision is "mixed" is decided by comparing these dtypes with the parameter's
own dtype, never by whether a field is None.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_supported_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            f"{what} has dtype {dtype}; MFSDP v2 supports float32, bfloat16 and float16 "
            "parameters. Cast the module (e.g. module.float()) before fully_shard."
        )


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    main_params_dtype: torch.dtype = torch.float32
    main_grads_dtype: Optional[torch.dtype] = None
    grad_comm_dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        check_supported_dtype(self.main_params_dtype, "MixedPrecisionPolicy.main_params_dtype")
        if self.main_grads_dtype is not None:
            check_supported_dtype(self.main_grads_dtype, "MixedPrecisionPolicy.main_grads_dtype")
        if self.grad_comm_dtype is not None:
            check_supported_dtype(self.grad_comm_dtype, "MixedPrecisionPolicy.grad_comm_dtype")

    def resolve(self, param_dtype: torch.dtype) -> "ResolvedPrecision":
        grads = self.main_grads_dtype or param_dtype
        comm = self.grad_comm_dtype or grads
        return ResolvedPrecision(
            compute=param_dtype, main_params=self.main_params_dtype, main_grads=grads, grad_comm=comm
        )


@dataclasses.dataclass(frozen=True)
class ResolvedPrecision:
    """The concrete dtypes of one parameter group."""

    compute: torch.dtype
    main_params: torch.dtype
    main_grads: torch.dtype
    grad_comm: torch.dtype

    @property
    def model_weight_aliases_main(self) -> bool:
        return self.compute == self.main_params
