"""Pipeline parallelism with torch.distributed.pipelining: contiguous runs of blocks per stage.

A stage is a part of the model (KimiModel.part: a run of blocks, the embedding on the first stage, the
final norm and LM head on the last), run by the model's own forward, which passes through what a part
lacks. A rank runs one stage, or several with the interleaved and zero-bubble schedules (stages rank,
rank + pp, ...); the parts keep the whole model's parameter names, so optimizer routing and checkpoints are
unchanged, and KimiModel.union joins a rank's stages into the one model its optimizer and checkpoints see.
What crosses a stage boundary is the AttnRes stream's sources(): exactly the tensors later sublayers read
(the hidden state; or every output so far; or the completed block sums plus the running partial sum),
each sent once per micro-batch, never one tensor per layer. The receiving stage rebuilds the stream from
them and the number of sublayers already done (kimi.model.attnres.resume_stream).

Tied embeddings live on both end stages, kept equal by summing their gradients (TiedEnds); packed
documents reach every stage as the batch's [B, T] mask of document starts (a schedule keyword argument),
split into micro-batches with the tokens.

Stages are balanced by training FLOPs per block (MLA blocks cost more than KDA ones at long sequences) with
the embedding on the first stage and the LM head on the last; `parallel.pp_split` overrides the boundaries.
"""

from __future__ import annotations

import copy
from typing import List, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                           ScheduleInterleavedZeroBubble)

from kimi.model import lm_loss, training_flops
from kimi.model.config import ModelConfig
from kimi.schema.pipeline import SINGLE_STAGE_SCHEDULES as SINGLE_STAGE

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "zero_bubble": ScheduleInterleavedZeroBubble}


def split_blocks(cfg: ModelConfig, stages: int, seq_len: int,
                 split: Sequence[int] | None = None) -> List[range]:
    """Contiguous block ranges, one per stage: `split` (first block of stages 1..) or balanced by cost. The
    stages and split must have passed kimi.config.check_stage_split (the validation pass runs it)."""
    n = cfg.num_layers
    if split:
        bounds = [0, *split, n]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    costs, end_cost = training_flops(cfg, seq_len)  # the model's end (LM head) is on the last stage
    total, ranges, start = sum(costs) + end_cost, [], 0
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


def stage_indices(rank: int, pp: int, virtual: int) -> list[int]:
    """The stages a pipeline rank runs: rank, rank + pp, ... (looped placement, as interleaved schedules
    expect)."""
    return [rank + k * pp for k in range(virtual)]


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


def stage_parts(model: nn.Module, ranges: Sequence[range], rank: int, pp: int,
                virtual: int) -> list[nn.Module]:
    """The parts of `model` that pipeline rank `rank` runs, one per stage, in stage order."""
    total = pp * virtual
    return [model.part(ranges[i], i == 0, i == total - 1) for i in stage_indices(rank, pp, virtual)]


def _recorded(part: nn.Module) -> list:
    """What a training forward records in the model besides its output: each sublayer's declared RECORDS
    (a MoE layer's token counts per expert and last auxiliary loss, MLA's max logits for QK-Clip)."""
    out = []
    for _, m in part.sublayers():
        for name in m.RECORDS:
            value = getattr(m, name)
            out.append((m, name, value.clone() if isinstance(value, torch.Tensor) else copy.copy(value)))
    return out


def _restore(saved: list) -> None:
    for m, name, value in saved:
        setattr(m, name, value)


def _without_records(stage: PipelineStage, part: nn.Module) -> None:
    """torch's PipelineStage (2.13) infers its shapes by running the stage's forward once with gradients
    before the first real micro-batch: on the first micro-batch's tokens (first stage) or on uninitialised
    activations (the others). What that forward records would skew the first step (one extra micro-batch of
    MoE loads, hence another bias update; QK-Clip logits of garbage): undo it."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return

    def inference_leaving_no_records(*args, **kwargs):
        saved = _recorded(part)
        try:
            return infer(*args, **kwargs)
        finally:
            _restore(saved)

    stage._forward_metadata_inference = inference_leaving_no_records


def build_schedule(parts: Sequence[nn.Module], mesh: DeviceMesh, device: torch.device, schedule: str,
                   microbatches: int):
    pp, rank = mesh.size(), mesh.get_local_rank()
    total = pp * len(parts)
    stages = [PipelineStage(part, index, total, device, group=mesh.get_group())
              for part, index in zip(parts, stage_indices(rank, pp, len(parts)))]
    for stage, part in zip(stages, parts):
        _without_records(stage, part)
    if schedule in SINGLE_STAGE:
        return SCHEDULES[schedule](stages[0], n_microbatches=microbatches, loss_fn=lm_loss)
    return SCHEDULES[schedule](stages, n_microbatches=microbatches, loss_fn=lm_loss)
