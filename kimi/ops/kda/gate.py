"""The KDA layer's elementwise inputs: q and k L2-normalised per head, and the per-channel log decay

    g = -exp(A_log[h]) * softplus(f + dt_bias[h, :])    (fp32, or fp64 for fp64 inputs)
    g = L * sigmoid(exp(A_log[h]) * (f + dt_bias[h, :]))  with a lower bound L < 0 (Kimi K3's "safe" gate)

The safe gate keeps every token's log decay in (L, 0): a 64-token chunk's cumulative decay stays above 64 L,
which bounds what the chunked forms divide by (Kimi K3 trains with L = -5).

`normalize_and_gate` runs them with the fused Triton kernels (kimi.ops.kda.triton.gate, one pass each) or
with PyTorch, dispatched like chunk_kda: backend=None picks Triton for CUDA tensors with fp32 gates and falls
back to PyTorch, with one warning, if a kernel fails to compile or launch (kimi.ops.dispatch: forward and
backward kernels are probed first when gradients are needed); backend="triton" turns that into an error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimi.ops.dispatch import Guard, auto_picks_triton, needs_grad

_GUARD = Guard("kda_gate/l2norm", "backend='triton', i.e. model.kda.backend=triton")


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, computed in fp32 (fp64 for fp64), returned in x's dtype."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _torch(q, k, f, A_log, dt_bias, lower_bound=None):
    gdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    x = f.to(gdt) + dt_bias.to(gdt).view(f.shape[-2:])
    a = A_log.to(gdt).exp()[:, None]
    g = -a * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(a * x)
    return l2_normalize(q), l2_normalize(k), g


def _triton(q, k, f, A_log, dt_bias, lower_bound=None):
    from .triton.gate import kda_gate, l2norm  # imports triton, so only once asked for

    return l2norm(q), l2norm(k), kda_gate(f, A_log, dt_bias, lower_bound)


def _probe(q, f, A_log, dt_bias, lower_bound) -> None:
    """Forward and backward kernels once on a two-row input of the same dtypes and head shape."""
    from .triton.gate import kda_gate_bwd, kda_gate_fwd, l2norm_bwd, l2norm_fwd

    x = q.new_zeros(1, 2, *q.shape[2:])
    y, rstd = l2norm_fwd(x, 1e-6)
    l2norm_bwd(x, rstd, torch.zeros_like(y))
    f_ = f.new_zeros(1, 2, *f.shape[2:])
    lower = float(lower_bound or 0.0)
    g = kda_gate_fwd(f_, A_log, dt_bias, lower)
    kda_gate_bwd(f_, A_log, dt_bias, torch.zeros_like(g), lower)


def normalize_and_gate(q: torch.Tensor, k: torch.Tensor, f: torch.Tensor, A_log: torch.Tensor,
                       dt_bias: torch.Tensor, backend: str | None = None, lower_bound: float | None = None):
    """(l2norm(q), l2norm(k), g) for q, k [B, T, H, K], f [B, T, H, K] (the gate's pre-activation),
    A_log [H], dt_bias [H * K]. backend: None (auto), "triton", or anything else for PyTorch. lower_bound:
    None for Kimi Linear's softplus gate, or the safe gate's L < 0."""
    forced = backend == "triton"
    auto = backend is None and auto_picks_triton(q.device) and q.dtype != torch.float64
    if not (forced or auto) or not _GUARD.use_triton(forced):
        return _torch(q, k, f, A_log, dt_bias, lower_bound)
    if needs_grad(q, k, f, A_log, dt_bias):
        key = (q.device, q.dtype, q.shape[-1], f.dtype, A_log.dtype, dt_bias.dtype, tuple(f.shape[2:]),
               lower_bound is None)
        if not _GUARD.probe(key, "kda_gate/l2norm", lambda: _probe(q, f, A_log, dt_bias, lower_bound),
                            forced):
            return _torch(q, k, f, A_log, dt_bias, lower_bound)
    return _GUARD.call("l2norm/kda_gate", _triton, _torch, forced, q, k, f, A_log, dt_bias, lower_bound)
