"""The problem of tests/parallel/test_expert_parallel.py: 8 experts, top-2 routing, fp64, a different number
of tokens on each rank. Rank 1 sends nothing to experts 4-7 (so nothing at all to the upper half of the
ranks at ep = 2), and no rank chooses expert 6 (an expert that receives no rows)."""

import torch

E, K, D, HIDDEN = 8, 2, 12, 20


def weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(E, HIDDEN, D, generator=gen, dtype=torch.float64) / D ** 0.5,
            torch.randn(E, HIDDEN, D, generator=gen, dtype=torch.float64) / D ** 0.5,
            torch.randn(E, D, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN ** 0.5]


def rank_problem(rank: int) -> tuple[torch.Tensor, ...]:
    """(tokens [N, D], experts [N, K], routing weights [N, K], output gradient [N, D]) of one rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    n = 9 + 5 * rank
    scores = torch.rand(n, E, generator=gen, dtype=torch.float64)
    scores[:, 6] = -1
    if rank == 1:
        scores[:, 4:] = -1
    experts = scores.topk(K, dim=-1).indices
    return (torch.randn(n, D, generator=gen, dtype=torch.float64), experts,
            torch.rand(n, K, generator=gen, dtype=torch.float64),
            torch.randn(n, D, generator=gen, dtype=torch.float64))
