"""The built-in optimizers, each an :class:`~kimi.optim.registry.OptimizerKind` registered by its optim.name:
AdamW, and MuonClip (Muon on hidden matrices, AdamW on the rest; kimi/optim/muonclip.py)."""

from __future__ import annotations

import torch

from kimi.optim.config import OptimConfig
from kimi.optim.groups import weight_decay_groups
from kimi.optim.muonclip import DEFAULT_ADAMW_PATTERNS, MuonClip, route
from kimi.optim.registry import OptimizerKind, StateModel

ADAMW_STATE = StateModel("AdamW", "moments", 2)  # exp_avg, exp_avg_sq
MUON_STATE = StateModel("Muon", "momentum", 1)  # the momentum buffer


class AdamWKind(OptimizerKind):
    """torch's AdamW (fused where every parameter is on CUDA); weight decay on 2+-dim tensors only."""

    FAMILIES = {"adamw": ADAMW_STATE}

    def build(self, model, named, process_group=None, fragments=None):
        cfg = self.cfg
        groups = weight_decay_groups(named, cfg.weight_decay, fragments)
        fused = all(p.is_cuda for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)


class MuonClipKind(OptimizerKind):
    """MuonClip: hidden matrices to Muon, the rest to AdamW (muonclip.route), each family its param groups."""

    FAMILIES = {"muon": MUON_STATE, "adamw": ADAMW_STATE}

    def adamw_patterns(self) -> tuple:
        return DEFAULT_ADAMW_PATTERNS if self.cfg.adamw_patterns is None else tuple(self.cfg.adamw_patterns)

    def family(self, name, param):
        return route(name, param, self.adamw_patterns(), tuple(self.cfg.muon_patterns))

    def build(self, model, named, process_group=None, fragments=None):
        cfg = self.cfg
        return MuonClip(named, lr=cfg.lr, weight_decay=cfg.weight_decay,
                        momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                        adjust_lr_fn=cfg.adjust_lr_fn,
                        ns_dtype=ns_dtype(cfg.ns_dtype, named),
                        betas=tuple(cfg.betas), adamw_eps=cfg.eps, adamw_patterns=self.adamw_patterns(),
                        muon_patterns=tuple(cfg.muon_patterns),
                        splits=muon_splits(model, cfg),
                        process_group=process_group, fragments=fragments)


def ns_dtype(name: str, named) -> torch.dtype:
    """optim.ns_dtype as a dtype; auto: bf16 where the parameters are on CUDA (fp32 Newton-Schulz there ran
    on the GPU's plain fp32 units: 0.88 s of a 1.8 s `1b` step on an H200), fp32 elsewhere (a CPU has no
    faster bf16 matmul, and fp32 is the exact reference)."""
    if name == "auto":
        name = "bf16" if any(p.is_cuda for _, p in named) else "fp32"
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def muon_splits(model: torch.nn.Module, cfg: OptimConfig) -> dict:
    """The weights MuonClip orthogonalises in blocks: MLA's fused ones per logical matrix
    (optim.muon_split_fused) and, with optim.muon_per_head, the query, key and value projections head by
    head."""
    if not hasattr(model, "muon_splits"):
        return {}
    return {name: split for name, split in model.muon_splits(per_head=cfg.muon_per_head).items()
            if split.per_head or cfg.muon_split_fused}
