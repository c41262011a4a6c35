"""Parallelism, applied from outside the single-device model (DESIGN.md).

``ParallelDims`` checks the configured degrees against the launched processes before any work and builds
the DeviceMesh (pp, dp_replicate, dp_shard, tp); ``parallelize`` applies, in order, the pipeline stage's
trim, tensor (and sequence) parallelism, activation checkpointing, torch.compile and FSDP2 (ZeRO-3 per
sublayer; HSDP when dp_replicate > 1); ``pipeline.build_schedule`` runs the stages.
"""

from .checkpointing import apply_activation_checkpointing, apply_compile
from .dims import ParallelDims, destroy_distributed, init_distributed
from .fsdp import apply_data_parallel
from .parallelize import parallelize

__all__ = ["ParallelDims", "apply_activation_checkpointing", "apply_compile", "apply_data_parallel",
           "destroy_distributed", "init_distributed", "parallelize"]
