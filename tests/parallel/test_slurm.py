"""launch/slurm.sbatch on a real SLURM: Debian's slurm-wlm 22.05 as a one-node cluster on this machine, which
tests/slurm/start.sh installs (apt-get) and starts (munged, slurmctld, slurmd); the module is skipped only
where that cannot be done (not root, no apt-get, the install failed). Every job is the README's CPU-cluster
sbatch line with a tiny run's overrides appended:

- it trains what one process trains (losses and weights);
- cut by its time limit, it gets SLURM's signal, its ranks save, it requeues itself, and the requeued run
  resumes and ends with the losses and weights of an uninterrupted torchrun run, bit for bit;
- `scancel` leaves the newest complete checkpoint intact, and a resubmission resumes from it;
- a job that keeps stopping is requeued MAX_REQUEUES times, then ends (and, without SLURM, with stand-ins for
  srun, scontrol and torchrun: the script's signal forward by pid and its requeue decisions).

SLURM checks time limits every 30 s, so the warning of `--time=2 --signal=B:TERM@65` comes at the first check
from 25 s into the job: 25-55 s in. To know which step it lands on and keep the runs short, the test holds
the two ranks (SIGSTOP) once they train, until SLURM's SIGTERM, passed on by the script and torchrun, is
pending in both, and then lets them go on: they finish the step and save, as at any signal mid-step. The
requeued job would get the same warning 25-55 s into its own run, before it trains on a slow or busy
machine: while it waits to start again, the test raises its limit (scontrol update, as an operator may), so
that it runs to the end."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from helpers import MEASURE_CPU, free_port, worker_pid
from layout_runs import ROOT, assert_same_run, final_weights, metrics, overrides, torchrun

from kimi import checkpoint

pytestmark = pytest.mark.dist

START = ROOT / "tests" / "slurm" / "start.sh"
CLUSTER_DIR = Path(os.environ.get("KIMI_SLURM_DIR", "/tmp/kimi-slurm"))
UNAVAILABLE = 77  # start.sh's exit code when SLURM cannot run here
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def readme_sbatch() -> tuple[list[str], list[str]]:
    """The README's CPU-cluster sbatch line: (its words up to the script, the overrides after it)."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"`(sbatch --gpus-per-node=0 [^`]*launch/slurm\.sbatch[^`]*)`", text)
    assert match, "README.md has no `sbatch --gpus-per-node=0 ... launch/slurm.sbatch ...` line"
    words = shlex.split(match.group(1))
    at = words.index("launch/slurm.sbatch")
    return words[:at + 1], words[at + 1:]


class Cluster:
    """sbatch, scontrol and scancel on the cluster of SLURM_CONF (it has no accounting: no sacct)."""

    def __init__(self, conf: str):
        self.env = {**os.environ, "SLURM_CONF": conf, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
        self.jobs: list[str] = []
        self.outputs: dict[str, Path] = {}

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)

    def submit(self, tmp: Path, run: Path, extra: list[str], *options: str, **env: str) -> str:
        """The README's line from the repository root, with `options` before the script and `extra`
        overrides after the README's; the run dir is `run` ($RUN_DIR), the job's output tmp/slurm-<id>.out."""
        line, readme_overrides = readme_sbatch()
        cmd = [*line[:-1], "--parsable", "--job-name=kimi-test", f"--output={tmp}/slurm-%j.out",
               "--open-mode=append", *options, line[-1], *readme_overrides, *extra]
        env = {**self.env, "RUN_DIR": str(run), "MASTER_PORT": str(free_port()), **env}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stdout}{proc.stderr}"
        job = proc.stdout.strip().split(";")[0]
        self.jobs.append(job)
        self.outputs[job] = tmp / f"slurm-{job}.out"
        return job

    def state(self, job: str) -> Optional[dict]:
        """JobState, Restarts, StartTime, ... while scontrol knows the job (until MinJobAge after its end)."""
        proc = self.run("scontrol", "-o", "show", "job", job)
        return dict(re.findall(r"(?:^| )(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else None

    def running(self, job: str) -> bool:
        """Not ended (states such as SIGNALING come and go; a failed query counts as not ended)."""
        return (self.state(job) or {}).get("JobState") not in ENDED

    def wait(self, job: str, until: Callable[[dict], bool], timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job)
            if state is not None and until(state):
                return state
            assert time.monotonic() < deadline, f"job {job} not {what} in {timeout:.0f} s\n{self.report(job)}"
            time.sleep(0.25)

    def finished(self, job: str, timeout: float = 240) -> dict:
        return self.wait(job, lambda s: s["JobState"] in ENDED, timeout, "finished")

    def output(self, job: str) -> str:
        path = self.outputs[job]
        return path.read_text(errors="replace") if path.exists() else ""

    def report(self, job: str) -> str:
        """What to read when a job did not do what it should: its state, its output and slurmctld's log."""
        log = CLUSTER_DIR / "log" / "slurmctld.log"
        ctld = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else ""
        return (f"state: {self.state(job)}\n--- job output (end) ---\n{self.output(job)[-5000:]}\n"
                f"--- slurmctld.log (end) ---\n{ctld}")

    def cancel_all(self) -> None:
        if self.jobs:
            self.run("scancel", *self.jobs)


@pytest.fixture(scope="module")
def slurm():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("the README's line asks for 2 CPUs (--cpus-per-task=2); this machine has 1")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(START), str(CLUSTER_DIR)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=1200)
    reason = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
    if proc.returncode == UNAVAILABLE:
        pytest.skip(reason)
    assert proc.returncode == 0, f"tests/slurm/start.sh exited {proc.returncode}: {proc.stderr[-3000:]}"
    conf, status = proc.stdout.split()[:2]
    print(f"\n[slurm] {status} in {time.monotonic() - t0:.1f} s: {proc.stderr.strip()}")
    cluster = Cluster(conf.split("=", 1)[1])
    cluster.run("scancel", "--name=kimi-test")  # jobs left by an earlier session would hold the node
    yield cluster
    cluster.cancel_all()
    if status == "started":  # stop the daemons this module started; a cluster that was already up stays up
        subprocess.run(["bash", str(START), "--stop", str(CLUSTER_DIR)], capture_output=True, timeout=120)


def trains(run: Path) -> bool:
    """Whether metrics.jsonl has a training loss: the ranks are past step 1."""
    path = run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            if "loss" in json.loads(line):
                return True
        except ValueError:  # a line being written
            pass
    return False


def pending_sigterm(pid: int) -> bool:
    """Whether process `pid` has a SIGTERM waiting (sent to it while it is stopped)."""
    masks = re.findall(r"^(?:ShdPnd|SigPnd):\s*([0-9a-f]+)$", Path(f"/proc/{pid}/status").read_text(), re.M)
    return any(int(m, 16) & (1 << (signal.SIGTERM - 1)) for m in masks)


def test_the_readme_sbatch_line_trains_what_one_process_trains(slurm, tmp_path, data, references):
    run = tmp_path / "run"
    job = slurm.submit(tmp_path, run, overrides(data, "muonclip", "trainer.micro_batch_size=2"))
    state = slurm.finished(job)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "0", slurm.report(job)
    assert_same_run(run, references("muonclip"), tmp_path)


def test_a_job_cut_by_its_time_limit_saves_requeues_and_ends_like_an_uninterrupted_run(slurm, tmp_path, data):
    steps = 12
    run, whole, tag = tmp_path / "run", tmp_path / "whole", uuid.uuid4().hex
    settings = ["trainer.micro_batch_size=2", "model.num_layers=2", "trainer.checkpoint_every=0",
                f"trainer.max_steps={steps}", f"trainer.eval_every={steps}"]
    extra = overrides(data, "muonclip", *settings)
    job = slurm.submit(tmp_path, run, extra, "--time=2", "--signal=B:TERM@65", KIMI_TEST_TAG=tag)
    with ThreadPoolExecutor(1) as pool:
        deadline, ranks = time.monotonic() + 120, [None, None]
        while not (all(ranks) and trains(run)):  # once both ranks train, hold them
            assert time.monotonic() < deadline and slurm.running(job), f"no training\n{slurm.report(job)}"
            ranks = [ranks[i] or worker_pid(tag, i) for i in range(2)]
            time.sleep(0.05)
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        held, start = time.monotonic(), (slurm.state(job) or {}).get("StartTime")
        # meanwhile, on the idle CPUs: the same run uninterrupted, under a plain torchrun
        reference = pool.submit(torchrun, 2, whole, [*readme_sbatch()[1], *extra])
        try:  # SLURM's signal: to the batch script, which passes it to torchrun, which passes it to the ranks
            while not all(pending_sigterm(pid) for pid in ranks):
                assert time.monotonic() - held < 90 and slurm.running(job), \
                    f"no SIGTERM reached the ranks\n{slurm.report(job)}"
                time.sleep(0.05)
            signalled = time.monotonic()
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        slurm.wait(job, lambda s: s["Restarts"] != "0", 180, "requeued")
        lift = slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
        assert lift.returncode == 0, lift.stderr
        state = slurm.finished(job)
        reference.result()
    print(f"\n[slurm] job started {start}; SIGTERM reached the ranks {signalled - held:.0f} s after step 1")
    out = slurm.output(job)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", slurm.report(job)
    stopped = re.search(r"\[kimi\] stopped at step (\d+) \(SIGTERM\)", out)
    assert stopped, slurm.report(job)
    step = int(stopped.group(1))
    saved = checkpoint.step_dir(run / "checkpoints", step)
    assert f"resumed from {saved} at step {step}" in out, slurm.report(job)
    assert metrics(run) == metrics(whole) and len(metrics(run)[0]) == steps
    got, want = final_weights(run, tmp_path), final_weights(whole, tmp_path)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_scancel_keeps_the_newest_complete_checkpoint_and_a_resubmission_resumes(slurm, tmp_path, data):
    run = tmp_path / "run"
    extra = overrides(data, "muonclip", "trainer.micro_batch_size=2", "model.num_layers=2",
                      "trainer.max_steps=1000", "trainer.eval_every=0", "trainer.checkpoint_every=1")
    job = slurm.submit(tmp_path, run, extra)
    deadline = time.monotonic() + 120
    while checkpoint.latest_complete(run / "checkpoints") is None:
        assert time.monotonic() < deadline and slurm.running(job), f"no checkpoint\n{slurm.report(job)}"
        time.sleep(0.05)
    cancel = slurm.run("scancel", job)
    assert cancel.returncode == 0, cancel.stderr
    state = slurm.finished(job, timeout=120)
    assert state["JobState"] == "CANCELLED" and state["Restarts"] == "0", slurm.report(job)  # not requeued

    notes: list[str] = []
    intact = checkpoint.newest_intact(run / "checkpoints", log=notes.append)
    assert intact is not None and checkpoint.verify(intact.path) == [], notes
    again = slurm.submit(tmp_path, run, [*extra, f"trainer.max_steps={intact.step + 2}"])
    state = slurm.finished(again)
    assert state["JobState"] == "COMPLETED", slurm.report(again)
    assert f"resumed from {intact.path} at step {intact.step}" in slurm.output(again), slurm.report(again)
    assert checkpoint.latest_complete(run / "checkpoints").step == intact.step + 2


# ---- the script's own logic ----------------------------------------------------------------------------
# A torchrun stand-in, reached through a path with a space (the old forward matched a command-line pattern
# that such a path broke), so that the script's signal forward and requeue decisions take a second: it
# records its start and each SIGTERM, and a SIGTERM (or FAKE_EXIT at once) ends it as the trainer ends under
# torchrun (exit 0, the trainer's code in <run dir>/exit_code). The real chain (torchrun, ranks, checkpoint)
# is the time-limit test's above.

FAKE_TORCHRUN = """#!/usr/bin/env bash
for a; do [[ $a == hydra.run.dir=* ]] && run="${a#hydra.run.dir=}"; done
trap 'echo TERM >> "$run/agent.log"; echo 75 > "$run/exit_code"; exit 0' TERM
echo "started $*" >> "$run/agent.log"
if [[ -n ${FAKE_EXIT:-} ]]; then echo "$FAKE_EXIT" > "$run/exit_code"; exit 0; fi
while :; do sleep 0.05; done
"""
FAKE_SRUN = """#!/usr/bin/env bash
while [[ $1 == --* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") echo localhost ;;
  "show job") echo "JobId=$3 JobState=RUNNING" ;;
  "requeue "*) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
esac
"""


def fake_tools(tmp: Path, slurm: bool) -> dict:
    """The environment for the torchrun stand-in as $PYTHON; without `slurm`, also `srun` (which runs its
    command here) and `scontrol` (which answers what the script asks and logs a requeue) on the PATH."""
    tools = [("python", FAKE_TORCHRUN, "python env")]
    tools += [] if slurm else [("srun", FAKE_SRUN, "bin"), ("scontrol", FAKE_SCONTROL, "bin")]
    for name, text, where in tools:
        (tmp / where).mkdir(exist_ok=True)
        (tmp / where / name).write_text(text)
        (tmp / where / name).chmod(0o755)
    env = {"PYTHON": str(tmp / "python env" / "python")}
    return env if slurm else {**env, "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}",
                              "FAKE_SLURM_LOG": str(tmp / "slurm.log")}


def test_the_script_forwards_its_signal_by_pid_and_caps_its_requeues(tmp_path):
    job_id, run, log = str(uuid.uuid4().int % 10**9), tmp_path / "run", tmp_path / "slurm.log"
    env = {**os.environ, **fake_tools(tmp_path, slurm=False), "SLURM_JOB_ID": job_id, "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_SUBMIT_DIR": str(ROOT), "RUN_DIR": str(run),
           "MAX_REQUEUES": "2"}

    def sbatch(**more: str) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(ROOT / "launch" / "slurm.sbatch"), "trainer.max_steps=9"],
                                env={**env, **more}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def agent_log() -> list[str]:
        return (run / "agent.log").read_text().splitlines() if (run / "agent.log").exists() else []

    job = sbatch(SLURM_RESTART_COUNT="0")
    deadline = time.monotonic() + 30
    while not agent_log():
        assert time.monotonic() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)
    assert agent_log()[0].endswith("train.py hydra.run.dir=" + str(run) + " trainer.max_steps=9")
    job.send_signal(signal.SIGTERM)  # to the batch script alone, as --signal=B:TERM does
    out, err = job.communicate(timeout=60)
    assert job.returncode == 75 and agent_log()[1:] == ["TERM"], (out, err)  # passed on, once
    assert log.read_text() == f"requeue {job_id}\n"
    assert not Path(f"/tmp/kimi-agent-{job_id}.pid").exists()

    for restarts, code, requeued in (("1", "75", True), ("2", "75", False), ("0", "0", False),
                                     ("0", "2", False)):
        log.unlink(missing_ok=True)
        job = sbatch(SLURM_RESTART_COUNT=restarts, FAKE_EXIT=code)
        out, err = job.communicate(timeout=60)
        assert job.returncode == int(code), (restarts, code, out, err)
        assert log.exists() == requeued, (restarts, code)
        capped = restarts == "2"
        assert (f"error: not requeueing job {job_id}: it was requeued 2 times (MAX_REQUEUES=2); "
                "submit it again"
                in err) == capped, err


def test_a_job_that_keeps_stopping_requeues_max_requeues_times(slurm, tmp_path):
    """On a real SLURM: SLURM_RESTART_COUNT counts the requeues, and the script stops requeueing at the
    cap."""
    run = tmp_path / "run"
    job = slurm.submit(tmp_path, run, [], MAX_REQUEUES="1", FAKE_EXIT="75",
                       **fake_tools(tmp_path, slurm=True))
    state = slurm.finished(job, timeout=180)
    assert state["Restarts"] == "1" and state["JobState"] != "COMPLETED", slurm.report(job)
    assert len((run / "agent.log").read_text().splitlines()) == 2, slurm.report(job)
    assert f"error: not requeueing job {job}: it was requeued 1 times (MAX_REQUEUES=1)" in slurm.output(job)


@pytest.mark.slow
def test_the_plans_measure_runs_its_layouts_under_srun_inside_an_allocation(slurm, tmp_path, data):
    """kimi.plan measure=1 in a batch job (kimi/plan/measure.py): the layout trains under srun, one torchrun
    per node of the plan (this cluster's one node, 2 ranks) meeting at the allocation's first node; the ranks'
    results land in runs/plan_measure_<job id> of the job's directory; the measured peak is within 10% of the
    plan's, as under a plain torchrun (tests/plan/test_plan_measure.py). Several nodes: no such cluster
    here."""
    plan = tmp_path / "plan.json"
    args = ["model=tiny", "cluster.gpus=2", "cluster.gpus_per_node=2", "cluster.peak_flops=1e11",
            "cluster.hbm_bytes=1e9", "trainer.tokens_per_step=256", "top=1", "measure=1", f"json={plan}",
            *MEASURE_CPU, *data]
    cmd = ["sbatch", "--parsable", "--job-name=kimi-test", "--nodes=1", "--ntasks-per-node=1",
           "--cpus-per-task=2", f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%j.out",
           "--wrap", shlex.join([sys.executable, "-m", "kimi.plan", *args])]
    proc = subprocess.run(cmd, env={**slurm.env, "MASTER_PORT": str(free_port())}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    slurm.jobs.append(job)
    slurm.outputs[job] = tmp_path / f"slurm-{job}.out"
    state = slurm.finished(job, timeout=600)
    assert state["JobState"] == "COMPLETED", slurm.report(job)
    out = slurm.output(job)
    assert f"Measured in SLURM job {job}: 2 ranks, 1 node(s) x 2, under srun and torchrun" in out, out[-3000:]
    measured = json.loads(plan.read_text())["measured"]
    assert measured[0]["error"] is None and 0.9 <= measured[0]["ratio"] <= 1.1, measured
    work = tmp_path / "runs" / f"plan_measure_{job}" / "layout1"
    assert sorted(p.name for p in work.glob("rank*.json")) == ["rank0.json", "rank1.json"]


@pytest.mark.slow
def test_prepare_in_parts_as_a_datatrove_slurm_array_gives_the_single_process_bytes(tmp_path, offline, slurm):
    """data.prepare_executor=slurm (kimi/data/prepare/executor.py): datatrove submits the workers as an array
    job and the merge as a job after it; the merged files are the single-process preparation's (30-60 s)."""
    from prepare_problem import prepare, prepare_overrides, prepared_dir, uneven_corpus

    corpus = uneven_corpus(tmp_path / "corpus")
    single = prepare_overrides(corpus, tmp_path / "single")
    assert prepare(*single) == 0
    partition = slurm.run("sinfo", "-h", "-o", "%R").stdout.split()[0]
    name = "kimi-prepare-test"  # not kimi-test: the fixture cancels those when it starts
    overrides = [*prepare_overrides(corpus, tmp_path / "parts"), "data.prepare_workers=2",
                 "data.prepare_executor=slurm", f"+data.prepare_executor_args.partition={partition}",
                 "+data.prepare_executor_args.time=00:10:00",
                 f"+data.prepare_executor_args.job_name={name}",
                 f"+data.prepare_executor_args.slurm_logs_folder={tmp_path / 'logs'}"]
    env = {**os.environ, "SLURM_CONF": slurm.env["SLURM_CONF"], "OMP_NUM_THREADS": "1"}
    submitted = subprocess.run([sys.executable, "-m", "kimi.data.prepare", *overrides], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=300)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    assert "[data] submitted 2 worker task(s) and a merge job" in submitted.stdout
    data_dir = prepared_dir(overrides)
    deadline = time.monotonic() + 300
    try:
        while (slurm.run("squeue", "-h", f"--name={name},{name}-merge").stdout.strip()
               or not (data_dir / "manifest.json").exists()):
            logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.out"))
            assert time.monotonic() < deadline, f"the jobs did not finish in 300 s:\n{logs[-3000:]}"
            time.sleep(2)
    finally:
        slurm.run("scancel", f"--name={name},{name}-merge")
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.out")))
    assert "[data] worker 1/2 done" in logs and "[data] parts: 2/2 workers done" in logs
    merged = {p.name: p.read_bytes() for p in data_dir.iterdir() if p.name not in (".lock", "parts-2")}
    # what stays of the parts: the merge job's own datatrove log, written after the merge
    assert [p.name for p in (data_dir / "parts-2").iterdir()] == ["datatrove-merge"]
    reference = {p.name: p.read_bytes() for p in prepared_dir(single).iterdir() if p.name != ".lock"}
    assert sorted(merged) == sorted(reference)
    assert all(merged[f] == reference[f] for f in reference)
