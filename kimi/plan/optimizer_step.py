"""The optimizer step's working memory beyond its state, traced from the model's shapes on the meta device.

optim.name's optimizer is built over a meta-device model, given gradients, stepped once (its state then
exists) and stepped again under kimi.plan.activations' live-storage tracker, after gradient clipping as the
engines do it: the most bytes alive at once besides the weights, gradients and state is the step's
transient (MuonClip: each bucket's stacked momentum and its Newton-Schulz scratch; AdamW: foreach
temporaries). On the CPU MuonClip keeps each bucket's Newton-Schulz buffers between steps
(kimi/optim/muonclip.py), so all buckets' are alive at the end of a step rather than one at a time: the
trace keeps them alike when trainer.device is cpu, and counts what it kept (kept_bytes_per_param), which
is alive through the whole of every later step, beside the state.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Tuple

import torch

from kimi.config import Config
from kimi.plan import disk_cache
from kimi.plan.activations import _Live, _track
from kimi.plan.shapes import muonclip, section_key

_CACHE: Dict[Tuple[str, bool], Tuple[float, float]] = {}


@contextlib.contextmanager
def _kept_scratch(keep: bool):
    """Newton-Schulz scratch from one dict for the whole step when `keep` (as MuonClip keeps it on CPU);
    yields that dict (empty when not `keep`)."""
    import kimi.ops.newton_schulz as ns
    import kimi.optim.muonclip as mc

    kept: dict = {}
    if not keep:
        yield kept
        return
    original = ns.scratch

    def scratch(buffers, name, shape, like):
        return original(kept if buffers is None else buffers, name, shape, like)

    ns.scratch = mc.scratch = scratch
    try:
        yield kept
    finally:
        ns.scratch = mc.scratch = original


def _trace(cfg: Config, keep: bool) -> Tuple[float, float]:
    """(the step's transient, the Newton-Schulz buffers it keeps) in bytes per parameter."""
    from kimi.model import KimiModel
    from kimi.optim import build_optimizer

    with torch.device("meta"):
        model = KimiModel(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer.step()  # the state
    live = _Live(cfg.model.d_model)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    _track(live, [*params, *(p.grad for p in params), *state])
    with _kept_scratch(keep) as kept, live:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    n = sum(p.numel() for p in params)
    return live.peak / n, sum(t.untyped_storage().nbytes() for t in kept.values()) / n


def step_bytes_per_param(cfg: Config) -> float:
    """Bytes the optimizer step holds at once beyond weights, gradients and state, per parameter of the model
    (cached per model shape and optimizer); a rank's share is this times the parameters it updates."""
    return _traced(cfg)[0]


def kept_bytes_per_param(cfg: Config) -> float:
    """Bytes the optimizer keeps from one step to the next beside its state, per parameter of the model: the
    part of step_bytes_per_param alive through every step (MuonClip's Newton-Schulz buffers on the CPU; 0
    elsewhere)."""
    return _traced(cfg)[1]


def _traced(cfg: Config) -> Tuple[float, float]:
    keep = cfg.trainer.device == "cpu" and muonclip(cfg)
    key = (section_key(cfg.model, cfg.optim), keep)
    if key not in _CACHE:
        _CACHE[key] = disk_cache.cached("optimizer_step", repr(key), lambda: _trace(cfg, keep), list, tuple)
    return _CACHE[key]
