"""torchrun worker for tests/ops/test_kda_context.py: KDA over a sequence split across the ranks
(kimi/parallel/context_parallel.py); rank 0 writes the whole outputs, final state and input gradients,
gathered from every rank's shard.

    torchrun --nproc_per_node N tests/dist_kda_cp.py OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from kda_cp_problem import T, attention_inputs, conv_inputs, inputs  # noqa: E402

from kimi.ops.kda.context import local_cu_seqlens  # noqa: E402
from kimi.parallel.context_parallel import (Exchange, context_parallel_kda, gather_prefix,  # noqa: E402
                                           keep_in_graph, previous_tail)

CASES = {"plain": None, "packed": [0, 5, 16, 27]}  # packed: documents inside shards and at a shard edge
# and longer than one 64-token KDA chunk per shard: 256 tokens (2 ranks: 2 chunks each; 4: exactly one) and
# 320 (160 and 80 tokens, chunks cut short), documents starting at the middle edge and inside shards
LONG = {"plain": None, "packed": lambda t: [0, 5, t // 2, t // 2 + 37, t - 9]}
KDA_CASES = {**{(case, T): starts for case, starts in CASES.items()},
             **{(case, t): starts and starts(t) for t in (256, 320) for case, starts in LONG.items()}}


def gather_time(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=1)


def conv_case(rank: int, n: int) -> dict:
    """A short conv over packed documents split across the ranks: its K-1 halo from the previous rank."""
    starts = CASES["packed"]
    conv, x = conv_inputs()
    mine = x.detach()[:, rank * n:(rank + 1) * n].clone().requires_grad_()
    local, continues = local_cu_seqlens(torch.tensor([*starts, T], dtype=torch.int32), rank * n, n)
    halo, tails = previous_tail(mine[:, n - (conv.weight.shape[-1] - 1):], Exchange(dist.group.WORLD))
    y, _ = conv(mine, local, halo if continues else None)
    y = keep_in_graph(y, tails)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(9), dtype=x.dtype)
    (y * w[:, rank * n:(rank + 1) * n]).sum().backward()
    dist.all_reduce(conv.weight.grad)  # each rank's copy of the weight saw its own tokens
    return {"y": gather_time(y.detach()), "x_grad": gather_time(mine.grad),
            "w_grad": conv.weight.grad, "w": w}


def attention_case(rank: int, n: int) -> dict:
    """Causal attention with this rank's queries over the keys and values of every shard up to its own."""
    from kimi.ops.attention import attention

    q, k, v = attention_inputs()
    mine = [x.detach()[:, rank * n:(rank + 1) * n].clone().requires_grad_() for x in (q, k, v)]
    keys, values = (gather_prefix(x, Exchange(dist.group.WORLD)) for x in mine[1:])
    o, max_logits = attention(mine[0], keys, values, causal=True, return_max_logits=True)
    w = torch.randn(o.shape[0], T, *o.shape[2:], generator=torch.Generator().manual_seed(10), dtype=o.dtype)
    grads = torch.autograd.grad((o * w[:, rank * n:(rank + 1) * n]).sum(), mine)
    dist.all_reduce(max_logits, op=dist.ReduceOp.MAX)  # what QK-Clip's max-reduce over the cp ranks gives
    return {"o": gather_time(o.detach()), "grads": [gather_time(g) for g in grads], "w": w,
            "max_logits": max_logits}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for (case, t), starts in KDA_CASES.items():
        n = t // world
        full = inputs(b=1 if starts else 2, seed=1, t=t)
        mine = [x.detach()[:, rank * n:(rank + 1) * n].clone().requires_grad_() for x in full]
        cu = None if starts is None else torch.tensor([*starts, t], dtype=torch.int32)
        local, continues = local_cu_seqlens(cu, rank * n, n)
        o, state = context_parallel_kda(*mine, Exchange(dist.group.WORLD), cu_seqlens=local,
                                        continues=continues)
        w = torch.randn(o.shape[0], t, *o.shape[2:], generator=torch.Generator().manual_seed(7),
                        dtype=o.dtype)
        w_s = torch.randn(state.shape, generator=torch.Generator().manual_seed(8), dtype=o.dtype)
        loss = (o * w[:, rank * n:(rank + 1) * n]).sum()
        # plain: the final state too (every rank holds it); packed: outputs alone, as in training
        if case == "plain":
            loss = loss + (state * w_s).sum() / world
        grads = torch.autograd.grad(loss, mine)
        results[case, t] = {"o": gather_time(o.detach()), "state": state.detach(),
                            "grads": [gather_time(x) for x in grads], "w": w, "w_s": w_s}
    results["conv"] = conv_case(rank, T // world)
    results["attention"] = attention_case(rank, T // world)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
