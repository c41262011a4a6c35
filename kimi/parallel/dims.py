"""Degrees of parallelism, the process group and the DeviceMesh.

The mesh dimensions, outermost first, are (pp, dp_replicate, dp_shard, tp): tensor-parallel ranks are
neighbours (the fastest links), pipeline stages the farthest apart, and a rank's data-parallel index is its
position in the flattened (dp_replicate, dp_shard) pair. Ranks of one tp group, and the stages of one
pipeline, read the same data.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kimi.config import ConfigError, ParallelConfig

from .checkpointing import MODES


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world: int

    @classmethod
    def from_config(cls, p: ParallelConfig, world: int | None = None) -> "ParallelDims":
        """Check the degrees against ``world`` (default: torchrun's WORLD_SIZE); errors say what to change."""
        world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
        dims = cls(p.dp_replicate, p.dp_shard, p.tp, p.pp, world)
        if p.activation_checkpointing not in MODES:
            raise ConfigError(f"parallel.activation_checkpointing={p.activation_checkpointing!r} is invalid: "
                              f"choose one of {'|'.join(MODES)}")
        for name in ("dp_replicate", "dp_shard", "tp", "pp"):
            if getattr(dims, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(dims, name)} is invalid: degrees are >= 1")
        product = dims.dp_replicate * dims.dp_shard * dims.tp * dims.pp
        if product != world:
            raise ConfigError(
                f"parallel.dp_replicate*dp_shard*tp*pp = {dims.dp_replicate}*{dims.dp_shard}*{dims.tp}*{dims.pp}"
                f" = {product} but {world} process(es) were launched; make the product equal the number of "
                f"processes (e.g. torchrun --nproc_per_node={product}, or parallel.dp_shard={world})")
        if p.sequence_parallel and dims.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1 (it splits the sequence over "
                              "the tensor-parallel ranks)")
        if dims.pp > 1:
            from .pipeline import SCHEDULES

            if p.pp_schedule not in SCHEDULES:
                raise ConfigError(f"parallel.pp_schedule={p.pp_schedule!r} is invalid: choose one of "
                                  f"{'|'.join(SCHEDULES)}")
            if 0 < p.pp_microbatches < dims.pp and p.pp_schedule != "gpipe":
                raise ConfigError(f"parallel.pp_microbatches={p.pp_microbatches} is too few for the "
                                  f"{p.pp_schedule} schedule over {dims.pp} ranks: use at least {dims.pp} (or 0 "
                                  "for that many)")
            if p.pp_virtual_stages < 1:
                raise ConfigError(f"parallel.pp_virtual_stages={p.pp_virtual_stages} is invalid: use >= 1")
        return dims

    def virtual_stages(self, p: ParallelConfig) -> int:
        """Pipeline stages each rank runs."""
        from .pipeline import SINGLE_STAGE

        return 1 if self.pp == 1 or p.pp_schedule in SINGLE_STAGE else p.pp_virtual_stages

    @property
    def loss_parallel(self) -> bool:
        """Whether the LM head's logits stay sharded over the vocabulary for the loss: under tensor
        parallelism (with a pipeline too: the trainer runs the schedule under loss_parallel())."""
        return self.tp > 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's data-parallel index (which micro-batches it reads)."""
        if mesh is None:
            return 0
        _, replicate, shard, _ = mesh.get_coordinate()
        return replicate * self.dp_shard + shard

    def stage_group(self, mesh: DeviceMesh | None):
        """The ranks that hold this rank's pipeline stage (all of them without pipeline parallelism): the
        process group MuonClip coordinates over."""
        if mesh is None:
            return None
        if self.pp == 1:
            return dist.group.WORLD
        return mesh["dp_replicate", "dp_shard", "tp"]._flatten().get_group()


def init_distributed(device: torch.device) -> None:
    """Join torchrun's process group: NCCL for CUDA, gloo for CPU; each CUDA rank takes its local GPU."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def destroy_distributed() -> None:
    """Leave cleanly: gloo can abort at interpreter exit if its threads outlive the group (ENVIRONMENT.md)."""
    if dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
