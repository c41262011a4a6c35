"""Does low-precision training reach bf16's loss? The default job (tiny model, Shakespeare, CPU) run once per
precision with everything else equal (data order, initial weights, schedule); fp8 and MXFP8 emulated on CPU
(torchao's emulation: the same quantisation, the matmul in fp32 over the dequantised operands).

    python bench/precision.py [--runs bf16 fp8_tensorwise ...] [--steps 300] [--eval-every 50] [-- OVERRIDE \
...]
    python bench/precision.py --table     # the table and plot again from the JSON, no training
    python bench/precision.py --numerics  # one layer's error against fp64 per format (seconds)

Each run's record is added to bench/results/precision.json as soon as it finishes (a later run replaces one of
the same name); the table compares every run's final validation loss with bf16's, and the plot
(docs/precision_loss.png) draws the validation curves side by side. The runs live under runs/bench_precision/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kimi.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "precision.json"
PLOT = ROOT / "docs" / "precision_loss.png"
RUNS = {"bf16": ["trainer.precision=bf16"],
        "fp8_tensorwise": ["trainer.precision=fp8", "precision.fp8.recipe=tensorwise"],
        "fp8_rowwise": ["trainer.precision=fp8", "precision.fp8.recipe=rowwise"],
        "fp8_rowwise_with_gw_hp": ["trainer.precision=fp8", "precision.fp8.recipe=rowwise_with_gw_hp"],
        "mxfp8": ["trainer.precision=mxfp8"]}


def train(name: str, steps: int, eval_every: int, overrides: list[str]) -> dict:
    run_dir = ROOT / "runs" / "bench_precision" / name
    if run_dir.exists():  # a fresh run, never a resume of an older one
        shutil.rmtree(run_dir)
    cmd = [sys.executable, str(ROOT / "train.py"), *RUNS[name], f"trainer.max_steps={steps}",
           f"trainer.eval_every={eval_every}", f"trainer.checkpoint_every={steps}", "trainer.sample_tokens=0",
           "trainer.diag_every=0", "logging.wandb.mode=disabled", f"hydra.run.dir={run_dir}", *overrides]
    print(f"[bench] {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"training {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")
    return {"name": name, "overrides": RUNS[name] + overrides, "steps": steps, "seconds": round(seconds, 1),
            "evals": [{"step": r["step"], "val_loss": r["val_loss"]} for r in records if "val_loss" in r]}


def table(runs: dict) -> str:
    base = runs.get("bf16")
    lines = ["| run | steps | final val loss | minus bf16's | largest gap to bf16 at an evaluation | wall "
             "time (s) |",
             "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        final = r["evals"][-1]["val_loss"]
        diff = gap = ""
        if base and name != "bf16" and base["steps"] == r["steps"]:
            diff = f"{final - base['evals'][-1]['val_loss']:+.4f}"
            ref = {e["step"]: e["val_loss"] for e in base["evals"]}
            gap = f"{max(abs(e['val_loss'] - ref[e['step']]) for e in r['evals'] if e['step'] in ref):.4f}"
        lines.append(f"| {name} | {r['steps']} | {final:.4f} | {diff} | {gap} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in runs.items():
        steps = [e["step"] for e in r["evals"]]
        losses = [e["val_loss"] for e in r["evals"]]
        axes[0].plot(steps, losses, marker="o", ms=3, label=name)
        axes[1].plot(steps[1:], losses[1:], marker="o", ms=3, label=name)
    axes[0].set_title("validation loss")
    axes[1].set_title("after the first evaluation")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def numerics() -> str:
    """Relative error (Frobenius) against fp64 of one 128 -> 96 projection on 64 tokens under bf16 autocast,
    forward and both gradients, per format (the problem tests/precision/test_low_precision.py bounds)."""
    import copy

    import torch
    from torch import nn

    from kimi.precision.linear import fp8_config, to_fp8, to_mxfp8

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g, dtype=torch.float64)
    w = torch.randn(96, 128, generator=g, dtype=torch.float64) * 0.05
    grad = torch.randn(64, 96, generator=g, dtype=torch.float64)
    exact = (x @ w.T, grad @ w, grad.T @ x)
    base = nn.Linear(128, 96, bias=False)
    base.weight.data = w.float()
    layers = {"bf16": copy.deepcopy(base), "mxfp8": to_mxfp8(copy.deepcopy(base), emulate=True)}
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        layers[f"fp8 {recipe}"] = to_fp8(copy.deepcopy(base), fp8_config(recipe, emulate=True))
    lines = ["| layer | output | input gradient | weight gradient |", "|---|---|---|---|"]
    for name, layer in layers.items():
        xi = x.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(xi)
        out.backward(grad.to(out.dtype))
        found = (out, xi.grad, layer.weight.grad)
        errors = [((a.double() - b).norm() / b.norm()).item() for a, b in zip(found, exact)]
        lines.append(f"| {name} | " + " | ".join(f"{e:.4f}" for e in errors) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--table", action="store_true", help="only print the table and redraw the plot")
    parser.add_argument("--numerics", action="store_true", help="only print one layer's errors per format")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for every run (after --)")
    args = parser.parse_args()
    if args.numerics:
        print(numerics())
        return

    def recorded() -> dict:
        return json.loads(OUT.read_text())["runs"] if OUT.is_file() else {}

    if not args.table:
        for name in args.runs:
            result = train(name, args.steps, args.eval_every, args.overrides)
            runs = {**recorded(), name: result}  # read again: another invocation may have added a run since
            OUT.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
            print(table(runs), flush=True)
    runs = recorded()
    print(table(runs))
    plot(runs, PLOT)
    print(f"wrote {PLOT}")


if __name__ == "__main__":
    main()
