"""Does MuonClip train faster than AdamW? The default job (tiny model, Shakespeare, CPU) run once per \
optimizer
with everything else equal: the same data order, initial weights, learning rate, warmup and cosine schedule.

Reports validation loss along the way, the final one, wall time, and how many training tokens each optimizer
needed to reach AdamW's final validation loss (interpolated between evaluations): Moonlight reports Muon
reaching AdamW's loss with ~52% of the training FLOPs (arXiv 2502.16982).

    python bench/convergence.py [--optims adamw muonclip] [--steps 600] [--eval-every 50] [-- OVERRIDE ...]

Hydra overrides after `--` go to every run. Prints a markdown table and writes
bench/results/convergence.json; the runs live under runs/bench_convergence/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kimi.ablate import tokens_to_reach  # training tokens to a validation loss, between evaluations
from kimi.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def train(optim: str, steps: int, eval_every: int, overrides: list[str], run_dir: Path) -> dict:
    if run_dir.exists():  # a fresh run, never a resume of an older one
        shutil.rmtree(run_dir)
    cmd = [sys.executable, str(ROOT / "train.py"), f"optim={optim}", f"trainer.max_steps={steps}",
           f"trainer.eval_every={eval_every}", f"trainer.checkpoint_every={steps}",
           "logging.wandb.mode=disabled",
           f"hydra.run.dir={run_dir}", *overrides]
    start = time.perf_counter()
    print(f"[bench] {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"training with optim={optim} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["step"], r.get("tokens"), r["val_loss"]) for r in records if "val_loss" in r]
    tokens_per_step = next(r["tokens"] / r["step"] for r in records if r.get("tokens"))
    return {"optim": optim, "seconds": seconds, "tokens_per_step": tokens_per_step,
            "evals": [{"step": s, "tokens": s * tokens_per_step, "val_loss": v} for s, _, v in evals]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optims", nargs="+", default=["adamw", "muonclip"])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "convergence.json")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for every run (after --)")
    args = parser.parse_args()

    runs = [train(o, args.steps, args.eval_every, args.overrides, ROOT / "runs" / "bench_convergence" / o)
            for o in args.optims]
    base = runs[0]
    target = base["evals"][-1]["val_loss"]
    steps = [e["step"] for e in base["evals"]]
    print(f"\nvalidation loss, {args.steps} steps of {base['tokens_per_step']:,.0f} tokens"
          f"{' with ' + ' '.join(args.overrides) if args.overrides else ''}\n")
    print("| step | " + " | ".join(r["optim"] for r in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for i, step in enumerate(steps):
        print(f"| {step} | " + " | ".join(f"{r['evals'][i]['val_loss']:.4f}" for r in runs) + " |")
    print(f"\n| optimizer | final val loss | wall time | tokens to reach {base['optim']}'s {target:.4f} | "
          "ratio | time to reach it | ratio |")
    print("|---|---|---|---|---|---|---|")
    base_need = tokens_to_reach(base["evals"], target)
    base_time = base["seconds"] * base_need / base["evals"][-1]["tokens"]
    for r in runs:
        need = tokens_to_reach(r["evals"], target)
        # wall time taken as proportional to tokens (it includes start-up and evaluations)
        r["tokens_to_target"] = need
        r["seconds_to_target"] = None if need is None else r["seconds"] * need / r["evals"][-1]["tokens"]
        cells = (["not reached", "-", "-", "-"] if need is None else
                 [f"{need:,.0f}", f"{need / base_need:.2f}", f"{r['seconds_to_target']:.0f} s",
                  f"{r['seconds_to_target'] / base_time:.2f}"])
        print(f"| {r['optim']} | {r['evals'][-1]['val_loss']:.4f} | {r['seconds']:.0f} s | "
              + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "overrides": args.overrides, "runs": runs}, indent=2)
                        + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
