"""The trainer's side of diagnostics: which steps, the diagnostic forward, the ranks' tallies on rank 0."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from kimi.schema.vocabulary import RootConfig as Config

from .observe import observe
from .record import combine
from .render import Table, console_line, tables, write_pngs

if TYPE_CHECKING:
    from kimi.data import Batch
    from kimi.parallel.interface import Engine


class Diagnostics:
    """What each building block is doing, every trainer.diag_every steps (null: the evaluation steps) and at
    the last step; never at step 0 (the optimizer families need a step). The diagnostic forward is the
    engine's evaluation of the first validation batch, so every layout runs it as it evaluates; the
    optimizer families' statistics come from the engine's step (Engine.step(family_stats=True))."""

    def __init__(self, cfg: Config, run_dir: Path, engine: Engine, mesh, dims, is_main: bool,
                 log: Callable[[str], None]):
        t = cfg.trainer
        self.cfg, self.engine, self.dims, self.is_main, self.log = cfg, engine, dims, is_main, log
        self.every = t.eval_every if t.diag_every is None else t.diag_every
        self.enabled = t.diag_every != 0
        self.max_steps = t.max_steps
        self.head_rank = mesh["tp"].get_local_rank() if dims.tp > 1 else 0
        # a stage without MLA layers has no QK-Clip of its own
        self.qk_clip_tau = cfg.optim.qk_clip_tau or None
        self.out_dir = run_dir / "diagnostics"
        self.plot = cfg.logging.plot

    def due(self, step: int) -> bool:
        """Whether `step` (the step about to be taken, counted from 1) is a diagnostics step."""
        return self.enabled and (step == self.max_steps or bool(self.every and step % self.every == 0))

    def note(self) -> Optional[str]:
        """What diagnostics cannot measure in this run, said once at the start (None: everything)."""
        why = self.engine.family_stats_missing() if self.enabled else None
        if why is not None:
            return (f"[kimi] diagnostics: no optim/grad_norm or optim/update_rms under {why}; the model's "
                    "diagnostics run")
        return None

    @torch.no_grad()
    def run(self, step: int, batch: Batch, step_out: Dict[str, Any]) -> Tuple[Dict[str, float],
                                                                              Dict[str, Path],
                                                                               Dict[str, Table]]:
        """Observe the engine's evaluation of `batch` on every rank (collective); on rank 0 return the step's
        metrics (with the optimizer families' from `step_out`, the engine's step output), its PNGs and
        tables, and log one line. Other ranks get empty dicts."""
        sums = self.engine.eval_observed(batch, lambda parts: observe(parts, self.cfg.model, self.head_rank))
        tally = sums.tally()
        tally.qk_clip = {layer: s.tolist() for layer, s in self.engine.qk_clip_head_max_logits.items()}
        tallies = [tally]
        if self.dims.enabled:
            tallies = [None] * dist.get_world_size()
            dist.all_gather_object(tallies, tally)
        if not self.is_main:
            return {}, {}, {}
        record = combine(tallies, self.cfg.model, self.qk_clip_tau)
        record.update({k: v for k, v in step_out.items() if k.startswith("optim/")})
        images = write_pngs(self.out_dir, step, record, self.qk_clip_tau) if self.plot else {}
        line = console_line(step, record)
        self.log(line + (f" | PNGs in {self.out_dir}" if images else ""))
        return record, images, tables(record)
