"""The pipeline's counts from the parallel section (kimi/parallel/config.py): stages per rank, stages in
all, micro-batches per step, and the schedules they depend on.

Read by the engine and the parallel rules (kimi/parallel), by the planner, and by the precision rules, a
floor below kimi/parallel (kimi/precision/rules.py: the tokens of one forward): so here, on the config's
ground floor, over any object with the section's keys.
"""

from __future__ import annotations

from typing import Any

from kimi.schema.vocabulary import RootConfig

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank; the others run pp_virtual_stages each


def stages_per_rank(p: Any) -> int:
    """Pipeline stages each pipeline rank runs: parallel.pp_virtual_stages for the interleaved schedules."""
    return 1 if p.pp == 1 or p.pp_schedule in SINGLE_STAGE_SCHEDULES else p.pp_virtual_stages


def pipeline_stages(p: Any) -> int:
    """Pipeline stages in all (1 without pipeline parallelism); each needs at least one block."""
    return p.pp * stages_per_rank(p)


def pipeline_microbatches(cfg: RootConfig) -> int:
    """Micro-batches per step through the pipeline (1 without one): parallel.pp_microbatches, 0 meaning pp."""
    p = cfg.parallel
    return 1 if p.pp == 1 else (p.pp_microbatches or p.pp)
