"""Apply parallelism to a single-device model, in torchtitan's fixed order (DESIGN.md): the pipeline stage's
part of the model, tensor parallelism, activation checkpointing, torch.compile, then FSDP2."""

from __future__ import annotations

from torch import nn

from kimi.config import ParallelConfig

from torch.distributed.device_mesh import DeviceMesh

from .checkpointing import apply_activation_checkpointing, apply_compile
from .dims import ParallelDims
from .fsdp import apply_data_parallel
from .pipeline import make_stage, split_blocks
from .tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Module, cfg: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh | None,
                bf16: bool = False, seq_len: int = 0) -> nn.Module:
    if dims.pp > 1:
        stage = mesh["pp"].get_local_rank()
        blocks = split_blocks(model.cfg, dims.pp, seq_len, cfg.pp_split)[stage]
        make_stage(model, blocks, first=stage == 0, last=stage == dims.pp - 1)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    if dims.dp > 1:
        apply_data_parallel(model, mesh["dp_replicate", "dp_shard"], cfg.reshard_after_forward, bf16)
    return model
