"""`python -m kimi.eval`: a run's checkpoint scored on lm-eval-harness tasks (docs/eval.md).

    python -m kimi.eval run=runs/exp1                                  # the shipped tasks (kimi_heldout)
    python -m kimi.eval run=runs/exp1 tasks=kimi_cloze limit=50 output=scores.json
    python -m kimi.eval run=runs/exp1 hf=hf_out               # also its to-hf export, lm-eval's hf model

Arguments are key=value as kimi.generate's; a bad one, a run without a checkpoint or an unknown task is one
line on stderr and exit code 2 (kimi/errors.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from kimi.cli import key_value_main, keyvalue
from kimi.config import ConfigError
from kimi.errors import EXIT_OK
from kimi.eval import harness
from kimi.generate import UsageError, _device, _int, load_from_checkpoint, split_known

USAGE = ("usage: python -m kimi.eval run=DIR [tasks=kimi_heldout] [limit=N] [num_fewshot=N] [batch_size=16] "
         "[max_length=2048] [device=cpu] [seed=0] [output=PATH] [hf=DIR [trust_remote_code=true "
         "[trust_modified_code=true]]]")
HELP = f"""{USAGE}

Score the model of a run directory (its newest complete checkpoint, from any parallel layout) or of one
checkpoint directory on lm-eval-harness tasks, through lm-eval's Python API with kimi.eval.lm.KimiLM.

  run          run directory or checkpoint directory (required)
  tasks        comma-separated task or group names (default kimi_heldout: the shipped tasks kimi_lastword,
               kimi_lastword_gen, kimi_cloze, kimi_heldout_ppl); lm-eval's own (hellaswag, arc_easy,
               mmlu, ...) download their data from the hub
  limit        at most N examples per task (default: all)
  num_fewshot  examples put before each question (default: the task's own, 0 for the shipped ones)
  batch_size   sequences per forward (default 16)
  max_length   tokens per forward; longer inputs lose their first tokens (default 2048)
  device       cpu, cuda, cuda:N (default cpu)
  seed         lm-eval's seeds (few-shot sampling) and any sampled generation's (default 0)
  output       write the scores (and the cross-check's) as JSON to this path
  hf           a directory `python -m kimi.convert to-hf` wrote from this run: also score it with lm-eval's
               hf model and the run's tokenizer, and print the largest difference
  trust_remote_code
               true: run the Python code of an hf= directory whose config.json has an auto_map (an export
               with its own modeling code); without it such a directory is refused (default false)
  trust_modified_code
               true: also run such code when it differs from what to-hf recorded in kimi_code.json (edited,
               added or removed files); without it such a directory is refused (default false)

While it scores, a line on stderr every few seconds says how many requests of each kind (loglikelihood,
rolling windows, generate_until) are done, and one line ends each kind; the scores go to stdout.

Exit codes: 0 done, 2 bad arguments, run directory, task name or a refused hf= directory, 1 failure."""


PROGRESS_EVERY_S = 5.0  # a progress line on stderr at most this often while a kind of request is scored


def _count(key: str):
    return lambda t: _int(key, t, 1, None, "must be an integer >= 1")


_PARSERS = {
    "run": str,
    "tasks": lambda t: [n.strip() for n in t.split(",") if n.strip()],
    "limit": _count("limit"),
    "num_fewshot": lambda t: _int("num_fewshot", t, 0, None, "must be an integer >= 0"),
    "batch_size": _count("batch_size"),
    "max_length": lambda t: _int("max_length", t, 2, None, "must be an integer >= 2"),
    "device": _device,
    "seed": lambda t: _int("seed", t, 0, 2**32, "must be an integer in [0, 2**32)"),
    "output": str,
    "hf": str,
    "trust_remote_code": lambda t: _bool("trust_remote_code", t),
    "trust_modified_code": lambda t: _bool("trust_modified_code", t),
}
DEFAULTS = {"tasks": [harness.LOCAL_GROUP], "limit": None, "num_fewshot": None, "batch_size": 16,
            "max_length": 2048, "device": "cpu", "seed": 0, "output": None, "hf": None,
            "trust_remote_code": False, "trust_modified_code": False}


def _bool(key: str, text: str) -> bool:
    try:
        return keyvalue.boolean(text)
    except ValueError as e:
        raise ConfigError(f"{key}={text!r} is invalid: {e}") from None


def parse_args(argv: list[str]) -> dict:
    values = dict(DEFAULTS)
    given = set()
    for arg in argv:
        key, text = split_known(arg, _PARSERS)
        if key in given:
            raise UsageError(f"{key} is given twice")
        given.add(key)
        values[key] = _PARSERS[key](text)
    if not values.get("run"):
        raise UsageError("run= is missing: give a run directory or a checkpoint directory")
    if not values["tasks"]:
        raise ConfigError("tasks= is empty: give task names, e.g. tasks=kimi_lastword,kimi_cloze")
    trusting = [key for key in ("trust_remote_code", "trust_modified_code") if key in given]
    if trusting and not values["hf"]:
        raise UsageError(f"{trusting[0]}= is about the hf= directory's code: give hf=DIR too, or drop it")
    return values


def largest_difference(ours: dict, theirs: dict) -> float:
    """The largest relative difference between two scores tables over the metrics both have."""
    return max((abs(v - theirs[t][m]) / max(abs(v), 1e-12) for t in ours for m, v in ours[t].items()
                if m in theirs.get(t, {})), default=0.0)


def _evaluate(args: dict) -> int:
    from kimi.eval.lm import KimiLM

    run = Path(args["run"])
    if not run.is_dir():
        raise FileNotFoundError(f"run={args['run']}: no such directory (give a run or checkpoint directory)")
    trust = {key: args[key] for key in ("trust_remote_code", "trust_modified_code")}
    if args["hf"]:  # refused before anything is scored, not after
        from kimi.eval.hf import check_folder

        check_folder(args["hf"], **trust)
    manager = harness.task_manager(args["tasks"])
    model, tokenizer, step = load_from_checkpoint(args["run"], args["device"])
    lm = KimiLM(model, tokenizer, args["batch_size"], args["max_length"], args["seed"],
                progress_every=PROGRESS_EVERY_S)
    common = dict(limit=args["limit"], num_fewshot=args["num_fewshot"], seed=args["seed"], manager=manager)
    ours = harness.scores(harness.evaluate(lm, args["tasks"], **common))
    print(f"[kimi] step {step} checkpoint of {args['run']}:\n{harness.table(ours)}", flush=True)
    report = {"run": args["run"], "step": step, "tasks": args["tasks"], "limit": args["limit"],
              "scores": ours}
    if args["hf"]:
        from kimi.eval.hf import hf_lm, torch_kda

        with torch_kda():
            hf = hf_lm(args["hf"], tokenizer, args["batch_size"], args["max_length"], args["device"], **trust)
            theirs = harness.scores(harness.evaluate(hf, args["tasks"], **common))
        diff = largest_difference(ours, theirs)
        print(f"[kimi] {args['hf']} through lm-eval's hf model:\n{harness.table(theirs)}\n"
              f"[kimi] largest relative difference: {diff:.2e}", flush=True)
        report.update(hf=args["hf"], hf_scores=theirs, largest_difference=diff)
    if args["output"]:
        Path(args["output"]).write_text(json.dumps(report, indent=1) + "\n")
        print(f"[kimi] scores written to {args['output']}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    def run(args) -> int:
        harness.require_lm_eval()
        return _evaluate(args)

    return key_value_main(argv, HELP, USAGE, parse_args, run, UsageError)
