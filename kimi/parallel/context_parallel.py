"""Context parallelism's KDA: each rank holds one consecutive shard of every sequence (rank r of the cp
group the r-th), and the ranks together compute exactly what one device computes on the whole.

Per layer and pass (kimi/ops/kda/context.py): each rank summarises its shard as (P, S_zero), the shard's
state transition and its final state from zero ([B, H, K, K] and [B, H, K, V], constant in the shard's
length), in the same chunked run that gives its outputs from a zero state; one all-gather gives every
rank every summary; each folds those of the ranks before it into its incoming state and adds that state's
share to its outputs (no second run: the outputs are affine in it). In the backward, the gradient of
every summary is summed over the ranks whose outputs used it (one all-reduce: gloo has no reduce-scatter)
and flows into the rank that made it, so state gradients travel from later shards to earlier ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kimi.ops.kda.context import add_incoming, incoming_states, shard_pass


class _AllGather(torch.autograd.Function):
    """Every rank's ``x`` stacked [world, *x.shape]; backward: this rank's slice of the gradient summed over
    the ranks (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather_stacked(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Each tensor of every rank, [world, *shape] each, in one all-gather (same dtype); differentiable."""
    return _unstack(_AllGather.apply(_flat(tensors), group), tensors)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unstack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The stacked [world, numel] gather of ``_flat(tensors)`` as one [world, *shape] view per tensor."""
    out, start = [], 0
    for t in tensors:
        out.append(flat[:, start : start + t.numel()].reshape(-1, *t.shape))
        start += t.numel()
    return out


class Exchange:
    """The cp group as the exchanges use it: this rank's place and the one collective, a differentiable
    all-gather (:func:`all_gather_stacked`)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return all_gather_stacked(tensors, self.group)


class LocalExchange:
    """Rank ``rank`` of ``size`` with no process group: every rank's tensors are copies of this rank's,
    gathered into buffers of the all-gather's shapes. A forward through it holds what that rank holds,
    but computes nothing a real group would (kimi.plan traces a context-parallel rank's memory with it)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = _flat(tensors)
        return _unstack(torch.stack([flat] * self.size), tensors)


def keep_in_graph(y: torch.Tensor, *gathered: torch.Tensor) -> torch.Tensor:
    """y, tied to gathered tensors by a zero term: the backward all-reduce of an all-gather must run on
    every rank, also on one whose outputs do not use what it gathered (the first rank reads no halo and no
    incoming state)."""
    return y + sum(0.0 * t.sum() for t in gathered).to(y.dtype)


def previous_tail(tail: torch.Tensor, exchange: Exchange) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the previous rank's ``tail``, or None on the first rank; every rank's tails, for keep_in_graph):
    a short conv's last K-1 inputs, the halo this rank's first tokens read. Differentiable: the halo's
    gradient returns to the rank it came from."""
    (tails,) = exchange.gather([tail])
    return (tails[exchange.rank - 1] if exchange.rank > 0 else None), tails


def context_parallel_kda(q, k, v, g, beta, exchange: Exchange, scale: float | None = None,
                         cu_seqlens: torch.Tensor | None = None, continues=True,
                         initial_state: torch.Tensor | None = None, backend: str | None = None,
                         lower_bound: float | None = None,
                         reached: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's outputs of KDA over a sequence split across the ranks of ``exchange`` (its shard's q,
    k, v, g, beta; ``cu_seqlens`` and ``continues`` describe the shard's documents as
    :func:`kimi.ops.kda.context.local_cu_seqlens` gives them), and the whole sequence's final state (the
    same on every rank). Collective: every rank calls it for the same layer. lower_bound: as chunk_kda's
    (Kimi K3's safe gate). reached: as :func:`kimi.ops.kda.context.shard_pass`'s."""
    o, reach, P, S = shard_pass(q, k, v, g, beta, scale, cu_seqlens, continues, backend, lower_bound, reached)
    all_P, all_S = exchange.gather([P, S])
    states = incoming_states(list(zip(all_P.unbind(0), all_S.unbind(0))), initial_state)
    o = add_incoming(o, reach, states[exchange.rank], cu_seqlens, continues)
    return keep_in_graph(o, all_P, all_S), states[-1]


def gather_prefix(x: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """This rank's shard of x [B, n, ...] preceded by every earlier rank's: [B, (rank + 1) n, ...], what
    causal attention over the whole sequence needs for this rank's queries (they are the last n of those
    positions: attention's bottom-right causal alignment). For MLA, x is the compressed latent and the
    shared key part, a fraction of full keys and values. Differentiable: the gradient of every earlier
    shard returns to its rank."""
    (shards,) = exchange.gather([x])
    return torch.cat(list(shards[: exchange.rank + 1].unbind(0)), dim=1)


class SequenceShard:
    """What the token mixers of one forward need to run their shard of the sequence (handed to them by
    KimiModel.forward as ``context``): which positions this rank holds, which rows continue a document
    from the previous rank, and the exchanges, each collective over the cp group.

    rows: batch rows of the forward (packed along T under data.varlen); length: this rank's tokens per
    row; doc_starts [rows, length]: the shard's document starts as the loader marks them (None without
    varlen), where a False first column means the row's first document began on an earlier rank.
    """

    def __init__(self, exchange: Exchange | LocalExchange, rows: int, length: int,
                 doc_starts: torch.Tensor | None, device: torch.device):
        self.exchange, self.rank, self.size = exchange, exchange.rank, exchange.size
        self.rows, self.length, self.doc_starts = rows, length, doc_starts
        self.offset = self.rank * length  # of this rank's first token in each row
        first = self.rank > 0
        self.continues = torch.full((rows,), first, dtype=torch.bool, device=device)
        # whether any row continues, known without reading the device where no document starts are given
        self.reached = first if doc_starts is None else None
        if doc_starts is not None:
            self.continues &= ~doc_starts[:, 0]
        self._prefix_starts: torch.Tensor | None = None

    def packing_starts(self) -> torch.Tensor:
        """doc_starts with every row's first token a start: the packed rows' sequence boundaries (the
        state and halo a continued first document carries come in through ``continues``)."""
        starts = self.doc_starts.clone()
        starts[:, 0] = True
        return starts

    def positions(self, device: torch.device) -> torch.Tensor:
        """The row positions of this rank's tokens, [length]."""
        return torch.arange(self.offset, self.offset + self.length, device=device)

    def halo(self, tails: list[torch.Tensor]) -> list[torch.Tensor]:
        """The previous rank's ``tails`` (each [rows, K-1, C]: a short conv's last inputs), in one
        all-gather; rank 0, which reads none, gets zeros still tied to the exchange so that it joins the
        backward all-reduce."""
        prev, gathered = previous_tail(torch.cat(tails, dim=-1), self.exchange)
        prev = 0.0 * gathered[0] if prev is None else prev
        return list(prev.split([t.shape[-1] for t in tails], dim=-1))

    def kda(self, q, k, v, g, beta, cu_seqlens: torch.Tensor | None = None, backend: str | None = None,
            lower_bound: float | None = None):
        """KDA's outputs for this shard (the whole sequence's state passed in from earlier ranks)."""
        o, _ = context_parallel_kda(q, k, v, g, beta, self.exchange, cu_seqlens=cu_seqlens,
                                    continues=self.continues, backend=backend, lower_bound=lower_bound,
                                    reached=self.reached)
        return o

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, length, ...] preceded by every earlier rank's: [rows, (rank + 1) * length, ...]."""
        return gather_prefix(x, self.exchange)

    def prefix_doc_starts(self) -> torch.Tensor:
        """The document starts of every row up to this rank's last token, [rows, (rank + 1) * length]
        (one all-gather, made on first use and kept for the forward)."""
        if self._prefix_starts is None:
            self._prefix_starts = self.prefix(self.doc_starts.to(torch.uint8)).bool()
        return self._prefix_starts


class ContextParallel:
    """Attached to a model by kimi.parallel.parallelize (``KimiModel.context_parallel``): its forwards
    run one shard of every sequence, rank r of ``group`` the r-th of cp consecutive shards."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def shard(self, rows: int, length: int, doc_starts: torch.Tensor | None, device) -> SequenceShard:
        return SequenceShard(Exchange(self.group), rows, length, doc_starts, device)


class LastRankOf:
    """A stand-in for ContextParallel: the forwards run as the last of ``size`` ranks, the heaviest (its
    MLA layers read every earlier shard), over a :class:`LocalExchange`. What they hold is that rank's;
    their outputs are not (kimi.plan.activations traces it)."""

    def __init__(self, size: int):
        self.size = size

    def shard(self, rows: int, length: int, doc_starts: torch.Tensor | None, device) -> SequenceShard:
        return SequenceShard(LocalExchange(self.size - 1, self.size), rows, length, doc_starts, device)
