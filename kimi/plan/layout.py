"""One candidate layout: the degrees, the engine, and the knobs of a step, as train.py overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List

from kimi.config import SINGLE_STAGE_SCHEDULES, Config
from kimi.parallel.engine_rules import DEEPSPEED, TORCH


@dataclass(frozen=True, order=True)
class Shape:
    """What the groups and the persistent state depend on."""

    tp: int
    pp: int
    schedule: str  # parallel.pp_schedule ("1f1b" without a pipeline)
    virtual: int  # stages per pipeline rank
    cp: int
    ep: int
    dp_shard: int
    dp_replicate: int
    engine: str = TORCH
    zero_stage: int = 0  # parallel.deepspeed.zero_stage (engine=deepspeed)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp_shard * self.dp_replicate

    def label(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        if self.pp > 1:
            parts[parts.index(f"pp{self.pp}")] += f"({self.schedule}" + (
                f" x{self.virtual})" if self.virtual > 1 else ")")
        dp = f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"fsdp{self.dp_shard}"
        parts.append(dp)
        if self.engine != TORCH:
            parts[-1] = f"zero{self.zero_stage}x{self.dp_shard}"
        return " ".join(parts)


@dataclass(frozen=True)
class Layout:
    shape: Shape
    ac: str  # parallel.activation_checkpointing
    micro_batch_size: int  # trainer.micro_batch_size: rows per rank per forward (per step with a pipeline)
    grad_accum: int
    microbatches: int  # parallel.pp_microbatches (1 without a pipeline)
    precision: str  # trainer.precision
    compile: bool  # parallel.compile

    @property
    def rows_per_forward(self) -> int:
        return self.micro_batch_size // self.microbatches

    def label(self) -> str:
        knobs = [self.shape.label(), f"ac={self.ac}", f"rows={self.rows_per_forward}"]
        knobs += [f"accum={self.grad_accum}"] if self.grad_accum > 1 else []
        knobs += [f"mb={self.microbatches}"] if self.shape.pp > 1 else []
        knobs += [self.precision] + ([] if self.compile else ["eager"])
        return " ".join(knobs)

    def overrides(self) -> List[str]:
        """The train.py overrides that give this layout (besides the model and trainer.seq_len given)."""
        s = self.shape
        out = [f"parallel.{k}={getattr(s, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")]
        if s.pp > 1:
            out += [f"parallel.pp_schedule={s.schedule}", f"parallel.pp_microbatches={self.microbatches}"]
            if s.schedule not in SINGLE_STAGE_SCHEDULES:
                out.append(f"parallel.pp_virtual_stages={s.virtual}")
        out += [f"parallel.sequence_parallel={str(s.tp > 1).lower()}",
                f"parallel.activation_checkpointing={self.ac}",
                f"parallel.compile={str(self.compile).lower()}", f"parallel.engine={s.engine}"]
        if s.engine == DEEPSPEED:
            out.append(f"parallel.deepspeed.zero_stage={s.zero_stage}")
        out += [f"trainer.micro_batch_size={self.micro_batch_size}",
                f"trainer.grad_accum_steps={self.grad_accum}", f"trainer.precision={self.precision}"]
        return out


def apply(cfg: Config, layout: Layout) -> Config:
    """A copy of cfg with this layout (the same keys `overrides` sets; the model section is shared)."""
    s = layout.shape
    p = cfg.parallel
    ds = dataclasses.replace(p.deepspeed, zero_stage=s.zero_stage) if s.engine == DEEPSPEED else p.deepspeed
    p = dataclasses.replace(
        p, dp_replicate=s.dp_replicate, dp_shard=s.dp_shard, cp=s.cp, tp=s.tp, pp=s.pp, ep=s.ep,
        pp_schedule=s.schedule if s.pp > 1 else p.pp_schedule,
        pp_microbatches=layout.microbatches if s.pp > 1 else p.pp_microbatches,
        pp_virtual_stages=s.virtual if s.pp > 1 and s.schedule not in SINGLE_STAGE_SCHEDULES
        else p.pp_virtual_stages,
        sequence_parallel=s.tp > 1, activation_checkpointing=layout.ac, compile=layout.compile,
        engine=s.engine, deepspeed=ds)
    t = dataclasses.replace(cfg.trainer, micro_batch_size=layout.micro_batch_size,
                            grad_accum_steps=layout.grad_accum, precision=layout.precision)
    return dataclasses.replace(cfg, parallel=p, trainer=t)
