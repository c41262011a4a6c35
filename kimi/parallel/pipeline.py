"""Pipeline parallelism with torch.distributed.pipelining: contiguous runs of blocks per stage.

Each rank trims the model to the parts its stages run (one stage, or several with the interleaved and
zero-bubble schedules: stages rank, rank + pp, ...), keeping the single-device parameter names (blocks keep
their indices in a ModuleDict), so optimizer routing and checkpoints are unchanged; each stage is a
StageView sharing the trimmed model's modules.
What crosses a stage boundary is the AttnRes stream's sources(): exactly the tensors later sublayers read
(the hidden state; or every output so far; or the completed block sums plus the running partial sum),
each sent once per micro-batch, never one tensor per layer. The receiving stage rebuilds the stream from
them and the number of sublayers already done (kimi.model.attnres.resume_stream).

Tied embeddings live on both end stages, kept equal by summing their gradients (TiedEnds); packed
documents reach every stage as a row-wise mask of document starts, split into micro-batches with the tokens.

Stages are balanced by training FLOPs per block (MLA blocks cost more than KDA ones at long sequences) with
the embedding on the first stage and the LM head on the last; `parallel.pp_split` overrides the boundaries.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                           ScheduleInterleavedZeroBubble)

from kimi.config import ConfigError, ModelConfig, mla_layer_indices
from kimi.data.loader import cu_seqlens_from_starts
from kimi.model.attnres import make_stream, resume_stream

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble}
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank; the others run parallel.pp_virtual_stages each


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


class StageView(nn.Module):
    """One pipeline stage: a view of the blocks (and the embedding or LM head) it runs, sharing the modules
    of the rank's trimmed model. Its input is the token ids (first stage) or the stream's sources; its output
    the sources or the logits (last stage)."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.cfg, self.block_range = model.cfg, blocks
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in blocks})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.final_query = model.final_query if last else None

    def forward(self, *inputs: torch.Tensor, doc_starts: torch.Tensor | None = None):
        """doc_starts: packed documents (data.varlen), a [B, T] mask of where each starts; the micro-batch's
        rows then run as one packed row, as the single-device trainer runs them."""
        cfg, blocks = self.cfg, self.block_range
        cu_seqlens = None if doc_starts is None else cu_seqlens_from_starts(doc_starts)
        if self.embed is not None:
            ids = inputs[0] if doc_starts is None else inputs[0].reshape(1, -1)
            stream = make_stream(cfg.residual, self.embed(ids), cfg.attnres_block_size, cfg.norm_eps)
        else:
            stream = resume_stream(cfg.residual, list(inputs), 2 * blocks.start, cfg.attnres_block_size,
                                   cfg.norm_eps)
        for i in blocks:
            stream = self.blocks[str(i)](stream, cu_seqlens=cu_seqlens)
        if self.lm_head is not None:
            return self.lm_head(self.norm(stream.mix(self.final_query)))
        return tuple(stream.sources())


def stage_indices(rank: int, pp: int, virtual: int) -> list[int]:
    """The stages a pipeline rank runs: rank, rank + pp, ... (looped placement, as interleaved schedules
    expect)."""
    return [rank + k * pp for k in range(virtual)]


def trim(model: nn.Module, ranges: Sequence[range], first: bool, last: bool) -> nn.Module:
    """Keep only the parts of `model` this rank's stages run (in place); names stay the single-device ones
    (blocks keep their indices in a ModuleDict), so optimizer routing and checkpoints are unchanged."""
    model.blocks = nn.ModuleDict({str(i): model.blocks[i] for r in ranges for i in r})
    if not first:
        model.embed = None
    if not last:
        model.norm, model.lm_head, model.final_query = None, None, None
    return model


class TiedEnds:
    """A tied embedding and LM head across the first and last stages (Megatron's scheme): each end keeps its
    own copy of the one matrix (``embed.weight`` on the first stage, ``lm_head.weight`` on the last, equal
    at initialisation), and after each backward the two gradients are summed over the pair of ranks, so
    both copies see the single-device gradient and take the same optimizer update. Middle stages hold
    neither."""

    def __init__(self, mesh: DeviceMesh):
        ranks = mesh.mesh  # [pp, dp_replicate, dp_shard, tp]
        pairs = torch.stack([ranks[0].flatten(), ranks[-1].flatten()], dim=1).tolist()
        # every rank takes part in creating every pair's group; each gets its own (None on middle stages)
        self.group, _ = dist.new_subgroups_by_enumeration(pairs)

    @staticmethod
    def weight(model: nn.Module) -> nn.Parameter | None:
        """This rank's copy of the tied matrix (None on a middle stage)."""
        if model.embed is not None:
            return model.embed.weight
        return model.lm_head.weight if model.lm_head is not None else None

    def sum_grads(self, model: nn.Module) -> None:
        weight = self.weight(model)
        if weight is None or self.group is None:
            return
        grad = weight.grad
        if grad is None:
            grad = weight.grad = torch.zeros_like(weight)
        if isinstance(grad, DTensor) and grad.placements != weight.placements:
            # a vocab-parallel embedding's gradient comes back replicated; both ends shard the vocabulary
            grad = weight.grad = grad.redistribute(weight.device_mesh, weight.placements)
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)

    def duplicate(self, model: nn.Module) -> nn.Parameter | None:
        """The copy not to count twice in a gradient norm summed over stages: the last stage's."""
        return self.weight(model) if model.embed is None else None


def make_stage(model: nn.Module, blocks: range, first: bool, last: bool) -> StageView:
    """A single stage cut from a whole model (trimmed in place): for tests and one-stage-per-rank use."""
    return StageView(trim(model, [blocks], first, last), blocks, first, last)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def build_schedule(views: Sequence[StageView], mesh: DeviceMesh, device: torch.device, schedule: str,
                   microbatches: int):
    pp, rank = mesh.size(), mesh.get_local_rank()
    total = pp * len(views)
    stages = [PipelineStage(view, index, total, device, group=mesh.get_group())
              for view, index in zip(views, stage_indices(rank, pp, len(views)))]
    if schedule in SINGLE_STAGE:
        return SCHEDULES[schedule](stages[0], n_microbatches=microbatches, loss_fn=cross_entropy)
    return SCHEDULES[schedule](stages, n_microbatches=microbatches, loss_fn=cross_entropy)
