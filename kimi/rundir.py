"""The run directory: checked before any work, locked while a trainer uses it, never silently reused.

- A run dir that is a file, not writable, or whose ``checkpoints`` is a file is refused at start-up.
- One trainer at a time: rank 0 holds an ``fcntl`` lock on ``<run_dir>/.lock`` (released by the kernel when
  the process ends, however it ends); a second trainer is refused with the holder's pid, host and start.
- ``trainer.resume=false`` in a run dir that holds checkpoints is refused unless ``trainer.overwrite=true``,
  which moves the old run into ``<run_dir>/previous/<time>/``. Nothing is deleted.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

from kimi.config import ConfigError

LOCK = ".lock"
# What belongs to one run (patterns in the run dir), moved aside together by trainer.overwrite=true.
RUN_FILES = ("checkpoints", "metrics.jsonl", "loss_curve.png", "tokenizer.model", "tokenizer_config.json", "wandb",
             "train.log", "config.yaml", "configs", "optimizer_routing*.txt", "exit_code", "deepspeed.json")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _writable(path: Path, what: str) -> None:
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ConfigError(f"{what} {path} is on a full disk (no space left on device); free space or choose "
                              "another hydra.run.dir") from e
        raise ConfigError(f"{what} {path} is not writable ({e.strerror}); choose another hydra.run.dir or fix its "
                          "permissions") from e


def check_dirs(run_dir: Path) -> Path:
    """Create the run dir if needed and make sure it and its checkpoints dir can be written; returns the
    checkpoints dir."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"trainer.run_dir {run_dir} is a file, not a directory; choose another hydra.run.dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"trainer.run_dir {run_dir} cannot be created ({e.strerror}); choose another "
                          "hydra.run.dir") from e
    _writable(run_dir, "trainer.run_dir")
    ckpt = run_dir / "checkpoints"
    if ckpt.exists() and not ckpt.is_dir():
        raise ConfigError(f"{ckpt} is a file, but checkpoints are written there; move it away")
    if ckpt.is_dir():
        _writable(ckpt, "the checkpoints directory")
    return ckpt


class RunLock:
    """Held for the process's lifetime (or until release); `holder` describes who holds it."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.holder()
            os.close(self.fd)
            self.fd = None
            raise ConfigError(f"run dir {run_dir} is in use by another trainer ({holder}); wait for it to finish, "
                              "stop it, or use another hydra.run.dir") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(self.fd, 0)
        os.write(self.fd, (json.dumps(me) + "\n").encode())

    def holder(self) -> str:
        try:
            info = json.loads(self.path.read_text())
            return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def __del__(self) -> None:  # a trainer dropped without close() (tests, notebooks) unlocks its run dir
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def set_aside(run_dir: Path, resume: bool, overwrite: bool, has_checkpoints: bool,
              log: Callable[[str], None]) -> None:
    """For a fresh run (resume=false) in a used run dir: refuse, or with overwrite move the old run aside."""
    if resume or not has_checkpoints:
        return
    if not overwrite:
        raise ConfigError(f"trainer.resume=false, but run dir {run_dir} holds checkpoints of an earlier run. "
                          "Set trainer.overwrite=true to move them to <run_dir>/previous/ and start over, use "
                          "another hydra.run.dir, or drop trainer.resume=false to continue that run")
    dest = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    dest.mkdir(parents=True)
    moved = sorted({p.name for pattern in RUN_FILES for p in run_dir.glob(pattern)})
    for name in moved:
        os.replace(run_dir / name, dest / name)
    log(f"[kimi] trainer.overwrite=true: moved the earlier run ({', '.join(moved)}) to {dest}")


def open_run_dir(run_dir: Path, resume: bool, overwrite: bool, is_main: bool, distributed: bool,
                 log: Callable[[str], None]) -> Optional[RunLock]:
    """Rank 0 checks, locks and (with overwrite) clears the run dir; every rank gets its verdict, so all
    fail alike. Returns rank 0's lock (None elsewhere)."""
    import torch.distributed as dist

    from kimi.checkpoint import list_checkpoints

    error, lock = None, None
    if is_main:
        try:
            ckpt = check_dirs(run_dir)
            lock = RunLock(run_dir)
            set_aside(run_dir, resume, overwrite, bool(list_checkpoints(ckpt)), log)
        except ConfigError as e:
            error = str(e)
            if lock is not None:
                lock.release()
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ConfigError(error)
    return lock
