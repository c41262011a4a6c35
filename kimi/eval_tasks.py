"""trainer.eval_tasks: lm-eval-harness tasks scored at the trainer's evaluation steps (docs/eval.md).

At each validation (trainer.eval_every, and the last step) every rank scores the first
trainer.eval_tasks_limit examples of each task on its own copy of the forward (the ranks of a sharded model
run the same requests together, as the end-of-run sample does), and rank 0 logs each score as
``eval/<task>/<metric>`` beside val_loss. Scores equal `python -m kimi.eval run=<that checkpoint>
tasks=... limit=<the same>`. Pipeline, sequence and context parallelism would need a decoding schedule of
their own: there the tasks are skipped with a note naming the command that scores a checkpoint instead.
"""

from __future__ import annotations

from typing import Any, Dict, List

from kimi.config import ConfigError


def check_names(names: List[str]) -> None:
    """Before any work: lm-eval is installed and knows every name (one line otherwise)."""
    if names:
        from kimi.eval import harness

        harness.task_manager(list(names))
    if len(set(names)) != len(names):
        raise ConfigError(f"trainer.eval_tasks={list(names)} names a task twice: give each once")


def scores(trainer) -> Dict[str, float]:
    """{"eval/<task>/<metric>": value} of trainer.eval_tasks on the trainer's model now; {} when none."""
    t, p = trainer.cfg.trainer, trainer.cfg.parallel
    if not t.eval_tasks:
        return {}
    if trainer.dims.pp > 1 or p.sequence_parallel or p.cp > 1:
        if not getattr(trainer, "_eval_tasks_noted", False):
            trainer._eval_tasks_noted = True
            trainer.log("[kimi] trainer.eval_tasks skipped under pipeline, sequence or context parallelism: "
                        "score a checkpoint with python -m kimi.eval run=<run dir>")
        return {}
    from kimi.eval import harness
    from kimi.eval.lm import KimiLM

    model = trainer.model
    training = model.training
    model.eval()
    try:
        lm = KimiLM(model, trainer.data.tokenizer, batch_size=t.micro_batch_size, seed=t.seed)
        found = harness.scores(harness.evaluate(lm, list(t.eval_tasks), limit=t.eval_tasks_limit or None,
                                                seed=t.seed, quiet=True))
    finally:
        model.train(training)
    record: Dict[str, Any] = {f"eval/{task}/{m}": v for task, metrics in found.items()
                              for m, v in metrics.items()}
    trainer.log(f"[kimi] step {trainer.step}: " + ", ".join(f"{k[5:]} {v:.4g}" for k, v in record.items()))
    return record
