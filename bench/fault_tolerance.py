"""What parallel.fault_tolerance=torchft costs per step, and what a rejoin costs.

The same run three ways, each group one process on the CPU (gloo), one thread each:

- plain: one process, no torchft;
- torchft x1: one replica group under torchft (a quorum of one): the quorum at each step's start, the
  gradient all-reduce over a one-member group and should_commit, with nothing to wait for;
- torchft x2: two replica groups; group 1 starts once group 0 is training, so its first quorum takes group 0's
  live state (the rejoin), then both run the timed steps together.

Each arm times --steps steps after --warmup untimed ones (median wall time per step) and, with torchft, the
time each step spent in the quorum, in the cross-group all-reduces (gradients, QK-Clip's logits) and in
should_commit.

    python bench/fault_tolerance.py [--model tiny] [--steps 10] [--set key=value ...]

Prints a markdown table and writes bench/results/fault_tolerance.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RUST_LOG", "warn")


class Timed:
    """Adds up the wall time of a method's calls (on one object)."""

    def __init__(self, obj, name: str):
        self.seconds, self.calls, original = 0.0, 0, getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        setattr(obj, name, timed)


def worker(out: Path, overrides: list[str], warmup: int, steps: int, ready: Path | None) -> None:
    from hydra import compose, initialize_config_dir

    from kimi.config import register_configs
    from kimi.parallel.fault_tolerance import FaultTolerantEngine
    from kimi.trainer import Trainer

    register_configs()
    run = Path(tempfile.mkdtemp(prefix="kimi_bench_ft_"))
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"trainer.run_dir={run}", "logging.wandb.mode=disabled",
                                           "trainer.checkpoint_every=0", "trainer.eval_every=0",
                                           "trainer.threads=1",
                                           *overrides])
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    start_s = time.perf_counter() - t0
    ft = trainer.engine if isinstance(trainer.engine, FaultTolerantEngine) else None
    stepper = trainer
    timers = {}
    if ft is not None:
        timers = {"quorum": Timed(ft.manager, "start_quorum"), "allreduce": Timed(ft.manager, "allreduce"),
                  "should_commit": Timed(ft.manager, "should_commit")}
    healed = trainer.step
    for i in range(warmup):
        stepper.train_step()
    if ready is not None:  # group 0: let group 1 start, and train until it has joined
        ready.touch()
        while ft.manager.num_participants() < 2:
            stepper.train_step()
    for t in timers.values():
        t.seconds, t.calls = 0.0, 0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        stepper.train_step()
        times.append(time.perf_counter() - t0)
    record = {"step_s": statistics.median(times), "steps": steps, "start_s": start_s,
              "healed_at_step": healed,
              **{f"{k}_s_per_step": t.seconds / steps for k, t in timers.items()},
              "gradient_bytes": sum(p.numel() * 4 for p in trainer.model.parameters() if p.requires_grad)}
    if ft is not None:
        record["quorum_participants"] = ft.manager.num_participants()
    trainer.close()
    shutil.rmtree(run, ignore_errors=True)
    out.write_text(json.dumps(record))


def launch(out: Path, overrides: list[str], args, ready: Path | None = None, warmup: int | None = None
           ) -> subprocess.Popen:
    warmup = args.warmup if warmup is None else warmup
    cmd = [sys.executable, __file__, "--worker", str(out), "--steps", str(args.steps), "--warmup",
           str(warmup)]
    cmd += ["--ready", str(ready)] if ready else []
    return subprocess.Popen([*cmd, "--", *overrides], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def result(job: subprocess.Popen, out: Path, what: str) -> dict:
    text = job.communicate()[0]
    if not out.exists():
        sys.exit(f"{what} failed:\n{text[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides, e.g. trainer.seq_len=256")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fault_tolerance.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.overrides, args.warmup, args.steps, args.ready)

    from torchft.coordination import LighthouseServer

    load_start = os.getloadavg()[0]  # other work on the machine: the arms with two groups share its CPUs
    tmp = Path(tempfile.mkdtemp(prefix="kimi_bench_ft_"))
    base = [f"model={args.model}", "optim=muonclip", "trainer.max_steps=1000", *args.set]
    results = {"plain": result(launch(tmp / "plain.json", base, args), tmp / "plain.json", "plain")}
    for groups in (1, 2):
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                                      heartbeat_timeout_ms=2000)
        ft = [*base, "parallel.fault_tolerance=torchft", f"parallel.torchft.replica_groups={groups}",
              f"parallel.torchft.lighthouse={lighthouse.address()}"]
        try:
            ready = tmp / f"ready{groups}" if groups == 2 else None
            jobs = [launch(tmp / f"x{groups}_g0.json", [*ft, "parallel.torchft.replica_group=0"], args,
                           ready)]
            if ready is not None:
                while not ready.exists():
                    if jobs[0].poll() is not None:
                        sys.exit(f"group 0 failed:\n{jobs[0].communicate()[0][-4000:]}")
                    time.sleep(0.1)
                # its first step is group 0's last untimed one: then both time the same steps
                jobs.append(launch(tmp / f"x{groups}_g1.json", [*ft, "parallel.torchft.replica_group=1"],
                                   args,
                                   warmup=1))
            for g, job in enumerate(jobs):
                results[f"torchft_x{groups}/group{g}"] = result(job, tmp / f"x{groups}_g{g}.json",
                                                                f"x{groups} {g}")
        finally:
            lighthouse.shutdown()

    plain = results["plain"]["step_s"]
    settings = " ".join(args.set) or "defaults"
    load = os.getloadavg()[0]
    print(f"\n{args.model} model, MuonClip, one CPU thread per group ({settings}); median of {args.steps} "
          f"steps; {os.cpu_count()} CPUs, load average {load_start:.1f} at the start, {load:.1f} at the "
          "end\n")
    print("| arm | step time | vs plain | quorum | all-reduces | should_commit | torchft's share | gradient "
          "bytes |")
    print("|---|---|---|---|---|---|---|---|")
    keys = ("quorum_s_per_step", "allreduce_s_per_step", "should_commit_s_per_step")
    for name, r in results.items():
        parts = [f"{r[k] * 1e3:.1f} ms" if k in r else "-" for k in keys]
        share = f"{sum(r[k] for k in keys) / r['step_s']:.1%}" if keys[0] in r else "-"
        print(f"| {name} | {r['step_s'] * 1e3:.1f} ms | {r['step_s'] / plain:.2f}x | {' | '.join(parts)} | "
              f"{share} | {r['gradient_bytes'] / 2**20:.2f} MiB |")
    joined = results["torchft_x2/group1"]
    print(f"\ngroup 1 joined at step {joined['healed_at_step']}, taking group 0's live state: its start "
          f"(model build, quorum and state transfer) took {joined['start_s']:.2f} s, group 0's plain start "
          f"{results['plain']['start_s']:.2f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "set": args.set, "steps": args.steps,
                                    "cpus": os.cpu_count(), "load_average": [load_start, load],
                                    "results": results},
                                   indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
