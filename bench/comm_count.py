"""Counting what a rank really runs, for the benchmarks: a dispatch mode that lets DTensor ops through
(NotImplemented) so it sees only the local tensor ops and the collectives they turn into."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op names (legacy and functional) -> collective type
KINDS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
         "allgather_": "all_gather", "_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
         "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
         "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
         "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
         "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
         "broadcast_": "broadcast", "broadcast": "broadcast", "send": "send", "recv_": "recv"}
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class CommCounter(TorchDispatchMode):
    """Matmul FLOPs, and per collective type the calls and the bytes this rank puts in (its first tensor
    argument: the input of a reduction or gather, the buffer sent)."""

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    @property
    def collectives(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented
        name = func.overloadpacket.__name__
        if name in MATMULS:
            a, b = args[-2], args[-1]
            self.flops += 2 * a.numel() * b.shape[-1]
        elif name in KINDS:
            kind = KINDS[name]
            tensors = [t for x in args for t in (x if isinstance(x, (list, tuple)) else [x])
                       if isinstance(t, torch.Tensor)]
            self.calls[kind] += 1
            self.bytes[kind] += tensors[0].numel() * tensors[0].element_size() if tensors else 0
        return func(*args, **(kwargs or {}))


def write_every_rank(out, record: dict) -> None:
    """Rank 0 writes the list of every rank's `record` to `out` as JSON (one process: its own, in a list)."""
    import json

    import torch.distributed as dist

    everyone = [record]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, record)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.write_text(json.dumps(everyone))
