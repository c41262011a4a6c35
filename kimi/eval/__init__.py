"""Evaluation with lm-eval-harness (docs/eval.md): kimi.eval.lm (our model as an lm-eval LM),
kimi.eval.harness (tasks and results), kimi.eval.cli (`python -m kimi.eval`), kimi.eval.hf (the cross-check
through lm-eval's hf model), kimi.eval.build_tasks and tasks/ (the shipped tasks, built from the default
corpus's held-out works). trainer.eval_tasks runs tasks at the trainer's evaluation steps
(kimi/eval/in_training.py)."""
