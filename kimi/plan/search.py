"""Enumerate the layouts of N GPUs, prune them, and rank what the rules accept and memory holds.

Shapes (tp, pp with its schedule, cp, ep, dp_shard, dp_replicate, engine) whose product is the GPU count
are enumerated first and pruned by cheap necessary conditions: tp within a node, and the project's rules
that need only the shape (heads and experts divisible, stages against blocks, what cp and the DeepSpeed
engine do not take). Each surviving shape then takes every activation checkpointing mode, rows per forward
(gradient accumulation or pipeline micro-batches fill the step's tokens) and precision (bf16, fp8).

The candidates are walked fastest first by a lower bound of their step time (compute, bubble and Muon owner
compute, which need no model call): a candidate is validated by the project's full rules
(kimi.run.validation.validate, with the GPU count as the world), its collectives timed (kimi.plan.comm)
and, when that time would place it among the K best so far, sized (kimi.plan.memory, the expensive call);
the walk stops once the next lower bound cannot beat the K best. A memory failure also skips every
candidate of the same shape and precision that needs at least as much (more rows per forward, less
recomputation), and kimi/plan/bounds.py rejects, unsized, those that the layouts sized so far show cannot
fit. Before its evaluation a candidate is queued again behind the communication its whole shape exposes
at least (comm_floor), and once K layouts are known, its collectives without MuonClip's (whose owner plan
is the costly part) may already show it too slow.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from kimi.config import Config, check_context_parallel, check_expert_parallel, check_sequence_parallel
from kimi.config import check_stage_split
from kimi.errors import ConfigError
from kimi.model.rules import check_tensor_parallel
from kimi.parallel.engine_rules import DEEPSPEED, TORCH
from kimi.parallel.rules import check_cuda_graphs, check_engine
from kimi.precision.registry import precision_for

from . import timing
from .bounds import AC_MODES, MemoryBound
from .cluster import GIB, Cluster
from .layout import Layout, Shape, apply
from .model_facts import ModelFacts
from .shapes import section_key, stable_keys

_MODELS_CHECKED: set = set()  # section_key of each model section whose own rules passed
RESERVE = 0.10  # of HBM kept free: the CUDA context, NCCL, the allocator's fragmentation
MAX_TOKENS_PER_FORWARD = 65536  # rows per forward are tried up to this many tokens
ENGINES = ((TORCH, 0), (DEEPSPEED, 1), (DEEPSPEED, 2), (DEEPSPEED, 3))


def first_line(e: BaseException) -> str:
    return str(e).strip().split("\n")[0]


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def schedules(pp: int, layers: int) -> List[Tuple[str, int]]:
    """(schedule, stages per rank) tried for a pipeline of pp ranks. GPipe is left out (1F1B's bubble, more
    activations) and so is zero_bubble (no bubble formula here; docs/planning.md)."""
    if pp == 1:
        return [("1f1b", 1)]
    return [("1f1b", 1)] + [("interleaved_1f1b", v) for v in (2, 4) if pp * v <= layers]


@dataclass
class Rejections:
    """reason -> the families of layouts it rejects (labels), in the order found."""

    by_reason: Dict[str, List[str]] = field(default_factory=dict)

    def add(self, family: str, reason: str) -> None:
        families = self.by_reason.setdefault(reason, [])
        if family not in families:
            families.append(family)

    def discard(self, family: str) -> None:
        for reason in [r for r, fams in self.by_reason.items() if family in fams]:
            self.by_reason[reason].remove(family)
            if not self.by_reason[reason]:
                del self.by_reason[reason]


@dataclass
class Evaluated:
    layout: Layout
    time: timing.StepTime
    memory: Dict[str, int]  # by part
    peak: int  # bytes at the rank's peak: the sum of its parts
    tokens_per_s: float
    mfu: float


@dataclass
class Plan:
    best: List[Evaluated]
    rejected: Rejections
    shapes: int
    candidates: int
    walked: int
    sized: int
    seconds: float
    tokens_per_step: int


class Search:
    """One plan: the base config (model, optimizer, seq_len), the cluster, the tokens per step."""

    def __init__(self, cfg: Config, cluster: Cluster, tokens_per_step: int, facts: ModelFacts,
                 memory: Callable[[Config], Dict[str, int]], comm: Callable[[Config], list],
                 validate: Callable[[Config, int], None],
                 comm_bound: Optional[Callable[[Config], List[list]]] = None,
                 comm_ranks: Optional[Callable[[Config], List[list]]] = None,
                 memory_floor: Optional[Callable[[Config], Dict[str, int]]] = None):
        """comm_bound: per pipeline rank, collectives that are a subset of what `comm` returns for that rank
        (a cheaper lower bound of the exposed time), or None. comm_ranks: per pipeline rank, all of them
        (`comm` returns the busiest's), for the per-shape bound of comm_floor, or None. memory_floor: parts
        no larger than `memory`'s for a context-parallel layout, and cheaper to size, or None."""
        self.cfg, self.cluster, self.tokens, self.facts = cfg, cluster, tokens_per_step, facts
        self.memory_fn, self.comm_fn, self.validate_fn = memory, comm, validate
        self.memory_floor_fn = memory_floor
        self.comm_bound_fn = comm_bound
        self.comm_ranks_fn = comm_ranks
        # (shape, precision) -> (forwards per step, its layout without recomputation and fewest forwards)
        self.floors: Dict[Tuple[Shape, str], Tuple[int, Layout]] = {}
        self._floor_s: Dict[Tuple[Shape, str], float] = {}
        self.rejected = Rejections()
        kind = cluster.gpu.split()[0]
        self.ceiling = timing.MFU_CEILING.get(kind, timing.MFU_CEILING["h200"])
        self.ceiling_unfused = timing.MFU_CEILING_UNFUSED.get(kind, timing.MFU_CEILING_UNFUSED["h200"])
        self.usable = int(cluster.hbm_bytes * (1 - RESERVE))
        self.fitted: set = set()  # families (shape, precision) with a layout that fits
        self.bound = MemoryBound()
        self.sized = 0  # calls of the memory model
        self.cpu = cfg.trainer.device == "cpu"  # ranks that are CPU processes (a measure=K run here)

    # ---- shapes ----------------------------------------------------------------------------------------
    def shapes(self) -> Iterator[Shape]:
        n, gpn, m = self.cluster.gpus, self.cluster.gpus_per_node, self.cfg.model
        seq = self.cfg.trainer.seq_len
        for tp in divisors(n):
            if tp > gpn:
                self.rejected.add(f"tp{tp}", f"tp > {gpn} GPUs per node (tensor parallelism stays in a node)")
                continue
            try:
                check_tensor_parallel(m, tp)
            except ConfigError as e:
                self.rejected.add(f"tp{tp}", first_line(e))
                continue
            for pp in divisors(n // tp):
                for schedule, v in schedules(pp, m.num_layers):
                    for cp in divisors(n // (tp * pp)):
                        dp = n // (tp * pp * cp)
                        if self.tokens % (seq * dp):
                            self.rejected.add(
                                f"tp{tp} pp{pp} cp{cp} dp{dp}",
                                f"trainer.tokens_per_step={self.tokens} is not a whole number of "
                                f"trainer.seq_len={seq} rows per data-parallel rank")
                            continue
                        for dp_replicate in divisors(dp):
                            dp_shard = dp // dp_replicate
                            experts = math.gcd(dp_shard, m.moe.num_experts) if m.moe.num_experts else 1
                            for ep in divisors(experts):
                                pure = tp == pp == cp == ep == dp_replicate == 1
                                for engine, zero in ENGINES if pure else ENGINES[:1]:
                                    shape = Shape(tp, pp, schedule, v, cp, ep, dp_shard, dp_replicate, engine,
                                                  zero)
                                    if self._shape_ok(shape):
                                        yield shape

    def _shape_ok(self, shape: Shape) -> bool:
        """The project's rules that need only the shape."""
        cfg = apply(self.cfg, self._layout(shape, "none", 1, 1, 1, "bf16"))
        try:
            check_stage_split(cfg.parallel, cfg.model.num_layers, cfg.parallel.pp_split)
            check_expert_parallel(cfg)
            check_context_parallel(cfg)
            check_cuda_graphs(cfg)
            check_sequence_parallel(cfg)
            check_engine(cfg.parallel)
        except ConfigError as e:
            self.rejected.add(shape.label(), first_line(e))
            return False
        return True

    def _layout(self, shape: Shape, ac: str, mbs: int, accum: int, microbatches: int,
                precision: str) -> Layout:
        # compile: the compiled roofline's ceiling; the engine and cp do not take it (their rules say so),
        # nor a CPU run (inductor's C++ compile would cost minutes of a few-step measurement)
        compile_ = shape.engine == TORCH and shape.cp == 1 and not self.cpu
        return Layout(shape, ac, mbs, accum, microbatches, precision, compile_)

    # ---- candidates ------------------------------------------------------------------------------------
    def layouts(self, shape: Shape) -> Iterator[Layout]:
        seq = self.cfg.trainer.seq_len
        rows = self.tokens // (seq * shape.dp_shard * shape.dp_replicate)  # per data-parallel rank and step
        cap = max(1, MAX_TOKENS_PER_FORWARD // (seq // shape.cp))
        for per_forward in (d for d in divisors(rows) if d <= cap):
            n = rows // per_forward  # forwards per step: accumulation steps or pipeline micro-batches
            if shape.pp > 1 and (n < shape.pp or (shape.virtual > 1 and n % shape.pp)):
                continue
            mbs, accum, micro = (rows, 1, n) if shape.pp > 1 else (per_forward, n, 1)
            acs = AC_MODES if shape.engine == TORCH else AC_MODES[:1]
            precisions = ("bf16", "fp8") if shape.engine == TORCH and shape.tp == 1 else ("bf16",)
            if self.cpu:  # fp32, as the CPU trains (the memory model was checked in it: docs/planning.md)
                precisions = ("fp32",)
            for ac in acs:
                for precision in precisions:
                    yield self._layout(shape, ac, mbs, accum, micro, precision)

    def lower_bound(self, layout: Layout) -> Tuple[float, float, float]:
        """(compute, bubble, Muon owner compute) seconds: the step time before any communication."""
        s = layout.shape
        ceiling = self.ceiling if layout.compile else self.ceiling_unfused
        per_rank = self.facts.flops_per_token * self.tokens / self.cluster.gpus
        compute = timing.compute_seconds(per_rank, self.cluster.peak_flops, ceiling, layout.ac,
                                         precision_for(layout.precision).converts)
        bubble = compute * timing.bubble_fraction(s.pp, layout.microbatches, s.virtual, s.schedule)
        muon = self.facts.busiest_owner(self.cfg, s) / (self.cluster.peak_flops * self.ceiling)
        return compute, bubble, muon

    # ---- evaluation ------------------------------------------------------------------------------------
    def comm_lines(self, cfg: Config, compute_s: float) -> Tuple[List[timing.CommLine], float]:
        """The busiest pipeline rank's collectives, timed, and its exposed seconds: the rank that exposes the
        most (the step waits for it; the most bytes, the former choice, missed a later stage's expert
        all-to-alls behind the first stage's FSDP gathers), the most bytes among equals."""
        if self.comm_ranks_fn is None:
            return self._timed(cfg, self.comm_fn(cfg), compute_s)
        links: Dict[str, Tuple[int, str, float]] = {}
        timed = [(self._timed(cfg, rows, compute_s, links), sum(c.bytes for c in rows))
                 for rows in self.comm_ranks_fn(cfg)]
        return max(timed, key=lambda t: (t[0][1], t[1]))[0]

    def _timed(self, cfg: Config, collectives, compute_s: float,
               links: Optional[Dict[str, Tuple[int, str, float]]] = None
               ) -> Tuple[List[timing.CommLine], float]:
        """links: each mesh dim's (group, link, bandwidth), filled as met (one layout's ranks share it)."""
        p, links = cfg.parallel, {} if links is None else links
        lines = []
        for c in collectives:
            if c.dim not in links:
                group, span = group_span(c.dim, p)
                links[c.dim] = (group, *self.cluster.link(span))
            group, link, bandwidth = links[c.dim]
            seconds = timing.collective_seconds(c.kind, c.bytes, group, bandwidth, c.dim)
            overlapped = c.dim in timing.OVERLAPPED_DIMS and c.kind != "all_to_all"
            lines.append(timing.CommLine(c.kind, c.dim, c.calls, c.bytes, group, link, seconds, overlapped))
        return lines, timing.exposed(lines, compute_s)

    def comm_floor(self, layout: Layout) -> float:
        """Seconds of communication every layout of this shape and precision exposes at least: the
        collectives that are never overlapped (tp, cp, ep, every all-to-all, MuonClip's) of its layout
        without recomputation and with the fewest forwards (their bytes only grow with recomputation and
        with more forwards: tokens per step are fixed, per-forward terms add up), on the pipeline rank with
        the least; 1% below it, for the integer rounding of per-forward shards."""
        key = (layout.shape, layout.precision)
        if key not in self._floor_s:
            cfg = apply(self.cfg, self.floors[key][1])
            least = min(sum(c.seconds for c in self._timed(cfg, rows, 0.0)[0] if not c.overlapped)
                        for rows in self.comm_ranks_fn(cfg))
            self._floor_s[key] = 0.99 * least
        return self._floor_s[key]

    def evaluate(self, layout: Layout, bound: Tuple[float, float, float],
                 cutoff: float = math.inf) -> Evaluated | str:
        """The layout timed and sized, or why not: "rules" or "memory" (the reason recorded), or "slow"
        (not sized: its step time is no better than `cutoff`)."""
        cfg = apply(self.cfg, layout)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # validate's warnings, once per layout
                self.validate_fn(cfg, self.cluster.gpus)
        except ConfigError as e:
            self.rejected.add(layout.label(), first_line(e))
            return "rules"
        family = f"{layout.shape.label()} {layout.precision}"
        weights, activations, stepping = self.bound.lower(layout)
        if stepping > self.usable:  # known without sizing it (kimi/plan/bounds.py)
            self._too_big(family, f"the optimizer step's peak {stepping / GIB:.1f} GiB > "
                                  f"{self.usable / GIB:.1f} GiB", layout)
            return "memory"
        if weights + activations > self.usable:
            self._too_big(family, f"at least {(weights + activations) / GIB:.1f} GiB (weights "
                                  f"{weights / GIB:.1f}, activations {activations / GIB:.1f}, as sized for "
                                  f"layouts like it) > {self.usable / GIB:.1f} GiB", layout)
            return "memory"
        compute, bubble, muon = bound
        if cutoff < math.inf and self.comm_bound_fn is not None:
            # MuonClip's owner plan is the communication model's expensive part: without it, each pipeline
            # rank's exposed time is a lower bound of the busiest's with it (exposure only grows with more
            # collectives), which often shows the layout cannot beat the `top` best
            least = min(self._timed(cfg, rows, compute)[1] for rows in self.comm_bound_fn(cfg))
            if compute + bubble + muon + least >= cutoff:
                return "slow"
        lines, exposed = self.comm_lines(cfg, compute)
        step = timing.StepTime(compute, bubble, muon, lines, exposed)
        if step.step_s >= cutoff:
            return "slow"  # sizing is the expensive call: only for a layout that would be shown
        if layout.shape.cp > 1 and self.memory_floor_fn is not None:
            floor = self.memory_floor_fn(cfg)
            self.sized += 1
            self.bound.learn(layout, floor)  # a lower bound teaches only lower bounds
            if self._over(floor, family, layout, " at least (one device's trace at a rank's tokens)"):
                return "memory"
        memory = self.memory_fn(cfg)
        self.sized += 1
        self.bound.learn(layout, memory)
        if self._over(memory, family, layout):
            return "memory"
        total = sum(memory.values())  # the parts are those at the rank's peak (kimi.plan.memory)
        self.fitted.add(family)
        self.rejected.discard(family)
        tokens_per_s = self.tokens / step.step_s
        mfu = self.facts.flops_per_token * tokens_per_s / (self.cluster.gpus * self.cluster.peak_flops)
        return Evaluated(layout, step, memory, total, tokens_per_s, mfu)

    def _over(self, memory: Dict[str, int], family: str, layout: Layout, note: str = "") -> bool:
        """Whether a sizing's parts exceed the usable memory (recorded as the family's reason if so)."""
        total = sum(memory.values())
        if total <= self.usable:
            return False
        part = max(memory, key=memory.get)
        self._too_big(family, f"{part} {memory[part] / GIB:.1f} GiB, {total / GIB:.1f} GiB in all{note} > "
                              f"{self.usable / GIB:.1f} GiB", layout)
        return True

    def _too_big(self, family: str, why: str, layout: Layout) -> None:
        """A family is rejected for memory when none of its layouts fits, with the reason of the leanest
        one tried (the walk goes from the fastest, which keep the most, to leaner ones)."""
        if family not in self.fitted:
            self.rejected.discard(family)
            self.rejected.add(family, f"{why} (HBM less {RESERVE:.0%}) at activation checkpointing "
                                      f"{layout.ac}, {layout.rows_per_forward} row(s) per forward")

    def run(self, top: int, progress: Optional[Callable[[str], None]] = None) -> Plan:
        with stable_keys():  # every layout's config shares the run's model and optimizer sections
            return self._run(top, progress)

    def _run(self, top: int, progress: Optional[Callable[[str], None]]) -> Plan:
        start = time.perf_counter()
        heap: List[Tuple[float, int, Layout, Tuple[float, float, float], bool]] = []
        shapes = 0
        last = start
        for shape in self.shapes():
            shapes += 1
            for layout in self.layouts(shape):
                bound = self.lower_bound(layout)
                heap.append((sum(bound), len(heap), layout, bound, False))
                key = (shape, layout.precision)
                forwards = layout.grad_accum * layout.microbatches
                if layout.ac == "none" and (key not in self.floors or forwards < self.floors[key][0]):
                    self.floors[key] = (forwards, layout)
            now = time.perf_counter()
            if progress is not None and now - last > 1.0:
                last = now
                progress(f"planning: {shapes:,} shapes, {len(heap):,} layouts enumerated, "
                         f"{now - start:.0f} s")
        candidates = len(heap)
        heapq.heapify(heap)
        best: List[Evaluated] = []  # sorted by step time
        too_big: Dict[Tuple[Shape, str], List[Tuple[int, int]]] = {}  # failed (ac index, rows per forward)
        walked = 0
        while heap and (len(best) < top or heap[0][0] < best[-1].time.step_s):
            first, order, layout, bound, refined = heapq.heappop(heap)
            if not refined and self.comm_ranks_fn is not None:
                # the shape's exposed communication, known once per shape: back in the queue with it
                # unless it adds nothing (then its place is unchanged)
                extra = self.comm_floor(layout)
                if extra > 0:
                    heapq.heappush(heap, (first + extra, order, layout, bound, True))
                    continue
            key, need = (layout.shape, layout.precision), (AC_MODES.index(layout.ac), layout.rows_per_forward)
            if any(a >= need[0] and r <= need[1] for a, r in too_big.get(key, [])):
                continue  # a layout needing no more memory did not fit
            walked += 1
            now = time.perf_counter()
            if progress is not None and now - last > 1.0:
                last = now
                progress(f"planning: {walked:,} of {candidates:,} layouts evaluated ({shapes:,} shapes), "
                         f"{self.sized:,} sized, {now - start:.0f} s")
            found = self.evaluate(layout, bound, best[-1].time.step_s if len(best) >= top else math.inf)
            if found == "memory":
                too_big.setdefault(key, []).append(need)
            if isinstance(found, str):
                continue
            best.append(found)
            best.sort(key=lambda e: (e.time.step_s, e.peak))
            del best[top:]
        return Plan(best, self.rejected, shapes, candidates, walked, self.sized, time.perf_counter() - start,
                    self.tokens)


def group_span(dim: str, p) -> Tuple[int, int]:
    """(ranks in the group a collective over mesh dim `dim` runs on, consecutive ranks it spans). The mesh
    is (pp, dp_replicate, dp_shard, cp, tp), tp innermost (kimi/parallel/dims.py); expert parallelism takes
    neighbouring dp_shard ranks (cp is 1 with it); FSDP's group is the flattened (dp_shard, cp)."""
    inner = {"tp": (p.tp, 1), "cp": (p.cp, p.tp), "ep": (p.ep, p.tp), "dp_shard": (p.dp_shard * p.cp, p.tp),
             "dp_replicate": (p.dp_replicate, p.tp * p.cp * p.dp_shard),
             "pp": (p.pp, p.tp * p.cp * p.dp_shard * p.dp_replicate)}
    group, stride = inner[dim]
    return group, group * stride


def progress_printer() -> Callable[[str], None]:
    """Progress lines on stderr: rewritten in place on a terminal (every second), else a line every 10 s
    (a log file or a pipe keeps them all)."""
    if sys.stderr.isatty():
        return lambda line: print(f"\r{line}", end="", file=sys.stderr, flush=True)
    last = [time.perf_counter()]

    def show(line: str) -> None:
        now = time.perf_counter()
        if now - last[0] >= 10.0:
            last[0] = now
            print(line, file=sys.stderr, flush=True)
    return show


def validate_layout(cfg: Config, world: int) -> None:
    """The project's one validation pass (what the trainer runs first), with `world` processes; the model
    section's own rules once per model section (every layout of a search shares it)."""
    from kimi.model.rules import validate_model
    from kimi.run.validation import validate

    key = section_key(cfg.model)
    if key not in _MODELS_CHECKED:
        validate_model(cfg.model)
        _MODELS_CHECKED.add(key)
    validate(cfg, world=world, model_checked=True)


def make_search(cfg: Config, cluster: Cluster, tokens_per_step: int, facts: ModelFacts) -> Search:
    """A Search over the project's validation and the memory and communication models."""
    from .comm import collectives_per_step, per_rank
    from .memory import memory_floor, memory_per_rank

    return Search(cfg, cluster, tokens_per_step, facts, memory_per_rank, collectives_per_step,
                  validate_layout, lambda cfg: per_rank(cfg, muonclip=False), per_rank, memory_floor)
