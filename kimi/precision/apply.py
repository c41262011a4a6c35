"""Low-precision training applied to a model: which projections convert (targets), whether the matmuls
are emulated (emulated), the conversion itself (apply_low_precision) and FSDP's fp8 all-gather hooks
(float8_gather). The package's docstring (kimi/precision/__init__.py) says what converts and why."""

from __future__ import annotations

import torch
from torch import nn

from kimi.errors import ConfigError
from kimi.precision.config import PrecisionConfig
from kimi.schema.vocabulary import RootConfig as Config
from kimi.model.moe import RoutedExperts
from kimi.precision.registry import precision_for


def emulated(precision: str, p: PrecisionConfig, device: torch.device) -> bool:
    """Whether the fp8 / MXFP8 matmuls are emulated on `device` (precision.emulate); a device that cannot run
    them natively when asked to is a one-line ConfigError."""
    if p.emulate:
        return True
    if device.type != "cuda":
        if p.emulate is None:
            return True
        raise ConfigError(f"precision.emulate=false needs CUDA for trainer.precision={precision}: set "
                          "precision.emulate=null (emulated on CPU) or train on a GPU")
    need, have = precision_for(precision).NATIVE_FROM, torch.cuda.get_device_capability(device)
    if have < need:
        raise ConfigError(f"trainer.precision={precision} needs a GPU of compute capability "
                          f"{need[0]}.{need[1]} or newer for its native matmuls, this one is "
                          f"{have[0]}.{have[1]}: use trainer.precision=bf16, or precision.emulate=true "
                          "(slow, for checks)")
    return False


def targets(model: nn.Module, p: PrecisionConfig, align: int) -> dict[str, nn.Linear]:
    """The projections to convert, by name (module docstring's filter)."""
    found = {}
    blocks = list(model.blocks.items())
    for k, (i, block) in enumerate(blocks):
        if k < p.keep_end_blocks or k >= len(blocks) - p.keep_end_blocks:
            continue
        for name, mod in block.named_modules():
            if type(mod) is not nn.Linear or name.rpartition(".")[2] == "router":
                continue
            small = min(mod.in_features, mod.out_features) < p.min_features
            if not small and mod.in_features % align == 0 and mod.out_features % align == 0:
                found[f"blocks.{i}.{name}"] = mod
    return found


def apply_low_precision(model: nn.Module, cfg: Config, device: torch.device,
                        fsdp: bool = False) -> list[str]:
    """Convert `model` in place for cfg.trainer.precision and cfg.precision.qat; returns the names of the
    projections now computed in fp8 / MXFP8. fsdp: FSDP2 will shard the model, so
    precision.fp8.fsdp_all_gather applies (fsdp_float8.py); a single-process model keeps plain weights."""
    precision, p = cfg.trainer.precision, cfg.precision
    kind = precision_for(precision)
    converted: list[str] = []
    if kind.converts:
        convert = kind.converter(p, emulated(precision, p, device), fsdp and p.fp8.fsdp_all_gather)
        for name, mod in targets(model, p, kind.ALIGN).items():
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, convert(mod))
            converted.append(name)
    if p.qat == "mxfp4_experts":
        from kimi.precision.mxfp4 import fake_quantize

        for experts in (m for m in model.modules() if isinstance(m, RoutedExperts)):
            experts.weight_quant = fake_quantize
    return converted


def float8_gather(cfg: Config, fsdp: bool):
    """The engine's hooks for precision.fp8.fsdp_all_gather (fsdp_float8.Float8Gather) when FSDP shards the
    model, else None."""
    if not (fsdp and precision_for(cfg.trainer.precision).FSDP_GATHER and cfg.precision.fp8.fsdp_all_gather):
        return None
    from kimi.precision.fsdp_float8 import Float8Gather

    return Float8Gather()
