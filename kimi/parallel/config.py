"""The parallel section (parallel.*, parallel.deepspeed, parallel.torchft): its schema and the names
parallel.engine takes.

Torch-free, like every section's config (kimi/schema/__init__.py); the section's rules, and the rules across
sections that parallelism sets, are kimi/parallel/rules.py's; the engines kimi/parallel/engine_rules.py's;
the pipeline's counts kimi/schema/pipeline.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kimi.schema.pipeline import PP_SCHEDULES
from kimi.schema.vocabulary import one_of

# parallel.engine's names: the table of kimi/parallel/engine_rules.py, which fills it (it imports this module)
ENGINES: Dict[str, Any] = {}
AC_MODES = ("none", "full", "selective")
CUDA_GRAPHS = ("none", "regions", "step")  # parallel.cuda_graphs (kimi/parallel/cuda_graphs.py)
FAULT_TOLERANCE = ("none", "torchft")


@dataclass
class DeepSpeedConfig:
    """parallel.engine=deepspeed (kimi/parallel/deepspeed_engine.py): ZeRO over the dp_shard ranks; the
    DeepSpeed JSON config is generated from these and the rest of the config (run_dir/deepspeed.json)."""

    zero_stage: int = 2  # 1: optimizer state partitioned; 2: + gradients; 3: + parameters
    reduce_bucket_size: int = 500_000_000  # elements per gradient reduction bucket
    allgather_bucket_size: int = 500_000_000  # elements per parameter all-gather bucket (stages 1-2)
    overlap_comm: bool = False  # overlap gradient reduction with the backward
    offload_optimizer: bool = False  # keep optimizer state and fp32 masters in CPU memory (ZeRO-Offload)


@dataclass
class TorchftConfig:
    """parallel.fault_tolerance=torchft (kimi/parallel/fault_tolerance.py): each replica group is a job of its
    own; gradients are averaged over the groups in the step's quorum, a group that (re)joins takes a peer's
    live state."""

    replica_group: int = 0  # this job's group, 0..replica_groups-1: which share of the data it reads
    replica_groups: int = 2  # groups the run is planned with: the global batch when all are in the quorum
    # e.g. http://host:29510; null: the TORCHFT_LIGHTHOUSE environment variable
    lighthouse: Optional[str] = None
    min_replicas: int = 1  # groups a step needs to commit its update (the others wait for more)
    timeout_s: float = 60.0  # a collective or a state transfer between groups
    quorum_timeout_s: float = 60.0  # waiting for the quorum at the start of a step


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    # expert parallelism: the routed experts of every MoE layer split over this many of the dp_shard ranks
    # (kimi/parallel/expert_parallel.py); the experts' weights are FSDP-sharded over the rest
    ep: int = 1
    # context parallelism: every sequence split into this many consecutive shards, one per rank
    # (kimi/parallel/context_parallel.py); trainer.seq_len must divide by it
    cp: int = 1
    activation_checkpointing: str = one_of(AC_MODES, "none")  # see kimi/parallel/activation_checkpointing.py
    compile: bool = False  # torch.compile each token mixer and MLP
    # on one CUDA GPU (kimi/parallel/cuda_graphs.py): none; regions (with compile: each compiled region
    # replays as a CUDA graph); step (each micro-batch's forward and backward replays as one graph)
    cuda_graphs: str = one_of(CUDA_GRAPHS, "none")
    reshard_after_forward: bool = True  # FSDP2: False keeps weights gathered until the backward (ZeRO-2-like)
    sequence_parallel: bool = False  # with tp > 1: activations between sublayers split along the sequence
    pp_schedule: str = one_of(PP_SCHEDULES, "1f1b")
    pp_virtual_stages: int = 2  # stages per rank for interleaved_1f1b and zero_bubble
    pp_microbatches: int = 0  # micro-batches per step through the pipeline; 0: as many as stages
    pp_split: Optional[List[int]] = None  # first block of stages 1..pp-1; null: balanced by FLOPs
    # torch: FSDP2/TP/PP from torch.distributed; deepspeed: DeepSpeed's ZeRO 1-3 over dp_shard ranks
    engine: str = one_of(ENGINES, "torch")
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    # none, or torchft: replica groups (each its own torchrun job) that train on when one is lost
    fault_tolerance: str = one_of(FAULT_TOLERANCE, "none")
    torchft: TorchftConfig = field(default_factory=TorchftConfig)
