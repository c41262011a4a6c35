"""Checkpoints written in the background (trainer.async_checkpoint): each holds exactly what a blocking save
of the same step holds, although training changed the weights while it was written; a process killed in the
middle of a background write loses nothing older, and a rerun resumes from the newest complete checkpoint to
the weights of an uninterrupted run; a failed background write stops the run with the storage message and
keeps the older checkpoints. (Several ranks: the hsdp2x2 and pp2xdp2 layouts of
tests/parallel/test_parallel.py.)"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import train_run
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kimi import checkpoint
from kimi.errors import RunError

pytestmark = pytest.mark.e2e

STEPS = ["trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3", "optim=muonclip"]
ASYNC = "trainer.async_checkpoint=true"
# Kills its own process inside DCP's writer thread once the step-4 checkpoint's files are written, before
# DCP's .metadata and kimi's COMPLETE marker: the crash a background save must survive.
CRASH = """
import json, os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from torch.distributed.checkpoint import filesystem
from helpers import train_run
write = filesystem.FileSystemWriter.write_data
def write_then_die(self, plan, planner):
    written = write(self, plan, planner)
    if str(self.path).endswith("step_00000004"):
        written.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return written
filesystem.FileSystemWriter.write_data = write_then_die
train_run(Path(sys.argv[2]), json.loads(sys.argv[3]), *sys.argv[4:])
"""


@pytest.fixture(scope="module")
def blocking(tmp_path_factory, data):
    run = tmp_path_factory.mktemp("blocking")
    train_run(run, data, *STEPS)
    return run


def whole_state(path: Path, tmp: Path) -> dict:
    """A checkpoint's tensors and numbers, without the config and extra entries (they name the run dir and
    the save mode)."""
    out = tmp / f"{path.parent.parent.name}_{path.name}.pt"
    dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=False)
    del state["trainer"]["config"], state["trainer"]["extra"]
    return state


def assert_same(got, want, where: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
    else:
        assert got == want, where


def test_background_checkpoints_hold_what_blocking_saves_hold(tmp_path, data, blocking, monkeypatch):
    write = filesystem.FileSystemWriter.write_data

    def slow_write(self, plan, planner):  # so the next steps change the weights while these are written
        time.sleep(1.0)
        return write(self, plan, planner)

    monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", slow_write)
    run = tmp_path / "async"
    train_run(run, data, *STEPS, ASYNC)
    log = (run / "train.log").read_text()
    assert log.index("step 3/6") < log.index("saved checkpoint"), log  # step 3 trained during step 2's save
    saved = checkpoint.list_checkpoints(run / "checkpoints")
    assert [(c.step, c.complete) for c in saved] == [(2, True), (4, True), (6, True)]
    for c in saved:
        assert checkpoint.verify(c.path) == []
        assert json.loads((c.path / checkpoint.COMPLETE).read_text())["background"] is True
        assert_same(whole_state(c.path, tmp_path),
                    whole_state(checkpoint.step_dir(blocking / "checkpoints", c.step), tmp_path),
                    f"step {c.step}")


def test_a_crash_during_a_background_save_keeps_the_older_checkpoints(tmp_path, data, blocking):
    run = tmp_path / "crashed"
    crash = subprocess.run([sys.executable, "-c", CRASH, str(Path(__file__).parents[1]), str(run),
                            json.dumps(data), *STEPS, ASYNC], capture_output=True, text=True, timeout=300)
    assert crash.returncode == -9, crash.stdout[-2000:] + crash.stderr[-3000:]
    found = {c.step: c.complete for c in checkpoint.list_checkpoints(run / "checkpoints")}
    assert found == {2: True, 4: False}, found
    assert checkpoint.verify(checkpoint.step_dir(run / "checkpoints", 2)) == []

    train_run(run, data, *STEPS, ASYNC)
    log = (run / "train.log").read_text()
    assert "skipping incomplete checkpoint" in log and "step_00000004" in log
    assert "resumed from" in log and "at step 2" in log
    last = checkpoint.latest_complete(run / "checkpoints")
    assert last.step == 6
    assert_same(whole_state(last.path, tmp_path)["model"],
                whole_state(checkpoint.step_dir(blocking / "checkpoints", 6), tmp_path)["model"])


def test_a_failed_background_write_stops_the_run_and_keeps_the_older_checkpoint(tmp_path, data, monkeypatch):
    write = filesystem.FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        if str(self.path).endswith("step_00000004"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, plan, planner)

    monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", full_disk)
    run = tmp_path / "full"
    with pytest.raises(RunError, match=r"no space left on device while saving checkpoint .*step_00000004; "
                                       r"the newest complete checkpoint .*step_00000002 is intact"):
        train_run(run, data, *STEPS, ASYNC)
    assert [(c.step, c.complete) for c in checkpoint.list_checkpoints(run / "checkpoints")] == [(2, True)]
