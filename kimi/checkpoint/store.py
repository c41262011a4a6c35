"""The step directories on disk: listing them, writing one (DCP files, then the manifest and, last, the
COMPLETE marker) and rotating old ones away. Below kimi.checkpoint's save and load and the background writer
(background.py), which both write through it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kimi.errors import STORAGE_ERRORS, RunError

from . import manifest

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")

@dataclass
class CheckpointInfo:
    step: int
    path: Path
    complete: bool


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def list_checkpoints(root: Path) -> List[CheckpointInfo]:
    """All step directories under ``root``, oldest first, flagged complete or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append(CheckpointInfo(int(m.group(1)), p, (p / COMPLETE).is_file()))
    return sorted(found, key=lambda c: c.step)


def latest_complete(root: Path) -> Optional[CheckpointInfo]:
    done = [c for c in list_checkpoints(root) if c.complete]
    return done[-1] if done else None


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write(path: Path, state: Dict[str, Any], marker: Dict[str, Any], kept: Optional[CheckpointInfo]) -> None:
    """DCP-save `state` into a fresh `path`, then the manifest and COMPLETE marker (holding `marker`). `kept`:
    the checkpoint a failed write leaves in place, for the message."""
    t0 = time.time()
    with _saving(path, kept):
        _fresh_dir(path)
        dcp.save(state, checkpoint_id=str(path))
        _barrier()
        files = _gather_manifest(path)
    _mark_complete(path, {**marker, "seconds": round(time.time() - t0, 3)}, files)


def _fresh_dir(path: Path) -> None:
    if _is_rank0():
        if path.exists():  # a leftover from an interrupted save of the same step
            shutil.rmtree(path)
        path.mkdir(parents=True)
    _barrier()


@contextlib.contextmanager
def _saving(path: Path, kept: Optional[CheckpointInfo]):
    """A failed or interrupted save (an exception raised into it) removes its partial directory, which no
    resume would use or remove; a storage error (full disk, read-only) becomes one line that says the older
    checkpoint `kept` is intact."""
    try:
        yield
    except BaseException as e:  # DCP's own exception is a BaseException, and so is an interrupt
        _discard(path)
        cause = _cause(e, OSError)
        if cause is not None and cause.errno in STORAGE_ERRORS:
            earlier = (f"the newest complete checkpoint {kept.path} is intact" if kept
                       else "no earlier checkpoint exists")
            raise RunError(f"{STORAGE_ERRORS[cause.errno]} while saving checkpoint {path}; {earlier}. Fix "
                           "that and rerun the same command to continue") from e
        raise


def _mark_complete(path: Path, marker: Dict[str, Any], files: manifest.Manifest) -> None:
    """The marker goes last, by rename, so a checkpoint is complete exactly when its marker exists."""
    if _is_rank0():
        marker = {**marker, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": manifest.to_json(files)}
        tmp = path / (COMPLETE + ".tmp")
        tmp.write_text(json.dumps(marker) + "\n")
        os.replace(tmp, path / COMPLETE)


def _manifest_share(path: Path) -> manifest.Manifest:
    """Sizes and checksums of this rank's share of the checkpoint's files."""
    names = sorted(p.name for p in path.iterdir())
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return manifest.describe(path, names[rank::world])


def _gather_manifest(path: Path) -> manifest.Manifest:
    """Sizes and checksums of every file of the checkpoint, each rank checksumming a share."""
    mine = _manifest_share(path)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    shares: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    return {k: v for share in shares for k, v in share.items()}


def _rotate_after(root: Path, step: int, keep: int, run_id: str) -> None:
    if _is_rank0():
        _rotate(root, step, keep, run_id)
    _barrier()


def _rotate(root: Path, step: int, keep: int, run_id: str) -> None:
    ours = [c for c in list_checkpoints(root)
            if c.complete and c.step <= step and _marker(c.path).get("run_id") == run_id]
    for old in ours[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)


def _marker(path: Path) -> Dict[str, Any]:
    data, _ = manifest.read_marker(path / COMPLETE)
    return data or {}


def _discard(path: Path) -> None:
    if _is_rank0():
        shutil.rmtree(path, ignore_errors=True)


def _cause(e: BaseException, kind: type) -> Optional[BaseException]:
    """The exception of type `kind` behind `e`, also when DCP wrapped one rank's failure in its own."""
    seen = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, kind):
            return x
        stack += [x.__cause__, x.__context__]
        stack += [v for v in getattr(x, "failures", {}).values() if isinstance(v, BaseException)]
        stack += [v[0] for v in getattr(x, "failures", {}).values() if isinstance(v, tuple) and v]
    return None
