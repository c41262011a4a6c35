"""Communication of one training step per parallel layout (CPU, gloo), and the AttnRes pipeline payload.

For each layout the trainer runs the default tiny job under torchrun (MuonClip; 16 x 128 tokens per step,
the micro-batch split over the data-parallel ranks, so every layout trains the same batch); after a
warm-up step, one step is counted on every rank below DTensor: calls and bytes per collective type, and what
the pipeline stages send (the AttnRes sources, measured at each stage's output).

The payload table compares, per stage boundary, what kimi sends (the stream's sources: completed block sums
plus the running partial sum) with sending every sublayer output so far (what a pipeline that forwards the
whole residual history, as Full AttnRes needs, would send), for the tiny and small presets.

    python bench/parallel.py [--layouts dp_shard2 tp2 pp2 ...] [--model tiny]

Prints markdown tables and writes bench/results/parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from comm_count import CommCounter

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {  # name: (processes, data-parallel ranks, overrides)
    "dp_shard2": (2, 2, ["parallel.dp_shard=2"]),
    "dp_replicate2": (2, 2, ["parallel.dp_replicate=2"]),
    "tp2": (2, 1, ["parallel.tp=2"]),
    "pp2": (2, 1, ["parallel.pp=2", "parallel.pp_microbatches=4"]),
    "hsdp2x2": (4, 4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "dp2xtp2": (4, 2, ["parallel.dp_shard=2", "parallel.tp=2"]),
    "pp2xdp2": (4, 2, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.pp_microbatches=4"]),
}
GLOBAL_BATCH = 16


def worker(out: Path, model: str, overrides: list[str]) -> None:
    from kimi.config import register_configs
    from kimi.parallel import destroy_distributed
    from kimi.parallel.pipeline import StageView
    from kimi.trainer import Trainer

    register_configs()
    run = Path(tempfile.mkdtemp(prefix="kimi_bench_parallel_"))
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"model={model}", f"trainer.run_dir={run}", "logging.wandb.mode=disabled",
                                           "trainer.checkpoint_every=0", "trainer.eval_every=0", "trainer.threads=1",
                                           "trainer.resume=false", *overrides])
    trainer = Trainer(cfg)
    sent = []  # bytes each stage hands to the next, per micro-batch
    forward = StageView.forward

    def recording(self, *inputs):
        outputs = forward(self, *inputs)
        if isinstance(outputs, tuple):
            sent.append(sum(t.numel() * t.element_size() for t in outputs))
        return outputs

    StageView.forward = recording
    trainer.train_step()  # warm-up: optimizer state, MuonClip's layout exchange, pipeline shape inference
    sent.clear()
    counter = CommCounter()
    with counter:
        trainer.train_step()
    record = {"calls": dict(counter.calls), "bytes": dict(counter.bytes), "stage_sends": sent}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, record)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(everyone))
    destroy_distributed()


def run_layout(name: str, model: str) -> list[dict]:
    nproc, dp, extra = LAYOUTS[name]
    out = Path(tempfile.mkdtemp()) / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
           "--worker", str(out), "--model", model, "--", *extra, f"trainer.micro_batch_size={GLOBAL_BATCH // dp}"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"layout {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def attnres_payloads(model: str, pp: int, seq_len: int) -> list[dict]:
    """Per boundary of a `pp`-stage split: tensors [tokens, d_model] kimi sends (the stream's sources) and
    the count if every sublayer output so far were sent."""
    from kimi.config import ModelConfig, register_configs
    from kimi.parallel.pipeline import split_blocks

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"model={model}"])
    fields = {k: v for k, v in cfg.model.items()}
    fields["vocab_size"] = fields["vocab_size"] or cfg.data.tokenizer.vocab_size
    mcfg = ModelConfig(**fields)
    rows = []
    for stage, blocks in enumerate(split_blocks(mcfg, pp, seq_len)[:-1]):
        done = 2 * blocks.stop  # sublayers before the boundary
        if mcfg.residual == "attnres_block":
            ours = 1 + done // mcfg.attnres_block_size + (done % mcfg.attnres_block_size > 0)
        else:
            ours = 1 if mcfg.residual == "standard" else 1 + done
        rows.append({"model": model, "pp": pp, "boundary": f"{stage}->{stage + 1}", "after_block": blocks.stop,
                     "tensors": ours, "all_outputs": 1 + done, "bytes_per_token_fp32": ours * mcfg.d_model * 4,
                     "all_outputs_bytes_per_token_fp32": (1 + done) * mcfg.d_model * 4})
    return rows


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n:.0f} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "parallel.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        return worker(args.worker, args.model, args.overrides)

    results = {name: run_layout(name, args.model) for name in args.layouts}
    kinds = sorted({k for ranks in results.values() for r in ranks for k in r["bytes"]})
    print(f"\n{args.model} model, {GLOBAL_BATCH} x 128 tokens per step in every layout, one training step "
          "(MuonClip), per rank (mean over ranks), CPU gloo\n")
    print("| layout | ranks | " + " | ".join(kinds) + " | stage sends per micro-batch |")
    print("|---" * (len(kinds) + 3) + "|")
    for name, ranks in results.items():
        cells = []
        for k in kinds:
            calls = sum(r["calls"].get(k, 0) for r in ranks) / len(ranks)
            sent = sum(r["bytes"].get(k, 0) for r in ranks) / len(ranks)
            cells.append(f"{fmt_bytes(sent)} ({calls:.0f})" if calls else "-")
        stage = [s for r in ranks for s in r["stage_sends"]]
        cells.append(fmt_bytes(sum(stage) / len(stage)) if stage else "-")
        print(f"| {name} | {len(ranks)} | " + " | ".join(cells) + " |")
    print("\n(bytes, with the number of calls in brackets)")

    payloads = [row for model in ("tiny", "small") for pp in (2, 4) for row in attnres_payloads(model, pp, 128)]
    print("\nAttnRes payload per pipeline boundary: tensors of [tokens, d_model] sent\n")
    print("| model | pp | boundary (after block) | kimi: block sums + partial | every sublayer output so far | ratio |")
    print("|---|---|---|---|---|---|")
    for r in payloads:
        print(f"| {r['model']} | {r['pp']} | {r['boundary']} ({r['after_block']}) | {r['tensors']} | "
              f"{r['all_outputs']} | {r['all_outputs'] / r['tensors']:.1f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "layouts": results, "payloads": payloads}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
