"""Parallelism, applied from outside the single-device model (docs/architecture.md).

``ParallelDims`` holds the (already validated) degrees and builds the DeviceMesh (pp, dp_replicate, dp_shard,
tp); ``parallelize`` cuts the pipeline stages and applies to each, in order, tensor (and sequence)
parallelism, activation checkpointing, torch.compile and FSDP2 (ZeRO-3 per sublayer; HSDP when
dp_replicate > 1); an engine (``engine.TorchEngine``, chosen by parallel.engine) owns the step.
"""

from .checkpointing import apply_activation_checkpointing, apply_compile
from .dims import (ParallelDims, checkpoint_group, destroy_distributed, init_distributed, mean_over_ranks,
                   resolve_device, setup_group)
from .engine import ENGINES, TorchEngine, build_engine
from .fsdp import apply_data_parallel
from .parallelize import parallelize

__all__ = ["ENGINES", "ParallelDims", "TorchEngine", "apply_activation_checkpointing", "apply_compile",
           "apply_data_parallel", "build_engine", "checkpoint_group", "destroy_distributed", "init_distributed",
           "mean_over_ranks", "parallelize", "resolve_device", "setup_group"]
