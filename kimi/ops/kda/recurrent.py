"""One token of the KDA recurrence: the single place its update rule is written.

Decoding (T = 1 per call, state carried by the caller) runs exactly this step; the token-by-token reference
in :mod:`kimi.ops.kda.naive` loops over it, so the reference and the decode path cannot drift apart.
"""

import torch


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance the state by one token and read it out.

    q, k, g: [B, H, K] (q already multiplied by the scale); v: [B, H, V]; beta: [B, H];
    state: [B, H, K, V]. Returns (o [B, H, V], new state). Out-of-place, so autograd sees every step.
    """
    decayed = state * g.exp().unsqueeze(-1)  # S' = Diag(exp(g_t)) S_{t-1}
    # The delta rule writes only the part of v_t the decayed state does not already predict from k_t.
    residual = v - torch.einsum("bhk,bhkv->bhv", k, decayed)
    state = decayed + torch.einsum("bhk,bhv->bhkv", k * beta.unsqueeze(-1), residual)
    return torch.einsum("bhk,bhkv->bhv", q, state), state
