"""A run's stages (the root config's ``stages``, docs/stages.md): each a name, a length and the settings it
changes, run one after another by one command (kimi/run/stages.py).

On the config's ground floor (kimi/schema/), as kimi/config.py assembles it into the root Config: no torch
and no rest of kimi but the error type. The helpers here read the stages of a config or of a checkpoint's
config dict alike (the metrics, the resume message and the stop note ask which stage a step belongs to).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kimi.errors import ConfigError


@dataclass
class StageConfig:
    name: str = ""
    # Optimizer steps of this stage; or 0 and `tokens`: as many whole steps as take at least that many
    # training tokens at this stage's tokens per step (micro-batch x seq_len x accumulation x data ranks).
    # The run fills in both as it trains them (the saved config's stages)
    steps: int = 0
    tokens: int = 0
    # optim.schedule=wsd: the decay starts at this stage's first step and runs to the end of the last stage
    # (optim.decay_fraction is computed from it); at most one stage sets it
    decay: bool = False
    # The settings this stage changes, as dotted keys of the config (trainer.seq_len: 256, parallel.cp: 2,
    # data.sources: [...]) or nested sections; everything else is the run's config
    overrides: Dict[str, Any] = field(default_factory=dict)


def _get(stage: Any, key: str) -> Any:
    return stage.get(key) if isinstance(stage, dict) else getattr(stage, key)


def stage_ends(stages: Sequence[Any]) -> List[int]:
    """The global step each stage ends at (its last step), given every stage's steps resolved."""
    ends, total = [], 0
    for stage in stages:
        total += int(_get(stage, "steps"))
        ends.append(total)
    return ends


def stage_index(stages: Sequence[Any], step: int) -> int:
    """0-based index of the stage that trains step `step` (1-based; step 0, the state before any training,
    and a step past the end count as the first and last stage)."""
    for i, end in enumerate(stage_ends(stages)):
        if step <= end:
            return i
    return len(stages) - 1


def tokens_at(stages: Sequence[Any], step: int, tokens_per_step: int) -> int:
    """Training tokens after step `step`: the earlier stages' (their resolved tokens) and this stage's steps
    so far at its `tokens_per_step`."""
    i = stage_index(stages, step)
    before = sum(int(_get(s, "tokens")) for s in stages[:i])
    return before + (step - (stage_ends(stages)[i] - int(_get(stages[i], "steps")))) * tokens_per_step


def boundary_at(stages: Sequence[Any], step: int) -> Optional[int]:
    """The stage entered after step `step` when a stage ends there (not the last); else None."""
    ends = stage_ends(stages)
    return ends.index(step) + 1 if step in ends[:-1] else None


def stage_label(stages: Sequence[Any], i: int) -> str:
    """'stage 2/3 (decay)': how messages name a stage."""
    return f"stage {i + 1}/{len(stages)} ({_get(stages[i], 'name')})"


def flat_overrides(overrides: Dict[str, Any], prefix: str = "") -> List[Tuple[str, Any]]:
    """A stage's overrides as (dotted key, value) pairs, nested sections walked into (a list, such as
    data.sources, is one value)."""
    pairs: List[Tuple[str, Any]] = []
    for key, value in overrides.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"stages: override key {key!r} is invalid: use dotted config keys such as "
                              "trainer.seq_len")
        if isinstance(value, dict) and value:
            pairs += flat_overrides(value, f"{prefix}{key}.")
        else:
            pairs.append((f"{prefix}{key}", value))
    return pairs
