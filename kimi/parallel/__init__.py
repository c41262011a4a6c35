"""Parallelism, applied from outside the single-device model (DESIGN.md).

``ParallelDims`` checks the configured degrees against the launched processes before any work, builds the
DeviceMesh, and ``apply_data_parallel`` shards the model with FSDP2 (ZeRO-3 per block; HSDP when
dp_replicate > 1). Tensor and pipeline parallelism plug in here next.
"""

from .dims import ParallelDims, destroy_distributed, init_distributed
from .fsdp import apply_data_parallel

__all__ = ["ParallelDims", "apply_data_parallel", "destroy_distributed", "init_distributed"]
