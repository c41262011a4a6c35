"""The shapes the planner's models read, cached per model: the meta-device model, its parameters'
optimizer families and kimi.summary facts, the pipeline split, the residual stream's sources."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Tuple

from kimi.config import Config

_SHAPES: Dict[str, tuple] = {}
# repr of a config section by id() while a search runs (stable_keys), the object held so that its id is not
# reused: the models ask for the model and optimizer sections' keys ~800k times in one search of K3 on 4,096
# GPUs, and the repr of a model section with its nested sections costs ~50 us each time
_KEYS: Optional[Dict[int, Tuple[Any, str]]] = None


@contextlib.contextmanager
def stable_keys() -> Iterator[None]:
    """While it is open, section_key() remembers each section's repr: for a search, which changes no model or
    optimizer section of the configs it builds (they share the run's)."""
    global _KEYS
    outer, _KEYS = _KEYS, {} if _KEYS is None else _KEYS
    try:
        yield
    finally:
        _KEYS = outer


def section_key(*sections: Any) -> str:
    """The cache key of config sections (their repr), remembered per object inside stable_keys()."""
    if _KEYS is None:
        return repr(sections)
    out = []
    for s in sections:
        hit = _KEYS.get(id(s))
        if hit is None or hit[0] is not s:
            hit = _KEYS[id(s)] = (s, repr(s))
        out.append(hit[1])
    return "(" + ", ".join(out) + ",)"


def model_shapes(cfg: Config):
    """(the meta model, each parameter's optimizer family, its named_parameters(remove_duplicate=False)
    as a list, kimi.summary.param_facts of it) of cfg's model and optimizer, cached."""
    import torch

    from kimi.model import KimiModel
    from kimi.optim.registry import optimizer_for
    from kimi.summary import optimizer_families, param_facts, vocab_note

    vocab_note(cfg)
    key = section_key(cfg.model, cfg.optim)
    if key not in _SHAPES:
        with torch.device("meta"):
            model = KimiModel(cfg.model)
        named = list(model.named_parameters(remove_duplicate=False))
        _SHAPES[key] = (model, optimizer_families(optimizer_for(cfg.optim), model), named, param_facts(model))
    return _SHAPES[key][:3]


_PIPELINES: Dict[tuple, list] = {}


def _pipeline_key(cfg: Config) -> tuple:
    """What a pipeline split depends on: the model's shape, the schedule and the split's inputs."""
    p = cfg.parallel
    return (section_key(cfg.model), p.pp, p.pp_schedule, p.pp_virtual_stages, cfg.trainer.seq_len,
            tuple(p.pp_split or ()))


def pipeline(cfg: Config) -> list:
    """kimi.summary.pipeline_ranks(cfg), cached per model shape and pipeline layout (its FLOP balance
    builds blocks)."""
    from kimi.summary import pipeline_ranks

    key = _pipeline_key(cfg)
    if key not in _PIPELINES:
        _PIPELINES[key] = pipeline_ranks(cfg)
    return _PIPELINES[key]


_RANGES: Dict[tuple, list] = {}


def stage_ranges(cfg: Config) -> list:
    """Each pipeline stage's blocks (a range; pp x virtual stages in stage order), read from pipeline()
    rather than split again: a rank's stages are the contiguous runs of its blocks (every stage between two
    of them holds a block)."""
    key = _pipeline_key(cfg)
    if key not in _RANGES:
        found = {}
        for stages, blocks, _, _ in pipeline(cfg):
            runs: list = []
            for b in blocks:
                if runs and b == runs[-1][-1] + 1:
                    runs[-1].append(b)
                else:
                    runs.append([b])
            found.update({s: range(run[0], run[-1] + 1) for s, run in zip(stages, runs)})
        _RANGES[key] = [found[s] for s in sorted(found)]
    return _RANGES[key]


def facts(cfg: Config):
    model_shapes(cfg)
    return _SHAPES[section_key(cfg.model, cfg.optim)][3]


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
