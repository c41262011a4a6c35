"""DeepSpeed's ZeRO stages with our MuonClip as its client, against DeepSpeed's built-in Muon and AdamW.

For each ZeRO stage and optimizer the trainer runs under torchrun on --ranks ranks (parallel.engine=
deepspeed; gradient accumulation 2 by default, so an optimizer that orthogonalises per micro-batch shows
it), on the same model and batches:

- muonclip: ours, a client optimizer over DeepSpeed's partitions (kimi/parallel/zero_client.py): each matrix
  orthogonalised once per step by one owner rank;
- deepspeed_muon: DeepSpeed's own ``"optimizer": {"type": "Muon"}`` (its Newton-Schulz, its lr scale, no
  QK-Clip), built here as a baseline engine through the same seam;
- adamw: torch's AdamW as our client.

After a warm-up step one step is counted on every rank: bytes this rank put into collectives (all of
ZeRO's traffic, forward and backward included), the matmul FLOPs of Newton-Schulz (measured inside the
optimizer's orthogonalisation, not computed from shapes), and all ranks' Newton-Schulz FLOPs over those of
the same optimizer in one process without accumulation (1.00x: each matrix orthogonalised once per step,
MuonClip's design; more: work repeated across ranks or micro-batches); then --steps steps are timed;
optimizer state bytes per rank.

    python bench/zero.py [--stages 1 2 3] [--ranks 2] [--model tiny] [--set key=value ...]

Prints a markdown table and writes bench/results/deepspeed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path, where its own name would hide the deepspeed
# package: look there last (for comm_count).
HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from comm_count import CommCounter  # noqa: E402

ROOT = HERE.parent
ARMS = ("muonclip", "deepspeed_muon", "adamw")


class FlopsOf:
    """Wraps a module-level function so that the matmul FLOPs of its calls are added up."""

    def __init__(self, module, name: str):
        self.module, self.name, self.flops = module, name, 0
        self.original = getattr(module, name)

        def counted(*args, **kwargs):
            counter = CommCounter()
            with counter:
                out = self.original(*args, **kwargs)
            self.flops += counter.flops
            return out

        setattr(module, name, counted)


def builtin_muon_engine(cfg, dims, mesh, device, model):
    """DeepSpeed's own Muon through the engine seam (a baseline for this benchmark only)."""
    from kimi.parallel.deepspeed_engine import DeepSpeedEngine, deepspeed_config

    class BuiltinMuon(DeepSpeedEngine):
        def client_optimizer(self, cfg, model):
            o = cfg.optim
            # DeepSpeed refuses its Muon with ZeRO-3's reduce-scatter of gradients ("cannot be used together")
            zero = deepspeed_config(cfg, self.dims)["zero_optimization"]
            if zero["stage"] == 3:
                zero = {**zero, "reduce_scatter": False}
            return None, {"zero_optimization": zero, "optimizer": {"type": "Muon", "params": {
                "lr": o.lr, "momentum": o.momentum, "weight_decay": o.weight_decay, "betas": list(o.betas),
                "eps": o.eps}}}

    return BuiltinMuon(cfg, dims, mesh, device, model)


def state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "inner", None) or getattr(optimizer, "optimizer", None) or optimizer
    return sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0)


def worker(out: Path, arm: str, overrides: list[str], steps: int) -> None:
    import deepspeed.runtime.zero.muon.original_muon as ds_muon

    import kimi.optim.muonclip as ours
    import kimi.trainer
    from kimi.config import register_configs
    from kimi.parallel import destroy_distributed
    from kimi.trainer import Trainer

    register_configs()
    run = Path(tempfile.mkdtemp(prefix="kimi_bench_deepspeed_"))
    optim = "muonclip" if arm == "deepspeed_muon" else arm
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"trainer.run_dir={run}", "logging.wandb.mode=disabled",
                                           "trainer.checkpoint_every=0", "trainer.eval_every=0",
                                           "trainer.threads=1",
                                           "trainer.resume=false", "parallel.engine=deepspeed",
                                           f"optim={optim}",
                                           *overrides])
    if arm == "deepspeed_muon":
        kimi.trainer.build_engine = builtin_muon_engine
    trainer = Trainer(cfg)
    ns = [FlopsOf(ours, "newton_schulz"), FlopsOf(ds_muon, "muon_update")]
    trainer.train_step()  # warm-up: optimizer state, the owners' plan
    for f in ns:
        f.flops = 0
    counter = CommCounter()
    with counter:
        trainer.train_step()
    ns_flops = sum(f.flops for f in ns)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    seconds = (time.perf_counter() - t0) / steps
    record = {"bytes": counter.total_bytes, "calls": dict(counter.calls), "ns_flops": ns_flops,
              "step_s": seconds,
              "optimizer_state_bytes": state_bytes(trainer.engine.optimizer)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, record)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(everyone))
    destroy_distributed()


def run(arm: str, stage: int, args, ranks: int, accum: int) -> list[dict]:
    out = Path(tempfile.mkdtemp()) / "result.json"
    overrides = [f"model={args.model}", f"parallel.dp_shard={ranks}",
                 f"parallel.deepspeed.zero_stage={stage}",
                 f"trainer.micro_batch_size={args.batch // ranks // accum}",
                 f"trainer.grad_accum_steps={accum}",
                 *args.set]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           __file__,
           "--worker", str(out), "--arm", arm, "--steps", str(args.steps), "--", *overrides]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0 and not out.exists():
        sys.exit(f"{arm} at ZeRO-{stage} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    if proc.returncode != 0:  # results written, then the processes did not exit cleanly (seen once: gloo)
        print(f"[bench] {arm} at ZeRO-{stage} on {ranks} rank(s) exited {proc.returncode} after writing its "
              "results", file=sys.stderr)
    return json.loads(out.read_text())


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step over all ranks and "
                        "micro-batches")
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (after two untimed ones)")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides, e.g. trainer.seq_len=256")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "deepspeed.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.arm, args.overrides, args.steps)

    results = {f"zero{s}/{arm}": run(arm, s, args, args.ranks, args.accum) for s in args.stages
               for arm in args.arms}
    # the same optimizer in one process without accumulation: the Newton-Schulz work of one step done once
    alone = {f"zero{s}/{arm}": run(arm, s, args, 1, 1) for s in args.stages for arm in args.arms
             if arm != "adamw"}
    settings = " ".join(args.set) or "defaults"
    print(f"\n{args.model} model on {args.ranks} ranks, {args.batch} sequences per step in {args.accum} "
          f"micro-batches ({settings}); per rank, the fullest rank where ranks differ\n")
    print("| ZeRO | optimizer | bytes sent per step | Newton-Schulz FLOPs | all ranks' vs one process | step "
          "time | vs adamw | optimizer state |")
    print("|---|---|---|---|---|---|---|---|")
    for s in args.stages:
        base = results.get(f"zero{s}/adamw")
        for arm in args.arms:
            ranks = results[f"zero{s}/{arm}"]
            one = alone.get(f"zero{s}/{arm}")
            times = f"{sum(r['ns_flops'] for r in ranks) / one[0]['ns_flops']:.2f}x" if one else "-"
            step = max(r["step_s"] for r in ranks)
            ratio = f"{step / max(r['step_s'] for r in base):.2f}x" if base else "-"
            print(f"| {s} | {arm} | {mib(max(r['bytes'] for r in ranks))} | "
                  f"{max(r['ns_flops'] for r in ranks) / 1e9:.3f} G | {times} | {step * 1e3:.0f} ms | "
                  f"{ratio} | {mib(max(r['optimizer_state_bytes'] for r in ranks))} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "ranks": args.ranks, "batch": args.batch,
                                    "accum": args.accum, "set": args.set, "steps": args.steps,
                                    "results": results, "one_process": alone}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
