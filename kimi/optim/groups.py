"""Which parameters get weight decay: shared by the AdamW optimizer and MuonClip's AdamW family."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Tuple

import torch

from kimi.optim.owners import Fragment


def weight_decay_groups(named_params: Iterable[Tuple[str, torch.nn.Parameter]], weight_decay: float,
                        fragments: Optional[Mapping[str, Fragment]] = None):
    """Decay tensors with two or more dims (matrices, embeddings, conv kernels); never norms, biases,
    A_log, dt_bias or AttnRes queries, whose scale is meaningful and which pulling to zero would damage.
    A tensor named in ``fragments`` is a flat piece of a parameter and goes by the parameter's shape."""
    decay, no_decay = [], []
    for name, p in named_params:
        ndim = len(fragments[name].shape) if fragments and name in fragments else p.ndim
        if p.requires_grad:
            (decay if ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
