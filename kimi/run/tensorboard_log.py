"""TensorBoard beside wandb (logging.tensorboard): every scalar of metrics.jsonl, under its grouped name
(kimi.run.metrics.grouped_name), in event files that rank 0 writes with torch's SummaryWriter.

``<run_dir>/tensorboard/`` holds the charts against the step; ``<run_dir>/tensorboard/tokens/`` the same
scalars against the tokens trained so far (a run of its own in TensorBoard's list, like wandb's tokens axis).
Each start of the trainer opens new event files in both; TensorBoard reads every file of a folder in order.
A start at step N purges (SummaryWriter's purge_step) what an interrupted earlier session logged after N, so
no step is plotted twice: the same rule as metrics.jsonl's start records (kimi.run.metrics.read_metrics)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Optional

TENSORBOARD_DIR = "tensorboard"


class TensorBoardLog:
    def __init__(self, run_dir: Path, resume_step: int, tokens_per_step: int):
        from torch.utils.tensorboard import SummaryWriter

        root = Path(run_dir) / TENSORBOARD_DIR
        self.tokens_per_step = tokens_per_step
        # what the new session logs starts after its checkpoint's step (a fresh start: from step 0 on)
        purge = resume_step + 1 if resume_step else 0
        self.steps = SummaryWriter(str(root), purge_step=purge)
        self.tokens: Optional[Any] = (SummaryWriter(str(root / "tokens"), purge_step=purge * tokens_per_step)
                                      if tokens_per_step else None)

    def log(self, step: int, scalars: Dict[str, float]) -> None:
        """`scalars` ({grouped name: number}) at `step`; a value that is not a finite number is left out
        (wandb shows a null MFU as a gap, TensorBoard would plot NaN as a point)."""
        for name, value in scalars.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            self.steps.add_scalar(name, value, global_step=step)
            if self.tokens is not None and name != "tokens":
                self.tokens.add_scalar(name, value, global_step=step * self.tokens_per_step)
        self.steps.flush()  # a run watched live: TensorBoard sees each record at once
        if self.tokens is not None:
            self.tokens.flush()

    def close(self) -> None:
        self.steps.close()
        if self.tokens is not None:
            self.tokens.close()
