"""What a checkpoint costs training: a blocking save against one written in the background
(trainer.async_checkpoint), on the same trainer in one process.

For each model, after warm-up steps: the median step time with no save; a blocking save's time (training
stands still for all of it); and for a background save, the pause while the state is staged (copied into
CPU memory), the time the write takes behind training, and the steps trained meanwhile. Training time lost
per checkpoint is the blocking save's time, or the staging pause plus what the steps in flight took beyond
the median step. On a CPU the writer thread and checksums compete with training for the same cores, so the
steps in flight slow down; on a GPU the steps run on the device.

    python bench/checkpoint.py [--models tiny small] [--steps 6] [--repeats 3] [-- OVERRIDE ...]

Uses the default corpus (`make train` prepares it). Prints a markdown table and writes
bench/results/checkpoint.json; the runs live under runs/bench_checkpoint/ (removed first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from kimi.config import register_configs
from kimi.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
# Per model: tokens per step small enough for a CPU step of seconds.
MODEL_OVERRIDES = {"tiny": [], "small": ["trainer.micro_batch_size=2"]}


def build(model: str, overrides: list[str]) -> Trainer:
    run = ROOT / "runs" / "bench_checkpoint" / model
    if run.exists():
        shutil.rmtree(run)
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            f"model={model}", f"trainer.run_dir={run}", "trainer.max_steps=1000000",
            "trainer.checkpoint_every=0",
            "trainer.eval_every=0", "trainer.sample_tokens=0", "trainer.keep_checkpoints=2",
            "logging.wandb.mode=disabled", *MODEL_OVERRIDES.get(model, []), *overrides])
    return Trainer(cfg)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(model: str, steps: int, repeats: int, overrides: list[str]) -> dict:
    tr = build(model, overrides)
    for _ in range(2):  # warm-up: allocator, first-call costs
        tr.train_step()
    base = statistics.median(timed(tr.train_step)[0] for _ in range(steps))
    blocking, stalls, writes, in_flight, lost = [], [], [], [], []
    for _ in range(repeats):
        tr.cfg.trainer.async_checkpoint = False
        seconds, path = timed(lambda: tr.save_checkpoint(wait=True))
        blocking.append(seconds)
        size = sum(f.stat().st_size for f in Path(path).iterdir())
        tr.train_step()

        tr.cfg.trainer.async_checkpoint = True
        stall, _ = timed(lambda: tr.save_checkpoint(wait=False))
        saving, during = tr.saving, []
        while not saving.done():
            during.append(timed(tr.train_step)[0])
        finish, _ = timed(tr.finish_checkpoint)
        stalls.append(stall + finish)
        writes.append(saving.write_s)
        in_flight += during
        lost.append(stall + finish + sum(max(0.0, d - base) for d in during))
        tr.train_step()
    tr.close()
    row = {"model": model, "params": tr.num_params[0], "checkpoint_mb": size / 2**20, "step_s": base,
           "blocking_save_s": statistics.median(blocking), "background_pause_s": statistics.median(stalls),
           "background_write_s": statistics.median(writes), "steps_in_flight": len(in_flight) / repeats,
           "step_in_flight_s": statistics.median(in_flight) if in_flight else None,
           "lost_background_s": statistics.median(lost)}
    # a blocking save loses all of itself
    row["lost_ratio"] = row["lost_background_s"] / row["blocking_save_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=6, help="steps timed for the median step time")
    parser.add_argument("--repeats", type=int, default=3, help="saves of each kind (medians reported)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "checkpoint.json")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for every model (after --)")
    args = parser.parse_args()
    rows = [measure(m, args.steps, args.repeats, args.overrides) for m in args.models]
    machine = f"{os.cpu_count()} logical CPUs, torch {torch.__version__}"
    print(f"\nCheckpoint cost, one process, {machine}; medians of {args.repeats} saves of each kind:\n")
    print("| model | params | checkpoint | step | blocking save | background: pause | write | steps in "
          "flight (each) | training time lost in the background | / blocking save |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        each = "-" if r["step_in_flight_s"] is None else f"{r['step_in_flight_s']:.2f} s"
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['checkpoint_mb']:.0f} MiB | {r['step_s']:.2f} "
              f"s | {r['blocking_save_s']:.2f} s | {r['background_pause_s']:.3f} s | "
              f"{r['background_write_s']:.2f} s | {r['steps_in_flight']:.1f} ({each}) | "
              f"{r['lost_background_s']:.2f} s | {r['lost_ratio']:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "overrides": args.overrides, "rows": rows}, indent=2)
                        + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
