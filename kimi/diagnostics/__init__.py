"""Diagnostics: what each Kimi building block is doing, measured during training (README: Diagnostics).

  observe.py  one forward observed from outside the model (hooks, and the layers' probe): a rank's sums
  record.py   the ranks' sums as metrics.jsonl keys, and parsers of those keys back into matrices
  render.py   heatmap PNGs in <run_dir>/diagnostics/, wandb tables, the console line
  runner.py   the trainer's side: which steps, the diagnostic forward, gathering to rank 0
"""

from typing import TYPE_CHECKING

from kimi import lazy_getattr

from .record import attnres_matrix, attnres_sources, head_matrix, moe_matrix, per_block

# the trainer's side (runner.py: torch, the model's probe, dynamo) on first use: the dashboard reads the
# parsers above and must not pay torch's start-up
__getattr__ = lazy_getattr(__name__, {"Diagnostics": "runner"})

__all__ = ["Diagnostics", "attnres_matrix", "attnres_sources", "head_matrix", "moe_matrix", "per_block"]

if TYPE_CHECKING:
    from .runner import Diagnostics  # noqa: F401
