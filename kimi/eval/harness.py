"""lm-eval-harness around any of its models: finding the tasks (the shipped ones in kimi/eval/tasks, lm-eval's
own when a name is not ours), running them, and its results as {task: {metric: value}}."""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
from pathlib import Path
from typing import Any

from kimi.config import ConfigError

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
LOCAL_GROUP = "kimi_heldout"
PREFIX = "kimi_"  # of every shipped task
INSTALL = "lm-eval is not installed: install the eval extra (.venv/bin/pip install -e '.[eval]')"


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(INSTALL) from None


def task_manager(names: list[str]):
    """A TaskManager that knows `names`: the shipped tasks alone when all are ours (instant), else lm-eval's
    own too (indexing them takes seconds, and their data comes from the hub). An unknown name is one line;
    one with our prefix (no lm-eval task has it) without indexing lm-eval's."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    if not all(n in manager.all_tasks or n.startswith(PREFIX) for n in names):
        manager = _with_lm_evals()
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        ours = ", ".join(sorted(t for t in manager.all_tasks if t.startswith(PREFIX)))
        raise ConfigError(f"no lm-eval task named {unknown[0]}{hint}: give a shipped one ({ours}) or one of "
                          "lm-eval's (lm_eval ls tasks lists them)")
    return manager


def check_names(names: list[str]) -> None:
    """trainer.eval_tasks before any work: lm-eval is installed and knows every name (one line otherwise)."""
    if names:
        task_manager(list(names))
    if len(set(names)) != len(names):
        raise ConfigError(f"trainer.eval_tasks={list(names)} names a task twice: give each once")


@functools.lru_cache(maxsize=1)
def _with_lm_evals():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


def evaluate(lm, names: list[str], limit: int | None = None, num_fewshot: int | None = None, seed: int = 0,
             manager=None, quiet: bool = False) -> dict[str, Any]:
    """lm_eval.simple_evaluate on an LM instance; returns its results dict."""
    import lm_eval

    manager = manager or task_manager(names)
    level = logging.getLogger("lm_eval").level
    if quiet:  # inside training: the run's log keeps its own lines
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    try:
        with _no_machine_report():
            return lm_eval.simple_evaluate(model=lm, tasks=names, limit=limit, num_fewshot=num_fewshot,
                                           task_manager=manager, log_samples=False, bootstrap_iters=0,
                                           random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                           fewshot_random_seed=seed)
    except ValueError as e:  # random.sample's, when lm-eval draws more examples than a task holds
        if num_fewshot and "larger than population" in str(e):
            raise ConfigError(f"num_fewshot={num_fewshot} is more examples than a task of {','.join(names)} "
                              "has to draw its few-shot examples from: give a smaller num_fewshot") from None
        raise
    finally:
        logging.getLogger("lm_eval").setLevel(level)


# What lm-eval adds to its results about the machine, which we never read: torch's collect_env (pip, conda,
# nvidia-smi, lscpu and more, each a subprocess: 1.4-2 s a call on 2 idle CPU cores, paid again at every
# in-training evaluation) and `git describe` in the working directory.
MACHINE_REPORT = ("add_env_info", "get_git_commit_hash")


@contextlib.contextmanager
def _no_machine_report():
    """lm-eval's evaluator with MACHINE_REPORT's functions doing nothing (those its version has)."""
    from lm_eval import evaluator

    saved = {name: getattr(evaluator, name) for name in MACHINE_REPORT if hasattr(evaluator, name)}
    try:
        for name in saved:
            setattr(evaluator, name, lambda *args, **kwargs: None)
        yield
    finally:
        for name, function in saved.items():
            setattr(evaluator, name, function)


def scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of every task that ran (a group without metrics of its own left out), with
    no stderr or sample count; a metric is named without its filter ("acc,none" -> "acc",
    "exact_match,first_word" -> "exact_match")."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        named = {}
        for key, value in metrics.items():
            metric, _, _ = key.partition(",")
            if metric != "sample_len" and not metric.endswith("_stderr") and isinstance(value, (int, float)):
                named[metric] = float(value)
        if named:
            out[task] = named
    return out


def table(found: dict[str, dict[str, float]]) -> str:
    """One line per task and metric, aligned."""
    width = max((len(t) for t in found), default=4)
    return "\n".join(f"{task:<{width}}  {metric:<16} {value:.6g}" for task, metrics in found.items()
                     for metric, value in metrics.items())
