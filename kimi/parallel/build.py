"""build_engine: the engine parallel.engine names, around a model built on the meta device."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from kimi.config import Config
from kimi.model import KimiModel

from .dims import ParallelDims
from .engine import TorchEngine
from .engine_rules import DEEPSPEED, TORCH
from .interface import Engine


def _deepspeed_engine(*args) -> Engine:
    from .deepspeed_engine import DeepSpeedEngine  # imports deepspeed, which only this engine needs

    return DeepSpeedEngine(*args)


BUILDERS = {TORCH: TorchEngine, DEEPSPEED: _deepspeed_engine}


def build_engine(cfg: Config, dims: ParallelDims, mesh: DeviceMesh | None, device: torch.device,
                 model: KimiModel) -> Engine:
    """The engine named by parallel.engine, wrapping `model` (built on the meta device)."""
    return BUILDERS[cfg.parallel.engine](cfg, dims, mesh, device, model)
