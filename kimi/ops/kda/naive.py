"""Reference KDA: the recurrence run token by token, the obviously-correct form every faster path is
tested against (docs/algorithms.md section 1)."""

import torch

from .recurrent import kda_step


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 inputs stay fp64 (so tests can compare at 1e-10); everything else runs in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None.

    Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] in the compute dtype).
    Arguments are assumed valid; the public entry points in :mod:`kimi.ops.kda` check them.
    """
    dtype, out_dtype = compute_dtype(q), v.dtype
    B, T, H, K = q.shape
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q = q * scale
    if initial_state is None:
        state = q.new_zeros(B, H, K, v.shape[-1])
    else:
        state = initial_state.to(dtype)
    outputs = []
    for t in range(T):
        o_t, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1) if outputs else v.new_empty(v.shape)  # T = 0: an empty sequence
    return o.to(out_dtype), state
