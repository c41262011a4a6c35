"""Apply parallelism to a single-device model, in torchtitan's fixed order (DESIGN.md): tensor parallelism
(not yet), activation checkpointing, torch.compile, then FSDP2 data parallelism."""

from __future__ import annotations

import torch
from torch import nn

from kimi.config import ParallelConfig

from .checkpointing import apply_activation_checkpointing, apply_compile
from .dims import ParallelDims
from .fsdp import apply_data_parallel


def parallelize(model: nn.Module, cfg: ParallelConfig, dims: ParallelDims, device: torch.device,
                bf16: bool = False) -> nn.Module:
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    if dims.enabled:
        apply_data_parallel(model, dims.build_mesh(device.type), cfg.reshard_after_forward, bf16)
    return model
