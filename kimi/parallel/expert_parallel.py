"""Expert parallelism: the routed experts of an MoE layer split over the ranks of an `ep` group, each rank
holding E / ep of them (a contiguous range: rank r holds experts r E/ep .. (r+1) E/ep - 1), and every rank's
tokens sent to the ranks that hold their chosen experts and back, dropless.

One MoE layer on each rank of the group, for its own tokens (routing is local: every rank has the router):

1. sort the (token, choice) pairs by expert; `counts[e]`: this rank's pairs for expert e;
2. exchange the counts (all-to-all of E integers per rank), so each rank knows how many rows every other
   rank sends to each of its experts;
3. all-to-all of the rows themselves, variable sizes: the pairs for rank r's experts go to rank r;
4. the rows arrive grouped by source rank, then expert: regroup them by local expert, run the local experts
   (kimi.model.moe.swiglu_sorted: one grouped GEMM per projection), restore the arrival order;
5. all-to-all back, then weight and sum per token as without experts parallelism (kimi.model.moe.combine).

The row all-to-alls are differentiable (the backward of each is the reverse exchange), so gradients of the
tokens, routing weights and local experts follow from autograd. Bytes sent per rank and layer: 2 (forward)
+ 2 (backward) times the rows sent away, d values each; a rank's own experts' rows stay local.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kimi.model.activations import GLU, swiglu
from kimi.model.moe import RoutedExperts, combine, expert_counts, swiglu_sorted


def dispatch_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """counts [E] of this rank's pairs per expert -> [ep, E / ep]: row s holds what rank s sends to each of
    this rank's experts."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(ep, -1)


def experts_parallel(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                     w_up: torch.Tensor, w_down: torch.Tensor, group: dist.ProcessGroup,
                     act: GLU = swiglu) -> torch.Tensor:
    """kimi.model.moe.experts_grouped with the experts spread over `group`: x [N, d] this rank's tokens,
    experts / weights [N, k] their choices among all E experts, w_* this rank's E / ep experts."""
    ep, local = dist.get_world_size(group), w_gate.shape[0]
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    counts = expert_counts(flat, ep * local)
    received = dispatch_counts(counts, group)  # [ep, local]
    # the all-to-all's split sizes are host lists: the one host read of a layer's dispatch
    send, recv = torch.stack([counts.view(ep, local).sum(1), received.sum(1)]).tolist()
    rows = all_to_all_single_autograd(x[order // k], recv, send, group)
    # arrival order: by source rank, then expert; the experts want them by expert (then source)
    expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received.reshape(-1))
    by_expert = expert_of_row.argsort(stable=True)
    y = swiglu_sorted(rows[by_expert], received.sum(0), w_gate, w_up, w_down, act)
    y = torch.empty_like(y).index_copy(0, by_expert, y)  # back to arrival order
    return combine(all_to_all_single_autograd(y, send, recv, group), order, k, weights, x)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every RoutedExperts of `model` over `ep_mesh` (module docstring)."""
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    for experts in (m for m in model.modules() if isinstance(m, RoutedExperts)):
        for name in ("w_gate", "w_up", "w_down"):
            p = getattr(experts, name)
            placed = distribute_tensor(p.detach(), ep_mesh, [Shard(0)])
            setattr(experts, name, nn.Parameter(placed, requires_grad=p.requires_grad))
            experts.set_param_view(name, functools.partial(_local_experts, scale=1.0 / ep))
        experts.dispatch = functools.partial(experts_parallel, group=group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _local_experts(p: torch.Tensor, scale: float) -> torch.Tensor:
    """This rank's experts of an ep-sharded weight, their gradient scaled by 1 / ep (module docstring)."""
    return _ScaleGrad.apply(p.to_local() if isinstance(p, DTensor) else p, scale)
