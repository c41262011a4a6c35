"""measure=K: the plan's best layouts launched for a few steps on the machines it runs on, ranked by what they
did.

    python -m kimi.plan model=small cluster.gpus=4 ... trainer.device=cpu measure=2
    sbatch --nodes=2 --gpus-per-node=8 --wrap ".venv/bin/python -m kimi.plan model=1b cluster.gpus=16 ..."

Each layout's printed overrides train through the trainer itself, one process per GPU of the plan: under
torchrun on this machine (one node), or, inside a SLURM allocation (sbatch, salloc), under srun starting one
torchrun per node of the plan, meeting at the allocation's first node (as launch/slurm.sbatch trains). Step 1
makes the optimizer state, step 2's peak is measured (each rank's, as bench/plan_check.py measures it: under
torch's MemTracker, or by the allocator for a compiled layout, tracked_peak), step 3 is timed (tokens/s). A
layout that fails (out of memory, a rule the planner's checks missed, a crash) is reported with its error
line and the next one in the plan's order is tried, until K have run. With measure_layers=N the runs take
model.num_layers=N (depth-reduced, said so in the output) and their memory is predicted again for that
depth; the real model otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from kimi.parallel.engine_rules import DEEPSPEED

STEPS = 3  # the state's step, the measured peak's step, the timed step
TIMEOUT_S = 3600  # one layout's launch: a hang guard, not a budget


# ---- the peak, as bench/plan_check.py measures it ----------------------------------------------------------
def tracker():
    """torch's MemTracker, which also tolerates a module called twice in one step (a pipeline stage's
    micro-batches): it refuses that for its per-module statistics, and only the totals are read here."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                pass

    return Tracker()


def peak_split(mem, device) -> Dict[str, int]:
    """MemTracker's split at the peak on `device`, by category name (PARAM, GRAD, OPT, ACT, TEMP, ...)."""
    peak = mem.get_tracker_snapshot("peak")
    snap = peak.get(device) or next(iter(peak.values()), {})
    return {str(k).rsplit(".", 1)[-1]: v for k, v in snap.items()}


def tracked_peak(step, model, optimizer, device, compiled: bool = False) -> Dict[str, int]:
    """Two training steps (`step()`): one that makes the optimizer state, then one measured; the second's
    split at its peak on `device` (what this module and bench/plan_check.py compare with the memory model).
    An eager step is measured under MemTracker, which follows `model` and `optimizer`. A compiled one
    (parallel.compile) is measured by the allocator (allocator_peak): under any dispatch mode torch.compile's
    regions run their eager path, in that step and in every later one (tests/plan/test_plan_measure.py: a
    compiled step measured after a MemTracker step keeps what the eager step keeps)."""
    step()  # the optimizer state exists from here on
    if compiled:
        return allocator_peak(step, model, optimizer, device)
    mem = tracker()
    # the buffers the optimizer keeps between steps are alive from the step's start: tracked as "other" (the
    # one kind of tensor passed here), counted with the optimizer's state
    mem.track_external(model, optimizer, *kept_buffers(optimizer))
    with mem:
        step()
    split = peak_split(mem, device)
    split["OPT"] = split.get("OPT", 0) + split.pop("OTH", 0)
    return split


def kept_buffers(optimizer) -> list:
    """What `optimizer` keeps from one step to the next beside its state (MuonClip's Newton-Schulz buffers on
    the CPU, kimi/optim/muonclip.py; none for the others)."""
    keeps = getattr(optimizer, "kept_buffers", None)
    return keeps() if callable(keeps) else []


def allocator_peak(step, model, optimizer, device) -> Dict[str, int]:
    """One step measured without a dispatch mode, in MemTracker's terms: the parameters (PARAM), gradients
    (GRAD) and optimizer state (OPT, with the buffers it keeps between steps) alive at its start, and ACT,
    the most the step allocated at once beyond what it started with (activations, the gradients it makes,
    temporaries). What was alive before the step besides those (the batch, the loader's buffers) is left
    out, as MemTracker leaves it. CUDA: the caching allocator's peak statistic; CPU: the profiler's memory
    timeline of the step."""
    import torch

    params = list(model.parameters())
    state = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    start = {"PARAM": _bytes(params), "GRAD": _bytes(p.grad for p in params if p.grad is not None),
             "OPT": _bytes([*state, *kept_buffers(optimizer)])}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        rise = torch.cuda.max_memory_allocated(device) - before
    else:
        rise = _profiled_rise(step)
    return {**start, "ACT": rise, "Total": sum(start.values()) + rise}


def _bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors` (a DTensor's local shard)."""
    from kimi.optim.owners import local_tensor

    sizes = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def _profiled_rise(step) -> int:
    """The most bytes a CPU step had allocated at once beyond what it held at its start: the profiler's
    memory timeline, which sees the allocations inside compiled regions and leaves them compiled."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as work, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA, where the snapshots replace it
        path = os.path.join(work, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        _, sizes = json.loads(Path(path).read_text())
    totals = [sum(by_category) for by_category in sizes]
    return max(totals) - totals[0] if totals else 0


def peak_bytes(split: Dict[str, int]) -> int:
    return sum(v for k, v in split.items() if k != "Total")


# ---- one rank, under torchrun ------------------------------------------------------------------------------
def worker(out: Path, overrides: Sequence[str]) -> None:
    import torch

    from kimi.parallel import destroy_distributed
    from kimi.summary import compose_config
    from kimi.trainer import Trainer

    run = Path(tempfile.mkdtemp(prefix="kimi_plan_measure_"))
    trainer = Trainer(compose_config([*overrides, f"trainer.run_dir={run}"]))
    split = tracked_peak(trainer.train_step, trainer.engine.model, trainer.engine.optimizer, trainer.device,
                         trainer.cfg.parallel.compile)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    trainer.train_step()
    sync()
    seconds = time.perf_counter() - start
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps({"peak": split, "step_s": seconds}))
    trainer.close()  # its watchdog thread stopped before the process group goes
    destroy_distributed()
    shutil.rmtree(run, ignore_errors=True)  # the run's own files (its log, metrics): not what is measured


# ---- the launches ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Measured:
    index: int  # the layout's place in the plan (1-based)
    label: str
    predicted_tokens_per_s: float
    predicted_peak: int  # bytes, the heaviest rank (re-sized for a depth-reduced run)
    tokens_per_s: float = 0.0
    peak: int = 0  # bytes, the heaviest rank's measured peak
    split: Dict[str, int] = dataclasses.field(default_factory=dict)
    error: Optional[str] = None  # why it did not run

    @property
    def ratio(self) -> float:
        return self.predicted_peak / self.peak if self.peak else 0.0


def error_line(text: str, code: int) -> str:
    """The first line that says what went wrong on a rank (torchrun's own summary lines skipped)."""
    keys = ("OutOfMemoryError", "out of memory", "ConfigError", "Error:", "error:")
    for line in text.splitlines():
        if any(k in line for k in keys) and "ChildFailedError" not in line:
            return line.strip()[:300]
    return f"torchrun exited {code}"


@dataclasses.dataclass(frozen=True)
class Launcher:
    """How the ranks of one layout start: `nodes` torchruns of `per_node` ranks each; inside SLURM job `job`,
    by srun, meeting at its first node `head`, else as one torchrun here."""

    nodes: int
    per_node: int
    job: Optional[str] = None  # the SLURM job id; None: one torchrun on this machine
    head: str = ""
    port: int = 29500  # the first layout's rendezvous port (MASTER_PORT); each layout takes the next
    cpus_per_task: Optional[str] = None  # the allocation's (SLURM_CPUS_PER_TASK)

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    def describe(self) -> str:
        if self.job is None:
            return f"Measured on this machine: {self.ranks} ranks under torchrun"
        return (f"Measured in SLURM job {self.job}: {self.ranks} ranks, {self.nodes} node(s) x "
                f"{self.per_node}, under srun and torchrun")

    def command(self, worker: Sequence[str], index: int) -> List[str]:
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={self.per_node}"]
        if self.job is None:
            return [*torchrun, "--standalone", *worker]
        # SLURM 22.05 stopped passing the allocation's CPUs per task on to srun: ask for them again
        cpus = [f"--cpus-per-task={self.cpus_per_task}"] if self.cpus_per_task else []
        # one port per layout: a rendezvous store's port may still be in TIME_WAIT after the previous launch
        return ["srun", f"--nodes={self.nodes}", f"--ntasks={self.nodes}", "--ntasks-per-node=1", *cpus,
                "--kill-on-bad-exit=1", *torchrun, f"--nnodes={self.nodes}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={self.head}:{self.port + index}", f"--rdzv_id=kimi-plan-{self.job}-{index}",
                *worker]

    def work_dir(self) -> Path:
        """Where the ranks write their results when measure_dir is not given: under srun, runs/ of the
        directory kimi.plan runs in (every node must see it, as launch/slurm.sbatch's run directories)."""
        if self.job is None:
            return Path(tempfile.mkdtemp(prefix="kimi_plan_measure_"))
        return Path(f"runs/plan_measure_{self.job}").resolve()


def launcher(gpus: int, gpus_per_node: int, how: str, env: Dict[str, str]) -> Launcher:
    """The launcher of measure=K for a plan of `gpus` GPUs, `gpus_per_node` per node. how: auto (srun inside a
    SLURM allocation, torchrun otherwise), torchrun or srun. A plan that cannot run here is a ConfigError."""
    from kimi.errors import ConfigError

    nodes, per_node = max(gpus // gpus_per_node, 1), min(gpus, gpus_per_node)
    inside = "SLURM_JOB_ID" in env and "SLURM_JOB_NODELIST" in env
    if how == "auto":
        how = "srun" if inside else "torchrun"
    if how == "torchrun":
        if nodes > 1:
            raise ConfigError(f"measure runs cluster.gpus={gpus} processes on this machine, one node: plan "
                              f"for at most cluster.gpus_per_node={gpus_per_node} GPUs to measure, run it "
                              f"inside a SLURM allocation of {nodes} nodes (sbatch --nodes={nodes}), or "
                              "leave measure out")
        return Launcher(1, per_node)
    if not inside:
        raise ConfigError("measure_launcher=srun runs inside a SLURM allocation (sbatch or salloc): no "
                          "SLURM_JOB_ID here; use measure_launcher=torchrun for this machine")
    job = env["SLURM_JOB_ID"]
    have = int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")))
    if nodes > have:
        raise ConfigError(f"the plan's cluster.gpus={gpus} at cluster.gpus_per_node={gpus_per_node} is "
                          f"{nodes} nodes; SLURM job {job} has {have}: allocate {nodes} nodes or plan for "
                          "fewer GPUs")
    head = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], text=True,
                          capture_output=True, check=True, timeout=60).stdout.split()[0]
    return Launcher(nodes, per_node, job, head, int(env.get("MASTER_PORT", 29500)),
                    env.get("SLURM_CPUS_PER_TASK"))


def launch(overrides: Sequence[str], how: Launcher, work: Path, index: int = 1,
           timeout: float = TIMEOUT_S) -> Dict[str, Any]:
    """Train `overrides` on `how`'s ranks: {"ranks": [each rank's peak split and step_s]} or {"error": its
    line}. `work` is where the ranks write their results: under srun, storage every node sees."""
    work.mkdir(parents=True, exist_ok=True)
    cmd = how.command(["-m", "kimi.plan.measure", "--worker", str(work), "--", *overrides], index)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default for several processes per machine
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    files = [work / f"rank{r}.json" for r in range(how.ranks)]
    if not all(f.exists() for f in files):  # a rank stopped before its measurement
        return {"error": error_line(proc.stderr + proc.stdout, proc.returncode)}
    # every rank measured: a failure after that (at the process group's teardown) does not undo it
    return {"ranks": [json.loads(f.read_text()) for f in files]}


def measure(plan, cfg, overrides: Sequence[str], how: Launcher, k: int, layers: Optional[int] = None,
            work: Optional[Path] = None, log=print) -> List[Measured]:
    """Launch the plan's layouts in its order until `k` have run (or none are left); each result, those that
    failed too, in launch order. `overrides`: the user's training overrides (the layouts' are added); `work`:
    where the ranks write (`how.work_dir()` if None)."""
    from kimi.summary import compose_config

    from .layout import apply
    from .memory import memory_per_rank

    reduced = [f"model.num_layers={layers}"] if layers else []
    root = work or how.work_dir()
    done, out = 0, []
    for i, e in enumerate(plan.best, 1):
        if done == k:
            break
        args = [*overrides, *e.layout.overrides(), *reduced]
        predicted = e.peak
        if layers:  # the memory model again, for the depth that runs
            predicted = sum(memory_per_rank(apply(compose_config([*overrides, *reduced]), e.layout)).values())
        if e.layout.shape.engine == DEEPSPEED:
            # DeepSpeed makes its fp32 partitions and the optimizer's state at initialisation, out of the
            # tracked module's and optimizer's reach: MemTracker sees neither (bench/plan_check.py)
            predicted -= e.memory["optimizer"]
        m = Measured(i, e.layout.label(), e.tokens_per_s, predicted)
        log(f"[measure] #{i} {m.label}: training {STEPS} steps on {how.ranks} ranks ...")
        result = launch(args, how, root / f"layout{i}", i)
        if "error" in result:
            m.error = result["error"]
            log(f"[measure] #{i} failed: {m.error}; trying the next layout")
        else:
            heaviest = max(result["ranks"], key=lambda r: peak_bytes(r["peak"]))
            m.peak, m.split = peak_bytes(heaviest["peak"]), heaviest["peak"]
            m.tokens_per_s = plan.tokens_per_step / max(r["step_s"] for r in result["ranks"])
            done += 1
        out.append(m)
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def text(results: List[Measured], how: Launcher, device: str, model: str, layers: Optional[int],
         full_layers: int) -> str:
    from kimi.summary import table

    what = (f"depth-reduced: model.num_layers={layers} of {model}'s {full_layers} blocks (memory predicted "
            f"again for that depth; the predicted tokens/s are the full model's)" if layers
            else f"the real model ({model}, {full_layers} blocks)")
    out = [f"{how.describe()}, trainer.device={device}, {what}; step 2's peak per rank (MemTracker; the "
           "allocator's when compiled), step 3 timed"]
    ran = sorted((m for m in results if m.error is None), key=lambda m: (-m.tokens_per_s, m.peak))
    rows = [[str(r), f"#{m.index} {m.label}", f"{m.predicted_tokens_per_s:,.0f}", f"{m.tokens_per_s:,.0f}",
             _mib(m.predicted_peak), _mib(m.peak), f"{m.ratio:.3f}"] for r, m in enumerate(ran, 1)]
    if rows:
        out.append(table(rows, ["rank", "layout (plan's #)", "predicted tokens/s", "measured tokens/s",
                                "predicted MiB/rank", "measured MiB/rank", "predicted / measured"],
                         "llrrrrr"))
    for m in results:
        if m.error is not None:
            out.append(f"  #{m.index} {m.label} failed: {m.error}")
    if not ran:
        out.append("  no layout ran")
    return "\n".join(out)


def as_json(results: List[Measured]) -> List[Dict[str, Any]]:
    return [{**dataclasses.asdict(m), "ratio": m.ratio} for m in results]


def main() -> None:
    ap = argparse.ArgumentParser(description="one rank of a measure=K run (started by torchrun)")
    ap.add_argument("--worker", type=Path, required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    worker(args.worker, args.overrides)


if __name__ == "__main__":
    main()
