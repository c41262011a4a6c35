"""Checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout: ``<run_dir>/checkpoints/step_00000100/`` holds DCP's shard files and ``.metadata``; a file named
``COMPLETE`` is written last, only after every rank has finished writing, so a checkpoint interrupted
half-way (killed job, full disk) is never mistaken for a good one. Resume takes the newest complete
checkpoint and ignores (and reports) incomplete ones.

One state dict holds everything needed for an exact continuation: the engine's model, optimizer and lr
schedule state (kimi.parallel.engine: laid out like the parameters, so it reloads under another layout),
the data loader position, the RNG states, the step and the resolved config.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kimi.config import ConfigError

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")

# DCP warns once per call that it runs without a process group; that is the normal single-process case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


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


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _full_state(engine, loader, step: int, config: Dict[str, Any], extra: Dict[str, Any]):
    state = engine.state_dict()
    return {
        "model": state["model"],
        "optim": state["optim"],
        "trainer": {
            "step": step,
            "scheduler": state["scheduler"],
            "loader": loader.state_dict(),
            "rng": rng_state(),
            # Stored as JSON text: DCP flattens nested dicts, so a dict of unknown keys cannot be loaded
            # into an empty placeholder, but a string can.
            "config": json.dumps(config),
            "extra": json.dumps(extra),
        },
    }


def save(root: Path, step: int, engine, loader, config: Dict[str, Any], extra: Optional[Dict[str, Any]] = None,
         keep: int = 2) -> Path:
    """Write checkpoint ``step`` and mark it complete; then keep only the newest ``keep`` complete ones."""
    path = step_dir(root, step)
    if _is_rank0():
        if path.exists():  # a leftover from an interrupted save of the same step
            shutil.rmtree(path)
        path.mkdir(parents=True)
    _barrier()
    t0 = time.time()
    state = _full_state(engine, loader, step, config, extra or {})
    dcp.save(state, checkpoint_id=str(path))
    _barrier()
    if _is_rank0():
        marker = {"step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": round(time.time() - t0, 3)}
        tmp = path / (COMPLETE + ".tmp")
        tmp.write_text(json.dumps(marker) + "\n")
        os.replace(tmp, path / COMPLETE)
        done = [c for c in list_checkpoints(root) if c.complete]
        for old in done[:-keep]:
            shutil.rmtree(old.path, ignore_errors=True)
    _barrier()
    return path


def load(path: Path, engine, loader) -> Dict[str, Any]:
    """Restore everything saved by :func:`save` in place; returns the trainer part (step, config, extra)."""
    state = _full_state(engine, loader, 0, {}, {})
    dcp.load(state, checkpoint_id=str(path))
    tr = state["trainer"]
    engine.load_state_dict({"model": state["model"], "optim": state["optim"], "scheduler": tr["scheduler"]})
    loader.load_state_dict(tr["loader"])
    set_rng_state(tr["rng"])
    return {"step": tr["step"], "config": json.loads(tr["config"]), "extra": json.loads(tr["extra"])}


def read_trainer_state(path: Path) -> Dict[str, Any]:
    """The non-tensor trainer entries of a checkpoint (step, config, extra) without building a model."""
    state = {"trainer": {"step": 0, "config": "", "extra": ""}}
    dcp.load(state, checkpoint_id=str(path))
    tr = state["trainer"]
    return {"step": tr["step"], "config": json.loads(tr["config"]), "extra": json.loads(tr["extra"])}


def check_compatible(saved: Dict[str, Any], path: Path, model_config: Dict[str, Any], tokenizer_sha256: str) -> None:
    """Refuse to resume into a different model or tokenizer: the weights would not load, or would silently
    be fed other token ids. `saved` is read_trainer_state(path); model_config is this run's config["model"]."""
    old_model = saved["config"].get("model", {})
    diff = {k: (old_model.get(k), v) for k, v in model_config.items() if old_model.get(k) != v and k != "name"}
    if diff:
        lines = ", ".join(f"model.{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise ConfigError(f"cannot resume from {path}: the model differs ({lines}). Use the same model "
                          "settings, another run dir (hydra.run.dir=...), or trainer.resume=false")
    old_tok = saved["extra"].get("tokenizer_sha256")
    if old_tok and old_tok != tokenizer_sha256:
        raise ConfigError(f"cannot resume from {path}: it was trained with tokenizer {old_tok[:12]}, this run "
                          f"uses {tokenizer_sha256[:12]}; use the original data/tokenizer settings")
