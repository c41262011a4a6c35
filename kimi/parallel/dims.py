"""Degrees of parallelism, the process group and the DeviceMesh.

The mesh dimensions, outermost first, are (pp, dp_replicate, dp_shard, cp, tp): tensor-parallel ranks are
neighbours (the fastest links), context-parallel ranks next (they exchange a few small tensors per layer),
pipeline stages the farthest apart, and a rank's data-parallel index is its position in the flattened
(dp_replicate, dp_shard) pair. Ranks of one tp or cp group, and the stages of one pipeline, read the same
data (each cp rank keeps its shard of every row). FSDP shards over the flattened (dp_shard, cp) ranks, as
torchtitan does: the cp ranks hold the same weights and their gradients are averaged like data parallelism's.

With expert parallelism a second mesh over the same ranks splits dp_shard into (edp, ep), ep innermost:
(pp, dp_replicate, edp, ep, tp). The ep ranks of a group are neighbouring dp_shard ranks; the routed experts'
weights are split over ep and FSDP-sharded over (dp_replicate, edp), the rest of the model as before.
"""

from __future__ import annotations

import datetime
import gc
import os
import warnings
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kimi.errors import ConfigError
from kimi.parallel.config import ParallelConfig
from kimi.parallel.watchdog import stop_all

T = TypeVar("T")

# fsdp_mesh slices the flattened "dp_shard_cp" dim from the root mesh, which torch's DeviceMesh says it will
# deprecate: a note for us, not for the user, and every rank printed it. Rank 0 alone still shows it.
if int(os.environ.get("RANK", "0")) != 0:
    warnings.filterwarnings("ignore", message=r"Slicing a flattened dim from root mesh")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world: int
    ep: int = 1
    cp: int = 1
    # parallel.fault_tolerance=torchft: this job is replica group `replica_group` of `replica_groups`, each a
    # job of its own (kimi/parallel/fault_tolerance.py); the mesh above is one group's
    replica_group: int = 0
    replica_groups: int = 1

    @classmethod
    def from_config(cls, p: ParallelConfig, world: int | None = None) -> "ParallelDims":
        """The degrees of an already validated config (kimi.run.validation.validate checks them against the
        world)."""
        world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
        groups = (p.torchft.replica_group,
                  p.torchft.replica_groups) if p.fault_tolerance == "torchft" else (0, 1)
        return cls(p.dp_replicate, p.dp_shard, p.tp, p.pp, world, p.ep, p.cp, *groups)

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
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh

    @staticmethod
    def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
        """The (dp_replicate, dp_shard x cp) mesh FSDP places weights on (module docstring)."""
        return mesh["dp_replicate", "dp_shard_cp"]

    @property
    def fsdp(self) -> bool:
        """Whether weights go through FSDP: with data or context parallelism (whose gradients it averages)."""
        return self.dp * self.cp > 1

    def build_expert_mesh(self, device_type: str) -> DeviceMesh | None:
        """The (pp, dp_replicate, edp, ep, tp) mesh of expert parallelism (module docstring), or None."""
        if self.ep == 1:
            return None
        return init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep,
                                              self.tp), mesh_dim_names=("pp", "dp_replicate", "edp", "ep",
                                                                        "tp"))

    @property
    def data_world(self) -> int:
        """How many ranks read distinct micro-batches: the data-parallel ranks of every replica group."""
        return self.replica_groups * self.dp

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's data-parallel index (which micro-batches it reads), among data_world."""
        if mesh is None:
            return self.replica_group * self.dp
        _, replicate, shard, _, _ = mesh.get_coordinate()
        return self.replica_group * self.dp + replicate * self.dp_shard + shard

    def stage_group(self, mesh: DeviceMesh | None):
        """The ranks that hold this rank's pipeline stage (all of them without pipeline parallelism): the
        process group MuonClip coordinates over."""
        if mesh is None:
            return None
        if self.pp == 1:
            return dist.group.WORLD
        return mesh["dp_replicate", "dp_shard", "cp", "tp"]._flatten().get_group()


def sum_over(group) -> Callable[[torch.Tensor], None] | None:
    """An in-place sum of a tensor over `group` (None: one process, nothing to sum)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return lambda t: dist.all_reduce(t, group=group)


def resolve_device(name: str) -> torch.device:
    """trainer.device as a torch.device: auto is CUDA when visible, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device='cuda' is invalid: no CUDA device is visible; use "
                          "trainer.device=cpu")
    return torch.device(name)


def mean_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """x averaged over every rank, in place (x itself without torch.distributed)."""
    if dist.is_initialized():
        dist.all_reduce(x, op=dist.ReduceOp.AVG if x.device.type == "cuda" else dist.ReduceOp.SUM)
        if x.device.type != "cuda":  # gloo has no AVG
            x /= dist.get_world_size()
    return x


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """Join torchrun's process group: NCCL for CUDA, gloo for CPU; each CUDA rank takes its local GPU.

    Collectives wait timeout_s plus a minute: the watchdog (kimi/parallel/watchdog.py) ends a stalled job
    at timeout_s with a message naming the rank, before a collective's own timeout would."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kwargs = {}
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:
        # torchrun's agent keeps its store across restarts, with the previous group's addresses in it: a
        # restarted rank would connect to its dead predecessor. Each restart's group gets keys of its own.
        store, rank, world = next(dist.rendezvous("env://"))
        kwargs = {"store": dist.PrefixStore(f"kimi/restart{restart}", store), "rank": rank,
                  "world_size": world}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s + 60), **kwargs)


def setup_group() -> dist.ProcessGroup:
    """A group for waiting on rank 0's one-off work (tokenising a corpus can take hours): its barrier has
    no practical timeout; the watchdog still ends the job if a rank stops."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))


def main_rank_first(make: Callable[[], T], distributed: bool) -> T:
    """make() on rank 0, then on the other ranks once rank 0's has returned (a barrier of setup_group): for
    work whose result rank 0 writes to shared storage and the others then find (the token cache), instead of
    every rank racing to write it."""
    if not distributed:
        return make()
    main = dist.get_rank() == 0
    if main:
        made = make()
    dist.barrier(group=setup_group())
    return made if main else make()


def checkpoint_group(timeout_s: float) -> dist.ProcessGroup:
    """A gloo group for the collectives of checkpoints written in the background (trainer.async_checkpoint):
    they run on a thread of their own, and two threads must not share a group. Gloo because DCP stages and
    plans on the CPU, also when training runs on NCCL."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s + 60))


def destroy_distributed() -> None:
    """Leave cleanly: gloo can abort at exit if its threads outlive the group (docs/environment.md), and so
    can a watchdog still reading the group's store."""
    stop_all()
    if dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
