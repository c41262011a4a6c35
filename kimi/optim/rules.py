"""The optim section's rules (kimi.run.validation runs them before any data work)."""

from __future__ import annotations

from kimi.optim.config import OptimConfig
from kimi.schema.vocabulary import check, check_choices, check_finite, require
# fills kimi.config.OPTIMIZERS, optim.name's choices, before check_choices reads them
import kimi.optim.registry  # noqa: F401


def validate_optim(o: OptimConfig) -> None:
    check_choices(o, "optim")
    check_finite(o, "optim")
    check(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    product = o.lr * o.weight_decay
    require(product < 1,
            f"optim.lr*optim.weight_decay = {o.lr}*{o.weight_decay} = {product:g} is invalid: must be < 1 "
            "(each step multiplies the weights by 1 - lr*weight_decay); lower optim.weight_decay")
    check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", list(o.betas),
          "must be two numbers in [0, 1)")
    # AdamW divides by sqrt(v) + eps, and v stays 0 for a parameter without gradient: 0/0 would be nan
    check(o.eps > 0, "optim.eps", o.eps, "must be > 0 (1e-8 is usual)")
    check(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0 (0 disables clipping)")
    check(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    check(0 < o.decay_fraction <= 1, "optim.decay_fraction", o.decay_fraction, "must be in (0, 1]")
    check(0 <= o.momentum < 1, "optim.momentum", o.momentum, "must be in [0, 1) (0.95 in Muon)")
    check(o.ns_steps >= 1, "optim.ns_steps", o.ns_steps, "must be >= 1 (5 in Muon)")
    # QK-Clip is a post-step hook for either optimizer: any optim.name may set it
    check(o.qk_clip_tau >= 0, "optim.qk_clip_tau", o.qk_clip_tau,
          "must be >= 0 (100 in K2; 0 disables QK-Clip)")
