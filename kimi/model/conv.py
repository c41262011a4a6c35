"""A short causal convolution as a token mixer (letter C in model.layer_pattern): each channel mixes the
last conv_size tokens, nothing further back. A cheap local mixer to interleave with KDA and MLA, and the
smallest complete example of the sublayer contract (kimi/model/sublayer.py): one file and one registry line.

    o = W_out SiLU(ShortConv(W_in x))          d_model channels, depthwise, causal
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kimi.model.config import ModelConfig

from .init import Rules, normal, prefixed
from .kda import ShortConv
from .sublayer import Sublayer, TPPlan


class ConvMixer(Sublayer, nn.Module):
    LABEL, FAMILY = "conv", "conv mixers"
    TP_DIVIDES = ("d_model",)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.in_proj = nn.Linear(d, d, bias=False)
        self.conv = ShortConv(d, cfg.conv_size)
        self.out_proj = nn.Linear(d, d, bias=False)

    def init_rules(self, std: float, out_std: float) -> Rules:
        return {"in_proj.weight": normal(std), "out_proj.weight": normal(out_std),
                **prefixed("conv", self.conv.init_rules())}

    def tp_plan(self) -> TPPlan:
        """Channels split over the ranks: in_proj column-parallel, the conv's channels with it, out_proj
        row-parallel."""
        return TPPlan(colwise=("in_proj",), rowwise=("out_proj",), by_heads=("conv.weight",))

    # No flops_per_token beyond the parameters': each depthwise tap weight is one multiply-add per token (the
    # same 6 per parameter forward and backward as a linear's), which training_flops' 6 N counts already.

    def new_cache(self) -> dict:
        return {}  # the conv's last inputs, under "x"

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache: dict | None = None,
                context=None) -> torch.Tensor:
        """As KDA's convs: packed documents do not read each other, a cache holds the last inputs, and a
        context-parallel shard reads the previous shard's last inputs (its halo)."""
        h = self.in_proj(x)
        prev, continues = (None, None) if cache is None else (cache.get("x"), None)
        if context is not None:
            halo = self.conv.weight.shape[-1] - 1
            tail = h.reshape(context.rows, -1, h.shape[-1])[:, context.length - halo:]
            (prev,), continues = context.halo([tail]), context.continues
        y, tail = self.conv(h, cu_seqlens, prev, continues)
        if cache is not None:
            cache["x"] = tail
        return self.out_proj(F.silu(y))
