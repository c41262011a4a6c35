"""Runs that cannot be lost, corrupted or hijacked: untrusted checkpoint files, damaged checkpoints, reused
and shared run directories, full disks, changed settings on resume, exit codes and a stalled rank."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_TRAINER as TINY
from helpers import copy_run, run_cfg, train_run

import kimi.run.signals
from kimi import checkpoint
from kimi.errors import RunError
from kimi.cli import run_main
from kimi.config import ConfigError, register_configs
from kimi.run.metrics import read_metrics
from kimi.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
register_configs()


def cfg(run: Path, data: list[str], *overrides: str):
    return run_cfg(run, data, *overrides)


def train(run: Path, data: list[str], *overrides: str) -> Trainer:
    return train_run(run, data, *overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data) -> Path:
    """A run with complete checkpoints at steps 2 and 4; tests copy it before changing anything."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train(run, data, "trainer.max_steps=4", "trainer.checkpoint_every=2")
    return run


def ckpt(run: Path, step: int) -> Path:
    return checkpoint.step_dir(run / "checkpoints", step)


def data_file(path: Path) -> Path:
    return next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")


# ---- trusted loading -------------------------------------------------------------------------------------

class Evidence:
    """Unpickling this creates a file: proof that a checkpoint ran code."""

    path = ""

    def __reduce__(self):
        return open, (self.path, "w")


def replant(path: Path, name: str, payload: bytes) -> None:
    """Replace one file of a checkpoint and fix its manifest, as an attacker who can write the run dir
    would."""
    (path / name).write_bytes(payload)
    marker = json.loads((path / checkpoint.COMPLETE).read_text())
    marker["files"][name] = [len(payload), checkpoint.manifest.crc32(path / name)]
    (path / checkpoint.COMPLETE).write_text(json.dumps(marker))


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["metadata", "extra", "optimizer"])
def test_a_planted_pickle_never_runs(tmp_path, data, trained, monkeypatch, where):
    import pickle

    from kimi.generate import load_from_checkpoint

    evidence = tmp_path / "code-ran"
    Evidence.path = str(evidence)
    run = copy_run(trained, tmp_path)
    if where == "metadata":
        replant(ckpt(run, 4), ".metadata", pickle.dumps(Evidence()))
    else:  # a checkpoint written with a malicious object in an entry that loading reads
        real = checkpoint._full_state

        def planted(*args):
            state = real(*args)
            if where == "extra":
                state["trainer"]["extra"] = Evidence()
            else:
                state["optim"]["param_groups"][0]["lr"] = Evidence()
            return state

        monkeypatch.setattr(checkpoint, "_full_state", planted)
        train(run, data, "trainer.max_steps=5", "trainer.checkpoint_every=2")
        monkeypatch.setattr(checkpoint, "_full_state", real)
        assert checkpoint.latest_complete(run / "checkpoints").step == 5
    loads = {"resume": lambda: Trainer(cfg(run, data, "trainer.max_steps=8")),
             "generate": lambda: load_from_checkpoint(str(run))}
    if where == "optimizer":  # generation reads the model only: it never touches the optimizer entries
        loads.pop("generate")
    for load in loads.values():
        with pytest.raises(RunError, match="refusing to load checkpoint"):
            load()
        assert not evidence.exists()


def forge(run: Path, source: int, step: int, how: str) -> Path:
    """A checkpoint step_<step> whose every file matches its manifest, made from checkpoint `source`: its
    metadata reads that checkpoint's shards by a '../' path or an absolute one, or it is a whole copy whose
    marker and name claim another step."""
    import dataclasses
    import pickle
    import shutil

    real, forged = ckpt(run, source), ckpt(run, step)
    if how == "step":
        shutil.copytree(real, forged)
        marker = json.loads((forged / checkpoint.COMPLETE).read_text())
        (forged / checkpoint.COMPLETE).write_text(json.dumps({**marker, "step": step}))
        return forged
    with open(real / ".metadata", "rb") as f:
        metadata = checkpoint.load_metadata(f)
    where = {"relative": lambda name: f"../{real.name}/{name}",
             "absolute": lambda name: str(real / name)}[how]
    metadata.storage_data = {k: dataclasses.replace(v, relative_path=where(v.relative_path))
                             for k, v in metadata.storage_data.items()}
    forged.mkdir()
    shutil.copy(real / checkpoint.COMPLETE, forged / checkpoint.COMPLETE)
    marker = json.loads((forged / checkpoint.COMPLETE).read_text())
    (forged / checkpoint.COMPLETE).write_text(json.dumps({**marker, "step": step, "files": {}}))
    replant(forged, ".metadata", pickle.dumps(metadata))
    return forged


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["relative", "absolute", "step"])
def test_a_forged_checkpoint_is_refused_before_anything_is_read(tmp_path, data, trained, monkeypatch, capsys,
                                                                 how):
    from kimi.generate import load_from_checkpoint

    run = copy_run(trained, tmp_path)
    forged = forge(run, 2, 12, how)
    message = "holds the state of step 2, but its COMPLETE marker says step 12" if how == "step" else \
        "its .metadata reads files outside its manifest"
    read = []
    real_read = checkpoint.SafeReader.read_data
    monkeypatch.setattr(checkpoint.SafeReader, "read_data", lambda self, *a: read.append(
        Path(self.path)) or real_read(self, *a))
    with pytest.raises(RunError, match=f"checkpoint {forged} is damaged: {message}"):
        load_from_checkpoint(str(forged))
    if how != "step":  # a loader that does not verify first still refuses it
        with pytest.raises(RunError, match=f"refusing to load checkpoint {forged}: {message}"):
            checkpoint.load_model(forged, {})
        assert forged not in read
    # resume passes over it as over any damaged checkpoint, and sets it aside
    trainer = Trainer(cfg(run, data, "trainer.max_steps=6"))
    assert trainer.step == 4
    assert f"skipping damaged checkpoint {forged}: {message}" in capsys.readouterr().out
    assert (run / "checkpoints" / f"{forged.name}{checkpoint.DAMAGED}").is_dir()
    trainer.close()
    if how != "step":
        assert forged not in read


# ---- integrity -------------------------------------------------------------------------------------------

def flip(path: Path) -> None:
    f = data_file(path)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    f = data_file(path)
    f.write_bytes(f.read_bytes()[:-100])


def remove(path: Path) -> None:
    data_file(path).unlink()


def marker_alone(path: Path) -> None:
    for p in path.iterdir():
        if p.name != checkpoint.COMPLETE:
            p.unlink()


def marker_without_manifest(path: Path) -> None:
    (path / checkpoint.COMPLETE).write_text("{}\n")


FAULTS = {"flipped byte": (flip, "does not match its checksum"), "truncated": (truncate, "bytes, "),
          "missing file": (remove, "is missing"), "marker alone": (marker_alone, "is missing"),
          "no manifest": (marker_without_manifest, "lists no files")}


@pytest.mark.e2e
@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_intact_one(tmp_path, data, trained, capsys, fault):
    damage, message = FAULTS[fault]
    run = copy_run(trained, tmp_path)
    damage(ckpt(run, 4))
    trainer = Trainer(cfg(run, data, "trainer.max_steps=6"))
    assert trainer.step == 2
    out = capsys.readouterr().out
    assert f"skipping damaged checkpoint {ckpt(run, 4)}: " in out and message in out
    # set aside, not deleted: rotation will not count it, and a new step 4 will not replace it
    assert (run / "checkpoints" / f"{ckpt(run, 4).name}{checkpoint.DAMAGED}").is_dir()
    trainer.close()


@pytest.mark.e2e
def test_no_intact_checkpoint_is_an_error_naming_them(tmp_path, data, trained, capsys):
    run = copy_run(trained, tmp_path)
    flip(ckpt(run, 2))
    truncate(ckpt(run, 4))
    with pytest.raises(RunError, match="no intact checkpoint in .*step_00000002, step_00000004"):
        Trainer(cfg(run, data, "trainer.max_steps=6"))
    assert ckpt(run, 2).is_dir() and ckpt(run, 4).is_dir()  # nothing deleted


@pytest.mark.e2e
def test_generation_refuses_a_damaged_checkpoint_named_directly(tmp_path, trained):
    from kimi.generate import load_from_checkpoint

    run = copy_run(trained, tmp_path)
    flip(ckpt(run, 4))
    with pytest.raises(RunError, match="is damaged: .*checksum"):
        load_from_checkpoint(str(ckpt(run, 4)))
    assert load_from_checkpoint(str(run))[2] == 2  # the run dir: the newest intact one


# ---- run-directory safety --------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_fresh_run_in_a_used_run_dir_is_refused_or_moves_the_old_run_aside(tmp_path, data, trained):
    run = copy_run(trained, tmp_path)
    old_metrics = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError,
                       match="trainer.resume=false, but run dir .* holds checkpoints.*overwrite=true"):
        Trainer(cfg(run, data, "trainer.resume=false"))
    assert checkpoint.latest_complete(run / "checkpoints").step == 4
    # overwrite: the old run moves aside whole; the new one keeps its own checkpoints (step 1 < the old 4)
    train(run, data, "trainer.resume=false", "trainer.overwrite=true", "trainer.max_steps=2",
          "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2")
    [previous] = (run / "previous").iterdir()
    assert [c.step for c in checkpoint.list_checkpoints(previous / "checkpoints")] == [2, 4]
    assert (previous / "metrics.jsonl").read_bytes() == old_metrics
    assert [c.step for c in checkpoint.list_checkpoints(run / "checkpoints")] == [1, 2]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2]


@pytest.mark.unit
def test_rotation_deletes_only_older_checkpoints_of_its_own_run(tmp_path):
    root = tmp_path / "checkpoints"
    for step, run_id in ((2, "a"), (4, "a"), (6, "a"), (9, "b"), (20, "a")):
        path = checkpoint.step_dir(root, step)
        path.mkdir(parents=True)
        (path / checkpoint.COMPLETE).write_text(json.dumps({"run_id": run_id, "files": {"x": [0, 0]}}))
    checkpoint.store._rotate(root, 6, keep=2, run_id="a")
    assert [c.step for c in checkpoint.list_checkpoints(root)] == [4, 6, 9, 20]


@pytest.mark.e2e
def test_metrics_are_appended_and_a_torn_last_line_is_dropped(tmp_path, data, trained):
    run = copy_run(trained, tmp_path)
    before = (run / "metrics.jsonl").read_bytes()
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 1.2')  # a crash mid-write
    train(run, data, "trainer.max_steps=6")
    after = (run / "metrics.jsonl").read_bytes()
    assert after.startswith(before) and b'"loss": 1.2\n' not in after and b'"loss": 1.2{' not in after
    assert all(json.loads(line) for line in after.splitlines())
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.unit
@pytest.mark.parametrize("torn", ["", '{"step": 3', "x" * 200_000])  # longer than one block read back
def test_only_a_torn_last_line_is_cut(tmp_path, torn):
    from kimi.run.metrics import _drop_torn_line

    whole = '{"step": 1}\n{"step": 2}\n'
    path = tmp_path / "metrics.jsonl"
    path.write_text(whole + torn)
    _drop_torn_line(path)
    assert path.read_text() == whole
    path.write_text(torn)
    _drop_torn_line(path)
    assert path.read_text() == ""


@pytest.mark.unit
def test_an_interrupted_save_leaves_no_step_directory(tmp_path, monkeypatch, capsys):
    """A second SIGTERM during a save interrupts it (KeyboardInterrupt): its directory goes, and a trainer's
    resume removes any incomplete one left by a save that could not clean up (a crash)."""
    import torch

    def interrupted(state, checkpoint_id):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"part")
        raise KeyboardInterrupt("second SIGTERM")

    monkeypatch.setattr(checkpoint.store.dcp, "save", interrupted)
    root = tmp_path / "checkpoints"
    with pytest.raises(KeyboardInterrupt):
        checkpoint.store._write(ckpt(tmp_path, 3), {"x": torch.zeros(2)}, {"step": 3}, None)
    assert not ckpt(tmp_path, 3).exists()
    ckpt(tmp_path, 5).mkdir()  # a crash's leftover
    assert checkpoint.newest_intact(root, set_aside=False) is None and ckpt(tmp_path, 5).is_dir()
    assert checkpoint.newest_intact(root, set_aside=True) is None and not ckpt(tmp_path, 5).exists()
    assert "skipping incomplete checkpoint" in capsys.readouterr().out


@pytest.mark.e2e
def test_a_second_trainer_on_the_same_run_dir_is_refused(tmp_path, data):
    first = Trainer(cfg(tmp_path / "run", data, "trainer.max_steps=2"))
    with pytest.raises(ConfigError, match=f"in use by another trainer \\(pid {os.getpid()} on host "):
        Trainer(cfg(tmp_path / "run", data, "trainer.max_steps=2"))
    first.fit()  # the first one is not disturbed, and releases the run dir
    Trainer(cfg(tmp_path / "run", data, "trainer.max_steps=2")).close()


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["run dir is a file", "checkpoints is a file"])
def test_an_unusable_run_dir_is_found_at_start_up(tmp_path, data, case):
    run = tmp_path / "run"
    if case == "run dir is a file":
        run.write_text("x")
        message = "is a file, not a directory"
    else:
        run.mkdir()
        (run / "checkpoints").write_text("x")
        message = "checkpoints is a file"
    with pytest.raises(ConfigError, match=message):
        Trainer(cfg(run, data))


def mount_tmpfs(path: Path, size: str, read_only: bool = False) -> None:
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"needs a small tmpfs (root): mount failed: {proc.stderr.strip()}")


@pytest.mark.e2e
def test_a_read_only_run_dir_is_found_at_start_up(tmp_path, data):
    run = tmp_path / "ro"
    mount_tmpfs(run, "1m", read_only=True)
    try:
        with pytest.raises(ConfigError, match="is not writable"):
            Trainer(cfg(run, data))
        # train.py: Hydra opens its log file in the run dir before the trainer's checks
        for run_dir in (run / "new",):
            proc = train_py(run_dir, data)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            assert proc.stderr.strip().splitlines() == [f"error: hydra.run.dir={run_dir}: cannot write in "
                                                        f"{run}: not writable (read-only file system); "
                                                        "choose another run dir or make it writable"]
    finally:
        subprocess.run(["umount", str(run)], check=True)


@pytest.mark.e2e
def test_a_full_disk_at_a_save_keeps_the_earlier_checkpoint(tmp_path, data, trained):
    size = sum(f.stat().st_size for f in ckpt(trained, 4).iterdir())
    run = tmp_path / "small"
    mount_tmpfs(run, str(int(1.5 * size) + 300_000))  # room for a checkpoint or two, not three
    try:
        trainer = Trainer(cfg(run, data, "trainer.max_steps=6", "trainer.checkpoint_every=2",
                              "trainer.keep_checkpoints=3"))
        with pytest.raises(RunError) as failure:
            trainer.fit()
        message = str(failure.value)
        failed = int(message.split("while saving checkpoint ")[1].split(";")[0].rsplit("_", 1)[1])
        assert message.startswith("no space left on device while saving checkpoint ") and failed in (4, 6)
        assert f"the newest complete checkpoint {ckpt(run, failed - 2)} is intact" in message
        kept = checkpoint.list_checkpoints(run / "checkpoints")
        assert [c.step for c in kept] == list(range(2, failed, 2))  # the partial one is gone, none lost
        assert all(c.complete and checkpoint.verify(c.path) == [] for c in kept)
    finally:
        subprocess.run(["umount", str(run)], check=True)


# ---- wandb online, unusable --------------------------------------------------------------------------------

@pytest.mark.unit
def test_wandb_online_without_credentials_is_one_line_at_once(tmp_path, monkeypatch):
    import wandb

    from kimi.config import WandbConfig
    from kimi.run.wandb_run import start_wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    t0 = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=r"^logging.wandb.mode=online, but wandb cannot start: No API "
                                              r"key configured.* Set WANDB_API_KEY "
                                              r".*logging.wandb.mode=offline"):
            start_wandb(WandbConfig(mode="online"), tmp_path, {}, "run-id")
    finally:
        wandb.teardown()
    assert time.monotonic() - t0 < 15


@pytest.mark.e2e
def test_wandb_online_without_network_logs_offline_with_a_warning(tmp_path, monkeypatch, capsys):
    """wandb itself against a closed local port (its failure once init_timeout has passed, shortened here):
    the offline fallback must start although wandb's service still holds the online attempt's run id."""
    import socket

    import wandb

    import kimi.run.wandb_run
    from kimi.config import WandbConfig
    from kimi.run.wandb_run import start_wandb
    from kimi.wandb_offline import run_file

    assert 0 < kimi.run.wandb_run.WANDB_ONLINE_TIMEOUT_S <= 30  # a network outage delays a start by no more
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setattr(kimi.run.wandb_run, "WANDB_ONLINE_TIMEOUT_S", 2.0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        run = start_wandb(WandbConfig(mode="online"), run_dir, {}, "run-id")
        run.log({"tokens": 1, "loss": 2.0})  # training goes on, logging offline
        run.finish()
    finally:
        wandb.teardown()
    out = capsys.readouterr().out.strip().splitlines()
    assert run.settings.mode == "offline" and run.id.startswith("run-id-offline-"), run.id
    assert len(out) == 1 and out[0].startswith("[kimi] warning: wandb's server did not answer within 2 s (")
    assert out[0].endswith(f"logging offline to {run_dir / 'wandb'} as run {run.id} instead; upload it with "
                           "`wandb sync` once the network is back"), out
    assert run_file(run_dir).parent.name.endswith(f"-{run.id}")


# ---- resume that says what it keeps ------------------------------------------------------------------------

@pytest.mark.e2e
def test_resume_lists_changed_settings_and_applies_the_new_ones(tmp_path, data, trained, capsys):
    run = copy_run(trained, tmp_path)
    capsys.readouterr()
    trainer = Trainer(cfg(run, data, "trainer.max_steps=8", "trainer.checkpoint_every=2", "optim.lr=2e-2",
                          "optim.weight_decay=0.2"))
    out = capsys.readouterr().out
    assert "3 setting(s) differ from the checkpoint's; this run's values apply:" in out
    for line in ("optim.lr: 0.01 -> 0.02", "optim.weight_decay: 0.1 -> 0.2", "trainer.max_steps: 4 -> 8"):
        assert line in out
    from kimi.optim import lr_multiplier

    for group in trainer.optimizer.param_groups:
        assert group["initial_lr"] == 2e-2
        assert group["lr"] == pytest.approx(2e-2 * lr_multiplier(4, trainer.cfg.optim, 8))
        assert group["weight_decay"] in (0.2, 0.0)
    trainer.close()


@pytest.mark.e2e
def test_resume_with_another_optimizer_is_refused(tmp_path, data, trained):
    run = copy_run(trained, tmp_path)
    with pytest.raises(ConfigError, match="it was trained with optim=muonclip"):
        Trainer(cfg(run, data, "optim=adamw"))


# ---- exit codes ------------------------------------------------------------------------------------------

def train_py(run: Path, data: list[str], *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}", *data, *TINY,
           "trainer.eval_every=0", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.e2e
def test_exit_codes_a_scheduler_can_read(tmp_path, data):
    run = tmp_path / "run"
    stopped = train_py(run, data, "trainer.max_steps=4", "trainer.stop_at_step=2")
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "stopped at step 2 (trainer.stop_at_step=2)" in stopped.stdout
    again = train_py(run, data, "trainer.max_steps=4", "trainer.stop_at_step=2")
    # nothing left to train is not a stop: a scheduler that requeues on 75 would requeue it forever
    assert again.returncode == 0 and "already at step 2, at or past trainer.stop_at_step=2" in again.stdout
    done = train_py(run, data, "trainer.max_steps=4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "exit_code").read_text() == "0\n"
    bad = train_py(run, data, "+trainer.max_stepz=3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("error: trainer.max_stepz is not a config key")
    assert checkpoint.latest_complete(run / "checkpoints").step == 4


STARTING = ("[kimi] SIGTERM with no training step under way (starting, or done): nothing to save, exiting "
            "with code 75. Run the same command again to continue")


def catches_sigterm(pid: int) -> bool:
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)$", Path(f"/proc/{pid}/status").read_text(), re.M)
    return bool(caught and int(caught.group(1), 16) & (1 << (signal.SIGTERM - 1)))


@pytest.mark.e2e
def test_sigterm_while_importing_exits_75_with_one_line(tmp_path, data):
    run = tmp_path / "run"
    run.mkdir()  # as the launch scripts make it, for exit_code
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}", *data, *TINY]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not catches_sigterm(job.pid):  # train.py's first statements: long before torch is imported
        assert job.poll() is None, job.communicate()
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 75 and out.strip().splitlines() == [STARTING], (out, err)
    assert "Traceback" not in err and (run / "exit_code").read_text() == "75\n"


# Libraries that train.py's start maps in, in this order: a signal sent as one appears lands inside its import
# (torch's, numpy's, pyarrow's for datasets, sentencepiece's)
START_POINTS = ("libtorch_cpu", "_multiarray_umath", "pyarrow", "sentencepiece")


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_anywhere_in_the_start_is_one_line_and_75(tmp_path, data):
    """The start-up handler ends the process itself: an exception raised from it inside library code (an
    import) could come out as that library's own error and traceback."""
    wrong = []
    for point in START_POINTS:
        run = tmp_path / point
        run.mkdir()
        cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}", *data, *TINY]
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
        while point not in Path(f"/proc/{job.pid}/maps").read_text():
            assert job.poll() is None, (point, job.communicate())
            time.sleep(0.005)
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=300)
        code = (run / "exit_code").read_text() if (run / "exit_code").exists() else None
        if job.returncode != 75 or out.strip().splitlines()[-1:] != [STARTING] or "Traceback" in err \
                or code != "75\n":
            wrong.append((point, job.returncode, code, out[-500:], err[-2000:]))
    assert not wrong, wrong


def leave_by_raising(code: int) -> None:
    """kimi.run.signals._leave for a handler run inside pytest's own process: SystemExit instead of
    os._exit."""
    raise SystemExit(code)


@pytest.mark.unit
def test_a_second_sigterm_during_the_start_exits_75_and_later_interrupts(monkeypatch, capsys):
    """A SIGTERM kept during the start (the run would stop after its first step) and then a second one: the
    start ends at once with code 75 (nothing is trained yet); once training, a second signal interrupts it."""
    stops = kimi.run.signals.StopSignals(lambda: (0, 0))
    monkeypatch.setattr(kimi.run.signals, "_leave", leave_by_raising)
    stops.catch(signal.SIGTERM)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.received == "SIGTERM"
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.value.code == 75 and capsys.readouterr().out.strip().splitlines()[-1] == STARTING
        stops.restore()  # the exit ignores further SIGTERMs while it leaves
        stops.catch(signal.SIGTERM)
        stops.starting = False
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stops.restore()


# train.py, with each checkpoint write first touching the file argv[1] and then taking 3 s (a save to slow
# storage), long enough for a second signal to arrive while it is written
SLOW_SAVE = ("import runpy, sys, time; from pathlib import Path\n"
             "from torch.distributed.checkpoint import filesystem\n"
             "write, saving = filesystem.FileSystemWriter.write_data, Path(sys.argv[1])\n"
             "def slow(self, plan, planner):\n"
             "    saving.touch(); time.sleep(3); return write(self, plan, planner)\n"
             "filesystem.FileSystemWriter.write_data = slow\n"
             "sys.argv = sys.argv[2:]\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.e2e
def test_a_second_sigterm_while_the_checkpoint_is_written_waits_for_it(tmp_path, data):
    run, saving = tmp_path / "run", tmp_path / "saving"
    cmd = [sys.executable, "-c", SLOW_SAVE, str(saving), str(ROOT / "train.py"), f"hydra.run.dir={run}",
           *data, *TINY, "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.max_steps=100000"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for sent, ready in enumerate([lambda: (run / "metrics.jsonl").exists() and
                                      any("loss" in r for r in read_metrics(run / "metrics.jsonl")),
                                      saving.exists]):
            while not ready():  # training under way; then the stop's checkpoint being written
                assert job.poll() is None, (sent, job.communicate())
                time.sleep(0.02)
            job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 75 and "Traceback" not in err, (out[-2000:], err[-3000:])
    assert (run / "exit_code").read_text() == "75\n"
    again = [line for line in out.splitlines() if "again while a checkpoint is being written" in line]
    stopped = re.search(r"\[kimi\] stopped at step (\d+) \(SIGTERM\)", out)
    assert len(again) == 1 and stopped, out[-2000:]
    last = checkpoint.latest_complete(run / "checkpoints")  # the stop's checkpoint, whole
    assert last.step == int(stopped.group(1)) and checkpoint.verify(last.path) == []


@pytest.mark.e2e
def test_sigterm_while_preparing_data_exits_75_at_once(tmp_path, data, monkeypatch, capsys):
    import kimi.trainer

    def signal_then_prepare(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("data preparation went on after SIGTERM")

    monkeypatch.setattr(kimi.trainer, "prepare", signal_then_prepare)
    monkeypatch.setattr(kimi.run.signals, "_leave", leave_by_raising)  # not this pytest process
    with pytest.raises(SystemExit) as stopped:
        Trainer(cfg(tmp_path / "run", data))
    assert stopped.value.code == 75 and STARTING in capsys.readouterr().out
    assert "error" not in (tmp_path / "run" / "train.log").read_text()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.undo()
    Trainer(cfg(tmp_path / "run", data)).close()  # the run dir was released


@pytest.mark.e2e
def test_nan_stop_is_one_line_and_exit_code_1(tmp_path, data, capsys):
    trainer = Trainer(cfg(tmp_path / "run", data, "trainer.max_steps=5"))
    trainer.model.register_forward_hook(lambda m, args, out: out * float("nan"))
    capsys.readouterr()  # the data preparation's progress, when this test prepares it
    assert run_main(trainer.fit) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: loss is nan at step 1: stopping before the update")


@pytest.mark.e2e
def test_an_infinite_gradient_stops_the_run_before_the_update_and_any_checkpoint(tmp_path, data, capsys):
    import torch

    run = tmp_path / "run"
    trainer = Trainer(cfg(run, data, "trainer.max_steps=5", "trainer.checkpoint_every=1"))
    weight = next(trainer.model.parameters())
    weight.register_hook(lambda g: torch.full_like(g, float("inf")) if trainer.step == 2 else g)
    before = {}
    real_step = trainer.engine.step
    trainer.engine.step = lambda *a, **k: before.update(
        {n: p.detach().clone() for n, p in trainer.model.named_parameters()}) or real_step(*a, **k)
    capsys.readouterr()
    assert run_main(trainer.fit) == 1
    err = capsys.readouterr().err.strip().splitlines()
    # fp32: no advice to use it
    assert err == [f"error: the gradient norm is inf at step 3: stopping before the update; the last "
                   f"complete checkpoint {ckpt(run, 2)} holds the weights that gave it: move it aside to "
                   f"resume from {ckpt(run, 1)}. Try a lower optim.lr or more optim.warmup_steps"]
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name  # the failing step updated nothing
    assert [c.step for c in checkpoint.list_checkpoints(run / "checkpoints")] == [1, 2]


@pytest.mark.unit
@pytest.mark.parametrize("saved, precision, expected", [
    ([], "bf16", "stopping before the update. Try a lower optim.lr or more optim.warmup_steps or "
                 "trainer.precision=fp32"),
    ([2, 4], "fp32", "the last complete checkpoint is {c4}. Try"),
    ([2, 5], "fp32", "the last complete checkpoint {c5} holds the weights that gave it: move it aside to "
                     "resume from {c2}. Try"),
    ([5], "fp32", "the only complete checkpoint, {c5}, holds the weights that gave it: start over. Try")])
def test_a_non_finite_value_names_a_checkpoint_that_can_help(tmp_path, saved, precision, expected):
    from kimi.run.divergence import check_finite

    for step in (*saved, 6):  # step 6: newer than the failing step (another run's): never named
        ckpt(tmp_path, step).mkdir(parents=True)
        (ckpt(tmp_path, step) / checkpoint.COMPLETE).write_text("{}")
    check_finite("loss", 1.5, 5, tmp_path / "checkpoints", precision)
    with pytest.raises(FloatingPointError) as stop:
        check_finite("loss", float("nan"), 5, tmp_path / "checkpoints", precision)
    message = str(stop.value)
    assert message.startswith("loss is nan at step 6: stopping before the update")
    assert expected.format(**{f"c{s}": ckpt(tmp_path, s) for s in saved}) in message
    assert message.endswith("fp32") == (precision != "fp32")


# ---- bounded hangs ---------------------------------------------------------------------------------------

def rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the torchrun worker with RANK=rank among parent's children."""
    for child in Path("/proc").glob("[0-9]*"):
        try:
            if int((child / "stat").read_text().split(")")[1].split()[1]) != parent:
                continue
            env = (child / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(child.name)
    return None


@pytest.mark.dist
def test_a_stopped_rank_ends_the_job_with_a_message(tmp_path, data):
    run, timeout = tmp_path / "run", 10
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), f"hydra.run.dir={run}", *data, *TINY, "parallel.dp_shard=2",
           "trainer.micro_batch_size=2", "trainer.eval_every=0", "trainer.max_steps=100000",
           "trainer.checkpoint_every=1", f"trainer.collective_timeout_s={timeout}"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 240
        while (checkpoint.latest_complete(run / "checkpoints")
               or checkpoint.CheckpointInfo(0, run, False)).step < 3:
            assert job.poll() is None and time.time() < deadline, job.communicate()
            time.sleep(0.2)
        pid = rank_pid(job.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        _, err = job.communicate(timeout=timeout + 60)
        waited = time.time() - stopped_at
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert waited < timeout + 30, waited
    assert f"rank 1 (pid {pid} on " in err and "made no progress for" in err, err[-3000:]
    assert "Last finished step per rank: 0: " in err
    latest = checkpoint.latest_complete(run / "checkpoints")
    assert latest.step >= 3 and checkpoint.verify(latest.path) == []


@pytest.mark.dist
def test_leaving_the_process_group_stops_a_watchdog_nobody_closed(tmp_path):
    """A script that never closes its Trainer (bench/plan_check.py did not) left the watchdog's thread reading
    the store while the process exited; under load it aborted the rank ("terminate called without an active
    exception"). destroy_distributed stops every running watchdog first."""
    import torch.distributed as dist

    from kimi.parallel import destroy_distributed
    from kimi.parallel.watchdog import Watchdog

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    dog = Watchdog(2.0).start()
    thread = dog._thread
    assert thread.is_alive()
    destroy_distributed()
    assert not thread.is_alive() and not dist.is_initialized()
