"""Where every block of every parameter lives, which rank updates it, and batched transfers between them.

MuonClip's distributed layer (docs/algorithms.md section 4). Newton-Schulz needs whole matrices; a parameter
may be a plain tensor replicated over the data-parallel ranks, or a DTensor whose blocks are spread over a
mesh by FSDP2 (Shard(0), or _StridedShard over tensor parallelism) and TP (Shard(0) / Shard(1)), and
replicated over any remaining mesh dimension. Rather than special-casing layouts, every rank asks where
its own block sits in the full tensor (compute_local_shape_and_global_offset, the function DCP relies on)
and the ranks swap these answers once. A block may also be a range of the flattened tensor (a
:class:`Fragment`): DeepSpeed's ZeRO partitions cut the concatenation of all parameters into equal flat
ranges, so a matrix may be split anywhere, mid-row. From then on:

  * every Muon matrix has ONE owner, chosen to balance Newton-Schulz FLOPs over the ranks (preferring a
    rank that already holds much of the matrix). The owner keeps the matrix's momentum (so Muon state per
    rank is ~ total / world: ZeRO-1), receives the gradient blocks it lacks, orthogonalises once, and sends
    every holder its block of the update;
  * every AdamW block has one keeper among the ranks holding it. Sharded blocks are updated where they are;
    a replicated block is updated by its keeper (which alone keeps its Adam moments) and the new values go
    to the other replicas.

All transfers of one kind in a step travel in one all_to_all per dtype, whatever the number of matrices.
With no process group (one process) the plan still applies, every transfer is local and no collective runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class Fragment:
    """This rank's share of a parameter stored flat: elements [start, start + numel) of the full tensor of
    ``shape`` in row-major order (a DeepSpeed ZeRO partition's piece of it; numel 0: none)."""

    shape: Tuple[int, ...]
    start: int
    numel: int


@dataclass(frozen=True)
class Piece:
    """One block of a parameter: where it sits in the full tensor, and the ranks that hold a copy. A flat
    piece is a range of the flattened tensor: offset (start,), shape (numel,)."""

    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    holders: Tuple[int, ...]
    flat: bool = False
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # taken at once: the planner's owner plans (kimi/plan) read it millions of times, and a cached
        # property's first read (a lock, Python's descriptor) costs several times this
        object.__setattr__(self, "numel", math.prod(self.shape))

    @property
    def slices(self) -> Tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece of the full tensor (a view, except for a flat piece of a non-contiguous tensor)."""
        if self.flat:
            return full.reshape(-1)[self.offset[0] : self.offset[0] + self.shape[0]]
        return full[self.slices]


@dataclass
class ParamPlan:
    """Layout of one parameter across the group, the same on every rank except ``local``."""

    name: str
    shape: Tuple[int, ...]  # the full (global) shape
    dtype: torch.dtype
    device: torch.device
    pieces: List[Piece]
    senders: List[int]  # per piece: the holder that sends it to the owner (the owner itself if it holds it)
    keepers: List[int]  # per piece: the holder that updates it (AdamW) and sends the result to the others
    owner: int  # the rank that orthogonalises the full matrix (Muon); -1 for AdamW parameters
    local: Optional[int]  # index of this rank's piece, None when it holds an empty block

    def local_piece(self) -> Optional[Piece]:
        return None if self.local is None else self.pieces[self.local]


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's block of a parameter (or of its gradient / state): the DTensor's local shard, or p."""
    return p.to_local() if isinstance(p, DTensor) else p


def like_param(block: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state tensor laid out like p: the DTensor built from this rank's block, or the block itself."""
    if isinstance(p, DTensor):
        return DTensor.from_local(block, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return block


def local_block(p: torch.Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offset), tuple(shape)
    return (0,) * p.ndim, tuple(p.shape)


def ns_flops(shape: Sequence[int], steps: int = 5) -> int:
    """FLOPs of Newton-Schulz on a [.., A, B] weight: per step X X^T, A^2 and (bA + cA^2) X, m = min(A, B)."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * m * m * n + 2 * m**3)


def _layout(name: str, p: torch.Tensor, fragments: Mapping[str, Fragment]):
    """(full shape, dtype, offset, block shape, flat) of this rank's block of a parameter."""
    frag = fragments.get(name)
    if frag is not None:
        return tuple(frag.shape), str(p.dtype), (frag.start,), (frag.numel,), True
    return (tuple(p.shape), str(p.dtype), *local_block(p), False)


def build_plans(named: Sequence[Tuple[str, torch.Tensor]], muon: Sequence[bool],
                group: Optional[dist.ProcessGroup],
                fragments: Optional[Mapping[str, Fragment]] = None) -> List[ParamPlan]:
    """Swap block positions with every rank of ``group`` (one all_gather_object) and assign owners.
    ``fragments``: the parameters stored flat, by name (the tensor given is then the fragment itself)."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    mine = [(n, *_layout(n, p, fragments or {})) for n, p in named]
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
    for r, theirs in enumerate(everyone):
        if [(n, s) for n, s, *_ in theirs] != [(n, s) for n, s, *_ in mine]:
            raise ValueError(
                f"rank {r} of the optimizer's process group holds other parameters than rank {rank}; every "
                "rank of the group must hold blocks of the same model (under pipeline parallelism pass "
                "process_group = the ranks of one stage)")

    return assign(everyone, muon, rank, [(p.dtype, local_tensor(p).device) for _, p in named])


def assign(everyone: Sequence[Sequence[tuple]], muon: Sequence[bool], rank: int,
           kinds: Sequence[Tuple[torch.dtype, torch.device]]) -> List[ParamPlan]:
    """The plans from every rank's block layouts (``everyone[r][i]``: (name, full shape, dtype name, offset,
    block shape, flat) of parameter i on rank r): keepers, owners and senders, as rank ``rank`` sees them.
    A function of shapes alone, which kimi/plan/owner_plan.py also calls to size MuonClip's traffic."""
    world = len(everyone)
    flops_load, keep_load = [0] * world, [0] * world
    plans = []
    for i, (dtype, device) in enumerate(kinds):
        by_block = {}
        name, full_shape = everyone[rank][i][:2]
        for r, layouts in enumerate(everyone):
            _, _, _, offset, shape, flat = layouts[i]
            if 0 not in shape:  # not an empty block
                by_block.setdefault((offset, shape, flat), []).append(r)
        pieces = [Piece(o, s, tuple(h), f) for (o, s, f), h in by_block.items()]
        if sum(pc.numel for pc in pieces) != math.prod(full_shape):
            raise ValueError(f"{name}: the ranks' blocks do not tile its {full_shape} elements exactly")
        keepers = []
        for pc in pieces:
            keeper = min(pc.holders, key=keep_load.__getitem__)  # ties: the lowest rank (holders ascend)
            keep_load[keeper] += pc.numel
            keepers.append(keeper)
        plans.append(ParamPlan(name, full_shape, dtype, device, pieces, [], keepers,
                               -1, next((k for k, pc in enumerate(pieces) if rank in pc.holders), None)))
    # Owners: largest matrices first, each to the least-loaded rank, ties to the rank holding most of it.
    for i in sorted((i for i, m in enumerate(muon) if m), key=lambda i: -ns_flops(plans[i].shape)):
        plan = plans[i]
        held = [0] * world
        for pc in plan.pieces:
            for r in pc.holders:
                held[r] += pc.numel
        plan.owner = min(zip(flops_load, [-h for h in held], range(world)))[2]
        flops_load[plan.owner] += ns_flops(plan.shape)
        # Each piece is sent by one holder: the owner when it holds it, else one chosen by position.
        plan.senders = [plan.owner if plan.owner in pc.holders else pc.holders[(i + k) % len(pc.holders)]
                        for k, pc in enumerate(plan.pieces)]
    return plans


class Router:
    """Moves blocks between ranks along a plan; all transfers of one call go out in one all_to_all per dtype.

    ``route(items)`` takes (plan, kind, tensor) triples, built in the same order on every rank, and returns
    a list aligned with them:
      "to_owner"    tensor = this rank's block (or None)  -> on the owner: the full tensor, else None
      "from_owner"  tensor = the full tensor on the owner -> on each holder: its block, else None
      "from_keeper" tensor = the keeper's block           -> on each holder: that block, else None
    ``collectives`` and ``bytes_sent`` count this rank's traffic, for tests and benchmarks.
    """

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.rank, self.world = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
        self.collectives = 0
        self.bytes_sent = 0

    def _travels(self, plan: ParamPlan, kind: str) -> bool:
        """Whether any rank sends anything for this item: the same answer on every rank."""
        if kind == "to_owner":
            return any(s != plan.owner for s in plan.senders)
        if kind == "from_owner":
            return any(h != plan.owner for pc in plan.pieces for h in pc.holders)
        return any(len(pc.holders) > 1 for pc in plan.pieces)

    def route(self, items: Sequence[Tuple[ParamPlan, str, Optional[torch.Tensor]]]
              ) -> List[Optional[torch.Tensor]]:
        rank = self.rank
        results: List[Optional[torch.Tensor]] = [None] * len(items)
        sends: List[Tuple[int, torch.Tensor, torch.dtype]] = []
        recvs: List[Tuple[int, Tuple[int, ...], torch.dtype, Callable[[torch.Tensor], None]]] = []
        dtypes = set()
        for n, (plan, kind, t) in enumerate(items):
            piece = plan.local_piece()
            if self._travels(plan, kind):
                dtypes.add(plan.dtype)
            if kind == "to_owner":
                if piece is not None and plan.senders[plan.local] == rank and plan.owner != rank:
                    sends.append((plan.owner, t, plan.dtype))
                if plan.owner == rank and len(plan.pieces) == 1 and plan.senders[0] == rank \
                        and tuple(t.shape) == plan.shape and t.dtype == plan.dtype:
                    results[n] = t  # the owner holds it whole (one process, or replicated): no copy
                elif plan.owner == rank:
                    full = torch.empty(plan.shape, dtype=plan.dtype, device=plan.device)
                    for k, pc in enumerate(plan.pieces):
                        if plan.senders[k] == rank:
                            pc.of(full).copy_(t)
                        else:
                            recvs.append((plan.senders[k], pc.shape, plan.dtype, pc.of(full).copy_))
                    results[n] = full
            elif kind == "from_owner":
                if plan.owner == rank:
                    sends.extend((h, pc.of(t), plan.dtype) for pc in plan.pieces for h in pc.holders
                                 if h != rank)
                    if piece is not None:
                        results[n] = piece.of(t)
                elif piece is not None:
                    recvs.append((plan.owner, piece.shape, plan.dtype, self._setter(results, n)))
            elif kind == "from_keeper":
                if piece is None:
                    continue
                keeper = plan.keepers[plan.local]
                if keeper == rank:
                    sends.extend((h, t, plan.dtype) for h in piece.holders if h != rank)
                    results[n] = t
                else:
                    recvs.append((keeper, piece.shape, plan.dtype, self._setter(results, n)))
            else:
                raise ValueError(f"unknown route kind {kind!r}")
        # Every rank reaches the same dtype set (it depends only on the plans), so the collectives pair up.
        for dtype in sorted(dtypes, key=str):
            self._all_to_all([s for s in sends if s[2] == dtype], [r for r in recvs if r[2] == dtype], dtype,
                             items[0][0].device)
        return results

    @staticmethod
    def _setter(results: list, n: int) -> Callable[[torch.Tensor], None]:
        def put(x: torch.Tensor) -> None:
            results[n] = x
        return put

    def _all_to_all(self, sends, recvs, dtype: torch.dtype, device: torch.device) -> None:
        # Stable sorts by peer keep each pair's messages in the order both sides built them.
        sends = sorted(sends, key=lambda s: s[0])
        recvs = sorted(recvs, key=lambda r: r[0])
        in_splits, out_splits = [0] * self.world, [0] * self.world
        for peer, t, _ in sends:
            in_splits[peer] += t.numel()
        for peer, shape, _, _ in recvs:
            out_splits[peer] += math.prod(shape)
        flat_in = (torch.cat([t.to(dtype).reshape(-1) for _, t, _ in sends]) if sends
                   else torch.empty(0, dtype=dtype, device=device))
        flat_out = torch.empty(sum(out_splits), dtype=dtype, device=device)
        dist.all_to_all_single(flat_out, flat_in, out_splits, in_splits, group=self.group)
        self.collectives += 1
        self.bytes_sent += flat_in.numel() * flat_in.element_size()
        start = 0
        for _, shape, _, put in recvs:
            size = math.prod(shape)
            put(flat_out[start : start + size].view(shape))
            start += size
