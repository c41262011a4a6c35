"""Parallelism, applied from outside the single-device model (docs/architecture.md).

``ParallelDims`` holds the (already validated) degrees and builds the DeviceMesh (pp, dp_replicate, dp_shard,
tp); ``parallelize`` cuts the pipeline stages and applies to each, in order, tensor (and sequence)
parallelism, activation checkpointing, torch.compile and FSDP2 (ZeRO-3 per sublayer; HSDP when
dp_replicate > 1); an engine (interface.Engine: ``engine.TorchEngine`` or
``deepspeed_engine.DeepSpeedEngine``, chosen by parallel.engine, built by ``build_engine``) owns the step.

The names below are imported on first use, so that importing one light module of the package (dims,
engine_rules, rules) does not import the engines and the model.
"""

from typing import TYPE_CHECKING

from kimi import lazy_getattr

_WHERE = {
    "apply_activation_checkpointing": "activation_checkpointing", "apply_compile": "activation_checkpointing",
    "ParallelDims": "dims", "checkpoint_group": "dims", "destroy_distributed": "dims",
    "init_distributed": "dims", "main_rank_first": "dims", "mean_over_ranks": "dims",
    "resolve_device": "dims", "setup_group": "dims",
    "Engine": "interface", "TorchEngine": "engine", "build_engine": "build", "ENGINES": "engine_rules",
    "apply_data_parallel": "fsdp", "parallelize": "parallelize",
}
__all__ = sorted(_WHERE)


__getattr__ = lazy_getattr(__name__, _WHERE)


if TYPE_CHECKING:  # for type checkers: the names of __all__, which __getattr__ imports at run time
    from .build import build_engine  # noqa: F401
    from .activation_checkpointing import apply_activation_checkpointing, apply_compile  # noqa: F401
    from .dims import (ParallelDims, checkpoint_group, destroy_distributed, init_distributed,  # noqa: F401
                       main_rank_first, mean_over_ranks, resolve_device, setup_group)
    from .engine import TorchEngine  # noqa: F401
    from .engine_rules import ENGINES  # noqa: F401
    from .fsdp import apply_data_parallel  # noqa: F401
    from .interface import Engine  # noqa: F401
    from .parallelize import parallelize  # noqa: F401
