"""RMSNorm, computed in fp32 whatever the activation dtype (the mean of squares loses too much in bf16)."""

import torch
from torch import nn

from kimi.ops.norm import rms_norm

from .views import ParamViews


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
