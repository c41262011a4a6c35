"""Optimizer factory: the optimizer optim.name names (registry.py; built in: AdamW, or MuonClip, Muon on
hidden matrices and AdamW on the rest, see muonclip.py), and QK-Clip, a hook run after any optimizer's step
(qk_clip.py).

The names of the package's modules are imported on first use, and torch with them, so that importing the
optimizer's torch-free config (kimi/optim/config.py, which kimi.config assembles) does not import them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

from kimi import lazy_getattr

if TYPE_CHECKING:
    import torch

    from kimi.optim.config import OptimConfig
    from kimi.optim.groups import weight_decay_groups  # noqa: F401
    from kimi.optim.muonclip import MuonClip  # noqa: F401
    from kimi.optim.optimizers import muon_splits, ns_dtype  # noqa: F401
    from kimi.optim.qk_clip import QKClip
    from kimi.optim.schedules import build_scheduler, lr_multiplier  # noqa: F401

__all__ = ["MuonClip", "QKClip", "RoutedOptimizer", "build_optimizer", "build_qk_clip", "build_scheduler",
           "lr_multiplier", "muon_splits", "ns_dtype", "weight_decay_groups"]
_WHERE = {"weight_decay_groups": "groups", "MuonClip": "muonclip", "muon_splits": "optimizers",
          "ns_dtype": "optimizers", "QKClip": "qk_clip", "build_scheduler": "schedules",
          "lr_multiplier": "schedules"}


__getattr__ = lazy_getattr(__name__, _WHERE)


@runtime_checkable
class RoutedOptimizer(Protocol):
    """An optimizer that routes each parameter to one of several update rules (MuonClip: Muon or AdamW)."""

    def routing_table(self) -> Optional[str]:
        """One line per parameter and its family, then the per-family totals (None: nothing is routed)."""


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, process_group=None, named=None,
                    fragments=None) -> torch.optim.Optimizer:
    """The optimizer optim.name names (kimi/optim/registry.py). process_group: the ranks holding this model
    part (MuonClip coordinates over them; default: all). named, fragments: the tensors to update by name when
    they are not the model's parameters but flat pieces of them (DeepSpeed's fp32 masters,
    kimi/parallel/zero_client.py), and where each piece lies."""
    from kimi.optim.registry import built, optimizer_for

    named = list(model.named_parameters()) if named is None else named
    kind = optimizer_for(cfg)
    return built(kind.build(model, named, process_group, fragments), kind)


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
    from kimi.optim.qk_clip import QKClip

    model.record_max_logits(True)
    return QKClip(model.named_parameters() if named is None else named, specs, cfg.qk_clip_tau, group=group,
                  head_group=head_group, fragments=fragments)
