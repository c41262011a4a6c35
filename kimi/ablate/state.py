"""A run directory's state in the study: done, failed, partial or new (read by the runner and the records)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def complete_at(run_dir: Path, step: int) -> bool:
    """Whether the run dir holds a complete checkpoint of `step` (its COMPLETE marker is written last)."""
    from kimi import checkpoint

    return (checkpoint.step_dir(run_dir / "checkpoints", step) / checkpoint.COMPLETE).is_file()


def exit_code(run_dir: Path) -> Optional[int]:
    try:
        return int((run_dir / "exit_code").read_text().strip())
    except (OSError, ValueError):
        return None


def status(run_dir: Path, max_steps: int) -> str:
    """done (a complete final checkpoint), failed (exit code 1 or 2 and no final checkpoint), partial
    (started, not finished: it resumes) or new."""
    if complete_at(run_dir, max_steps):
        return "done"
    if exit_code(run_dir) in (1, 2):
        return "failed"
    return "partial" if run_dir.exists() else "new"
