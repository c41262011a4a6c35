"""trainer.eval_tasks: lm-eval-harness tasks scored at the trainer's evaluation steps (docs/eval.md).

At each validation (trainer.eval_every, and the last step) every rank scores the first
trainer.eval_tasks_limit examples of each task on its own copy of the forward (the ranks of a sharded model
run the same requests together, as the end-of-run sample does), and rank 0 logs each score as
``eval/<task>/<metric>`` beside val_loss. Scores equal `python -m kimi.eval run=<that checkpoint>
tasks=... limit=<the same>`. A layout that cannot decode (kimi.model.decode.decode_blocker) skips them, with
one note naming the command that scores a checkpoint instead.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from kimi.config import TrainerConfig


class TaskScores:
    """The scores of trainer.eval_tasks (`t`) on a model, each time it is called.

    tokenizer: the run's; blocked: why the layout cannot decode (None: it can); log: rank 0's console."""

    def __init__(self, t: TrainerConfig, tokenizer, blocked: Optional[str], log: Callable[[str], None]):
        self.t, self.tokenizer, self.blocked, self.log = t, tokenizer, blocked, log
        self.noted = False

    def __call__(self, model, step: int) -> Dict[str, float]:
        """{"eval/<task>/<metric>": value} of the tasks on `model` now; {} when none are asked for."""
        t = self.t
        if not t.eval_tasks:
            return {}
        if self.blocked:
            if not self.noted:
                self.noted = True
                self.log(f"[kimi] trainer.eval_tasks skipped: {self.blocked}; score a checkpoint with "
                         "python -m kimi.eval run=<run dir>")
            return {}
        from kimi.eval import harness
        from kimi.eval.lm import KimiLM

        training = model.training
        model.eval()
        try:
            lm = KimiLM(model, self.tokenizer, batch_size=t.micro_batch_size, seed=t.seed)
            found = harness.scores(harness.evaluate(lm, list(t.eval_tasks), limit=t.eval_tasks_limit or None,
                                                    seed=t.seed, quiet=True))
        finally:
            model.train(training)
        record: Dict[str, Any] = {f"eval/{task}/{m}": v for task, metrics in found.items()
                                  for m, v in metrics.items()}
        self.log(f"[kimi] step {step}: " + ", ".join(f"{k[5:]} {v:.4g}" for k, v in record.items()))
        return record
