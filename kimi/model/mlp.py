"""SwiGLU feed-forward: W_down(silu(W_gate x) * W_up x), no biases."""

import torch
import torch.nn.functional as F
from torch import nn

from .init import Rules, normal


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def init_rules(self, std: float, out_std: float) -> Rules:
        return {"w_gate.weight": normal(std), "w_up.weight": normal(std), "w_down.weight": normal(out_std)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
