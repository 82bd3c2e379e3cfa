"""Loss scaling for fp16 training (Megatron-LM's ``--fp16`` semantics).

The loss is multiplied by ``scale`` before backward, so that small fp16 gradients do not
flush to zero; the trainer divides the gradients by it again before clipping. A step whose
gradients overflowed (inf/nan) is skipped, and the dynamic scaler lowers the scale:

* after ``hysteresis`` overflows (consecutive or not, counted since the last growth) the
  scale is multiplied by ``backoff_factor`` (never below ``min_scale``);
* after ``growth_interval`` clean steps in a row it is multiplied by ``growth_factor`` and
  the hysteresis budget is refilled.
"""

from __future__ import annotations

from typing import Any, Dict


class ConstantGradScaler:
    """``--loss-scale S``: a fixed scale; overflowing steps are still skipped."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"the loss scale must be positive, got {scale}.")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        del found_inf

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale ({min_scale}) <= initial_scale ({initial_scale}).")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("growth_factor must exceed 1 and backoff_factor lie in (0, 1).")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("growth_interval (--loss-scale-window) and hysteresis must be at least 1.")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._clean_steps = 0
        self._overflows_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self._clean_steps = 0
            self._overflows_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "overflows_left": self._overflows_left}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])
