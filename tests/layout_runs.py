"""Training runs compared across layouts and engines (tests/parallel/test_parallel.py,
tests/parallel/test_deepspeed.py): the overrides of a 3-step tiny run, one process in-line, several ranks
under torchrun, and the comparison of two runs' losses and final weights."""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_TRAINER
from hydra import compose, initialize_config_dir
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kimi import checkpoint
from kimi.config import Config, register_configs, to_config
from kimi.run.metrics import read_metrics
from kimi.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
register_configs()
# AdamW's eps at 1e-4, not 1e-8: Adam's update moves by up to lr * (gradient error) / eps, so a gradient
# element near 1e-9 (blocks.1.mlp.w_down has one at step 1) turns the float summation-order differences
# between layouts (~1e-11 there, ~1e-9 through a loss-parallel cross-entropy) into 1e-5..1e-4 of weight
# under eps 1e-8. The test compares layouts, not how Adam amplifies that noise.
STEPS = ["trainer.max_steps=3", "trainer.eval_every=3", "trainer.checkpoint_every=0", "model.num_layers=4",
         "optim.eps=1e-4"]


def overrides(data: list[str], optim: str, *extra: str) -> list[str]:
    return [*TINY_TRAINER, *data, f"optim={optim}", *STEPS, *extra]


def composed(run: Path, args: list[str]) -> Config:
    """The typed config train.py would run in `run` with overrides `args`."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_config(compose("config", overrides=[f"trainer.run_dir={run}", *args]))


def single_process(run: Path, data: list[str], optim: str, *extra: str) -> Trainer:
    trainer = Trainer(composed(run, overrides(data, optim, *extra)))
    result = trainer.fit()
    if "sample" in result:
        (run / "sample.txt").write_text(result["sample"])
    return trainer


def torchrun(nproc: int, run: Path | None, args: list[str],
             check: bool = True) -> subprocess.CompletedProcess:
    """train.py (or, with run=None, any script and its arguments) on nproc ranks."""
    script = [str(ROOT / "train.py"), f"hydra.run.dir={run}"] if run is not None else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *script, *args]
    # faulthandler: a rank killed by a signal in native code prints its Python stack first
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
                          capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def native_crash(proc: subprocess.CompletedProcess) -> str | None:
    """torchrun's line for a rank that died of SIGSEGV or SIGBUS (a crash inside torch's native code, not a
    Python error of ours), or None."""
    return next((line.strip() for line in proc.stderr.splitlines()
                 if "exitcode" in line
                 and any(f"-{n} " in line for n in (signal.SIGSEGV, signal.SIGBUS))), None)


def metrics(run: Path) -> tuple[list[float], list[float]]:
    rows = read_metrics(run / "metrics.jsonl")
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


def final_weights(run: Path, tmp: Path) -> dict[str, torch.Tensor]:
    latest = checkpoint.latest_complete(run / "checkpoints")
    dcp_to_torch_save(latest.path, tmp / f"{run.name}.pt")
    state = torch.load(tmp / f"{run.name}.pt", weights_only=True)
    return {k: v for k, v in state["model"].items()}


def assert_same_run(run: Path, ref: Path, tmp: Path, atol: float = 1e-5) -> None:
    (loss, val), (ref_loss, ref_val) = metrics(run), metrics(ref)
    assert len(loss) == len(ref_loss) == 3 and len(val) == len(ref_val) == 2
    torch.testing.assert_close(torch.tensor(loss + val), torch.tensor(ref_loss + ref_val), rtol=1e-5, atol=0)
    got, want = final_weights(run, tmp), final_weights(ref, tmp)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def dist_train(nproc: int, runs: list[tuple[Path, list[str]]], spec: Path,
               check: bool = True) -> subprocess.CompletedProcess:
    """Train `runs` ((run dir, overrides) each) one after another in one torchrun launch of
    tests/dist_train.py on nproc ranks: torch's start on every rank costs more than a tiny run. A run that
    names the run dir of one before it resumes from its checkpoint. The configs are composed here, once
    (Hydra's composition costs about 0.3 s a run, which every rank would pay again), and pickled to `spec`."""
    spec.write_bytes(pickle.dumps([composed(run, list(o)) for run, o in runs]))
    return torchrun(nproc, None, [str(ROOT / "tests" / "dist_train.py"), str(spec)], check=check)


def resumed_at(run: Path) -> list[int]:
    """The step each start of a run resumed at, in order, from its train.log (a start from scratch: none)."""
    return [int(step) for step in re.findall(r"\[kimi\] resumed from \S+ at step (\d+)",
                                             (run / "train.log").read_text())]


def reference_runs(out: Path, data: list[str]):
    """reference(optim, *overrides) -> the run dir of one process of the torch engine with those settings,
    trained once per combination (under ``out``)."""
    runs: dict = {}

    def reference(optim: str, *extra: str) -> Path:
        key = (optim, *extra)
        if key not in runs:
            name = "_".join(k.replace("=", "-").replace("/", "_") for k in key)
            if len(name) > 120:  # a file name has at most 255 bytes: long override lists by their hash
                name = f"{name[:80]}_{hashlib.sha256(name.encode()).hexdigest()[:16]}"
            runs[key] = out / name
            single_process(runs[key], data, optim, *extra)
        return runs[key]

    return reference
