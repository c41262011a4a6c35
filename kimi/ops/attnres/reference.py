"""The depth mix of Attention Residuals in PyTorch (depth_weights, depth_attention: the model's own mix,
kimi.model.attnres imports them from here) and the unfused mix and pre-norm, composed as the model runs
them without a fused kernel: the mix function (depth_attention, or its compiled form), then
kimi.model.norm.RMSNorm's formula on the mix's output in its own dtype. The fused kernels are tested
against this."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kimi.ops.norm import rms_norm


def depth_weights(query: torch.Tensor, sources: Sequence[torch.Tensor], eps: float) -> torch.Tensor:
    """Softmax over sources of query . RMSNorm(v_i), per token: [N, *batch] fp32 (fp64 for fp64 input).

    The key norm has no learnable weight. The paper's pseudocode passes an RMSNorm module, but a per-layer
    weight gamma would be redundant: w . (gamma * n(v)) = (w * gamma) . n(v), so the pseudo-query already
    spans every such scaling, and with w initialised to zero gamma would get no gradient at the start
    anyway. No 1/sqrt(d) and no temperature either: the query's norm is the temperature, learned.
    """
    keys = rms_norm(torch.stack(list(sources)), eps)  # normalised only to score; values stay raw
    return (keys @ query.to(keys.dtype)).softmax(dim=0)


def depth_attention(query: torch.Tensor | None, sources: Sequence[torch.Tensor], eps: float) -> torch.Tensor:
    """sum_i softmax_i(query . RMSNorm(v_i)) v_i, mixed in fp32 and returned in the sources' dtype.

    query None is allowed with a single source (weight 1 whatever the query: the model gives the very first
    sublayer no query because its gradient would be identically zero).
    """
    if query is None:
        if len(sources) != 1:
            raise ValueError("a sublayer without a pseudo-query must have exactly 1 source, got "
                             f"{len(sources)}")
        return sources[0]
    weights = depth_weights(query, sources, eps)
    values = torch.stack(list(sources)).to(weights.dtype)
    return (weights.unsqueeze(-1) * values).sum(dim=0).to(sources[0].dtype)


def mix_then_norm(query: torch.Tensor | None, sources: Sequence[torch.Tensor], eps: float,
                  norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
                  mix: Callable = depth_attention) -> torch.Tensor:
    """mix(query, sources, eps), then with norm_weight its pre-norm (pre_norm)."""
    h = mix(query, sources, eps)
    return h if norm_weight is None else pre_norm(h, norm_weight, norm_eps)


def pre_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kimi.model.norm.RMSNorm's forward with this weight: rms_norm(h, eps) * weight, in h's dtype."""
    return (rms_norm(h, eps) * weight).to(h.dtype)
