"""Where a training step's time goes: ``with clock("data"):`` around each part of the step adds its seconds,
and the progress window (kimi.run.progress.ProgressWindow) turns them into each window's per-step averages
(metrics.jsonl's time/*_s, the progress line's short form); what the parts leave of the step is time/other_s.

The parts: data (the loader's next batch), forward_backward (the micro-batches' forward and backward, and
reading the step's loss), optimizer (engine.step: gradient reduction, clipping and the update).

On a CPU the times are exact. On CUDA they are the host's: a kernel still running when its part ends is
counted in the part that waits for it (the loss and the gradient norm are read on the host, so most of the
work lands where it belongs, but the update's kernels spill into the next step's data or forward).
logging.step_time_sync=true synchronizes the device at the end of each part, which makes every part exact
at the cost of the overlap between them."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict

import torch

PARTS = ("data", "forward_backward", "optimizer")


class StepClock:
    def __init__(self, sync: bool = False):
        self.sync = sync  # CUDA only, where the device has been started (a CPU run never is)
        self.seconds = dict.fromkeys(PARTS, 0.0)

    @contextmanager
    def __call__(self, part: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.sync and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.seconds[part] += time.perf_counter() - t

    def take(self) -> Dict[str, float]:
        """The seconds of each part since the last take, and start again from zero."""
        out, self.seconds = self.seconds, dict.fromkeys(PARTS, 0.0)
        return out


def breakdown(step_s: float, parts: Dict[str, float], steps: int) -> Dict[str, float]:
    """metrics.jsonl's time/* of a window of `steps` steps of `step_s` seconds each (its training time per
    step), from the parts' total seconds over the window: each part per step, and the rest (time/other_s:
    the loop's own work between the parts, never below zero)."""
    per_step = {f"time/{p}_s": parts[p] / steps for p in PARTS}
    return {"time/step_s": step_s, **per_step, "time/other_s": max(0.0, step_s - sum(per_step.values()))}


def short_form(times: Dict[str, float]) -> str:
    """The progress line's form of a breakdown: the step's time and the parts' shares of it."""
    step = times["time/step_s"]
    took = f"{step * 1e3:.1f} ms" if step < 1 else f"{step:.2f} s"
    share = {label: 100 * times[f"time/{p}_s"] / step if step > 0 else 0.0
             for label, p in (("data", "data"), ("fwd+bwd", "forward_backward"), ("optim", "optimizer"))}
    return f"{took}/step (" + ", ".join(f"{k} {v:.0f}%" for k, v in share.items()) + ")"
