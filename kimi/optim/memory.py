"""The size check of a training run: the model's fp32 weights and gradients and optim.name's state (its
registry entry's state model, kimi/optim/registry.py) against the memory of the device, before any data or
model is made (kimi/model/footprint.py holds the estimate and the check)."""

from __future__ import annotations

import torch

from kimi.model.footprint import check_fits
from kimi.optim.registry import optimizer_for

WEIGHT_GRAD_BYTES = 8  # fp32 weights and fp32 gradients, per parameter


def check_training_fits(cfg, device: torch.device | str) -> int:
    """check_fits for a training run of the config `cfg` (a kimi.config.Config), before its data and model:
    fp32 weights, gradients and the fewest bytes optim.name's state keeps per parameter (AdamW: two moments;
    MuonClip: one momentum per Muon matrix, two moments for the rest, so at least one), split evenly over
    the ranks that shard them (the best any layout does: FSDP does not shard over dp_replicate, DeepSpeed's
    ZeRO may shard over every rank); trainer.skip_size_check skips it."""
    p = cfg.parallel
    shards = p.dp_shard * p.cp * p.tp * p.pp * (p.dp_replicate if p.engine != "torch" else 1)
    per_param = WEIGHT_GRAD_BYTES + optimizer_for(cfg.optim).min_state_bytes()
    return check_fits(cfg.model, per_param, device, "fp32 weights, gradients and optimizer "
                      "state", "more ranks (parallel.dp_shard, tp, pp)", shards=shards,
                      vocab_size=cfg.data.tokenizer.vocab_size, skip=cfg.trainer.skip_size_check,
                      skip_with="trainer.skip_size_check=true")
