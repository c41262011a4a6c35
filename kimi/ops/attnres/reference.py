"""The unfused depth mix and pre-norm, composed as the model runs them without a fused kernel: the mix
function (kimi.model.attnres.depth_attention, or its compiled form) and then kimi.model.norm.RMSNorm's formula
on the mix's output in its own dtype. The fused kernels are tested against this."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kimi.model.attnres import depth_attention
from kimi.model.norm import rms_norm


def mix_then_norm(query: torch.Tensor | None, sources: Sequence[torch.Tensor], eps: float,
                  norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
                  mix: Callable = depth_attention) -> torch.Tensor:
    """mix(query, sources, eps), then with norm_weight its pre-norm (pre_norm)."""
    h = mix(query, sources, eps)
    return h if norm_weight is None else pre_norm(h, norm_weight, norm_eps)


def pre_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kimi.model.norm.RMSNorm's forward with this weight: rms_norm(h, eps) * weight, in h's dtype."""
    return (rms_norm(h, eps) * weight).to(h.dtype)
