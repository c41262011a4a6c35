"""The planner's time model of one optimizer step (docs/planning.md, "Assumptions").

    step = compute + pipeline bubble + MuonClip owner compute + exposed communication

compute: the step's model FLOPs per rank (recomputation included) over peak x the compiled roofline's MFU
ceiling; bubble: compute x (pp - 1) / (micro-batches x stages per rank); owner compute: the Newton-Schulz
FLOPs of the Muon matrices the busiest rank owns (kimi/optim/owners.py balances them the same way);
communication: each collective's bytes through a ring over its group, at the bandwidth of the link the
group crosses. Each constant below is an assumption, with where it comes from.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Sequence

# MFU ceilings of the compiled and the unfused roofline: bench/results/step_audit.json, families/1b
# (model=1b, one 4,096-token row, bf16), compiled/gpus/<GPU>/mfu_ceiling and mfu_ceiling_unfused
# (docs/benchmarks.md, "The compiled roofline"). ASSUMPTION: one constant for every model family (the 1b
# preset is the largest one the audit prices); B200 has no audit and takes the H200's.
MFU_CEILING = {"h100": 0.4600, "h200": 0.5514, "b200": 0.5514}
MFU_CEILING_UNFUSED = {"h100": 0.1496, "h200": 0.2015, "b200": 0.2015}
# Matmul share of the compiled 1b step on an H200 (same file: parts_s matmuls 23.3 ms of compiled_step_s
# 44.1 ms). ASSUMPTION: trainer.precision=fp8 runs that share at twice the bf16 rate, the rest unchanged.
MATMUL_SHARE = 0.527
FP8_TIME = 1 - MATMUL_SHARE / 2
# Recomputation, as a factor on compute time. full: the forward again (forward = 1/3 of forward+backward).
# selective keeps matmul and kernel outputs (kimi/parallel/activation_checkpointing.py) and recomputes the
# rest of the forward: ASSUMPTION, a third of the step's non-matmul share (1 - 0.527 - 0.052 custom ops).
RECOMPUTE = {"none": 1.0, "selective": 1 + (1 - MATMUL_SHARE - 0.052) / 3, "full": 4 / 3}

# ASSUMPTION (overlap): collectives over these dims run beside compute (FSDP2 prefetches its gathers and
# reduces gradients during the backward; pipeline sends are asynchronous): only what exceeds the compute
# time is exposed. Everything else (tp, cp and ep collectives inside a sublayer, every all_to_all,
# MuonClip's transfers after the backward) waits on the critical path.
OVERLAPPED_DIMS = ("dp_shard", "dp_replicate", "pp")


def ring_factor(kind: str, n: int) -> float:
    """Bytes a rank sends per byte of the collective's full buffer, in a ring over n ranks."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # send, recv, broadcast (a pipelined ring): the buffer once


# Which buffer a collective's bytes are (kimi.plan.comm counts the first tensor argument): FSDP2's and
# ZeRO's all_gathers count their output (the gathered unit) and their reduce_scatters their output (the
# rank's shard); the functional collectives of tp, sequence parallelism and cp count their input (an
# all_gather the shard, a reduce_scatter the whole tensor).
OUTPUT_COUNTED_DIMS = ("dp_shard", "dp_replicate")


def collective_seconds(kind: str, nbytes: float, n: int, bandwidth: float, dim: str = "tp") -> float:
    """Time of a collective over n ranks whose counted buffer on one rank holds nbytes (see
    OUTPUT_COUNTED_DIMS): the ring factor times the full buffer (an all_gather's gathered, a
    reduce_scatter's before reduction, an all_to_all's what a rank sends or receives) over the bandwidth."""
    if n <= 1:
        return 0.0
    output = dim in OUTPUT_COUNTED_DIMS
    if (kind == "reduce_scatter" and output) or (kind == "all_gather" and not output):
        nbytes = nbytes * n  # the shard was counted
    return ring_factor(kind, n) * nbytes / bandwidth


def bubble_fraction(pp: int, microbatches: int, virtual: int, schedule: str) -> float:
    """Idle share of a pipeline step relative to its compute: (pp - 1) / (micro-batches x stages per rank)
    for 1F1B and interleaved 1F1B (Narayanan et al. 2021); GPipe has the 1F1B bubble."""
    if pp <= 1:
        return 0.0
    v = 1 if schedule in ("gpipe", "1f1b") else virtual
    return (pp - 1) / (microbatches * v)


def busiest_owner(ns_flops: Iterable[int], ranks: int) -> int:
    """Newton-Schulz FLOPs of the busiest rank when each matrix goes, largest first, to the least-loaded
    rank (kimi.optim.owners.build_plans' rule, without its tie-break on what a rank holds)."""
    loads = [0] * max(1, ranks)
    heapq.heapify(loads)
    for f in sorted(ns_flops, reverse=True):
        heapq.heapreplace(loads, loads[0] + f)
    return max(loads)


@dataclass
class CommLine:
    kind: str
    dim: str
    calls: int
    bytes: int
    group: int
    link: str
    seconds: float
    overlapped: bool


@dataclass
class StepTime:
    compute_s: float
    bubble_s: float
    muon_s: float
    comm: List[CommLine] = field(default_factory=list)
    comm_exposed_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.muon_s + self.comm_exposed_s

    def by_kind(self) -> Dict[str, Dict[str, float]]:
        """{kind (link): {bytes, seconds}} summed over the step's collectives."""
        out: Dict[str, Dict[str, float]] = {}
        for c in self.comm:
            row = out.setdefault(f"{c.kind} {c.dim} ({c.link})", {"bytes": 0, "seconds": 0.0})
            row["bytes"] += c.bytes
            row["seconds"] += c.seconds
        return out


def compute_seconds(flops_per_rank: float, peak: float, ceiling: float, recompute: str, fp8: bool) -> float:
    return flops_per_rank * RECOMPUTE[recompute] / (peak * ceiling) * (FP8_TIME if fp8 else 1.0)


def exposed(comm: Sequence[CommLine], compute_s: float) -> float:
    """Communication time left on the critical path (the overlap assumption above)."""
    hidden = sum(c.seconds for c in comm if c.overlapped)
    return max(0.0, hidden - compute_s) + sum(c.seconds for c in comm if not c.overlapped)
