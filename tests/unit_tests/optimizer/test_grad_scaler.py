"""fp16 loss scalers: backoff after `hysteresis` overflows, growth after a clean window."""

import pytest

from megatron.core.optimizer import ConstantGradScaler, DynamicGradScaler


def test_dynamic_scaler_backoff_hysteresis_and_growth():
    s = DynamicGradScaler(initial_scale=1024, min_scale=64, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024  # first overflow is absorbed by the hysteresis
    s.update(True)
    assert s.scale == 512
    s.update(True)
    assert s.scale == 256  # budget spent: every further overflow halves
    for _ in range(3):
        s.update(False)
    assert s.scale == 512  # a clean window doubles and refills the budget
    s.update(True)
    assert s.scale == 512
    for _ in range(10):
        s.update(True)
    assert s.scale == 64  # never below min_scale
    state = s.state_dict()
    t = DynamicGradScaler(initial_scale=2.0**32)
    t.load_state_dict(state)
    assert t.state_dict() == state


def test_constant_scaler_and_bad_settings():
    s = ConstantGradScaler(128)
    s.update(True)
    assert s.scale == 128
    with pytest.raises(ValueError):
        DynamicGradScaler(initial_scale=1, min_scale=2)
    with pytest.raises(ValueError):
        DynamicGradScaler(hysteresis=0)
