"""The plan as text (the ranked layouts, each one's memory and communication, the rejections, the
assumptions) and as JSON."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Sequence, Tuple

from kimi.summary import table

from . import timing
from .cluster import GIB, Cluster
from .search import RESERVE, Evaluated, Plan

MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "fsdp_gathered", "comm_buffers")

ASSUMPTIONS = [
    "compute = model FLOPs per rank (the step's FLOPs / GPUs, recomputation added) / (peak x MFU "
    "ceiling); the ceiling is the compiled roofline's for model=1b, one 4,096-token row "
    "(bench/results/step_audit.json: "
    f"H200 {timing.MFU_CEILING['h200']:.1%}, H100 {timing.MFU_CEILING['h100']:.1%}; B200 takes the H200's), "
    "for every model; layouts without parallel.compile take the unfused ceiling "
    f"({timing.MFU_CEILING_UNFUSED['h200']:.1%} on an H200)",
    "tensor, context and expert parallelism are assumed to keep the matmuls as efficient as one GPU's",
    f"fp8 runs the matmul share of the step ({timing.MATMUL_SHARE:.1%}) at twice the bf16 rate",
    "recomputation: activation checkpointing full adds a forward "
    f"(x{timing.RECOMPUTE['full']:.2f}), selective the forward's non-matmul work "
    f"(x{timing.RECOMPUTE['selective']:.2f})",
    "pipeline bubble = compute x (pp - 1) / (micro-batches x stages per rank) (1F1B, interleaved 1F1B)",
    "MuonClip owner compute: Newton-Schulz FLOPs of the matrices the busiest rank of a stage owns (largest "
    "first to the least loaded; an expert tensor is one parameter), at the same peak x ceiling; fused "
    "matrices are counted whole",
    "communication: ring collectives, all_reduce 2(n-1)/n, all_gather/reduce_scatter/all_to_all (n-1)/n of "
    "the full buffer (kimi.plan.comm's bytes are FSDP's and ZeRO's outputs, tp's and cp's inputs), send/recv "
    "once, at NVLink bandwidth when the group stays within a node (mesh order pp, "
    "dp_replicate, dp_shard, cp, tp, tp innermost), else the inter-node bandwidth; no per-call latency",
    "overlap: FSDP/ZeRO gathers and gradient reductions (dp_shard, dp_replicate) and pipeline sends run "
    "beside compute (only their excess over the compute time counts); tp, cp, ep collectives, every "
    "all_to_all and MuonClip's transfers are exposed",
    "fits: the heaviest rank's memory at its peak (kimi.plan.memory, the sum of its parts) within the "
    f"GPU's HBM less a {RESERVE:.0%} reserve",
]


MAX_REJECTED = 15


def grouped(by_reason: Dict[str, List[str]]) -> List[Tuple[str, List[str]]]:
    """Reasons that differ only in their numbers as one line (the first one's text), most families first;
    the rules come first and memory last (the memory ones say how far off each family is)."""
    groups: Dict[str, Tuple[str, List[str]]] = {}
    for reason, fams in by_reason.items():
        first, merged = groups.setdefault(re.sub(r"[0-9.]+", "#", reason), (reason, []))
        merged.extend(f for f in fams if f not in merged)
    return sorted(groups.values(), key=lambda g: ("GiB" in g[0], -len(g[1])))


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _bytes(n: float) -> str:
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def text(plan: Plan, cluster: Cluster, cfg, overrides: Sequence[str]) -> str:
    t = cfg.trainer
    c = cluster
    out = [f"Plan: model {cfg.model.name} on {c.gpus} x {c.gpu} ({c.gpus_per_node} per node), "
           f"{plan.tokens_per_step:,} tokens per step in rows of trainer.seq_len={t.seq_len}, "
           f"optim={cfg.optim.name}",
           f"  per GPU: {c.peak_flops / 1e12:.3g} TFLOP/s dense bf16, {_gib(c.hbm_bytes)} GiB HBM "
           f"({_gib(c.hbm_bytes * (1 - RESERVE))} usable), NVLink {c.intra_node_bandwidth / 1e9:.0f} GB/s, "
           f"inter-node {c.inter_node_bandwidth / 1e9:.0f} GB/s",
           f"  searched {plan.shapes:,} shapes, {plan.candidates:,} layouts; {plan.walked:,} evaluated "
           f"(fastest lower bound first), {plan.sized:,} sized, in {plan.seconds:.1f} s"]
    if not plan.best:
        out += ["", "No layout fits: see the rejections below."]
    else:
        rows = []
        for i, e in enumerate(plan.best, 1):
            st = e.time
            rows.append([str(i), e.layout.label(), f"{st.step_s:.3f}", f"{e.tokens_per_s:,.0f}",
                         f"{e.mfu:.1%}", _ms(st.compute_s), _ms(st.bubble_s), _ms(st.muon_s),
                         _ms(st.comm_exposed_s), _gib(e.peak)])
        out += ["", "Layouts, fastest predicted first (times in ms unless marked)",
                table(rows, ["#", "layout", "step s", "tokens/s", "MFU", "compute", "bubble", "Muon NS",
                             "comm exposed", "GiB/rank"], "llrrrrrrrr")]
        for i, e in enumerate(plan.best, 1):
            out += ["", *detail(i, e, overrides)]
    out += ["", "Rejected (a reason, e.g. its first case, and the families of layouts it rejects)"]
    groups = grouped(plan.rejected.by_reason)
    for reason, fams in groups[:MAX_REJECTED]:
        more = f" and {len(fams) - 3} more" if len(fams) > 3 else ""
        out.append(f"  {reason}: {', '.join(fams[:3])}{more}")
    if not groups:
        out.append("  none")
    if len(groups) > MAX_REJECTED:
        out.append(f"  ... {len(groups) - MAX_REJECTED} more reasons (json=PATH lists them all)")
    out += ["", "Assumptions (docs/planning.md)"] + [f"  - {a}" for a in ASSUMPTIONS]
    return "\n".join(out)


def detail(i: int, e: Evaluated, overrides: Sequence[str]) -> List[str]:
    mem = "  ".join(f"{k} {_gib(e.memory.get(k, 0))}" for k in MEMORY_PARTS)
    out = [f"#{i} {e.layout.label()}",
           f"  train.py overrides: {' '.join([*overrides, *e.layout.overrides()])}",
           f"  memory per rank, GiB: {mem}  (peak {_gib(e.peak)})"]
    comm = e.time.by_kind()
    if not comm:
        out.append("  communication: none")
    for kind, row in comm.items():
        out.append(f"  communication {kind}: {_bytes(row['bytes'])} per step, {_ms(row['seconds'])} ms")
    return out


def as_json(plan: Plan, cluster: Cluster, cfg, overrides: Sequence[str]) -> Dict[str, Any]:
    def layout(e: Evaluated) -> Dict[str, Any]:
        st = e.time
        return {"label": e.layout.label(), "layout": dataclasses.asdict(e.layout),
                "overrides": [*overrides, *e.layout.overrides()], "step_s": st.step_s,
                "compute_s": st.compute_s, "bubble_s": st.bubble_s, "muon_s": st.muon_s,
                "comm_exposed_s": st.comm_exposed_s, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu,
                "memory_bytes": e.memory, "memory_peak_bytes": e.peak,
                "communication": [dataclasses.asdict(c) for c in st.comm]}

    return {"model": cfg.model.name, "seq_len": cfg.trainer.seq_len, "tokens_per_step": plan.tokens_per_step,
            "cluster": dataclasses.asdict(cluster), "reserve": RESERVE, "shapes": plan.shapes,
            "candidates": plan.candidates, "evaluated": plan.walked, "sized": plan.sized,
            "seconds": plan.seconds,
            "layouts": [layout(e) for e in plan.best],
            "rejected": [{"reason": r, "families": f} for r, f in plan.rejected.by_reason.items()],
            "assumptions": ASSUMPTIONS}
