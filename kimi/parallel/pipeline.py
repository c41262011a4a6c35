"""Pipeline parallelism with torch.distributed.pipelining: contiguous runs of blocks per stage.

A stage is the full model with the other stages' parts removed, so parameter names stay those of the
single-device model (blocks keep their indices in a ModuleDict), and checkpoints reshard across layouts.
What crosses a stage boundary is the AttnRes stream's sources(): exactly the tensors later sublayers read
(the hidden state; or every output so far; or the completed block sums plus the running partial sum),
each sent once per micro-batch, never one tensor per layer. The receiving stage rebuilds the stream from
them and the number of sublayers already done (kimi.model.attnres.resume_stream).

Stages are balanced by training FLOPs per block (MLA blocks cost more than KDA ones at long sequences) with
the embedding on the first stage and the LM head on the last; `parallel.pp_split` overrides the boundaries.
"""

from __future__ import annotations

import types
from typing import List, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from kimi.config import ConfigError, ModelConfig, mla_layer_indices
from kimi.model.attnres import make_stream, resume_stream

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def block_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Relative training cost of each block: 6 FLOPs per parameter and token, plus attention over T."""
    from kimi.model.transformer import Block

    mla = set(mla_layer_indices(cfg))
    costs = []
    for i in range(cfg.num_layers):
        with torch.device("meta"):
            params = sum(p.numel() for p in Block(cfg, i in mla, first=i == 0).parameters())
        attn = (3 * cfg.mla_num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * seq_len
                if i in mla else 0)
        costs.append(6.0 * params + attn)
    return costs


def split_blocks(cfg: ModelConfig, stages: int, seq_len: int, split: Sequence[int] | None = None) -> List[range]:
    """Contiguous block ranges, one per stage: `split` (first block of stages 1..) or balanced by cost."""
    n = cfg.num_layers
    if n < stages:
        raise ConfigError(f"parallel.pp={stages} is more stages than model.num_layers={n}; every stage needs "
                          "a block: lower parallel.pp")
    if split:
        bounds = [0, *split, n]
        if len(split) != stages - 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ConfigError(f"parallel.pp_split={list(split)} is invalid: give {stages - 1} rising block "
                              f"indices in (0, {n}) where stages 1..{stages - 1} start")
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    costs = block_costs(cfg, seq_len)
    vocab = cfg.vocab_size * cfg.d_model * 6.0  # the LM head's matmul, on the last stage
    total, ranges, start = sum(costs) + vocab, [], 0
    for s in range(stages - 1):
        target, acc, end = total * (s + 1) / stages, sum(costs[:start]), start
        # extend while it brings the running cost closer to this boundary's share, leaving a block per stage
        while end < n - (stages - 1 - s) and abs(acc + costs[end] - target) <= abs(acc - target):
            acc += costs[end]
            end += 1
        end = max(end, start + 1)
        ranges.append(range(start, end))
        start = end
    ranges.append(range(start, n))
    return ranges


def _stage_forward(self, *inputs: torch.Tensor):
    """A stage's forward: token ids (first stage) or the stream's sources in; sources or logits out."""
    cfg, blocks = self.cfg, self._stage_blocks
    if self.embed is not None:
        stream = make_stream(cfg.residual, self.embed(inputs[0]), cfg.attnres_block_size, cfg.norm_eps)
    else:
        stream = resume_stream(cfg.residual, list(inputs), 2 * blocks.start, cfg.attnres_block_size, cfg.norm_eps)
    for i in blocks:
        stream = self.blocks[str(i)](stream)
    if self.lm_head is not None:
        return self.lm_head(self.norm(stream.mix(self.final_query)))
    return tuple(stream.sources())


def make_stage(model: nn.Module, blocks: range, first: bool, last: bool) -> nn.Module:
    """Keep only this stage's parts of `model` (in place) and give it the stage forward."""
    if model.cfg.tie_embeddings:
        raise ConfigError("parallel.pp > 1 with model.tie_embeddings=true is not supported yet: the embedding "
                          "and the LM head live on different stages; untie them")
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
    if not first:
        model.embed = None
    if not last:
        model.norm, model.lm_head, model.final_query = None, None, None
    model._stage_blocks = blocks
    model.forward = types.MethodType(_stage_forward, model)
    return model


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def build_schedule(stage_module: nn.Module, mesh: DeviceMesh, device: torch.device, schedule: str,
                   microbatches: int):
    pp = mesh.size()
    stage = PipelineStage(stage_module, mesh.get_local_rank(), pp, device, group=mesh.get_group())
    return SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=cross_entropy)
