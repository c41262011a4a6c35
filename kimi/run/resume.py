"""Where a run starts: its own newest intact checkpoint (trainer.resume), else the weights trainer.init_from
names (or <run_dir>/init, which kimi.convert from-hf writes); each checked against this config first."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from kimi import checkpoint
from kimi.config import Config, ConfigError, config_dict
from kimi.errors import RunError
from kimi.parallel.interface import Engine
from kimi.run.runlog import schedule_change
from kimi.schema.stages import boundary_at, stage_label

Log = Callable[[str], None]


def resume_note(ckpt_dir: Path) -> str:
    """What rerunning the same command would resume from (the watchdog's last words on a hang)."""
    last = checkpoint.latest_complete(ckpt_dir)
    return f"Rerun the same command to resume from {last.path}." if last else "No checkpoint was written yet."


def checkpoint_to_resume(cfg: Config, ckpt_dir: Path, tokenizer_sha256: str,
                         log: Log) -> Optional[Tuple[checkpoint.CheckpointInfo, Dict[str, Any]]]:
    """(newest intact checkpoint, its trainer state) checked against this config; or None."""
    if not cfg.trainer.resume:
        return None
    latest = checkpoint.newest_intact(ckpt_dir, log, set_aside=True)
    if latest is None:
        return None
    saved = checkpoint.read_trainer_state(latest.path)
    checkpoint.check_compatible(saved, latest.path, config_dict(cfg), tokenizer_sha256)
    return latest, saved


def weights_to_start_from(cfg: Config, run_dir: Path, tokenizer_sha256: str, log: Log) -> Optional[Path]:
    """The weights a new run starts from (trainer.init_from, else run_dir/init if present), checked against
    this config; or None."""
    given = cfg.trainer.init_from
    path = Path(given) if given else run_dir / "init"
    if not given and not path.exists():
        return None
    if (path / checkpoint.COMPLETE).is_file():  # a checkpoint named directly: it must be intact
        problems = checkpoint.verify(path)
        if problems:
            raise RunError(f"cannot start from the weights in {path}: {'; '.join(problems[:3])}")
    else:  # a run dir: its newest intact checkpoint (newest_intact verifies it)
        latest = checkpoint.newest_intact(path / "checkpoints", log)
        if latest is None:
            raise ConfigError(f"trainer.init_from={path} is neither a complete checkpoint nor a run dir with "
                              "one; name a checkpoint directory (<run>/checkpoints/step_N) or a run dir")
        path = latest.path
    saved = checkpoint.read_trainer_state(path)
    checkpoint.check_same_model(saved, path, config_dict(cfg), tokenizer_sha256)
    return path


def load_weights(engine: Engine, path: Path, log: Log) -> None:
    state = engine.model_state_dict()
    checkpoint.load_model(path, state)
    engine.load_model_state_dict(state)
    log(f"[kimi] weights from {path}; a new run: step 0, fresh optimizer state")


def resume(cfg: Config, engine: Engine, loader, latest: checkpoint.CheckpointInfo, saved: Dict[str, Any],
           log: Log) -> Tuple[int, str]:
    """Load `latest` into the engine and loader, and say what this config changes; (its step, its run id:
    '' when it records none). At a stage boundary (kimi/run/stages.py) the changes are the next stage's, and
    the loader continues or starts the stage's own stream (stream_changes)."""
    config = config_dict(cfg)
    changes = checkpoint.config_changes(saved["config"], config)
    entered = boundary_at(cfg.stages, int(saved["step"])) if cfg.stages else None
    fresh = entered is not None and stream_changes(saved["config"], config)
    state = checkpoint.load(latest.path, engine, _Unread(loader) if fresh else loader)
    step = int(state["step"])
    log(f"[kimi] resumed from {latest.path} at step {step}")
    if entered is not None:  # the stage's settings, not a user's change; its stop step is the driver's
        changes = [line for line in changes if not line.startswith("trainer.stop_at_step:")]
        label = stage_label(cfg.stages, entered)
        stream = ("a data stream of its own (trainer.seed, stage index)" if fresh
                  else "the data stream where the stage before left it")
        settings = " and these settings:\n" + "\n".join(f"         {line}" for line in changes)
        log(f"[kimi] stage boundary: {label} starts at step {step + 1} with {stream}"
            + (settings if changes else ""))
        if fresh:
            start_stage_stream(loader, cfg.trainer.seed, entered)
    elif changes:
        log(f"[kimi] {len(changes)} setting(s) differ from the checkpoint's; this run's values apply:\n"
            + "\n".join(f"         {line}" for line in changes))
    note = schedule_change(saved["config"], cfg.optim, cfg.trainer.max_steps, step)
    if note:
        log(note)
    return step, checkpoint.run_id(latest.path)


def _windows_per_step(config: Dict[str, Any]) -> int:
    t, p = config.get("trainer", {}), config.get("parallel", {})
    return (t.get("micro_batch_size", 0) * t.get("grad_accum_steps", 1) * p.get("dp_replicate", 1)
            * p.get("dp_shard", 1))


def stream_changes(saved: Dict[str, Any], config: Dict[str, Any]) -> bool:
    """Whether a stage reads other data than the checkpoint's stage did (other data settings, sequence
    length or windows per step): then its stream starts afresh, else it continues (docs/stages.md)."""
    return (saved.get("data") != config["data"]
            or saved.get("trainer", {}).get("seq_len") != config["trainer"]["seq_len"]
            or _windows_per_step(saved) != _windows_per_step(config))


def start_stage_stream(loader, seed: int, stage: int) -> None:
    """The loader at the start of stage `stage`'s own stream: its first window, in an order drawn from
    (trainer.seed, stage) alone, the same on any number of ranks."""
    import numpy as np

    state = loader.state_dict()
    state["seed"] = int(np.random.SeedSequence([seed, stage]).generate_state(1, np.uint64)[0])
    loader.load_state_dict(state)


class _Unread:
    """The loader as checkpoint.load sees it at a boundary whose stage starts a stream of its own: the saved
    position (another stage's windows) is read but not applied."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> Dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass
