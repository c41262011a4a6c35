"""One small MuonClip problem, solved in one process (the reference) and by tests/dist_muonclip.py under
torchrun in several layouts; shared so both sides build exactly the same weights, gradients and logits.

Shapes are chosen to be awkward: rows and columns not divisible by 2 or 4, a tall, a wide and a square
matrix, two of one shape (batched Newton-Schulz), a 3-D weight (a batch of matrices), a fused weight split
into two logical matrices, AdamW tensors of 1 and 2 dims, and QK-Clip rows on two weights.
"""

from __future__ import annotations

import torch

from kimi.optim.muonclip import DEFAULT_ADAMW_PATTERNS, MuonClip, RowSplit
from kimi.optim.qk_clip import QKClipSpec, RowRule

SHAPES = {"wq": (12, 6), "wkv": (10, 6), "tall": (9, 5), "wide": (5, 11), "sq1": (6, 6), "sq2": (6, 6),
          "experts": (3, 4, 6), "embed": (11, 4), "norm": (6,), "bias": (7,)}
SPLITS = {"wkv": RowSplit(5, ((0, 2), (2, 3)))}  # 2 heads of [2 key rows | 3 value rows]
LOGICAL_MATRICES = 7 + 3  # one per 2-D Muon weight, two for wkv, three for the experts
TAU = 1.0
HEADS = 2
HYPER = dict(lr=0.05, weight_decay=0.1, qk_clip_tau=TAU)


def extra_shapes(n: int) -> dict:
    """n more Muon matrices, for checking that the number of collectives does not grow with them."""
    return {f"more{i}": (4 + i % 3, 5 + i % 2) for i in range(n)}


def initial_weights(shapes=SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: 0.3 * torch.randn(s, generator=g) for n, s in shapes.items()}


def gradients(step: int, shapes=SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def max_logits(step: int, rank: int) -> list[torch.Tensor]:
    """Per-layer [HEADS] max logits a rank saw in a step; the layers' heads clip on some ranks only."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [2.0 * torch.rand(HEADS, generator=g) for _ in range(2)]


def clip_specs(source) -> list[QKClipSpec]:
    """Layer 0: plain multi-head rows of wq (6 per head, exponent 0.5); layer 1: the key rows of wkv.
    ``source(layer)`` gives the layer's logits for the step being taken (or None)."""
    rows0 = [RowRule("wq", 6, ((0, 3, 0.5), (3, 3, 1.0)))]
    rows1 = [RowRule("wkv", 5, ((0, 2, 0.5),))]
    return [QKClipSpec(f"layer{i}", HEADS, rows, lambda i=i: source(i))
            for i, rows in enumerate((rows0, rows1))]


def make_optimizer(named, source, **kwargs) -> MuonClip:
    return MuonClip(named, adamw_patterns=DEFAULT_ADAMW_PATTERNS, muon_patterns=("experts",), splits=SPLITS,
                    qk_clip_specs=clip_specs(source), **HYPER, **kwargs)


def reference(steps: int, world: int, shapes=SHAPES) -> dict[str, torch.Tensor]:
    """Single-process MuonClip; each step's logits are the max over what the `world` ranks saw."""
    params = {n: torch.nn.Parameter(w) for n, w in initial_weights(shapes).items()}
    current = {}
    opt = make_optimizer(list(params.items()), lambda i: current.get(i))
    for step in range(steps):
        for n, g in gradients(step, shapes).items():
            params[n].grad = g
        seen = [max_logits(step, r) for r in range(world)]
        current.update({i: torch.stack([s[i] for s in seen]).amax(0) for i in range(2)})
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}
