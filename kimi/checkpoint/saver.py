"""A run's saves as the trainer makes them: blocking, or staged and written in the background
(trainer.async_checkpoint) with at most one save in flight."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from kimi import checkpoint

from .background import BackgroundSave


class Saver:
    def __init__(self, root: Path, keep: int, background: bool, group, log: Callable[[str], None]):
        """group: the background writer's process group (kimi.parallel.checkpoint_group)."""
        self.root, self.keep, self.background, self.group, self.log = root, keep, background, group, log
        self.saving: Optional[BackgroundSave] = None  # the save being written in the background, if any
        # called with (directory, step) of each save once it is complete (marked and rotated), on this rank:
        # wandb's checkpoint artifacts (kimi.run.metrics.MetricsLogger, logging.wandb.log_checkpoints)
        self.on_saved: List[Callable[[Path, int], None]] = []

    def save(self, step: int, engine, loader, config: Dict[str, Any], extra: Dict[str, Any], run_id: str,
             wait: bool = True) -> Path:
        """Checkpoint `step`. In the background and with wait=False, return once the state is staged and let
        it be written while training goes on (finish completes it); a new save first finishes the one in
        flight."""
        self.finish()
        t0 = time.time()
        args = (self.root, step, engine, loader, config, extra)
        if not self.background:
            path = checkpoint.save(*args, keep=self.keep, run_id=run_id)
            self.log(f"[kimi] saved checkpoint {path} ({time.time() - t0:.1f}s)")
            return self._saved(path, step)
        self.saving = checkpoint.save_in_background(*args, keep=self.keep, run_id=run_id, group=self.group)
        self.log(f"[kimi] writing checkpoint {self.saving.path} in the background (staged in "
                 f"{self.saving.staged_s:.2f}s)")
        return self.finish() if wait else self.saving.path

    def writing(self) -> bool:
        """Whether this rank is still writing its part of the save in flight."""
        return self.saving is not None and not self.saving.done()

    def finish(self) -> Optional[Path]:
        """Wait for the save in flight (if any), then mark it complete and rotate; collective."""
        if self.saving is None:
            return None
        saving, self.saving = self.saving, None
        path = saving.finish()
        self.log(f"[kimi] saved checkpoint {path} (written in {saving.write_s:.1f}s in the background)")
        return self._saved(path, saving.step)

    def _saved(self, path: Path, step: int) -> Path:
        for call in self.on_saved:
            call(path, step)
        return path

    def abandon(self) -> None:
        """The run failed: say that the save in flight (if any) stays incomplete."""
        if self.saving is not None:
            self.log(f"[kimi] checkpoint {self.saving.path} was still being written: it has no "
                     f"{checkpoint.COMPLETE} marker, and a resume skips it for the newest complete one")
