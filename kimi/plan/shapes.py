"""The shapes the planner's models read, cached per model: the meta-device model, its parameters'
optimizer families and kimi.summary facts, the pipeline split, the residual stream's sources."""

from __future__ import annotations

from typing import Dict

from kimi.config import Config

_SHAPES: Dict[str, tuple] = {}


def model_shapes(cfg: Config):
    """(the meta model, each parameter's optimizer family, its named_parameters(remove_duplicate=False)
    as a list, kimi.summary.param_facts of it) of cfg's model and optimizer, cached."""
    import torch

    from kimi.model import KimiModel
    from kimi.optim.registry import optimizer_for
    from kimi.summary import optimizer_families, param_facts, vocab_note

    vocab_note(cfg)
    key = repr((cfg.model, cfg.optim))
    if key not in _SHAPES:
        with torch.device("meta"):
            model = KimiModel(cfg.model)
        named = list(model.named_parameters(remove_duplicate=False))
        _SHAPES[key] = (model, optimizer_families(optimizer_for(cfg.optim), model), named, param_facts(model))
    return _SHAPES[key][:3]


_PIPELINES: Dict[tuple, list] = {}


def pipeline(cfg: Config) -> list:
    """kimi.summary.pipeline_ranks(cfg), cached per model shape and pipeline layout (its FLOP balance
    builds blocks)."""
    from kimi.summary import pipeline_ranks

    p = cfg.parallel
    key = (repr(cfg.model), p.pp, p.pp_schedule, p.pp_virtual_stages, cfg.trainer.seq_len,
           tuple(p.pp_split or ()))
    if key not in _PIPELINES:
        _PIPELINES[key] = pipeline_ranks(cfg)
    return _PIPELINES[key]


def facts(cfg: Config):
    model_shapes(cfg)
    return _SHAPES[repr((cfg.model, cfg.optim))][3]


def sources(m, done: int) -> int:
    """Tensors [tokens, d_model] the residual stream holds after `done` sublayers (what a stage receives)."""
    if m.residual == "standard":
        return 1
    if m.residual == "attnres_full":
        return 1 + done
    bs = m.attnres.block_size
    return 1 + done // bs + (done % bs > 0)


def muonclip(cfg: Config) -> bool:
    """Whether optim.name's optimizer is MuonClip (its owner plan spreads state and work over the stage)."""
    from kimi.optim.optimizers import MuonClipKind
    from kimi.optim.registry import optimizer_for

    return isinstance(optimizer_for(cfg.optim), MuonClipKind)
