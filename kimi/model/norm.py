"""RMSNorm, computed in fp32 whatever the activation dtype (the mean of squares loses too much in bf16)."""

import torch
from torch import nn

from .views import ParamViews


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in fp32 (fp64 stays fp64); returns the compute dtype."""
    x = x.float() if x.dtype != torch.float64 else x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(ParamViews, nn.Module):
    """Root-mean-square norm over the last dim with a learnable per-channel weight (initialised to 1)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x, self.eps) * self.param("weight")).to(x.dtype)
