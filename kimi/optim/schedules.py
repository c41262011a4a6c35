"""Learning-rate schedules as multipliers of the peak lr, for ``torch.optim.lr_scheduler.LambdaLR``.

All start with a linear warmup from lr/warmup to lr (step 0 already trains, so it never uses lr=0):
- ``cosine``: cosine decay from lr to ``min_lr_ratio * lr`` at ``max_steps``.
- ``wsd`` (warmup-stable-decay, MiniCPM arXiv 2404.06395): constant lr, then a linear decay to
  ``min_lr_ratio * lr`` over the last ``decay_fraction`` of the steps. A run can be extended by restarting
  from a checkpoint taken in the stable phase.
- ``constant``: lr after warmup.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from kimi.optim.config import OptimConfig


def lr_multiplier(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of the peak lr used for optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    lo = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        span = max(1, max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * max_steps))
        decay_start = max_steps - decay_steps
        if step < decay_start:
            return 1.0
        return 1.0 - (1 - lo) * min(1.0, (step - decay_start) / decay_steps)
    raise ValueError(f"optim.schedule={cfg.schedule!r} is not one of cosine|wsd|constant")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    fn: Callable[[int], float] = lambda step: lr_multiplier(step, cfg, max_steps)  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
