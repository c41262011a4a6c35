"""Which parameters get weight decay: shared by the AdamW optimizer and MuonClip's AdamW family."""

from __future__ import annotations

from typing import Iterable, Tuple

import torch


def weight_decay_groups(named_params: Iterable[Tuple[str, torch.nn.Parameter]], weight_decay: float):
    """Decay tensors with two or more dims (matrices, embeddings, conv kernels); never norms, biases,
    A_log, dt_bias or AttnRes queries, whose scale is meaningful and which pulling to zero would damage."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
