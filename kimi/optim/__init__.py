"""Optimizer factory: AdamW, or MuonClip (Muon on hidden matrices, AdamW on the rest; see muonclip.py)."""

from __future__ import annotations

import torch

from kimi.config import OptimConfig
from kimi.optim.groups import weight_decay_groups
from kimi.optim.muonclip import DEFAULT_ADAMW_PATTERNS, MuonClip
from kimi.optim.schedules import build_scheduler, lr_multiplier

__all__ = ["MuonClip", "build_optimizer", "build_scheduler", "lr_multiplier", "weight_decay_groups"]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, process_group=None) -> torch.optim.Optimizer:
    """process_group: the ranks holding this model part (MuonClip coordinates over them; default: all)."""
    if cfg.name == "adamw":
        groups = weight_decay_groups(model.named_parameters(), cfg.weight_decay)
        fused = all(p.is_cuda for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)
    if cfg.name == "muonclip":
        patterns = DEFAULT_ADAMW_PATTERNS if cfg.adamw_patterns is None else tuple(cfg.adamw_patterns)
        # QK-Clip needs the per-head max logits of the training forwards, so tracking turns on here, with
        # the optimizer that consumes them; qk_clip_tau = 0 disables both (no specs, no tracking cost).
        clip = {}
        if cfg.qk_clip_tau > 0 and hasattr(model, "qk_clip_specs"):
            clip = {"qk_clip_tau": cfg.qk_clip_tau, "qk_clip_specs": model.qk_clip_specs()}
            for m in model.mla_modules():
                m.track_max_logits = True
        return MuonClip(model.named_parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                        momentum=cfg.momentum, nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                        adjust_lr_fn=cfg.adjust_lr_fn,
                        ns_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.ns_dtype],
                        betas=tuple(cfg.betas), adamw_eps=cfg.eps, adamw_patterns=patterns,
                        muon_patterns=tuple(cfg.muon_patterns),
                        splits=model.muon_splits() if hasattr(model, "muon_splits") else None,
                        process_group=process_group, **clip)
    raise ValueError(f"optim.name={cfg.name!r} is not available; choose one of: adamw, muonclip")
