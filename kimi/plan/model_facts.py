"""What the planner needs of the model, computed once per model shape (not per layout): FLOPs per token and
the Newton-Schulz FLOPs of each Muon matrix with the block that holds it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from kimi.config import Config
from kimi.model import KimiModel
from kimi.optim.owners import ns_flops
from kimi.optim.registry import optimizer_for
from kimi.summary import optimizer_families, pipeline_ranks

from . import timing
from .layout import Shape

FIRST, LAST = -1, -2  # the embedding's place, and the final norm's, query's and LM head's


@dataclass
class ModelFacts:
    flops_per_token: float  # forward and backward, model.flops_per_token(seq_len)
    params: int
    muon: List[Tuple[int, int]]  # (block index, or FIRST/LAST; Newton-Schulz FLOPs) per Muon matrix
    _owners: Dict[Tuple[int, str, int, int], int] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: Config) -> "ModelFacts":
        """cfg: composed, model.vocab_size resolved; the model is built on the meta device (shapes only)."""
        with torch.device("meta"):
            model = KimiModel(cfg.model)
        routes = optimizer_families(optimizer_for(cfg.optim), model)
        muon = []
        for name, p in model.named_parameters():
            if routes[name] != "muon":
                continue
            parts = name.split(".")
            where = int(parts[1]) if parts[0] == "blocks" else FIRST if parts[0] == "embed" else LAST
            muon.append((where, ns_flops(p.shape, cfg.optim.ns_steps)))
        return cls(model.flops_per_token(cfg.trainer.seq_len), model.num_params(), muon)

    def busiest_owner(self, cfg: Config, shape: Shape) -> int:
        """Newton-Schulz FLOPs of the busiest rank: each pipeline rank's Muon matrices are owned by the ranks
        of its stage (world / pp of them; kimi.parallel.dims.ParallelDims.stage_group), the heaviest rank."""
        key = (shape.pp, shape.schedule, shape.virtual, shape.world // shape.pp)
        if key not in self._owners:
            p = dataclasses.replace(cfg.parallel, pp=shape.pp, pp_schedule=shape.schedule,
                                    pp_virtual_stages=shape.virtual)
            worst = 0
            for _, blocks, first, last in pipeline_ranks(dataclasses.replace(cfg, parallel=p)):
                held = set(blocks) | ({FIRST} if first else set()) | ({LAST} if last else set())
                worst = max(worst, timing.busiest_owner([f for where, f in self.muon if where in held],
                                                        key[3]))
            self._owners[key] = worst
        return self._owners[key]
