"""Gated feed-forward: W_down(act(W_gate x) * W_up x), no biases; act is SiLU (SwiGLU) or Kimi K3's SiTU
(kimi/model/activations.py, model.mlp.activation)."""

from __future__ import annotations

import torch
from torch import nn

from .activations import GLU, glu_of, swiglu
from .init import Rules, normal
from .sublayer import Sublayer, TPPlan


class SwiGLU(Sublayer, nn.Module):
    LABEL, FAMILY = "SwiGLU", "MLPs"
    TP_DIVIDES = ("mlp.hidden",)
    HF_NAMES = {f"w_{x}.weight": f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}

    @classmethod
    def build(cls, cfg) -> "SwiGLU":
        return cls(cfg.d_model, cfg.mlp.hidden, glu_of(cfg))

    def __init__(self, d_model: int, hidden: int, act: GLU = swiglu):
        super().__init__()
        self.act = act
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def init_rules(self, std: float, out_std: float) -> Rules:
        return {"w_gate.weight": normal(std), "w_up.weight": normal(std), "w_down.weight": normal(out_std)}

    def tp_plan(self) -> TPPlan:
        return TPPlan(colwise=("w_gate", "w_up"), rowwise=("w_down",))

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """rows: the batch rows of a packed x (the MLP contract; a dense MLP acts per token)."""
        return self.w_down(self.act(self.w_gate(x), self.w_up(x)))
