"""Apply parallelism to a single-device model, in torchtitan's fixed order (DESIGN.md): the pipeline stage's
part of the model, tensor parallelism, activation checkpointing, torch.compile, then FSDP2."""

from __future__ import annotations

from torch import nn

from kimi.config import ParallelConfig

from torch.distributed.device_mesh import DeviceMesh

from .checkpointing import apply_activation_checkpointing, apply_compile
from .dims import ParallelDims
from .fsdp import apply_data_parallel
from .pipeline import StageView, split_blocks, stage_indices, trim
from .tensor_parallel import apply_tensor_parallel, sum_final_grads


def parallelize(model: nn.Module, cfg: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh | None,
                bf16: bool = False, seq_len: int = 0) -> tuple[nn.Module, list[StageView]]:
    """Returns the (trimmed) model, which holds every parameter of this rank under its single-device name,
    and the pipeline stages this rank runs (none without pipeline parallelism)."""
    stages: list[tuple[range, bool, bool]] = []
    if dims.pp > 1:
        virtual = dims.virtual_stages(cfg)
        total = dims.pp * virtual
        ranges = split_blocks(model.cfg, total, seq_len, cfg.pp_split)
        stages = [(ranges[i], i == 0, i == total - 1)
                  for i in stage_indices(mesh["pp"].get_local_rank(), dims.pp, virtual)]
        trim(model, [r for r, _, _ in stages], any(f for _, f, _ in stages), any(la for _, _, la in stages))
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], cfg.sequence_parallel, loss_parallel=dims.loss_parallel)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    views = [StageView(model, r, first, last) for r, first, last in stages]
    if dims.tp > 1 and cfg.sequence_parallel:
        for view in views:
            sum_final_grads(view, mesh["tp"])
    if dims.dp > 1:
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        for unit in views or [model]:  # each stage is an FSDP root: it is what the schedule calls
            apply_data_parallel(unit, dp_mesh, cfg.reshard_after_forward, bf16)
        for view in views:
            if view.final_query is not None:
                # the one parameter a stage holds directly: FSDP replaced it on the stage; keep the model's
                # name pointing at the same (sharded) tensor
                model.final_query = view.final_query
    return model, views
