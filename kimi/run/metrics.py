"""``metrics.jsonl``: what a run logs per step (MetricsLogger, also to wandb and TensorBoard under grouped
names, grouped_name), read back by every tool (read_metrics), and the loss-curve PNG."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from kimi.config import LoggingConfig
from kimi.schema.stages import stage_index, tokens_at
from kimi.run.wandb_run import offline_sync_hint, start_wandb, wandb_mode
from kimi.wandb_offline import wait_finished

# how long the end of a run waits for wandb's service to write an offline record's last block (milliseconds
# as a rule; on a loaded machine the service can lag by seconds), and a run stopped by a signal: its
# checkpoint is saved by then, and a scheduler kills what is still running soon after its SIGTERM (SLURM's
# KillWait: 30 s by default), which would cost the exit code that asks for a requeue
WANDB_WRITE_TIMEOUT_S, WANDB_WRITE_TIMEOUT_STOPPING_S = 60.0, 5.0


def grouped_name(key: str) -> str:
    """metrics.jsonl's key as wandb and TensorBoard show it: the training scalars under train/ (loss, lr,
    grad_norm, tokens_per_s, mfu, moe_*, qk_max_logit, ...), validation under val/ (val_loss -> val/loss,
    val_ppl -> val/ppl, val_loss/<source> -> val/loss/<source>), peak_memory_gib as memory/peak_gib; a key
    already in a family (eval/<task>/<metric>, optim/..., time/..., kda/..., qk_max_logit/<layer>) and
    tokens (the charts' x axis) as they are. metrics.jsonl keeps its flat keys: every tool reads them."""
    if key == "tokens":
        return key
    if key == "peak_memory_gib":
        return "memory/peak_gib"
    if key.startswith("val_"):
        return "val/" + key[len("val_"):]
    return key if "/" in key else f"train/{key}"


def qk_clip_record(stats: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """QK-Clip's last-step statistics as metrics: the worst head over layers, the mean fraction of heads
    clipped, and both per layer (qk_max_logit/<layer>, qk_clipped_frac/<layer>); empty without QK-Clip."""
    if not stats:
        return {}
    record = {"qk_max_logit": max(s["max_logit"] for s in stats.values()),
              "qk_clipped_frac": sum(s["clipped_frac"] for s in stats.values()) / len(stats)}
    for layer, s in stats.items():
        record[f"qk_max_logit/{layer}"] = s["max_logit"]
        record[f"qk_clipped_frac/{layer}"] = s["clipped_frac"]
    return record


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    """The records of metrics.jsonl that describe the run as it now stands.

    The file is only ever appended to. Each start of the trainer writes {"event": "start", "step": N}: the
    records logged after step N by an earlier, interrupted session (whose checkpoint was lost) no longer
    count, and a fresh start (N = 0) replaces everything before it. A line cut short by a crash is skipped."""
    rows: List[Dict[str, Any]] = []
    for r in _records(Path(path)):
        if r.get("event") == "start":
            rows = [x for x in rows if r["step"] and x.get("step", 0) <= r["step"]]
        else:
            rows.append(r)
    return rows


def _records(path: Path) -> Iterator[Dict[str, Any]]:
    """Every JSON object line of metrics.jsonl, in order (a line cut short by a crash is skipped)."""
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            yield r


class MetricsLogger:
    """Appends one JSON object per logged step to ``metrics.jsonl`` (see :func:`read_metrics`) and mirrors
    it to wandb, each wandb row with the tokens trained so far (the charts' x axis, see start_wandb) and, with
    logging.wandb.log_checkpoints, each checkpoint the saver completes as a model artifact; with
    logging.tensorboard, its scalars to TensorBoard as well (kimi.run.tensorboard_log). With logging.plot, a
    record with a validation loss redraws ``loss_curve.png`` beside metrics.jsonl."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, config_dict: Dict[str, Any], resume_step: int = 0,
                 enabled: bool = True, run_id: str = "", tokens_per_step: int = 0, saver=None):
        self.enabled, self.tokens_per_step = enabled, tokens_per_step
        self.path = Path(run_dir) / cfg.metrics_file
        self.history: List[Dict[str, Any]] = []
        self._wandb, self._tensorboard, self._offline = None, None, False
        self.plot_path = Path(run_dir) / "loss_curve.png" if cfg.plot else None
        self._drawn: Dict[Path, tuple] = {}  # the lines last drawn into each PNG: plot skips an unchanged one
        # a run of stages (kimi/run/stages.py): each record names the stage of its step
        self.stages = config_dict.get("stages") or []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _drop_torn_line(self.path)
        mode = wandb_mode(cfg.wandb)
        wandb_id, rewound = wandb_run_id(run_id or Path(run_dir).resolve().name, resume_step, self.path)
        self._append({"event": "start", "step": resume_step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                      **({"wandb_id": wandb_id} if mode != "disabled" else {}),
                      **self._stage(resume_step + 1)})
        self.history = read_metrics(self.path)
        if cfg.tensorboard:
            from kimi.run.tensorboard_log import TensorBoardLog

            self._tensorboard = TensorBoardLog(Path(run_dir), resume_step, tokens_per_step)
        if mode != "disabled":
            self._wandb = start_wandb(cfg.wandb, Path(run_dir), config_dict, wandb_id, rewound)
            self._offline = self._wandb.settings.mode == "offline"  # also online's fallback
            if cfg.wandb.log_checkpoints and saver is not None:
                saver.on_saved.append(self.log_checkpoint)

    def log(self, record: Dict[str, Any], images: Optional[Dict[str, Path]] = None,
            tables: Optional[Dict[str, Tuple[List[str], List[list]]]] = None) -> None:
        """Append `record` (it has a "step"); images (PNG paths) and tables ((columns, rows)) go to wandb
        only, at the same step, as wandb.Image and wandb.Table under their keys."""
        if not self.enabled:
            return
        import torch  # here, not at the top: read_metrics' readers (kimi.dashboard) need no torch

        record = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in record.items()}
        record.update(self._stage(record["step"]))
        if self.stages and "tokens" in record:  # the earlier stages' tokens, at their own tokens per step
            record["tokens"] = tokens_at(self.stages, record["step"], self.tokens_per_step)
        self.history.append(record)
        self._append(record)
        # wandb and TensorBoard chart numbers: the stage as its 1-based index (its name is in their config)
        scalars = {grouped_name(k): v for k, v in record.items() if k not in ("step", "stage")}
        if self.stages:
            scalars["stage"] = stage_index(self.stages, record["step"]) + 1
        if self._tensorboard is not None:
            self._tensorboard.log(record["step"], scalars)
        # a live run's curve, at each evaluation once a step has trained (a lone validation point is no curve)
        if self.plot_path is not None and "val_loss" in record and any("loss" in r for r in self.history):
            self.plot(self.plot_path)
        if self._wandb is not None:
            import wandb

            media = {k: wandb.Image(str(path)) for k, path in (images or {}).items()}
            media.update({k: wandb.Table(columns=cols, data=rows)
                          for k, (cols, rows) in (tables or {}).items()})
            # every row has the x axis, also an evaluation's or the diagnostics' off the progress lines' steps
            tokens = {"tokens": self._tokens(record["step"])} if self.tokens_per_step else {}
            self._wandb.log({**tokens, **scalars, **media}, step=record["step"])

    def _tokens(self, step: int) -> int:
        """Training tokens after step `step` (over the stages, each at its own tokens per step)."""
        if self.stages:
            return tokens_at(self.stages, step, self.tokens_per_step)
        return step * self.tokens_per_step

    def _stage(self, step: int) -> Dict[str, str]:
        """{"stage": the name of the stage that trains step `step`}, or {} for a run without stages."""
        return {"stage": self.stages[stage_index(self.stages, step)]["name"]} if self.stages else {}

    def log_checkpoint(self, path: Path, step: int) -> None:
        """A complete checkpoint directory as the next version of the run's model artifact, aliased
        step_<N> and latest."""
        if self._wandb is None:
            return
        import wandb

        artifact = wandb.Artifact(f"checkpoint-{self._wandb.id}", type="model",
                                  metadata={"step": step, "tokens": self._tokens(step)})
        artifact.add_dir(str(path))
        self._wandb.log_artifact(artifact, aliases=[f"step_{step}", "latest"])

    def _append(self, record: Dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self, stopping: bool = False) -> None:
        """stopping: the run ends on a signal (a shorter wait for wandb's record, WANDB_WRITE_TIMEOUT_*)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            folder = Path(self._wandb.dir).parent  # <run_dir>/wandb/offline-run-<time>-<id>
            record = folder / f"run-{self._wandb.id}.wandb"
            self._wandb.finish()
            self._wandb = None
            if self._offline:  # wandb's own hint is hidden by quiet=True
                # finish() returns before wandb's service has written the record's last block: a sync (or a
                # read) started now would see a run cut short
                timeout = WANDB_WRITE_TIMEOUT_STOPPING_S if stopping else WANDB_WRITE_TIMEOUT_S
                if not wait_finished(record, timeout):
                    print(f"[kimi] warning: wandb has not finished writing {record} after {timeout:.0f} s; "
                          "sync it once this process has exited", flush=True)
                print(offline_sync_hint(folder), flush=True)

    def plot(self, out: Path) -> Optional[Path]:
        """Train and validation loss against step, and a blend's per-source validation losses
        (val_loss/<name>) as lines of their own, as a PNG (matplotlib, no display needed). Written to a
        temporary file, then renamed over `out`: a viewer that reloads it during the run never reads half an
        image. The PNG's Description names its lines. A PNG that already shows these lines is not drawn again
        (a drawing takes about half a second; the run's end follows its last evaluation)."""
        train = [(r["step"], r["loss"]) for r in self.history if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in self.history if "val_loss" in r]
        sources = sorted({k for r in self.history for k in r if k.startswith("val_loss/")})
        if not train and not val:
            return None
        lines = (train, val, [(k, [(r["step"], r[k]) for r in self.history if k in r]) for k in sources])
        if self._drawn.get(Path(out)) == lines and Path(out).exists():
            return Path(out)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        if train:
            ax.plot(*zip(*train), label="train loss", lw=1.2)
        if val:
            ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
        for key, points in lines[2]:
            ax.plot(*zip(*points), "s--", label=f"validation loss: {key.split('/', 1)[1]}", lw=1.0, ms=3)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        labels = "; ".join(line.get_label() for line in ax.get_lines())
        tmp = Path(out).with_name(f".{Path(out).name}.tmp")
        fig.savefig(tmp, format="png", metadata={"Description": f"lines: {labels}"})
        plt.close(fig)
        os.replace(tmp, out)
        self._drawn[Path(out)] = lines
        return Path(out)


def _drop_torn_line(path: Path) -> None:
    """Cut a last line without its newline (a crash mid-write): a record cut short is no record, and the
    steps after the checkpoint are logged again anyway."""
    with path.open("rb+") as f:
        end = f.seek(0, 2)
        if end == 0 or (f.seek(end - 1), f.read(1))[1] == b"\n":
            return
        start = end
        while start > 0:  # back to the newline before the torn line, a block at a time
            block = min(start, 1 << 16)
            f.seek(start - block)
            cut = f.read(block).rfind(b"\n")
            if cut >= 0:
                start = start - block + cut + 1
                break
            start -= block
        f.truncate(start)


def wandb_run_id(run_id: str, resume_step: int, metrics: Path) -> Tuple[str, Optional[str]]:
    """(the wandb run id of this start, the earlier wandb run it rewinds or None).

    The id is the run's own (kept in its checkpoints): a resumed or moved run directory continues its wandb
    run, an overwritten one (a new run id) starts another. wandb only takes steps forward within a run, so a
    resume from a checkpoint older than steps already logged would silently lose the re-logged steps; such a
    start gets a run of its own, `<run id>-r<k>`, which names the earlier one in its notes. The id in use is
    kept in metrics.jsonl's start records."""
    used, logged, rewinds, ours = run_id, 0, set(), False
    for r in _records(metrics):
        if r.get("event") == "start":
            wid = str(r.get("wandb_id", ""))
            ours = wid == run_id or wid.startswith(f"{run_id}-r")  # what an earlier run id logged is not ours
            if ours:
                used = wid
                rewinds.add(wid)
        elif ours and isinstance(r.get("step"), int):
            logged = max(logged, r["step"])
    if logged <= resume_step:
        return used, None
    return f"{run_id}-r{len(rewinds - {run_id}) + 1}", used
