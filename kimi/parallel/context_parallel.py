"""Context parallelism's KDA: each rank holds one consecutive shard of every sequence (rank r of the cp
group the r-th), and the ranks together compute exactly what one device computes on the whole.

Per layer and pass (kimi/ops/kda/context.py): each rank summarises its shard as (P, S_zero), the shard's
state transition and its final state from zero ([B, H, K, K] and [B, H, K, V], constant in the shard's
length); one all-gather gives every rank every summary; each folds those of the ranks before it into its
incoming state and runs its shard from it. In the backward, the gradient of every summary is summed over
the ranks whose outputs used it (one all-reduce: gloo has no reduce-scatter) and flows into the rank that
made it, so state gradients travel from later shards to earlier ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kimi.ops.kda.context import incoming_states, run_shard, shard_summary


class _GatherSummaries(torch.autograd.Function):
    """Every rank's (P, S_zero), stacked [world, ...]; backward: each rank's own slice of the sum over ranks
    of the gradients."""

    @staticmethod
    def forward(ctx, P: torch.Tensor, S: torch.Tensor, group: dist.ProcessGroup):
        ctx.group, ctx.shapes = group, (P.shape, S.shape)
        flat = torch.cat([P.reshape(-1), S.reshape(-1)]).contiguous()
        gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, flat, group=group)
        stacked = torch.stack(gathered)
        return stacked[:, : P.numel()].reshape(-1, *P.shape), stacked[:, P.numel():].reshape(-1, *S.shape)

    @staticmethod
    def backward(ctx, grad_P: torch.Tensor, grad_S: torch.Tensor):
        world = grad_P.shape[0]
        flat = torch.cat([grad_P.reshape(world, -1), grad_S.reshape(world, -1)], dim=1).contiguous()
        dist.all_reduce(flat, group=ctx.group)
        mine = flat[dist.get_rank(ctx.group)]
        P_shape, S_shape = ctx.shapes
        n = P_shape.numel()
        return mine[:n].reshape(P_shape), mine[n:].reshape(S_shape), None


def context_parallel_kda(q, k, v, g, beta, group: dist.ProcessGroup, scale: float | None = None,
                         cu_seqlens: torch.Tensor | None = None, continues: bool = True,
                         initial_state: torch.Tensor | None = None,
                         backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's outputs of KDA over a sequence split across ``group`` (its shard's q, k, v, g, beta;
    ``cu_seqlens`` and ``continues`` describe the shard's documents as
    :func:`kimi.ops.kda.context.local_cu_seqlens` gives them), and the whole sequence's final state (the
    same on every rank). Collective: every rank of ``group`` calls it for the same layer."""
    P, S = shard_summary(q, k, v, g, beta, scale, cu_seqlens, continues, backend)
    all_P, all_S = _GatherSummaries.apply(P, S, group)
    states = incoming_states(list(zip(all_P.unbind(0), all_S.unbind(0))), initial_state)
    rank = dist.get_rank(group)
    o = run_shard((q, k, v, g, beta), states[rank], scale, cu_seqlens, continues, backend)
    return o, states[-1]
