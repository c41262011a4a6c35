"""The parallel section's rules: its degrees and options, the layout against the number of processes, and
the engine's (kimi/parallel/engine_rules.py). kimi.run.validation runs them before any data work."""

from __future__ import annotations

import importlib.util

from kimi.config import Config, ConfigError, ParallelConfig, check, check_choices, require

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
    require(not cfg.model.moe_num_experts,
            f"model.moe_num_experts={cfg.model.moe_num_experts} with parallel.fault_tolerance=torchft: the "
            "expert biases follow each group's own token counts, so replica groups would drift apart; use a "
            "dense model (model.moe_num_experts=0) or parallel.fault_tolerance=none")
