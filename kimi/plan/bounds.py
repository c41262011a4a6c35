"""A lower bound of a layout's memory from the layouts already sized, so that most of those that cannot fit
are rejected without calling the memory model (its call is the search's expensive step: a second for a
93-block model).

Two parts of kimi.plan.memory's sizing are bounded, each from facts of how the state is laid out:

  * weights (fp32 masters): present at every moment of the step; they depend on tp, pp (its schedule),
    cp, ep, the engine and dp_shard, not on dp_replicate or the step's knobs, and do not grow as dp_shard
    grows (FSDP and ZeRO shard over it);
  * activations: they depend on tp, pp (its schedule), cp and precision, on the rows per forward and the
    checkpointing mode (kimi.plan.memory: rows x seq_len / cp tokens, divided by tp, per the schedule's
    warm-up, which holds at most pp micro-batches), not on dp_shard, dp_replicate or ep; they do not shrink
    with more rows per forward or less recomputation. They are known from a sizing whose peak was the
    forward's (activations > 0).

The sum of the two is at most the peak, which holds them both at the forward's peak. And when a sizing's
peak is the optimizer step's (no activations in it: weights, gradients, optimizer state and the step's
working memory), that peak does not depend on the step's knobs (checkpointing, rows per forward,
precision): it bounds every layout of the same shape.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from .layout import Layout

AC_MODES = ("none", "selective", "full")  # most memory first


class MemoryBound:
    def __init__(self) -> None:
        self.weights: Dict[tuple, List[Tuple[int, int]]] = {}  # -> [(dp_shard, weights bytes)]
        self.activations: Dict[tuple, List[Tuple[int, int, int]]] = {}  # -> [(ac index, rows, bytes)]
        self.stepping: Dict[object, int] = {}  # shape -> the optimizer step's peak

    @staticmethod
    def _weights_key(layout: Layout) -> tuple:
        s = layout.shape
        return s.tp, s.pp, s.schedule, s.virtual, s.cp, s.ep, s.engine, s.zero_stage

    @staticmethod
    def _act_key(layout: Layout) -> tuple:
        s = layout.shape
        return s.tp, s.pp, s.schedule, s.virtual, s.cp, layout.precision

    def learn(self, layout: Layout, memory: Dict[str, int]) -> None:
        """Keep what a sizing says about the layouts like this one."""
        self.weights.setdefault(self._weights_key(layout), []).append((layout.shape.dp_shard,
                                                                      memory["weights"]))
        if memory["activations"] == 0:
            self.stepping[layout.shape] = sum(memory.values())
        else:
            self.activations.setdefault(self._act_key(layout), []).append(
                (AC_MODES.index(layout.ac), layout.rows_per_forward, memory["activations"]))

    def lower(self, layout: Layout) -> Tuple[int, int, int]:
        """(weights, activations, the optimizer step's peak) bytes this layout holds at least (the peak is
        at least the first two's sum, and at least the third)."""
        a, r = AC_MODES.index(layout.ac), layout.rows_per_forward
        w = max((b for d, b in self.weights.get(self._weights_key(layout), []) if d >= layout.shape.dp_shard),
                default=0)
        act = max((b for ka, kr, b in self.activations.get(self._act_key(layout), []) if ka >= a and kr <= r),
                  default=0)
        return w, act, self.stepping.get(layout.shape, 0)
