"""The run directory: checked before any work, locked while a trainer uses it, never silently reused.

- A run dir that is a file, not writable, or whose ``checkpoints`` is a file is refused at start-up.
- One trainer at a time: rank 0 holds an ``fcntl`` lock on ``<run_dir>/.lock`` (released by the kernel when
  the process ends, however it ends); a second trainer is refused with the holder's pid, host and start.
  The file names its holder while held and is emptied at release: a record found in an unlocked file is a
  trainer that ended without releasing it (killed, crashed), and the next start takes it over saying so.
- ``trainer.resume=false`` in a run dir that holds checkpoints is refused unless ``trainer.overwrite=true``,
  which moves the old run into ``<run_dir>/previous/<time>/``. Nothing is deleted.
- A command refused before any work (a config error found after Hydra made the run dir) leaves no folder
  behind: the folders Hydra made for it are removed while they hold nothing but its empty train.log
  (FoldersMade, remove_unused).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

from kimi.config import ConfigError

LOCK = ".lock"
# What belongs to one run (patterns in the run dir), moved aside together by trainer.overwrite=true.
RUN_FILES = ("checkpoints", "metrics.jsonl", "loss_curve.png", "tokenizer.model", "tokenizer_config.json",
             "wandb", "train.log", "config.yaml", "configs", "optimizer_routing*.txt", "exit_code",
             "deepspeed.json")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _writable(path: Path, what: str) -> None:
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ConfigError(f"{what} {path} is on a full disk (no space left on device); free space or "
                              "choose another hydra.run.dir") from e
        raise ConfigError(f"{what} {path} is not writable ({e.strerror}); choose another hydra.run.dir or "
                          "fix its permissions") from e


def check_dirs(run_dir: Path) -> Path:
    """Create the run dir if needed and make sure it and its checkpoints dir can be written; returns the
    checkpoints dir."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"trainer.run_dir {run_dir} is a file, not a directory; choose another "
                          "hydra.run.dir")
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
    """Held for the process's lifetime (or until release); `holder` describes who holds it. `log` gets one
    line when the lock is taken over from a trainer that ended without releasing it."""

    def __init__(self, run_dir: Path, log: Optional[Callable[[str], None]] = None):
        self.path = run_dir / LOCK
        self.fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.holder()
            os.close(self.fd)
            self.fd = None
            raise ConfigError(f"run dir {run_dir} is in use by another trainer ({holder}); wait for it to "
                              "finish, stop it, or use another hydra.run.dir") from None
        left = os.pread(self.fd, 4096, 0)
        if left.strip() and log is not None:
            log(f"[kimi] run dir {run_dir}: taking over the lock left by {self.holder()}, {_gone(left)}")
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
            try:  # an empty file: released, not left behind (the next start says nothing)
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def _gone(record: bytes) -> str:
    """Why the trainer an unlocked record names holds nothing: its pid is dead (on this host), or it runs
    elsewhere or is another process now, and holds no lock."""
    try:
        info = json.loads(record)
        pid, host = int(info["pid"]), info["host"]
    except (ValueError, KeyError, TypeError):
        return "which no longer holds it"
    if host != socket.gethostname():
        return "which no longer holds it"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid} is dead"
    except OSError:  # alive, another user's: a reused pid
        pass
    return f"which no longer holds it (pid {pid} is another process now)"


def set_aside(run_dir: Path, resume: bool, overwrite: bool, has_checkpoints: bool,
              log: Callable[[str], None]) -> None:
    """For a fresh run (resume=false) in a used run dir: refuse, or with overwrite move the old run aside."""
    if resume or not has_checkpoints:
        return
    if not overwrite:
        raise ConfigError(f"trainer.resume=false, but run dir {run_dir} holds checkpoints of an earlier run. "
                          "Set trainer.overwrite=true to move them to <run_dir>/previous/ and start over, "
                          "use another hydra.run.dir, or drop trainer.resume=false to continue that run")
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
            lock = RunLock(run_dir, log)
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


HYDRA_LOG = "train.log"  # Hydra's job log, created with the run dir (the trainer appends its output to it)


class FoldersMade:
    """Which folders of a run dir a command makes, known from what exists before Hydra makes it: `pattern`
    is hydra.run.dir (``${now:...}`` is read as now; the path is cut at any other interpolation). The folder
    of the path that exists deepest (`base`) is listed; a run dir below it whose first folder under `base`
    was not there was made by this command, with everything below."""

    def __init__(self, pattern: str):
        now = re.sub(r"\$\{now:([^}]*)\}", lambda m: time.strftime(m.group(1)), pattern)
        path = Path(os.path.abspath(now.split("${", 1)[0] or "."))
        self.base = next((p for p in (path, *path.parents) if p.is_dir()), None)
        self.names = {p.name for p in self.base.iterdir()} if self.base is not None else set()

    def top(self, run_dir: Path) -> Optional[Path]:
        """The highest folder of `run_dir`'s path this command made (None: it made none)."""
        run_dir = Path(os.path.abspath(run_dir))
        if self.base is None or self.base not in run_dir.parents:
            return None
        top = self.base / run_dir.relative_to(self.base).parts[0]
        return None if top.name in self.names else top


def remove_unused(run_dir: Path, top: Optional[Path]) -> bool:
    """Remove `run_dir` and the folders above it up to `top` (FoldersMade.top: those this command made)
    when they hold nothing but Hydra's empty train.log; anything holding a file stays. Returns whether
    `run_dir` went."""
    import logging

    run_dir = Path(os.path.abspath(run_dir))
    if top is None or not run_dir.is_dir() or run_dir.is_symlink():
        return False
    log = run_dir / HYDRA_LOG
    if any(p.name != HYDRA_LOG for p in run_dir.iterdir()) or log.is_symlink() or \
            (log.exists() and (not log.is_file() or log.stat().st_size)):
        return False
    for handler in list(logging.getLogger().handlers):  # Hydra's handler holds train.log open
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == log:
            logging.getLogger().removeHandler(handler)
            handler.close()
    try:
        log.unlink(missing_ok=True)
        folder = run_dir
        while True:
            folder.rmdir()  # refuses a folder that is not empty
            if folder == top:
                break
            folder = folder.parent
    except OSError:
        pass
    return not run_dir.exists()
