"""What a run dir keeps of a command that did not train (docs/runs.md): a command refused before any work
leaves no empty folder behind (only the folders Hydra made for it, only while they hold no file), and a lock
left by a killed trainer is taken over with one line saying so, while a held one still refuses."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from kimi.config import ConfigError
from kimi.run.rundir import LOCK, FoldersMade, RunLock, open_run_dir, remove_unused

pytestmark = pytest.mark.unit


# ---- no folder left behind --------------------------------------------------------------------------------
def test_only_the_empty_folders_this_command_made_are_removed(tmp_path):
    (tmp_path / "outputs").mkdir()  # there before: kept, even once empty
    made = FoldersMade(f"{tmp_path}/outputs/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}")
    run = tmp_path / "outputs" / time.strftime("%Y-%m-%d") / "12-00-00"
    run.mkdir(parents=True)
    (run / "train.log").touch()  # Hydra's, empty
    assert made.top(run) == run.parent and remove_unused(run, made.top(run))
    assert [p.name for p in tmp_path.rglob("*")] == ["outputs"]


@pytest.mark.parametrize("content", [{"train.log": "a line\n"}, {"train.log": "", "notes.txt": ""},
                                     {"train.log": "", "checkpoints/x": ""}])
def test_a_folder_holding_a_file_stays(tmp_path, content):
    made = FoldersMade(f"{tmp_path}/runs/exp1")
    run = tmp_path / "runs" / "exp1"
    for name, text in content.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    assert made.top(run) == tmp_path / "runs" and not remove_unused(run, made.top(run))
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) == sorted(content)


def test_a_run_dir_that_existed_before_stays(tmp_path):
    run = tmp_path / "runs" / "exp1"
    run.mkdir(parents=True)
    made = FoldersMade(str(run))
    (run / "train.log").touch()
    assert made.top(run) is None and not remove_unused(run, made.top(run)) and run.is_dir()


def test_a_refused_train_py_leaves_no_folder(tmp_path, monkeypatch, capsys):
    """`python train.py optim.lr=-1` in a fresh folder: one line, exit 2, and no outputs/<date>/<time>/."""
    from kimi import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "optim.lr=-1", "logging.wandb.mode=disabled"])
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with pytest.raises(SystemExit) as stop:
            train.cli()
    finally:  # Hydra's job logging: its log file's handler and this test's captured stdout
        for handler in set(root.handlers) - set(handlers):
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err == ["error: optim.lr=-1.0 is invalid: must be > 0"]
    assert list(tmp_path.iterdir()) == []


# ---- stale locks -----------------------------------------------------------------------------------------
def _killed_holder(run_dir) -> int:
    """The pid of a process that took the run dir's lock and was killed holding it (SIGKILL: no release)."""
    code = ("from pathlib import Path; from kimi.run.rundir import RunLock; "
            f"lock = RunLock(Path({str(run_dir)!r})); print('locked', flush=True); "
            "import time; time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
    return proc.pid


def test_a_killed_trainers_lock_is_taken_over_with_a_line(tmp_path):
    pid = _killed_holder(tmp_path)
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == pid  # what it left
    lines = []
    lock = open_run_dir(tmp_path, True, False, True, False, lines.append)
    assert len(lines) == 1 and f"taking over the lock left by pid {pid} on host" in lines[0]
    assert lines[0].endswith(f"pid {pid} is dead")
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_held_lock_still_refuses_and_a_released_one_says_nothing(tmp_path):
    lines = []
    held = RunLock(tmp_path, lines.append)
    with pytest.raises(ConfigError, match=f"in use by another trainer \\(pid {os.getpid()} on host "):
        RunLock(tmp_path, lines.append)
    held.release()
    assert (tmp_path / LOCK).read_text() == ""  # released: nothing left to take over
    RunLock(tmp_path, lines.append).release()
    assert lines == []
