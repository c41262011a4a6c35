"""Verification cards: each preset that fits a CPU trained for a fixed number of steps on a fixed corpus, and
what a silent change would move recorded beside it (after Megatron-Bridge's per-model cards).

A card holds the training loss of every step, the final validation loss, tokens per second, the model's
declared FLOPs per token and the run's peak memory (the process's maximum resident set). The corpus is
kimi.data.synthetic's (no network), the tokenizer is trained on it, and the run uses one thread, so the
losses are those of any machine with the same torch: tests/project/test_cards.py trains the short cards again
and fails naming the preset and step whose loss moved beyond the card's tolerance. Tokens per second and
memory are this machine's, for reading only.

    python bench/cards.py [--presets tiny,moe_tiny,k3_tiny,small,k3_like]

Writes bench/results/cards/<preset>.json and prints a markdown table; about 2 minutes on 2 CPU cores,
`small` most of it. A preset's card is written again only when its run ends; --check trains the cards again
and compares instead of writing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARDS = ROOT / "bench" / "results" / "cards"
# Steps per preset, and whether the test replays it: the short ones run in seconds; small's forward alone is
# 100M parameters, so it is trained for few steps and only here.
STEPS = {"tiny": 12, "moe_tiny": 12, "k3_tiny": 12, "small": 4, "k3_like": 48}
REPLAYED = ("tiny", "moe_tiny", "k3_tiny", "k3_like")
# Recipes (conf/recipe, docs/stages.md) carded on a model of their own at their own settings: k3_like's first
# two stages (40 steps at 64 tokens per row, 8 at 256: its third needs 2 ranks), one command, a stage
# boundary between them (a checkpoint, a new stream, the decay's start)
RECIPES = {"k3_like": "k3_tiny"}
# Relative change of a step's loss that fails the replay: the same torch on one thread gives the same bits,
# so this only absorbs another build's reordered float sums; a change of the model, the optimizer or the data
# moves the loss by far more within 12 steps.
RTOL = 1e-4


def overrides(preset: str, corpus: Path, cache: Path, run: Path) -> list[str]:
    """train.py's overrides of `preset`'s card: its data in `corpus` (kimi.data.synthetic.write_corpus),
    the token cache in `cache`, the run in `run`."""
    files = ",".join(str(p) for p in sorted(corpus.glob("*.txt")))
    data = ["data=files", f"data.data_files=[{files}]", f"data.cache_dir={cache}",
            "data.tokenizer.vocab_size=384", "data.val_fraction=0.1"]
    quiet = ["trainer.eval_every=0", "trainer.eval_batches=2", "trainer.log_every=1",
             "trainer.sample_tokens=0", "trainer.threads=1", "logging.wandb.mode=disabled",
             "logging.plot=false", f"trainer.run_dir={run}"]
    if preset in RECIPES:  # the recipe's own lengths, batches and schedule; stopped after the carded steps
        return [f"recipe={preset}", f"model={RECIPES[preset]}", *data,
                f"trainer.stop_at_step={STEPS[preset]}", *quiet]
    return [f"model={preset}", *data, f"trainer.max_steps={STEPS[preset]}", "trainer.seq_len=64",
            "trainer.micro_batch_size=4", "optim.warmup_steps=2", *quiet]


def card_of(records: list[dict], preset: str) -> dict:
    """The card's numbers from a run's metrics.jsonl records."""
    losses = [r["loss"] for r in records if "loss" in r]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # the first step warms up
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return {"preset": preset, "steps": STEPS[preset], "losses": losses, "val_loss": val[-1] if val else None,
            "tokens_per_s": sorted(rates)[len(rates) // 2] if rates else None}


def mismatches(card: dict, losses: list[float], val_loss: float | None) -> list[str]:
    """One line per step (and the validation loss) that moved beyond the card's tolerance."""
    rtol, out = card["rtol"], []
    if len(losses) != len(card["losses"]):
        return [f"{card['preset']}: {len(losses)} steps logged, the card has {len(card['losses'])}"]
    for step, (want, got) in enumerate(zip(card["losses"], losses), 1):
        if abs(got - want) > rtol * abs(want):
            out.append(f"{card['preset']} step {step}: loss {got:.6f}, card {want:.6f} "
                       f"(relative change {abs(got - want) / abs(want):.1e} > {rtol:g})")
    if card["val_loss"] is not None and (val_loss is None
                                          or abs(val_loss - card["val_loss"]) > rtol * abs(card["val_loss"])):
        out.append(f"{card['preset']} validation loss {val_loss}, card {card['val_loss']:.6f}")
    return out


def train(preset: str, work: Path) -> dict:
    """Train `preset`'s card in a process of its own (its peak memory is the run's); the card."""
    from kimi.data.synthetic import write_corpus
    from kimi.run.metrics import read_metrics
    from kimi.summary import compose_config, summarize

    corpus, run = write_corpus(work / "corpus"), work / preset
    args = overrides(preset, corpus, work / "cache", run)
    start, log = time.perf_counter(), work / "train.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run}"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak, not the largest child's so far
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) not in (0, 75):  # 75: stopped at trainer.stop_at_step (a recipe)
        sys.exit(f"the {preset} card's run failed:\n{log.read_text()[-4000:]}")
    card = card_of(read_metrics(run / "metrics.jsonl"), preset)
    vocab = json.loads(next((work / "cache").rglob("manifest.json")).read_text())["tokenizer"]["vocab_size"]
    s = summarize(compose_config([*args, f"model.vocab_size={vocab}"]))
    import torch

    card.update(rtol=RTOL, params=s.total, flops_per_token=s.flops_per_token,
                peak_rss_mb=round(usage.ru_maxrss / 1024, 1),
                seconds=round(seconds, 1), torch=torch.__version__, machine=platform.machine(),
                overrides=[a for a in args if not a.startswith(("data.data_files", "data.cache_dir",
                                                                "trainer.run_dir"))])
    return card


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(STEPS))
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed cards, write nothing")
    args = parser.parse_args()
    rows, failed = [], []
    for preset in args.presets.split(","):
        if preset not in STEPS:
            sys.exit(f"--presets: no card for {preset}; choose from {', '.join(STEPS)}")
        work = Path(tempfile.mkdtemp(prefix=f"card-{preset}-"))
        try:
            card = train(preset, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if args.check:
            failed += mismatches(json.loads((CARDS / f"{preset}.json").read_text()), card["losses"],
                                 card["val_loss"])
        else:
            CARDS.mkdir(parents=True, exist_ok=True)
            (CARDS / f"{preset}.json").write_text(json.dumps(card, indent=1) + "\n")
        val = "-" if card["val_loss"] is None else f"{card['val_loss']:.4f}"  # a recipe stopped mid-run
        rows.append(f"| {preset} | {card['params'] / 1e6:.2f}M | {card['steps']} | {card['losses'][0]:.4f} | "
                    f"{card['losses'][-1]:.4f} | {val} | {card['tokens_per_s']:.0f} | "
                    f"{card['flops_per_token'] / 1e6:.1f}M | {card['peak_rss_mb']:.0f} |")
        print(rows[-1], flush=True)  # a row as soon as its card is done
    print("\n| preset | parameters | steps | first loss | last loss | val loss | tokens/s | FLOPs/token | "
          "peak RSS (MB) |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    if failed:
        sys.exit("cards moved:\n" + "\n".join(failed))


if __name__ == "__main__":
    main()
