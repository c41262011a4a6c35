"""Apply parallelism to a single-device model, in torchtitan's fixed order (docs/architecture.md): cut the
pipeline stages, then on each stage context parallelism (which only tells the stage's forward its group),
tensor parallelism, expert parallelism, activation checkpointing, torch.compile, FSDP2."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from kimi.model import KimiModel
from kimi.parallel.config import ParallelConfig
from kimi.schema.pipeline import stages_per_rank

from .activation_checkpointing import apply_activation_checkpointing, apply_compile
from .context_parallel import ContextParallel
from .dims import ParallelDims
from .expert_parallel import apply_expert_parallel
from .fsdp import apply_data_parallel
from .pipeline import split_blocks, stage_parts
from .tensor_parallel import apply_tensor_parallel


def parallelize(model: KimiModel, cfg: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh | None,
                bf16: bool = False, seq_len: int = 0,
                expert_mesh: DeviceMesh | None = None) -> list[KimiModel]:
    """Returns the parts of `model` this rank runs, parallelised: its pipeline stages, or `model` itself
    without a pipeline. KimiModel.union(parts) is every parameter this rank holds, under the whole model's
    names (what the optimizer and checkpoints see); build it once the parts are materialised."""
    parts = [model]
    if dims.pp > 1:
        virtual = stages_per_rank(cfg)
        ranges = split_blocks(model.cfg, dims.pp * virtual, seq_len, cfg.pp_split)
        parts = stage_parts(model, ranges, mesh["pp"].get_local_rank(), dims.pp, virtual)
    for part in parts:
        if dims.cp > 1:
            part.context_parallel = ContextParallel(mesh["cp"].get_group())
        if dims.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], cfg.sequence_parallel, loss_parallel=dims.loss_parallel)
        if expert_mesh is not None:
            apply_expert_parallel(part, expert_mesh["ep"])
        apply_activation_checkpointing(part, cfg.activation_checkpointing, compiled=cfg.compile)
        if cfg.compile:
            apply_compile(part, cfg.cuda_graphs, selective=cfg.activation_checkpointing == "selective")
        if dims.fsdp:  # each stage is an FSDP root: it is what the schedule calls
            apply_data_parallel(part, dims.fsdp_mesh(mesh), cfg.reshard_after_forward, bf16, expert_mesh)
    return parts
