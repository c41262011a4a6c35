"""The gated activation of every feed-forward network (model.mlp.activation): the product act(g) * u that a
dense MLP, the shared experts and each routed expert take before their down-projection, from the gate
projection g = W_gate x and the up projection u = W_up x.

  swiglu  silu(g) * u                                              Kimi Linear, DeepSeek-V3, Llama
  situ    [b1 tanh(g / b1) sigmoid(g)] * [b2 tanh(u / b2)]         Kimi K3's SiTU-GLU, computed in fp32

SiTU replaces SiLU's linear factor g by its soft cap b1 tanh(g / b1) and caps the up branch at b2 (none when
model.mlp.situ_linear_beta is null), so every element is bounded by b1 * b2 (100 with K3's b1 = 4, b2 = 25):
near 0 it is SwiGLU, far from it the activations along the routed experts' chain of matmuls cannot explode.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F

GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> act(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0,
         linear_beta: Optional[float] = 25.0) -> torch.Tensor:
    dtype = torch.promote_types(torch.promote_types(gate.dtype, up.dtype), torch.float32)
    g, u = gate.to(dtype), up.to(dtype)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * u).to(torch.promote_types(gate.dtype, up.dtype))


def glu_of(cfg) -> GLU:
    """The model config's activation as a (gate, up) function."""
    if cfg.mlp.activation == "situ":
        return partial(situ, beta=cfg.mlp.situ_beta, linear_beta=cfg.mlp.situ_linear_beta)
    return swiglu
