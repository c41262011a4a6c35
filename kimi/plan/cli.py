"""Plan a layout: which parallel layouts of a model fit N GPUs, and how fast each is predicted to train.

    python -m kimi.plan model=kimi_linear_48b_a3b cluster.gpus=64 cluster.gpu=h200 \\
        trainer.seq_len=4096 trainer.tokens_per_step=4194304

The training config composes from conf/ with the same overrides train.py takes (model=, optim=,
trainer.seq_len=, ...); the planner searches parallel.* and the step's knobs (micro-batch, gradient
accumulation, activation checkpointing, precision) itself, so the layout keys given are replaced. It prints
the fastest layouts that the project's rules accept and that fit in memory, each with its memory per rank,
communication, bubble, MuonClip owner compute, tokens/s and MFU, and the train.py overrides that launch it;
then the families of layouts it rejected, and why. Its assumptions: docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from kimi.cli import keyvalue
from kimi.errors import ConfigError
from kimi.schema.run import tokens_per_step

from .cluster import KEYS, split_args


def help_text(argv: Sequence[str]) -> str:
    import kimi.parallel.engine_rules  # noqa: F401 (fills parallel.engine's choices)
    from kimi.cli.config_help import config_help

    mine = keyvalue.table([(k, meaning) for k, (_, meaning) in KEYS.items()], width=30)
    usage = f"{__doc__.strip()}\n\nThe planner's keys (key=value):\n{mine}"
    return config_help(usage, [a for a in argv if a.partition("=")[0] not in KEYS],
                       only=("model", "optim", "trainer", "precision"))


def plan(argv: Sequence[str], progress: bool = True):
    """(the plan's text, its JSON dict) for these arguments; the traces kept on disk between plans."""
    from kimi.folders import default_cache_dir

    from .disk_cache import enabled

    with enabled(default_cache_dir() / "plan"):
        return _plan(argv, progress)


def _plan(argv: Sequence[str], progress: bool):
    from kimi.summary import compose_config, vocab_note

    args = split_args(argv)
    cfg = compose_config(args.overrides)
    vocab_note(cfg)  # model.vocab_size=null: the tokenizer's, as the trainer sets it
    t = cfg.trainer
    tokens = args.tokens_per_step or tokens_per_step(t, args.cluster.gpus)
    if tokens % t.seq_len:
        raise ConfigError(f"trainer.tokens_per_step={tokens} is not a multiple of trainer.seq_len="
                          f"{t.seq_len}: give a whole number of rows")
    # the search's modules (torch, the model) once the command line is known good: a mistake in it is
    # reported without torch's start-up
    from .model_facts import ModelFacts
    from .report import as_json, text
    from .search import make_search, progress_printer

    search = make_search(cfg, args.cluster, tokens, ModelFacts.of(cfg))
    show = progress_printer() if progress else None
    # measure=K tries the next layout when one fails: the plan keeps a few spare
    result = search.run(max(args.top, 2 * args.measure), show)
    if show and sys.stderr.isatty():
        print(file=sys.stderr)
    shown = [a for a in args.overrides if not a.partition("=")[0].lstrip("+~").startswith(
        ("parallel.", "trainer.micro_batch_size", "trainer.grad_accum_steps", "trainer.precision"))]
    measured = []
    if args.measure:
        from . import measure

        work = Path(args.measure_dir).resolve() if args.measure_dir else None
        measured = measure.measure(result, cfg, shown, args.launcher, args.measure, args.measure_layers, work,
                                   log=lambda line: print(line, file=sys.stderr, flush=True))
    spare = result.best
    result = dataclasses.replace(result, best=result.best[:args.top])
    out, data = text(result, args.cluster, cfg, shown), as_json(result, args.cluster, cfg, shown)
    if args.measure:
        out += "\n\n" + measure.text(measured, args.launcher, cfg.trainer.device, cfg.model.name,
                                     args.measure_layers, cfg.model.num_layers)
        data["measured"] = measure.as_json(measured)
        data["measured_overrides"] = {m.index: [*shown, *spare[m.index - 1].layout.overrides()]
                                      for m in measured}
    return out, data, args.json


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(argv))
        return 0
    try:
        out, data, path = plan(argv)
        if path:
            Path(path).write_text(json.dumps(data, indent=1) + "\n")
    except Exception as e:  # noqa: BLE001 (Hydra/OmegaConf errors have no common base; ConfigError too)
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        from kimi.summary import one_line

        if not isinstance(e, (HydraException, OmegaConfBaseException, ConfigError, ValueError, OSError)):
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    print(out)
    if path:
        print(f"\nwritten: {path}")
    return 0


def cli() -> int:
    """`kimi-plan`."""
    return main()
