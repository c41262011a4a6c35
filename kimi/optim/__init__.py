"""Optimizer factory: AdamW, or MuonClip (Muon on hidden matrices, AdamW on the rest; see muonclip.py), and
QK-Clip, a hook run after either optimizer's step (qk_clip.py)."""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from kimi.config import OptimConfig
from kimi.optim.groups import weight_decay_groups
from kimi.optim.muonclip import DEFAULT_ADAMW_PATTERNS, MuonClip
from kimi.optim.qk_clip import QKClip
from kimi.optim.schedules import build_scheduler, lr_multiplier

__all__ = ["MuonClip", "QKClip", "RoutedOptimizer", "build_optimizer", "build_qk_clip", "build_scheduler",
           "lr_multiplier", "weight_decay_groups"]


@runtime_checkable
class RoutedOptimizer(Protocol):
    """An optimizer that routes each parameter to one of several update rules (MuonClip: Muon or AdamW)."""

    def routing_table(self) -> Optional[str]:
        """One line per parameter and its family, then the per-family totals (None: nothing is routed)."""


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, process_group=None, named=None,
                    fragments=None) -> torch.optim.Optimizer:
    """process_group: the ranks holding this model part (MuonClip coordinates over them; default: all).
    named, fragments: the tensors to update by name when they are not the model's parameters but flat
    pieces of them (DeepSpeed's fp32 masters, kimi/parallel/zero_client.py), and where each piece lies."""
    named = list(model.named_parameters()) if named is None else named
    if cfg.name == "adamw":
        groups = weight_decay_groups(named, cfg.weight_decay, fragments)
        fused = all(p.is_cuda for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)
    if cfg.name == "muonclip":
        patterns = DEFAULT_ADAMW_PATTERNS if cfg.adamw_patterns is None else tuple(cfg.adamw_patterns)
        return MuonClip(named, lr=cfg.lr, weight_decay=cfg.weight_decay,
                        momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                        adjust_lr_fn=cfg.adjust_lr_fn,
                        ns_dtype=ns_dtype(cfg.ns_dtype, named),
                        betas=tuple(cfg.betas), adamw_eps=cfg.eps, adamw_patterns=patterns,
                        muon_patterns=tuple(cfg.muon_patterns),
                        splits=muon_splits(model, cfg),
                        process_group=process_group, fragments=fragments)
    raise ValueError(f"optim.name={cfg.name!r} is not available; choose one of: adamw, muonclip")


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


def build_qk_clip(model: torch.nn.Module, cfg: OptimConfig, group=None, head_group=None, named=None,
                  fragments=None, specs=None) -> QKClip | None:
    """The QK-Clip hook for any optimizer (None when optim.qk_clip_tau = 0 or the model has no softmax
    attention). It turns on the max-logit recording it needs. group: the ranks holding this model part
    (their logits are max-reduced); head_group: the tensor-parallel ranks that split the heads; named,
    fragments: as for build_optimizer; specs: the model's QK-Clip specs, taken before its weights were
    partitioned (default: asked now)."""
    if specs is None:
        specs = model.qk_clip_specs() if hasattr(model, "qk_clip_specs") else []
    specs = specs if cfg.qk_clip_tau > 0 else []
    if not specs:
        return None
    model.record_max_logits(True)
    return QKClip(model.named_parameters() if named is None else named, specs, cfg.qk_clip_tau, group=group,
                  head_group=head_group, fragments=fragments)
