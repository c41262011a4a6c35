"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), verified and read without trusting the files.

Layout: ``<run_dir>/checkpoints/step_00000100/`` holds DCP's shard files and ``.metadata``; a file named
``COMPLETE`` is written last, only after every rank has finished writing, and holds the manifest (size and
CRC-32 of every file, kimi/checkpoint/manifest.py) and the run's id. A checkpoint is used only when its
marker exists and every file matches the manifest; resume takes the newest such one and reports (in one
line each) the ones it skips. Files are read through kimi/checkpoint/trust.py, which never unpickles
anything but DCP's metadata classes; the step directories are listed, written and rotated by
kimi/checkpoint/store.py.

One state dict holds everything needed for an exact continuation: the engine's model, optimizer and lr
schedule state (kimi.parallel.engine: laid out like the parameters, so it reloads under another layout),
the data loader position, the RNG states, the step and the resolved config. Everything that is not a
tensor is a number, a string or a plain container of those.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from kimi.errors import ConfigError
from kimi.errors import RunError
from kimi.folders import inside

from . import manifest
from .background import BackgroundSave
from .store import (COMPLETE, CheckpointInfo, _barrier, _cause, _is_rank0, _marker, _rotate_after, _write,
                    latest_complete, list_checkpoints, step_dir)
from .trust import SafePlanner, SafeReader, UntrustedCheckpoint, load_metadata

# DCP warns once per call that it runs without a process group; that is the normal single-process case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def rng_state() -> Dict[str, Any]:
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss),
                   "gauss": float(gauss)}
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
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


def save(root: Path, step: int, engine, loader, config: Dict[str, Any],
         extra: Optional[Dict[str, Any]] = None,
         keep: int = 2, run_id: str = "") -> Path:
    """Write checkpoint ``step``, then its manifest and COMPLETE marker; then keep only the newest ``keep``
    complete checkpoints of run ``run_id`` (never one of another run, never one newer than ``step``).

    A failed write (a full disk, say) removes the partial directory and raises: the earlier checkpoints
    stay."""
    path = step_dir(root, step)
    _write(path, _full_state(engine, loader, step, config, extra or {}), {"step": step, "run_id": run_id},
           latest_complete(root))
    _rotate_after(root, step, keep, run_id)
    return path


def save_in_background(root: Path, step: int, engine, loader, config: Dict[str, Any],
                       extra: Optional[Dict[str, Any]] = None, keep: int = 2, run_id: str = "", group=None):
    """As :func:`save`, but returns once the state is copied (staged): DCP writes it from a thread while
    training goes on. The returned :class:`~kimi.checkpoint.background.BackgroundSave`'s ``finish()`` writes
    the COMPLETE marker and rotates. `group`: a process group for the writer's collectives, not used by the
    training thread (kimi.parallel.dims.checkpoint_group)."""
    return BackgroundSave(root, step, _full_state(engine, loader, step, config, extra or {}),
                          {"step": step, "run_id": run_id}, keep, group)


def save_weights(path: Path, model_state: Dict[str, Any], config: Dict[str, Any],
                 extra: Dict[str, Any]) -> Path:
    """A weights-only checkpoint at `path` (no optimizer, schedule, data position or RNG): what
    ``trainer.init_from`` starts a new run from (kimi.convert from-hf writes one). Same files, manifest and
    COMPLETE marker as :func:`save`; `extra` is marked ``weights_only``."""
    state = {"model": model_state, "trainer": {"step": 0, "config": json.dumps(config),
                                               "extra": json.dumps({**extra, "weights_only": True})}}
    _write(Path(path), state, {"step": 0, "run_id": "", "weights_only": True}, None)
    return Path(path)


def _free_name(path: Path) -> Path:
    n, candidate = 1, path
    while candidate.exists():
        n, candidate = n + 1, path.with_name(f"{path.name}.{n}")
    return candidate


def verify(path: Path) -> List[str]:
    """Why checkpoint `path` cannot be used (empty: intact). Collective when distributed: each rank checks
    a share of the files."""
    data, why = manifest.read_marker(path / COMPLETE)
    problems = [why] if data is None else []
    if data is not None:
        files = data["files"]
        extra = manifest.unlisted(path, files, ignore=(COMPLETE,))
        if extra:
            problems.append(f"holds files it did not write ({', '.join(extra[:3])})")
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        problems += manifest.check_files(path, files, sorted(files)[rank::world])
    if dist.is_initialized():
        shares: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, problems)
        problems = list(dict.fromkeys(p for share in shares for p in share))
    return problems or _content_problems(path, data)


def _content_problems(path: Path, marker: Dict[str, Any]) -> List[str]:
    """What intact files can still hide: metadata that sends the reader to other files (another checkpoint's
    shards, any file on the machine), or a state whose step is not the one its marker and name promise. A
    file that would run code is not a problem here: every load refuses it, as an error (see _read)."""
    try:
        foreign = _foreign_files(path, marker["files"])
        if foreign:
            return [f"{foreign}: forged or edited"]
        step, named = read_trainer_state(path)["step"], _STEP_NAME.match(Path(path).name)
    except RunError:
        return []
    claimed = {"its COMPLETE marker": marker.get("step", step),
               "its name": int(named.group(1)) if named else step}
    wrong = [f"{who} says step {s}" for who, s in claimed.items() if s != step]
    return [f"holds the state of step {step}, but {' and '.join(wrong)}: forged or edited"] if wrong else []


DAMAGED = ".damaged"


def newest_intact(root: Path, log=print, set_aside: bool = False) -> Optional[CheckpointInfo]:
    """The newest checkpoint under `root` whose files match its manifest; each one passed over is reported
    in one line. None when there is no complete checkpoint; an error when there are some but none intact.

    set_aside (a trainer about to continue): rename the damaged ones newer than the intact one to
    ``step_N.damaged``, so rotation does not count them and a new save of step N does not replace them, and
    remove the incomplete ones (a save cut short: no marker, nothing to recover)."""
    found = list_checkpoints(root)
    for c in found:
        if not c.complete:  # never usable; a trainer (which holds the run dir) removes it, or nothing would
            if set_aside and _is_rank0():
                shutil.rmtree(c.path, ignore_errors=True)
            log(f"[kimi] skipping incomplete checkpoint {c.path} (no {COMPLETE} marker: its save did not "
                "finish)"
                + ("; removed" if set_aside else ""))
    complete, damaged = [c for c in found if c.complete], []
    for c in reversed(complete):
        problems = verify(c.path)
        if not problems:
            if set_aside and damaged and _is_rank0():
                for bad in damaged:
                    os.replace(bad, _free_name(bad.with_name(bad.name + DAMAGED)))
                log("[kimi] moved the damaged checkpoint(s) aside: "
                    f"{', '.join(p.name + DAMAGED for p in damaged)}")
            _barrier()
            return c
        log(f"[kimi] skipping damaged checkpoint {c.path}: {'; '.join(problems[:3])}")
        damaged.append(c.path)
    if complete:
        raise RunError(f"no intact checkpoint in {root}: {', '.join(c.path.name for c in complete)} all fail "
                       "their checks (see above). Move them aside to start over, or restore them from a copy")
    return None


def load(path: Path, engine, loader) -> Dict[str, Any]:
    """Restore everything saved by :func:`save` in place; returns the trainer part (step, config, extra)."""
    state = _full_state(engine, loader, 0, {}, {})
    # The loader's entries the checkpoint has: one written by another loader (an older version's keys, one
    # source instead of a blend) is the loader's to convert or refuse, in one line, not DCP's missing key.
    saved = SafeReader(str(path)).read_metadata().state_dict_metadata
    state["trainer"]["loader"] = {k: v for k, v in state["trainer"]["loader"].items()
                                  if f"trainer.loader.{k}" in saved}
    _read(state, path)
    tr = state["trainer"]
    engine.load_state_dict({"model": state["model"], "optim": state["optim"], "scheduler": tr["scheduler"]})
    loader.load_state_dict(tr["loader"])
    set_rng_state(tr["rng"])
    return {"step": tr["step"], "config": _config(tr["config"]), "extra": json.loads(tr["extra"])}


_UNTRUSTED = ("refusing to load checkpoint {}: {}. It was not written by kimi; remove it if you do not know "
              "where it came from")
_STEP_NAME = re.compile(r"^step_(\d+)$")


def _metadata(path: Path):
    """The checkpoint's DCP metadata, read without running anything it holds."""
    try:
        with open(Path(path) / ".metadata", "rb") as f:
            return load_metadata(f)
    except UntrustedCheckpoint as e:
        raise RunError(_UNTRUSTED.format(path, f"its .metadata {e}")) from None


def _foreign_files(path: Path, listed: Optional[Dict[str, Any]]) -> Optional[str]:
    """What is wrong when checkpoint `path`'s metadata would read files that are not plain names in its own
    directory (listed in its manifest, when it has one): DCP joins the names to the directory, so '../', '/'
    or a planted link reach anywhere (kimi.folders). None when it reads none."""
    names = {str(info.relative_path) for info in (_metadata(path).storage_data or {}).values()}
    foreign = sorted(n for n in names if n == COMPLETE or "/" in n or "\\" in n or inside(path, n) is None
                     or (listed is not None and n not in listed))
    return f"its .metadata reads files outside its manifest ({', '.join(foreign[:3])})" if foreign else None


def _read(state: Dict[str, Any], path: Path) -> None:
    """Fill `state` in place from checkpoint `path`, trusting none of its files (kimi/checkpoint/trust.py).
    Checked here first as well, before DCP opens anything: the metadata (DCP would log its own tracebacks
    before giving up on a bad one) and the files it names (whatever loaded `path`, verified or not)."""
    marker, _ = manifest.read_marker(Path(path) / COMPLETE)
    foreign = _foreign_files(path, marker["files"] if marker else None)
    if foreign:
        raise RunError(_UNTRUSTED.format(path, foreign))
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner())
    except (Exception, CheckpointException) as e:  # DCP's own exception is a BaseException
        refused = _cause(e, pickle.UnpicklingError)
        if refused is None:
            raise
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(refused))
        what = (f"an entry refers to {found.group(1)}" if found
                else f"an entry cannot be read ({type(refused).__name__})")
        raise RunError(_UNTRUSTED.format(path, what + ", which checkpoints never contain")) from None


def load_model(path: Path, model_state: Dict[str, Any]) -> None:
    """Fill a model state dict (e.g. torch.distributed.checkpoint.state_dict.get_model_state_dict) in
    place."""
    state = {"model": model_state}
    _read(state, path)


def _config(text: str) -> Dict[str, Any]:
    """A checkpoint's stored config, its model section's old flat keys (a checkpoint written before the
    sections, kimi/model/sections.py) moved to their sections as today's config has them."""
    from kimi.model.config import resolve_aliases

    config = json.loads(text)
    if isinstance(config.get("model"), dict):
        resolve_aliases(config["model"])
    return config


def read_trainer_state(path: Path) -> Dict[str, Any]:
    """The non-tensor trainer entries of a checkpoint (step, config, extra) without building a model."""
    state = {"trainer": {"step": 0, "config": "", "extra": ""}}
    _read(state, path)
    tr = state["trainer"]
    return {"step": tr["step"], "config": _config(tr["config"]), "extra": json.loads(tr["extra"])}


def check_compatible(saved: Dict[str, Any], path: Path, config: Dict[str, Any],
                     tokenizer_sha256: str) -> None:
    """Refuse to resume into a different model, tokenizer or optimizer: the weights or the optimizer state
    would not load, or tokens would silently mean other things. `saved` is read_trainer_state(path); config
    is this run's (config_dict)."""
    lines = _model_diff(saved, config, "checkpoint")
    if lines:
        raise ConfigError(f"cannot resume from {path}: the model differs ({lines}). Use the same model "
                          "settings, another run dir (hydra.run.dir=...), or trainer.resume=false "
                          "trainer.overwrite=true to start over (the old run is moved aside)")
    old_optim = saved["config"].get("optim", {}).get("name")
    if old_optim and old_optim != config["optim"]["name"]:
        raise ConfigError(f"cannot resume from {path} with optim={config['optim']['name']}: it was trained "
                          f"with optim={old_optim}, whose state does not carry over. Use optim={old_optim}, "
                          "or start over in another run dir (or with trainer.resume=false "
                          "trainer.overwrite=true)")
    check_tokenizer(saved, path, tokenizer_sha256, "resume from")


def _model_diff(saved: Dict[str, Any], config: Dict[str, Any], theirs: str) -> str:
    """'model.key: <theirs> old vs now new, ...' for every model setting (but the name) that differs."""
    old, new = flatten(saved["config"].get("model", {})), flatten(config["model"])
    return ", ".join(f"model.{k}: {theirs} {old.get(k)!r} vs now {v!r}" for k, v in new.items()
                     if old.get(k) != v and k != "name")


def check_tokenizer(saved: Dict[str, Any], path: Path, tokenizer_sha256: str, verb: str) -> None:
    old_tok = saved["extra"].get("tokenizer_sha256")
    if old_tok and old_tok != tokenizer_sha256:
        raise ConfigError(f"cannot {verb} {path}: it was trained with tokenizer {old_tok[:12]}, this run "
                          f"uses {tokenizer_sha256[:12]}; use the original data/tokenizer settings")


def check_same_model(saved: Dict[str, Any], path: Path, config: Dict[str, Any],
                     tokenizer_sha256: str) -> None:
    """Refuse to start a run from the weights of `path` (trainer.init_from) when its model or tokenizer
    differs from this run's."""
    lines = _model_diff(saved, config, "weights")
    if lines:
        raise ConfigError(f"cannot start from the weights in {path}: the model differs ({lines}). Use the "
                          "model settings they were written with (kimi.convert from-hf writes them as "
                          "<run>/model/hf.yaml: --config-dir <run> model=hf)")
    check_tokenizer(saved, path, tokenizer_sha256, "start from the weights in")


# Keys that name where and how this invocation runs, not what it trains.
_UNREPORTED = ("trainer.run_dir", "trainer.resume", "trainer.overwrite")


def config_changes(saved: Dict[str, Any], config: Dict[str, Any]) -> List[str]:
    """'key: checkpoint value -> this run's value' for every setting that differs (the run's values apply:
    model, tokenizer and optimizer changes are refused by check_compatible before this is asked)."""
    old, new = flatten(saved), flatten(config)
    keys = sorted((set(old) | set(new)) - set(_UNREPORTED))
    return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}" for k in keys
            if old.get(k) != new.get(k)]


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """A nested dict as one level of dotted keys ("trainer.max_steps")."""
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_id(path: Path) -> str:
    """The id of the run that wrote checkpoint `path` ("" for none)."""
    return str(_marker(path).get("run_id", ""))
