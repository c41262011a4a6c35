"""SwiGLU feed-forward: W_down(silu(W_gate x) * W_up x), no biases."""

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w_gate.weight, std=std)
        nn.init.normal_(self.w_up.weight, std=std)
        nn.init.normal_(self.w_down.weight, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
