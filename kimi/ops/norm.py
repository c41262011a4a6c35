"""The RMSNorm formula, in fp32 whatever the activation dtype (the mean of squares loses too much in bf16):
kimi.model.norm.RMSNorm's and the Attention Residuals' key norm (kimi/ops/attnres/reference.py)."""

import torch


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in fp32 (fp64 stays fp64); returns the compute dtype."""
    x = x.float() if x.dtype != torch.float64 else x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
