"""Mixture of experts: what the grouped expert computation buys over the per-expert loop, and how well the
aux-loss-free bias update balances the experts' load in training.

1. One MoE layer, forward + backward, grouped GEMM (kimi.model.moe.experts_grouped: tokens sorted by expert,
   torch._grouped_mm) vs the masked per-expert loop (experts_loop), side by side in one process (interleaved,
   median of --repeats), at a few token counts, fp32 and bf16.
2. `model=moe_tiny` trained --steps steps with the bias update (model.moe.bias_rate=1e-3) and without it
   (0): the worst layer's max/mean tokens per expert at every step (metrics.jsonl's moe_imbalance), and the
   validation loss; a plot of the two curves.

    python bench/moe.py [--tokens 1024 4096] [--repeats 5] [--steps 300] [--skip-training]

Prints markdown tables; writes bench/results/moe.json and bench/results/moe_imbalance.png. Not yet:
all-to-all bytes per expert-parallel layout (expert parallelism is not built yet).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def layer_times(tokens: int, dtype: torch.dtype, repeats: int, d=256, experts=16, top_k=2,
                hidden=256) -> dict:
    from kimi.model.moe import experts_grouped, experts_loop, route

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=gen).to(dtype).requires_grad_()
    router = torch.randn(experts, d, generator=gen) * 0.02
    ws = [(torch.randn(experts, *shape, generator=gen) * 0.02).to(dtype).requires_grad_()
          for shape in ((hidden, d), (hidden, d), (d, hidden))]
    weights, chosen, _ = route(x.detach(), router, torch.zeros(experts), top_k, 1, 1, True, 1.0)

    def step(fn):
        y = fn(x, chosen, weights, *ws)
        y.float().sum().backward()

    fns = {"grouped": experts_grouped, "loop": experts_loop}
    times = {k: [] for k in fns}
    for name in fns:
        step(fns[name])  # warm-up
    for r in range(repeats):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            start = time.perf_counter()
            step(fns[name])
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": tokens, "dtype": str(dtype).removeprefix("torch."), "d": d, "experts": experts,
            "top_k": top_k, "hidden": hidden, "seconds": med,
            "loop_over_grouped": med["loop"] / med["grouped"]}


def train(rate: float, steps: int, run_dir: Path) -> dict:
    from kimi.run.metrics import read_metrics

    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, str(ROOT / "train.py"), "model=moe_tiny", f"model.moe.bias_rate={rate}",
           f"trainer.max_steps={steps}", "trainer.log_every=1", f"trainer.eval_every={steps}",
           f"trainer.checkpoint_every={steps}", "trainer.sample_tokens=0", "logging.wandb.mode=disabled",
           f"hydra.run.dir={run_dir}"]
    print(f"[bench] {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"training failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    series = [r["moe_imbalance"] for r in rows if "moe_imbalance" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    return {"bias_rate": rate, "imbalance": series, "final_val_loss": val[-1],
            "mean_imbalance_last_50": statistics.mean(series[-50:])}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        steps = range(1, len(run["imbalance"]) + 1)
        ax.plot(steps, run["imbalance"], label=f"bias rate {run['bias_rate']:g}")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert (worst layer)")
    ax.set_title("moe_tiny: expert load with and without the bias update")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [layer_times(n, dt, args.repeats) for n in args.tokens for dt in (torch.float32, torch.bfloat16)]
    print(f"\nOne MoE layer (d 256, 16 experts of width 256, top-2), forward + backward, CPU, {args.threads} "
          f"threads, median of {args.repeats}:\n")
    print("| tokens | dtype | grouped (ms) | loop (ms) | loop / grouped |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['dtype']} | {1e3 * r['seconds']['grouped']:.1f} | "
              f"{1e3 * r['seconds']['loop']:.1f} | {r['loop_over_grouped']:.2f}x |")
    record = {"layer": rows, "machine": f"{os.cpu_count()} logical CPUs, torch {torch.__version__}"}
    if not args.skip_training:
        runs = [train(rate, args.steps, ROOT / "runs" / f"bench_moe_rate{rate:g}") for rate in (1e-3, 0.0)]
        print(f"\nmodel=moe_tiny, {args.steps} steps:\n")
        print("| bias rate | mean imbalance, last 50 steps | final validation loss |")
        print("|---|---|---|")
        for run in runs:
            print(f"| {run['bias_rate']:g} | {run['mean_imbalance_last_50']:.2f}x | "
                  f"{run['final_val_loss']:.4f} |")
        record["training"] = runs
        plot(runs, RESULTS / "moe_imbalance.png")
        print(f"\nwrote {RESULTS / 'moe_imbalance.png'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "moe.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {RESULTS / 'moe.json'}")


if __name__ == "__main__":
    main()
