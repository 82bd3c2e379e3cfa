"""Learning-rate and weight-decay schedule with Megatron-LM's OptimizerParamScheduler semantics.

Steps are counted in *samples*, as in Megatron: the trainer calls ``step(increment=global
batch size)`` after every optimizer step, and the warmup/decay lengths are given in
samples (``iters * global_batch_size``). Step 0 is applied at construction, so with warmup
the very first optimizer step runs at ``init_lr`` (0 by default), exactly like Megatron.
"""

from __future__ import annotations

import math
from typing import Any, Dict

_DECAY_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    def __init__(
        self,
        optimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        weight_decay: float = 0.0,
        use_checkpoint_opt_param_scheduler: bool = False,
    ):
        if lr_decay_style not in _DECAY_STYLES:
            raise ValueError(
                f"lr_decay_style must be one of {_DECAY_STYLES}, got {lr_decay_style!r}."
            )
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(
                f"min_lr ({min_lr}) must be between 0 and max_lr ({max_lr}); lower --min-lr."
            )
        if lr_decay_steps <= 0:
            raise ValueError(f"lr_decay_steps must be positive, got {lr_decay_steps}.")
        if not 0 <= lr_warmup_steps < lr_decay_steps:
            raise ValueError(
                f"lr warmup ({lr_warmup_steps} samples) must be shorter than the decay "
                f"({lr_decay_steps} samples); lower --lr-warmup-iters or raise --lr-decay-iters."
            )
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = int(lr_warmup_steps)
        self.lr_decay_steps = int(lr_decay_steps)
        self.lr_decay_style = lr_decay_style
        self.weight_decay = float(weight_decay)
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_lr(self, param_group: Dict[str, Any] | None = None) -> float:
        """Learning rate at the current ``num_steps`` (in samples)."""
        param_group = param_group or {}
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)

        # Linear warmup from init_lr; the boundary step itself already reaches max_lr.
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(
                self.lr_warmup_steps
            )
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr

        decay_ratio = float(self.num_steps - self.lr_warmup_steps) / float(
            self.lr_decay_steps - self.lr_warmup_steps
        )
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self) -> float:
        # Constant weight decay (Megatron's default --weight-decay-incr-style constant).
        return self.weight_decay

    def step(self, increment: int) -> None:
        """Advance by ``increment`` samples and write lr / weight decay into the groups."""
        self.num_steps += int(increment)
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group)
            # Groups excluded from decay carry wd_mult=0 (see get_megatron_optimizer).
            group["weight_decay"] = self.get_wd() * group.get("wd_mult", 1.0)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "init_lr": self.init_lr,
            "weight_decay": self.weight_decay,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # By default the schedule's shape comes from the command line (so a resumed run can
        # change it, as with Megatron's --override-opt_param-scheduler) and only the progress
        # from the checkpoint; --use-checkpoint-opt_param-scheduler takes the shape too.
        if self.use_checkpoint_opt_param_scheduler:
            self.max_lr = float(state_dict["max_lr"])
            self.min_lr = float(state_dict["min_lr"])
            self.init_lr = float(state_dict["init_lr"])
            self.lr_warmup_steps = int(state_dict["lr_warmup_steps"])
            self.lr_decay_steps = int(state_dict["lr_decay_steps"])
            self.lr_decay_style = state_dict["lr_decay_style"]
            self.weight_decay = float(state_dict["weight_decay"])
        self.num_steps = 0
        self.step(int(state_dict["num_steps"]))
