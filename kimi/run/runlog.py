"""What a run directory keeps about each start besides metrics and checkpoints.

- ``train.log``: rank 0's console output (stdout), appended across restarts, each start under a header line
  with its time, pid and command. Hydra's job logging names the same file; its records are appended too.
- ``config.yaml``: the resolved config of the newest start that trained, and ``configs/<time>-step<N>.yaml``
  for every start that trained (written only once all checks passed: a command that fails changes neither).
- ``optimizer_routing.txt`` (``optimizer_routing_pp<k>.txt`` per pipeline rank k, whose stages hold other
  parameters): which parameters MuonClip's Muon and AdamW each update; the console gets one summary line.
- ``tokenizer.model``: the run's own copy, so ``python -m kimi.generate`` needs only the run dir (a tiktoken
  tokenizer's ``tokenizer_config.json`` beside it).
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

LOG_NAME = "train.log"


def _command() -> str:
    """This process's command line, as a shell would take it back."""
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else ""


class _Tee:
    """A text stream that writes to `stream` and to a RunLog; everything else is the stream's."""

    def __init__(self, stream, log: "RunLog"):
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        self._log.write(text)
        return n

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class RunLog:
    """Rank 0's copy of its console output in ``<run_dir>/train.log``. Each write opens the file to append
    (so nothing is lost at a crash and no handle outlives the run); what is written before `open` (the run
    dir is not checked yet) is kept and written after the start's header. Disabled on other ranks."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.path = enabled, None
        self._pending: List[str] = []

    def open(self, run_dir: Path) -> None:
        if not self.enabled:
            return
        self.path = Path(run_dir) / LOG_NAME
        self.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} on {socket.gethostname()}: "
                   f"{_command()}\n" + "".join(self._pending))
        self._pending = []

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.path is None:
            self._pending.append(text)
            return
        try:
            with self.path.open("a") as f:
                f.write(text)
        except OSError:
            pass  # a full disk or a vanished run dir: the console still has it, and the run reports it

    @contextmanager
    def tee(self):
        """While inside: sys.stdout is also written here. An error leaving the block is written here too (the
        console gets it from kimi.cli.run_main)."""
        if not self.enabled:
            yield
            return
        stream = sys.stdout
        sys.stdout = _Tee(stream, self)
        try:
            yield
        except SystemExit:  # kimi.run.signals' exit at once, which has printed (and so logged) its own line
            raise
        except BaseException as e:
            from kimi.errors import describe

            name, message = type(e).__name__, describe(e)
            self.write(f"error: {message} ({name})\n" if message else f"error: {name}\n")
            raise
        finally:
            sys.stdout = stream


def config_yaml(config: Dict[str, Any]) -> str:
    """OmegaConf.to_yaml's text of a plain config dict (the same representers, strings that would load as
    another type quoted), written by PyYAML's C emitter where it is built: 5 ms for a run's config instead of
    OmegaConf's 34 ms, which wraps every value in a node first (2 idle CPU cores)."""
    import yaml
    from omegaconf._utils import OmegaConfDumper

    dumper = type("ConfigDumper", (getattr(yaml, "CDumper", yaml.Dumper),), {})
    dumper.add_representer(str, OmegaConfDumper.str_representer)
    return yaml.dump(config, Dumper=dumper, default_flow_style=False, allow_unicode=True, sort_keys=False)


def save_config(run_dir: Path, config: Dict[str, Any], step: int) -> Path:
    """Keep the resolved config a start trains with: ``<run_dir>/config.yaml`` (the newest) and a copy in
    ``configs/`` that later starts never replace. Returns the kept copy."""
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    text = (f"# the resolved config of the training started {started} at step {step}\n# command: "
            f"{_command()}\n"
            + config_yaml(config))
    history = Path(run_dir) / "configs"
    history.mkdir(parents=True, exist_ok=True)
    stem, n = f"{time.strftime('%Y%m%d-%H%M%S')}-step{step}", 1
    while (kept := history / (stem + (f"-{n}" if n > 1 else "") + ".yaml")).exists():
        n += 1  # two starts within a second
    kept.write_text(text)
    tmp = Path(run_dir) / ".config.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, Path(run_dir) / "config.yaml")
    return kept


def write_routing(run_dir: Path, engine, mesh, optim_name: str) -> Optional[str]:
    """Write the optimizer's routing table (MuonClip's; None for one without) into the run dir and return
    the console's summary line. Under pipeline parallelism each pipeline rank's stages hold other parameters:
    one file per pipeline rank k, written by the first of the ranks holding those stages (None elsewhere)."""
    from kimi.optim import RoutedOptimizer

    optimizer = engine.optimizer
    if not isinstance(optimizer, RoutedOptimizer) or (mesh is not None and any(mesh.get_coordinate()[1:])):
        return None  # mesh coordinates: (pp, dp_rep, dp_shard, cp, tp)
    text = optimizer.routing_table()
    if text is None:
        return None
    stage, stages = engine.pp_rank or 0, engine.dims.pp
    path = Path(run_dir) / ("optimizer_routing.txt" if stages == 1 else f"optimizer_routing_pp{stage}.txt")
    path.write_text(text + "\n")
    summary = text.splitlines()[-1]  # the table's per-family totals
    where = f" (pipeline rank {stage} of {stages}: each pipeline rank has its own file)" if stages > 1 else ""
    return f"[kimi] optimizer {optim_name}: {summary}; table in {path}{where}"


def schedule_change(saved: Dict[str, Any], optim, max_steps: int, step: int) -> Optional[str]:
    """What a changed trainer.max_steps does to the lr schedule of a resumed run (None: unchanged): the
    schedule is recomputed for the new length, so the next step's lr jumps to another point of it."""
    from kimi.optim import lr_multiplier

    old_max = saved.get("trainer", {}).get("max_steps")
    if old_max is None or old_max == max_steps or step >= max_steps:
        return None
    old_optim = SimpleNamespace(**{**vars(optim), **saved.get("optim", {})})  # the checkpoint's lr, schedule
    old = old_optim.lr * lr_multiplier(step, old_optim, old_max)
    new = optim.lr * lr_multiplier(step, optim, max_steps)
    ended = " (where that schedule had ended)" if step >= old_max else ""
    return (f"[kimi] trainer.max_steps {old_max} -> {max_steps}: the lr schedule ({optim.schedule}) is "
            f"recomputed for {max_steps} steps, so step {step + 1} trains with lr {new:.3e}, not {old:.3e} "
            f"as on the {old_max}-step schedule{ended}")


def data_identity(run_dir: Path, data, is_main: bool) -> Dict[str, Any]:
    """What a checkpoint records about its data; the run dir keeps its own copy of the tokenizer (rank 0
    copies it once) so `python -m kimi.generate` needs only the run."""
    tok_copy = Path(run_dir) / "tokenizer.model"
    if is_main and not tok_copy.exists():
        data.tokenizer.copy_to(tok_copy)
    return {"tokenizer_sha256": data.tokenizer.sha256, "tokenizer_path": str(tok_copy.resolve()),
            "data_dir": str(data.data_dir)}


def nothing_to_train(step: int, t, log: Callable[[str], None]) -> Dict[str, Any]:
    """Say why a run already at trainer.max_steps or trainer.stop_at_step trains nothing; fit's result. Both
    count as finished (exit 0): a scheduler that requeues a stopped run (exit 75) would requeue this one
    forever."""
    if step >= t.max_steps:
        log(f"[kimi] run already complete at step {step} (trainer.max_steps={t.max_steps}); raise "
            "trainer.max_steps to train further or use a new hydra.run.dir")
        return {"finished": True, "step": step, "val_loss": None}
    log(f"[kimi] already at step {step}, at or past trainer.stop_at_step={t.stop_at_step}: nothing to train. "
        "Raise or remove trainer.stop_at_step to continue")
    return {"finished": True, "step": step, "val_loss": None}
