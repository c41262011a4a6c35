"""launch/slurm.sbatch on a stand-in for SLURM (srun runs its command here, scontrol names this host and
records requeues): it trains with one torchrun per node, and at SLURM's warning signal the ranks save a
checkpoint before the job requeues itself, so the next run resumes from it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import TINY_TRAINER, make_corpus

from kimi import checkpoint

ROOT = Path(__file__).resolve().parents[1]
FAKE_SRUN = '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
FAKE_SCONTROL = ('#!/usr/bin/env bash\nif [[ "$1" == show ]]; then echo localhost; '
                 'else echo "$*" >> "$SCONTROL_LOG"; fi\n')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def sbatch(tmp: Path, *overrides: str) -> subprocess.Popen:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    corpus = make_corpus(tmp / "corpus")
    files = ",".join(str(p) for p in sorted(corpus.glob("*.txt")))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1]",
           "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(ROOT), "RUN_DIR": str(tmp / "run"),
           "NPROC_PER_NODE": "2", "PYTHON": sys.executable, "MASTER_PORT": str(free_port()),
           "SCONTROL_LOG": str(tmp / "scontrol.log"), "OMP_NUM_THREADS": "1"}
    args = [*TINY_TRAINER, f"data.data_files=[{files}]", f"data.cache_dir={tmp / 'cache'}", "parallel.dp_shard=2",
            "trainer.micro_batch_size=2", "trainer.eval_every=0", *overrides]
    return subprocess.Popen(["bash", str(ROOT / "launch" / "slurm.sbatch"), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def test_slurm_script_saves_and_requeues_on_the_time_limit_signal(tmp_path):
    job = sbatch(tmp_path, "trainer.max_steps=100000", "trainer.checkpoint_every=0")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and any("loss" in json.loads(x) for x in metrics.read_text().splitlines())):
        assert job.poll() is None and time.time() < deadline, job.communicate()[0][-3000:]
        time.sleep(0.5)
    job.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 sends to the batch shell
    out = job.communicate(timeout=240)[0]
    saved = checkpoint.latest_complete(tmp_path / "run" / "checkpoints")
    assert saved is not None and saved.step >= 1, out[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]

    # the requeued job: same run directory, resumes and finishes
    again = sbatch(tmp_path, f"trainer.max_steps={saved.step + 2}", "trainer.checkpoint_every=0")
    out = again.communicate(timeout=240)[0]
    assert again.returncode == 0, out[-3000:]
    assert f"resumed from {saved.path} at step {saved.step}" in out
    assert checkpoint.latest_complete(tmp_path / "run" / "checkpoints").step == saved.step + 2
