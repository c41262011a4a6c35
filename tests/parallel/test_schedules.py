import math

import pytest

from kimi.config import OptimConfig
from kimi.optim import lr_multiplier

pytestmark = pytest.mark.unit


def test_warmup_is_linear_and_never_zero():
    cfg = OptimConfig(warmup_steps=4, schedule="cosine")
    assert [lr_multiplier(s, cfg, 100) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_reaches_min_ratio_at_the_end():
    cfg = OptimConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(10, cfg, 110) == pytest.approx(1.0)
    assert lr_multiplier(60, cfg, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert lr_multiplier(110, cfg, 110) == pytest.approx(0.1)
    mids = [lr_multiplier(s, cfg, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(mids, mids[1:]))


def test_wsd_is_flat_then_decays_linearly():
    cfg = OptimConfig(warmup_steps=10, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    assert all(lr_multiplier(s, cfg, 100) == 1.0 for s in range(10, 80))
    assert lr_multiplier(90, cfg, 100) == pytest.approx(0.5)
    assert lr_multiplier(100, cfg, 100) == pytest.approx(0.0)


def test_constant_after_warmup():
    cfg = OptimConfig(warmup_steps=0, schedule="constant")
    assert {lr_multiplier(s, cfg, 50) for s in range(50)} == {1.0}
    assert math.isfinite(lr_multiplier(0, cfg, 1))
