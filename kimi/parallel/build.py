"""build_engine: the engine parallel.engine names (kimi/parallel/engine_rules.py's table), around a model
built on the meta device."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from kimi.model import KimiModel
from kimi.schema.vocabulary import RootConfig as Config
from kimi.schema.vocabulary import registered

from .dims import ParallelDims
from .engine_rules import ENGINES
from .interface import Engine


def build_engine(cfg: Config, dims: ParallelDims, mesh: DeviceMesh | None, device: torch.device,
                 model: KimiModel) -> Engine:
    """The engine named by parallel.engine, wrapping `model` (built on the meta device); its module is
    imported here (deepspeed's engine imports deepspeed, which only it needs). With
    parallel.fault_tolerance=torchft, that engine steps across torchft's replica groups."""
    engine = registered(ENGINES[cfg.parallel.engine], __package__)(cfg, dims, mesh, device, model)
    if cfg.parallel.fault_tolerance == "torchft":
        from .fault_tolerance import FaultTolerantEngine

        engine = FaultTolerantEngine(engine, cfg, mesh, device)
    return engine
