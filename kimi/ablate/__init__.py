"""Ablation studies: one factor at a time at matched tokens, several seeds, and their report.

    python -m kimi.ablate NAME [NAME ...] [seeds=[1,2,3]] [steps=N] [arms=[ARM,...]] [root=runs/ablate]
                          [out=DIR] [dry_run=true] [quiet=true] [retry_failed=true] [-- OVERRIDE ...]
    python -m kimi.ablate all                 # every experiment, one after another (the whole study)
    python -m kimi.ablate report [NAME ...]   # statistics, plots and a results section from the runs
    python -m kimi.ablate report docs=true    # the same, and the section into docs/ablations.md
    python -m kimi.ablate list                # the experiments and their arms

Options are key=value, as every kimi command's (the older --flag spellings are still read); Hydra overrides
for every run go after `--`.

An experiment is a Hydra config, ``conf/experiment/<NAME>.yaml``: it includes the study's scale
(``conf/ablate/study.yaml``) and lists its arms (``conf/ablate/<NAME>/<ARM>.yaml``, each the overrides that
make it; the first arm is the baseline) and seeds in ``hydra.sweeper.params``, so Hydra's multirun runs the
same study: ``python train.py -m +experiment=NAME`` (arms x seeds, one process). This wrapper runs the same
runs instead as subprocesses of train.py, one after another, into the same run directories
(``<root>/<NAME>/<ARM>_seed<N>``), and resumes a study that was stopped: a run whose final checkpoint (at
trainer.max_steps) is complete is done and skipped, a run stopped half-way resumes from its newest
checkpoint, and a run that failed (its ``exit_code`` file says 1 or 2: a diverged lr) is skipped unless
``retry_failed=true``. A run started with another trainer.max_steps (an earlier ``steps=``) is refused rather
than stretched. Ctrl-C lets the current run save a checkpoint, then stops the study.

Any other key in ``hydra.sweeper.params`` is a sweep run on the first seed only (``ablate_optimizer``'s
``optim.lr``): each arm's value with the lowest final validation loss is chosen (recorded in
``<root>/<NAME>/sweep.json``) and the other seeds run at that value only. Those runs are named
``<ARM>_<key's last part><value>_seed<N>`` (``adamw_lr0.003_seed1``), as the multirun names them.

When the config has them (``logging.wandb.group`` / ``.tags``), every run is grouped under its experiment and
tagged with its arm and seed (docs/dashboards.md); ``logging.wandb.name`` is ``<NAME>/<run directory>``.

Each finished run (done, or failed) leaves a record, ``<out>/runs/<NAME>/<run>.json``
(kimi/ablate/records.py): its validation curve, speed, cost and config fingerprint. A run with a record counts
as finished even where its run directory is gone, so a study whose records are committed continues, and its
report is redrawn, in a fresh clone. A run whose config and seed equal a finished run of another experiment
(the default model is the middle arm of several) is not trained again: its record points at that run
(``same_as``).

``report`` reads the records (and run directories that have none yet) and writes, per experiment,
``<out>/<NAME>.json`` and ``<out>/<NAME>.png`` (validation loss per arm, mean +- std over seeds),
``<out>/cost_vs_loss.png`` over all experiments, and ``<out>/README_section.md``, which it also prints
(docs/ablations.md says what each number means); ``docs=true`` also puts that section into docs/ablations.md,
between its two markers, with the plots linked from there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from . import records
from .report import DOCS_PAGE, PAPERS, RULE, analyse, report, tokens_to_reach
from .study import (DEFAULT_OUT, DEFAULT_ROOT, ORDER, AblateError, experiment_names, load_experiment,
                    run_study, status)

__all__ = ["AblateError", "DEFAULT_OUT", "DEFAULT_ROOT", "ORDER", "PAPERS", "RULE", "analyse",
           "experiment_names", "load_experiment", "main", "records", "report", "run_study", "status",
           "tokens_to_reach"]


# ---- command line ------------------------------------------------------------------------------------------
# key=value options (every kimi command's style) and the --flags they stand for; a list as Hydra writes one
OPTIONS = {"seeds": "--seeds", "steps": "--steps", "arms": "--arms", "root": "--root", "out": "--out",
           "docs": "--docs", "dry_run": "--dry-run", "quiet": "--quiet", "retry_failed": "--retry-failed"}
SWITCHES = {"dry_run", "quiet", "retry_failed"}


def as_flags(argv: List[str]) -> List[str]:
    """argv with each key=value option (before any `--`) as the --flag form argparse reads: seeds=[1,2] ->
    --seeds 1 2, dry_run=true -> --dry-run, docs=true -> --docs (docs=PAGE -> --docs PAGE)."""
    out = []
    for word in argv:
        key, eq, value = word.partition("=")
        if not eq or key.startswith("-"):
            out.append(word)
            continue
        if key not in OPTIONS:
            raise AblateError(f"{word}: kimi.ablate's options are {', '.join(f'{k}=' for k in OPTIONS)} "
                              "(Hydra overrides for every run go after --)")
        items = [v.strip() for v in value[1:-1].split(",") if v.strip()] if value.startswith("[") else [value]
        if key in SWITCHES or (key == "docs" and value.lower() in ("true", "false")):
            if value.lower() not in ("true", "false"):
                raise AblateError(f"{word}: {key} is true or false")
            out += [OPTIONS[key]] if value.lower() == "true" else []
        else:
            out += [OPTIONS[key], *items]
    return out


def _parser() -> argparse.ArgumentParser:
    """The options, in the --flag form as_flags writes; their help is --help's key=value table (help_text)."""
    parser = argparse.ArgumentParser(prog="python -m kimi.ablate", description=__doc__,
                                     usage="python -m kimi.ablate NAME [NAME ...] [key=value ...] "
                                           "[-- OVERRIDE ...] (--help lists the keys)",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", metavar="NAME",
                        help="experiments (conf/experiment/ablate_*.yaml) or all; report [NAME...]; list")
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="the seeds, e.g. [1,2,3] (default: the experiment file's)")
    parser.add_argument("--steps", type=int, help="trainer.max_steps of every run (default: the study's 600)")
    parser.add_argument("--arms", nargs="+", help="run only these arms, e.g. [standard,attnres_block]")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the runs' directory (runs/ablate)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="each finished run's record (<out>/runs/NAME/), and the report's JSON, PNGs and "
                             "results section (bench/results/ablations)")
    parser.add_argument("--docs", type=Path, nargs="?", const=DOCS_PAGE, metavar="PAGE",
                        help="report: true also puts the section into docs/ablations.md, a path into that "
                             "page, between its markers")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state; train nothing")
    parser.add_argument("--quiet", action="store_true", help="train.py's output only in each run's train.log")
    parser.add_argument("--retry-failed", action="store_true", help="rerun failed runs (exit code 1 or 2)")
    return parser


def help_text(parser: argparse.ArgumentParser) -> str:
    """--help: the module's usage, then each option as its key (OPTIONS) with the help its --flag has."""
    from kimi.cli import keyvalue

    key = {flag: k for k, flag in OPTIONS.items()}
    rows = [("NAME", parser._actions[1].help)]  # the positional names, after argparse's own -h
    for action in parser._actions[2:]:
        text = f"true: {action.help}" if action.nargs == 0 else action.help
        rows.append((key[action.option_strings[0]], text))
    return f"{__doc__.strip()}\n\nKeys:\n{keyvalue.table(rows)}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    parser = _parser()
    if "-h" in argv or "--help" in argv:
        print(help_text(parser))
        return 0
    try:
        argv = as_flags(argv)
    except AblateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        if args.names[0] == "list":
            for name in experiment_names():
                exp = load_experiment(name)
                sweep = "".join(f"; sweep {k} over {' '.join(v)}" for k, v in exp.sweep)
                print(f"{name}: arms {' '.join(exp.arms)} (baseline {exp.baseline}); seeds "
                      f"{' '.join(map(str, exp.seeds))}{sweep}")
            return 0
        if args.names[0] == "report":
            names = args.names[1:] or [n for n in experiment_names()
                                       if (args.root / n).is_dir() or (args.out / "runs" / n).is_dir()]
            report(names, args.root, args.out, page=args.docs)
            return 0
        names = experiment_names() if args.names == ["all"] else args.names
        user = ([f"trainer.max_steps={args.steps}"] if args.steps else []) + overrides
        counts = run_study(names, args.root, args.out, args.seeds, user, args.arms, args.dry_run, args.quiet,
                           args.retry_failed)
    except AblateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("[ablate] stopped; rerun the same command to continue", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (a config error from composing the overrides)
        from kimi.errors import exit_code_for

        if exit_code_for(e) is None:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return exit_code_for(e)
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    print(f"[ablate] {summary or 'nothing to do'}; report: python -m kimi.ablate report "
          + " ".join(names) + (f" root={args.root}" if args.root != DEFAULT_ROOT else "")
          + (f" out={args.out}" if args.out != DEFAULT_OUT else ""))
    return 1 if counts["failed"] else 0
