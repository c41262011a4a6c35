"""Stopping a run whose loss or gradient norm is no longer finite, before the update would carry it into the
weights (and from there into a checkpoint), with the checkpoint worth resuming from.

Both are computed from the weights after the last update and that step's batch, so the checkpoint of that
very step (when one was written) gives the same value again on resume, whatever lr it resumes with: the
message names an earlier one instead."""

from __future__ import annotations

import math
from pathlib import Path

from kimi.checkpoint import list_checkpoints
from kimi.precision.registry import precision_for


def check_finite(what: str, value: float, step: int, ckpt_dir: Path, precision: str) -> None:
    """Raise FloatingPointError (one line) when `value` (the `what` of step `step` + 1) is NaN or infinite;
    `step`: the updates done so far."""
    if math.isfinite(value):
        return
    raise FloatingPointError(f"{what} is {value} at step {step + 1}: stopping before the update"
                             f"{_where_to_resume(ckpt_dir, step)}. Try a lower optim.lr or more "
                             "optim.warmup_steps"
                             + (" or trainer.precision=fp32" if precision_for(precision).BF16 else ""))


def _where_to_resume(ckpt_dir: Path, step: int) -> str:
    done = [c for c in list_checkpoints(ckpt_dir) if c.complete and c.step <= step]
    if not done:
        return ""
    if done[-1].step < step:
        return f"; the last complete checkpoint is {done[-1].path}"
    if len(done) == 1:
        return f"; the only complete checkpoint, {done[-1].path}, holds the weights that gave it: start over"
    return (f"; the last complete checkpoint {done[-1].path} holds the weights that gave it: move it "
            f"aside to resume from {done[-2].path}")
