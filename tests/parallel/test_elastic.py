"""A rank killed mid-run under torchrun's elastic agent (`--max-restarts 1`): the agent stops the other rank
and restarts the group, the trainer resumes by itself from the newest complete checkpoint, and the run ends
with the weights and final loss of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import worker_pid
from layout_runs import ROOT, final_weights, metrics, overrides

from kimi import checkpoint

pytestmark = pytest.mark.dist

STEPS = ["trainer.max_steps=10", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2",
         "trainer.eval_every=10", "parallel.dp_shard=2", "trainer.micro_batch_size=2"]


def launch(run: Path, data: list[str], tag: str, restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", str(ROOT / "train.py"), f"hydra.run.dir={run}",
           *overrides(data, "muonclip", *STEPS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KIMI_TEST_TAG": tag}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_killed_rank_restarts_the_group_which_resumes_to_the_same_weights(data, tmp_path):
    whole = launch(tmp_path / "whole", data, uuid.uuid4().hex, restarts=0)
    out = whole.communicate(timeout=600)[0]
    assert whole.returncode == 0, out[-4000:]

    tag, run = uuid.uuid4().hex, tmp_path / "killed"
    job = launch(run, data, tag, restarts=1)
    deadline = time.monotonic() + 300
    while (checkpoint.latest_complete(run / "checkpoints") or type("", (), {"step": 0})).step < 3:
        assert job.poll() is None and time.monotonic() < deadline, "the run ended before step 3's checkpoint"
        time.sleep(0.05)
    pid = worker_pid(tag, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    out = job.communicate(timeout=600)[0]
    assert job.returncode == 0, out[-4000:]
    log = (run / "train.log").read_text()
    assert log.count("resum") >= 1, log[-3000:]  # the restarted group resumed from a checkpoint
    assert metrics(run)[0][-1] == metrics(tmp_path / "whole")[0][-1]
    got, want = final_weights(run, tmp_path), final_weights(tmp_path / "whole", tmp_path)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
