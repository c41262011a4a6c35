"""The planner's memory and communication models (kimi/plan/memory.py, kimi/plan/comm.py) against a measured
training step, layout by layout, on gloo ranks of this CPU.

Each layout trains a short run under torchrun (the trainer, so every engine, schedule and optimizer path is
the real one): step 1 creates the optimizer state, step 2 runs under torch's MemTracker (the peak of each
rank, and its split at that moment: parameters, gradients, optimizer state, the rest = activations,
gathered FSDP units and buffers; a compiled layout's is measured by the allocator instead, as
kimi.plan.measure.tracked_peak says why), step 3 under bench/comm_count.py's CommCounter (calls and bytes per
collective kind each rank puts in). The heaviest rank's measured peak is set beside memory_per_rank's, and
each pipeline rank's counts (the most any of its ranks put in) beside comm.per_rank's for it: with
pipeline parallelism the stages' collectives differ (the first holds the embedding, the last the head).

    python bench/plan_check.py [--layouts NAME ...] [--quick] [--work DIR]

Prints the memory and collectives tables (docs/planning.md, "Checked against measurement") and writes
bench/results/plan_check.json. 20-45 s per layout on 2 CPU cores, most of it the trainer's start; with
--work a rerun measures only the layouts not yet measured there and recomputes every prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import torch  # noqa: E402

from comm_count import CommCounter, write_every_rank  # noqa: E402

from kimi.plan.measure import tracked_peak  # noqa: E402  (the peak as measure=K takes it)

# every run: short rows, a generated corpus (see corpus()), no evaluation, checkpoints or sampling
BASE = ["trainer.seq_len=64", "trainer.micro_batch_size=2", "trainer.max_steps=3", "trainer.eval_every=0",
        "trainer.checkpoint_every=0", "trainer.sample_tokens=0", "trainer.threads=1", "trainer.log_every=1",
        "trainer.diag_every=0", "trainer.peak_flops=1e11", "trainer.resume=false", "trainer.device=cpu",
        "logging.wandb.mode=disabled", "data=files", "data.tokenizer.vocab_size=384", "data.val_fraction=0.1",
        "optim.warmup_steps=1"]
# name: (model, ranks, overrides); together they cover FSDP, HSDP, tp (with and without sequence parallelism),
# pp (1F1B, GPipe, interleaved 1F1B, pp x FSDP), ep, cp, ZeRO-1/2/3 and the three activation checkpointing
# modes
LAYOUTS = {
    "tiny/single/none": ("tiny", 1, []),
    "tiny/single/full": ("tiny", 1, ["parallel.activation_checkpointing=full"]),
    # bf16 autocast on the CPU (its policy, not CUDA's): the trace's bytes scaled by the compute dtype's size
    "tiny/single/none_bf16": ("tiny", 1, ["trainer.precision=bf16"]),
    # compiled (torch.compile on the CPU, inductor's C++: about a minute more), measured by the allocator
    "tiny/single/none_bf16_compiled": ("tiny", 1, ["trainer.precision=bf16", "parallel.compile=true"]),
    # and with rows of 512 tokens, where selective checkpointing's activations, not the optimizer step, set
    # the peak: eager and compiled
    "tiny/single/selective_bf16_512": ("tiny", 1, ["trainer.precision=bf16", "trainer.seq_len=512",
                                                   "parallel.activation_checkpointing=selective"]),
    "tiny/single/selective_bf16_512_compiled": ("tiny", 1, ["trainer.precision=bf16", "trainer.seq_len=512",
                                                            "parallel.activation_checkpointing=selective",
                                                            "parallel.compile=true"]),
    # the experts compiled (torch._grouped_mm inside the region), at 512 tokens so that the activations
    # set the peak
    "moe_tiny/single/none_bf16_512_compiled": ("moe_tiny", 1, [
        "trainer.precision=bf16", "trainer.seq_len=512", "parallel.compile=true"]),
    "k3_tiny/single/none_bf16_512_compiled": ("k3_tiny", 1, [
        "trainer.precision=bf16", "trainer.seq_len=512", "parallel.compile=true"]),
    # rows of 1,024 tokens under full recomputation: the backward's transient (a block recomputed and its
    # activation gradients), not what the forward keeps, sets the peak
    "tiny/single/full_1024": ("tiny", 1, ["trainer.seq_len=1024", "parallel.activation_checkpointing=full"]),
    "tiny/fsdp2/selective": ("tiny", 2, ["parallel.dp_shard=2",
                                         "parallel.activation_checkpointing=selective"]),
    "tiny/tp2/none": ("tiny", 2, ["parallel.tp=2"]),
    "tiny/tp2_sp/full": ("tiny", 2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                     "parallel.activation_checkpointing=full"]),
    "tiny/pp2_1f1b/none": ("tiny", 2, ["parallel.pp=2", "parallel.pp_microbatches=2"]),
    "tiny/pp2_interleaved/none": ("tiny", 2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                                              "parallel.pp_virtual_stages=2", "parallel.pp_microbatches=4",
                                              "trainer.micro_batch_size=4"]),
    "tiny/pp2_fsdp2/none": ("tiny", 4, ["parallel.pp=2", "parallel.dp_shard=2",
                                        "parallel.pp_microbatches=2"]),
    "tiny/cp2/full": ("tiny", 2, ["parallel.cp=2", "parallel.activation_checkpointing=full"]),
    "tiny/hsdp2x2/none": ("tiny", 4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "moe_tiny/ep2/none": ("moe_tiny", 2, ["parallel.dp_shard=2", "parallel.ep=2"]),
    "moe_tiny/fsdp2_tp2/full": ("moe_tiny", 4, ["parallel.dp_shard=2", "parallel.tp=2",
                                                "parallel.activation_checkpointing=full"]),
    "k3_tiny/single/selective": ("k3_tiny", 1, ["parallel.activation_checkpointing=selective"]),
    "k3_tiny/pp2_gpipe/none": ("k3_tiny", 2, ["parallel.pp=2", "parallel.pp_schedule=gpipe",
                                              "parallel.pp_microbatches=2"]),
    "k3_tiny/pp2_gpipe/full": ("k3_tiny", 2, ["parallel.pp=2", "parallel.pp_schedule=gpipe",
                                              "parallel.pp_microbatches=2",
                                              "parallel.activation_checkpointing=full"]),
    "tiny/zero1/none": ("tiny", 2, ["parallel.engine=deepspeed", "parallel.dp_shard=2",
                                    "parallel.deepspeed.zero_stage=1"]),
    "tiny/zero2/none": ("tiny", 2, ["parallel.engine=deepspeed", "parallel.dp_shard=2",
                                    "parallel.deepspeed.zero_stage=2"]),
    "tiny/zero3/none": ("tiny", 2, ["parallel.engine=deepspeed", "parallel.dp_shard=2",
                                    "parallel.deepspeed.zero_stage=3"]),
}
QUICK = ["tiny/single/none", "tiny/fsdp2/selective", "tiny/tp2/none", "tiny/pp2_1f1b/none"]
MEASURED = {"PARAM": "weights", "GRAD": "gradients", "OPT": "optimizer"}  # MemTracker's categories


def corpus(path: Path) -> list[str]:
    """data.* overrides for a small generated corpus (English-like sentences) and its own token cache."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
             for _ in range(400)]
    path.mkdir(parents=True, exist_ok=True)
    files = []
    for d in range(16):
        files.append(path / f"doc{d:02d}.txt")
        lines = (" ".join(rng.choice(words) for _ in range(8)) + "." for _ in range(80))
        files[-1].write_text("\n".join(lines))
    return [f"data.data_files=[{','.join(map(str, files))}]", f"data.cache_dir={path / 'cache'}"]


def compose_cfg(model: str, overrides: list[str], run: Path):
    from hydra import compose, initialize_config_dir

    from kimi.config import register_configs

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"model={model}", f"trainer.run_dir={run}", *BASE, *overrides])


# ---- one layout, under torchrun ---------------------------------------------------------------------------
def worker(out: Path, model: str, overrides: list[str]) -> None:
    from kimi.trainer import Trainer

    run = Path(tempfile.mkdtemp(prefix="kimi_plan_check_"))
    trainer = Trainer(compose_cfg(model, overrides, run))
    snap = tracked_peak(trainer.train_step, trainer.engine.model, trainer.engine.optimizer, trainer.device,
                        trainer.cfg.parallel.compile)
    counter = CommCounter()
    with counter:
        trainer.train_step()
    record = {"peak": snap, "calls": dict(counter.calls), "bytes": dict(counter.bytes),
              "pp_rank": trainer.engine.pp_rank or 0}
    write_every_rank(out, record)
    trainer.close()
    from kimi.parallel import destroy_distributed

    destroy_distributed()


def measure(name: str, data: list[str], work: Path) -> list[dict]:
    model, nproc, extra = LAYOUTS[name]
    out = work / (name.replace("/", "_") + ".json")
    if out.exists():  # measured before (--work): the measurement does not depend on the models
        return json.loads(out.read_text())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), "--worker", str(out), "--model", model, "--", *data, *extra]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:  # reported, and the other layouts still run
        (work / (name.replace("/", "_") + ".log")).write_text(proc.stdout + proc.stderr)
        lines = [x for x in proc.stderr.splitlines() if "Error" in x and "ChildFailed" not in x]
        print(f"[plan_check] {name} failed: {lines[0] if lines else proc.returncode}", flush=True)
        return None
    return json.loads(out.read_text())


# ---- the models' side -------------------------------------------------------------------------------------
def predict(name: str, data: list[str]) -> dict:
    from omegaconf import OmegaConf

    from kimi.plan.memory import memory_per_rank

    model, nproc, extra = LAYOUTS[name]
    cfg = OmegaConf.to_object(compose_cfg(model, [*data, *extra], Path("unused")))
    parts = memory_per_rank(cfg)
    out = {"peak": sum(parts.values()), "parts": parts}
    from kimi.plan.comm import per_rank

    out["collectives"] = [[vars(c) for c in rank] for rank in per_rank(cfg)]  # per pipeline rank
    return out


def compare(name: str, ranks: list[dict], want: dict) -> dict:
    peaks = [sum(v for k, v in r["peak"].items() if k != "Total") for r in ranks]
    heaviest = ranks[max(range(len(ranks)), key=lambda i: peaks[i])]["peak"]
    measured = {part: heaviest.get(cat, 0) for cat, part in MEASURED.items()}
    measured["rest"] = sum(v for k, v in heaviest.items() if k not in MEASURED and k != "Total")
    predicted = want["peak"]
    if "parallel.engine=deepspeed" in LAYOUTS[name][2]:
        # DeepSpeed makes its fp32 partitions and the optimizer's state at initialisation, out of the tracked
        # module's and optimizer's reach: MemTracker sees neither, so neither is compared
        predicted -= want["parts"]["optimizer"]
    row = {"layout": name, "ranks": len(ranks), "measured_peak": max(peaks), "predicted_peak": predicted,
           "ratio": predicted / max(peaks), "measured_parts": measured, "predicted_parts": want["parts"]}
    if "collectives" in want:
        row["comm"] = comm_rows(ranks, want["collectives"])
    return row


def comm_rows(ranks: list[dict], predicted: list[list[dict]]) -> list[dict]:
    """Per pipeline rank and collective kind: predicted (summed over dims) against the most any of that
    pipeline rank's ranks counted."""
    rows = []
    for stage, want in enumerate(predicted):
        mine = [r for r in ranks if r.get("pp_rank", 0) == stage]
        for kind in sorted({k for r in mine for k in r["calls"]} | {c["kind"] for c in want}):
            rows.append({"stage": stage, "kind": kind, "calls": max(r["calls"].get(kind, 0) for r in mine),
                         "bytes": max(r["bytes"].get(kind, 0) for r in mine),
                         "predicted_calls": sum(c["calls"] for c in want if c["kind"] == kind),
                         "predicted_bytes": sum(c["bytes"] for c in want if c["kind"] == kind)})
    return rows


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(rows: list[dict]) -> str:
    """The memory table and the collectives table (markdown)."""
    measured_parts, predicted_parts = ("weights", "gradients", "optimizer", "rest"), (
        "weights", "gradients", "optimizer", "activations", "fsdp_gathered", "comm_buffers")
    lines = ["| layout | ranks | measured peak MiB | predicted MiB | predicted / measured | measured: "
             "weights, grads, optimizer, rest | predicted: weights, grads, optimizer, activations, "
             "gathered, buffers |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        m, p = r["measured_parts"], r["predicted_parts"]
        lines.append(f"| {r['layout']} | {r['ranks']} | {mib(r['measured_peak'])} | "
                     f"{mib(r['predicted_peak'])} | {r['ratio']:.3f} | "
                     f"{', '.join(mib(m[k]) for k in measured_parts)} | "
                     f"{', '.join(mib(p[k]) for k in predicted_parts)} |")
    lines += ["", "| layout | pipeline rank | kind | counted calls | predicted calls | counted bytes "
              "(busiest rank) | predicted bytes | |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for c in r.get("comm", []):
            same = (c["calls"], c["bytes"]) == (c["predicted_calls"], c["predicted_bytes"])
            note = "equal" if same else f"{c['predicted_bytes'] / max(1, c['bytes']):.4f} of the bytes"
            lines.append(f"| {r['layout']} | {c['stage']} | {c['kind']} | {c['calls']} | "
                         f"{c['predicted_calls']} | {c['bytes']:,} | {c['predicted_bytes']:,} | {note} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "plan_check.json")
    ap.add_argument("--work", type=Path, help="keep each layout's measurement here; a rerun measures only "
                    "what is missing (default: a new temporary folder)")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.overrides)
    work = args.work or Path(tempfile.mkdtemp(prefix="kimi_plan_check_"))
    data = corpus(work / "corpus")
    rows = []
    for name in (QUICK if args.quick else args.layouts):
        measured = measure(name, data, work)
        if measured is None:
            continue
        rows.append(compare(name, measured, predict(name, data)))
        print(f"[plan_check] {name}: measured {mib(rows[-1]['measured_peak'])} MiB, predicted "
              f"{mib(rows[-1]['predicted_peak'])} MiB ({rows[-1]['ratio']:.3f})", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": "cpu", "torch": torch.__version__, "rows": rows}, indent=1))
    print(table(rows))
    print(f"\n[plan_check] wrote {args.out}")


if __name__ == "__main__":
    main()
