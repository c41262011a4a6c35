"""The parallel section's rules: its degrees and options, the layout against the number of processes, the
engine's (kimi/parallel/engine_rules.py), and the rules across sections that parallelism sets (sequence,
context, expert and pipeline parallelism against the model and the batch). kimi.run.validation runs them
before any data work; the planner (kimi/plan/search.py) asks the cross-section ones of each layout it tries.

Torch-free: kimi.config re-exports the cross-section rules, as it held them before."""

from __future__ import annotations

import importlib.util
from typing import List, Optional

from kimi.errors import ConfigError
from kimi.schema.pipeline import SINGLE_STAGE_SCHEDULES, pipeline_microbatches, pipeline_stages
from kimi.schema.vocabulary import RootConfig as Config
from kimi.schema.vocabulary import check, check_choices, require

from .config import ParallelConfig
from .engine_rules import engine_problem


def validate_parallel(p: ParallelConfig) -> None:
    check_choices(p, "parallel")
    for key in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
        check(getattr(p, key) >= 1, f"parallel.{key}", getattr(p, key), "must be >= 1")
    check(p.pp_virtual_stages >= 1, "parallel.pp_virtual_stages", p.pp_virtual_stages, "must be >= 1")
    check(p.pp_microbatches >= 0, "parallel.pp_microbatches", p.pp_microbatches,
          "must be >= 0 (0: as many as pipeline ranks)")
    ds = p.deepspeed
    check(ds.zero_stage in (1, 2, 3), "parallel.deepspeed.zero_stage", ds.zero_stage, "choose 1, 2 or 3")
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        check(getattr(ds, key) >= 1, f"parallel.deepspeed.{key}", getattr(ds, key), "must be >= 1 (elements)")


def check_engine(p: ParallelConfig) -> None:
    """The layouts the engine parallel.engine names cannot run (kimi/parallel/engine_rules.py)."""
    problem = engine_problem(p)
    require(problem is None, problem or "")


def _layout_hint(p: ParallelConfig, world: int) -> str:
    """How to make dp_replicate*dp_shard*cp*tp*pp equal the number of processes: the dp_shard that does it
    with the other degrees kept (when one exists), else the degrees that must change; and the process count
    this layout needs."""
    product = p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
    others = p.dp_replicate * p.cp * p.tp * p.pp
    launch = f"torchrun --nproc_per_node {product} for this layout"
    if world % others == 0 and world // others != p.dp_shard:
        return f"set parallel.dp_shard={world // others} for {world} processes, or launch {launch}"
    keys = [f"parallel.{k}" for k in ("dp_replicate", "cp", "tp", "pp") if getattr(p, k) > 1]
    return f"launch {launch}, or change {' and/or '.join(keys)} so that the product is {world}"


def check_layout(p: ParallelConfig, world: int) -> None:
    """The degrees against the number of processes."""
    product = p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
    degrees = f"{p.dp_replicate}*{p.dp_shard}*{p.cp}*{p.tp}*{p.pp}"
    if product != world:
        raise ConfigError(f"parallel.dp_replicate*dp_shard*cp*tp*pp = {degrees} = {product} but {world} "
                          f"process(es) were launched; the product must equal the number of processes: "
                          f"{_layout_hint(p, world)}")
    require(not p.sequence_parallel or p.tp > 1,
            "parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the sequence over the "
            "tensor-parallel ranks)")


TORCHFT_MISSING = ("parallel.fault_tolerance=torchft needs the torchft package, which is not installed: "
                   "pip install -e '.[ft]' (the project's ft extra), or set parallel.fault_tolerance=none")


def check_fault_tolerance(cfg: Config) -> None:
    """parallel.fault_tolerance=torchft (kimi/parallel/fault_tolerance.py): its knobs, and the layouts and
    models whose every update it keeps identical across replica groups."""
    p = cfg.parallel
    if p.fault_tolerance != "torchft":
        return
    ft = p.torchft
    check(ft.replica_groups >= 1, "parallel.torchft.replica_groups", ft.replica_groups, "must be >= 1")
    check(0 <= ft.replica_group < ft.replica_groups, "parallel.torchft.replica_group", ft.replica_group,
          f"must be in 0..{ft.replica_groups - 1} (parallel.torchft.replica_groups={ft.replica_groups})")
    check(1 <= ft.min_replicas <= ft.replica_groups, "parallel.torchft.min_replicas", ft.min_replicas,
          f"must be in 1..{ft.replica_groups} (parallel.torchft.replica_groups)")
    for key in ("timeout_s", "quorum_timeout_s"):
        check(getattr(ft, key) > 0, f"parallel.torchft.{key}", getattr(ft, key), "must be > 0 seconds")
    require(not cfg.data.streaming, "data.streaming=true with parallel.fault_tolerance=torchft: a joining "
            "group takes its peers' data position, and a stream's is per rank; set data.streaming=false "
            "(prepared shards) or parallel.fault_tolerance=none")
    require(importlib.util.find_spec("torchft") is not None, TORCHFT_MISSING)
    unsupported = [f"parallel.{k}={getattr(p, k)}" for k in ("pp",) if getattr(p, k) > 1]
    unsupported += [f"parallel.engine={p.engine}"] if p.engine != "torch" else []
    require(not unsupported, f"parallel.fault_tolerance=torchft runs on the torch engine without pipeline "
            f"parallelism, not with {', '.join(unsupported)}: reset those, or set "
            "parallel.fault_tolerance=none")
    require(p.dp_replicate == 1,
            f"parallel.dp_replicate={p.dp_replicate} with parallel.fault_tolerance=torchft: the replica "
            "groups are the replicate dimension (one torchrun job each); set parallel.dp_replicate=1 and "
            "launch parallel.torchft.replica_groups jobs")
    require(not cfg.model.moe.num_experts,
            f"model.moe.num_experts={cfg.model.moe.num_experts} with parallel.fault_tolerance=torchft: the "
            "expert biases follow each group's own token counts, so replica groups would drift apart; use a "
            "dense model (model.moe.num_experts=0) or parallel.fault_tolerance=none")


# ---- across sections -------------------------------------------------------------------------------------
def check_sequence_parallel(cfg: Config) -> None:
    """Sequence parallelism splits every sequence over the tp (and cp) ranks."""
    p, t = cfg.parallel, cfg.trainer
    if p.tp > 1 and p.sequence_parallel:
        ranks = f"parallel.tp={p.tp} ranks" if p.cp == 1 else f"parallel.cp*tp={p.cp}*{p.tp} ranks"
        require(t.seq_len % (p.tp * p.cp) == 0,
                f"trainer.seq_len={t.seq_len} does not split over {ranks} for sequence parallelism: make it "
                f"a multiple of {p.tp * p.cp}")


def check_context_parallel(cfg: Config) -> None:
    """parallel.cp splits every row into equal shards; what does not work across them yet is named."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    if p.cp == 1:
        return
    require(t.seq_len % p.cp == 0,
            f"trainer.seq_len={t.seq_len} does not split into parallel.cp={p.cp} equal shards: make it a "
            f"multiple of {p.cp}")
    require(t.seq_len // p.cp >= m.conv_size - 1,
            f"trainer.seq_len={t.seq_len} over parallel.cp={p.cp} gives shards of {t.seq_len // p.cp} "
            f"tokens, shorter than the short convolutions' halo (model.conv_size - 1 = {m.conv_size - 1}): "
            "use a longer sequence or a smaller cp")
    unsupported = [f"parallel.{k}={getattr(p, k)}" for k in ("ep",) if getattr(p, k) > 1]
    unsupported += ["parallel.compile=true"] if p.compile else []
    unsupported += [f"model.moe.aux_loss_coef={m.moe.aux_loss_coef} (its balance statistics are per whole "
                    "sequence; the aux-loss-free bias update works)"] if m.moe.aux_loss_coef else []
    require(not unsupported,
            f"parallel.cp={p.cp} does not work with {', '.join(unsupported)} yet: reset those, or use "
            "parallel.cp=1")


CUDA_GRAPHS_ONE_GPU = ("one GPU: a captured graph reads its weights at the addresses they had when it "
                       "was recorded (FSDP gathers them anew every step) and cannot hold the collectives of "
                       "tensor, pipeline, context or expert parallelism")


def check_cuda_graphs(cfg: Config) -> None:
    """parallel.cuda_graphs (kimi/parallel/cuda_graphs.py): on one CUDA GPU; regions replays what
    parallel.compile compiles; step cannot hold a host read. The device that trainer.device=auto resolves
    to is checked when the engine is built (TorchEngine)."""
    p, mode = cfg.parallel, cfg.parallel.cuda_graphs
    if mode == "none":
        return
    key = f"parallel.cuda_graphs={mode}"
    require(mode != "regions" or p.compile,
            f"{key} replays the regions parallel.compile compiles: set parallel.compile=true as well, or "
            "parallel.cuda_graphs=step (the whole micro-batch, compiled or not)")
    require(cfg.trainer.device != "cpu", f"{key} needs a CUDA GPU (trainer.device=cpu has no graphs to "
                                         "capture): set parallel.cuda_graphs=none on the CPU")
    layout = [f"parallel.{k}={getattr(p, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
              if getattr(p, k) > 1]
    require(not layout, f"{key} runs on {CUDA_GRAPHS_ONE_GPU}; with {', '.join(layout)} set "
                        "parallel.cuda_graphs=none")
    require(mode != "step" or not cfg.data.varlen,
            f"{key} with data.varlen=true: packed documents' offsets are read on the host every batch, "
            "which a captured graph cannot do; set data.varlen=false or parallel.cuda_graphs=regions")


def check_expert_parallel(cfg: Config) -> None:
    """parallel.ep takes its ranks from dp_shard and splits every MoE layer's experts evenly."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return
    require(m.moe.num_experts > 0, f"parallel.ep={p.ep} needs a mixture-of-experts model "
                                    "(model.moe.num_experts > 0, e.g. model=moe_tiny): expert parallelism "
                                    "splits the routed experts; set parallel.ep=1")
    require(p.dp_shard % p.ep == 0,
            f"parallel.ep={p.ep} does not divide parallel.dp_shard={p.dp_shard}: the expert-parallel ranks "
            "are taken from the dp_shard ranks; make dp_shard a multiple of ep")
    require(m.moe.num_experts % p.ep == 0,
            f"model.moe.num_experts={m.moe.num_experts} is not divisible by parallel.ep={p.ep}: each "
            "expert-parallel rank holds the same number of experts; choose an ep that divides it")


def check_stage_split(p: ParallelConfig, layers: int, split: Optional[List[int]]) -> None:
    """Every pipeline stage needs a block; parallel.pp_split names where stages 1.. start."""
    stages = pipeline_stages(p)
    if stages == p.pp:
        require(stages <= layers, f"parallel.pp={stages} is more stages than model.num_layers={layers}; "
                                  "every stage needs a block: lower parallel.pp")
    else:
        require(stages <= layers,
                f"parallel.pp={p.pp} x parallel.pp_virtual_stages={p.pp_virtual_stages} = {stages} stages "
                f"({p.pp_schedule}) is more than model.num_layers={layers}; every stage needs a block: "
                "lower parallel.pp_virtual_stages or parallel.pp")
    if split:
        split = [int(i) for i in split]
        bounds = [0, *split, layers]
        require(len(split) == stages - 1 and all(a < b for a, b in zip(bounds, bounds[1:])),
                f"parallel.pp_split={split} is invalid: give {stages - 1} rising block indices in "
                f"(0, {layers}) where stages 1..{stages - 1} start")


def check_pipeline(cfg: Config) -> None:
    """Stages against blocks, pp_split, and the micro-batches a step sends through the pipeline."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    if p.pp == 1:
        require(not p.pp_split,
                f"parallel.pp_split={list(p.pp_split or [])} is invalid: it sets pipeline stage boundaries "
                "and parallel.pp=1 has one stage; set parallel.pp_split=null")
        return
    check_stage_split(p, m.num_layers, p.pp_split)
    n = pipeline_microbatches(cfg)
    require(n >= p.pp or p.pp_schedule == "gpipe",
            f"parallel.pp_microbatches={p.pp_microbatches} is too few for the {p.pp_schedule} schedule over "
            f"{p.pp} ranks: use at least {p.pp} (or 0 for that many)")
    if p.pp_schedule not in SINGLE_STAGE_SCHEDULES:
        # torch's interleaved schedules run max(1, n // pp) rounds of equally many micro-batches
        rounds = max(1, n // p.pp)
        require(n % rounds == 0,
                f"parallel.pp_microbatches={n} is invalid for parallel.pp_schedule={p.pp_schedule} over "
                f"parallel.pp={p.pp} ranks: torch runs it in {rounds} rounds of equally many micro-batches; "
                f"use a multiple of {p.pp}")
    require(t.micro_batch_size % n == 0,
            f"trainer.micro_batch_size={t.micro_batch_size} does not split into "
            f"parallel.pp_microbatches={n} micro-batches: make it a multiple of {n}")
    require(t.grad_accum_steps == 1,
            "trainer.grad_accum_steps > 1 with parallel.pp > 1: raise parallel.pp_microbatches and "
            "trainer.micro_batch_size instead (the pipeline accumulates over micro-batches)")

