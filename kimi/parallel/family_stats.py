"""Per optimizer family (the families of optim.name's registry entry, kimi/optim/registry.py: MuonClip's
"muon" and "adamw" param groups, AdamW's one "adamw"): the gradient norm before clipping and the RMS of the
optimizer's update, for the trainer's diagnostics (kimi/diagnostics). Taken only at the steps that log them:
the update needs a copy of every parameter this rank holds.

Sharded parameters (FSDP, tensor parallelism, expert parallelism, pipeline stages) reduce like the global
gradient norm (tensor_parallel.squared_norm): sums of squares of the local pieces, reduced over the mesh
dims that shard them and over the stages, so every layout gives one process's numbers.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from kimi.optim.registry import families_of

from .tensor_parallel import squared_norm


def families(optimizer: torch.optim.Optimizer) -> Dict[str, List[torch.Tensor]]:
    """The optimizer's parameters by family, every family of its kind present even if empty here (a pipeline
    stage could lack one, and every stage must join the same reductions)."""
    names = families_of(optimizer)
    if names is None:
        raise ValueError("per-family statistics need an optimizer made by kimi.optim.build_optimizer")
    out: Dict[str, List[torch.Tensor]] = {f: [] for f in names}
    for group in optimizer.param_groups:  # one family needs no tags; several tag every group
        out[group.get("family", names[0])].extend(group["params"])
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class FamilyStats:
    """Create it before gradient clipping (it reads the gradients and copies the parameters), call
    :meth:`finish` right after the optimizer's step (before QK-Clip, which is not the optimizer's update).
    `uncounted`: a parameter another pipeline stage already counts (the last stage's tied LM head)."""

    @torch.no_grad()
    def __init__(self, optimizer: torch.optim.Optimizer, pp_group=None, uncounted=None):
        self.pp_group = pp_group
        self.params = {f: [p for p in ps if p is not uncounted] for f, ps in families(optimizer).items()}
        self.device = next(p.device for ps in self.params.values() for p in ps)
        self.grad_sq = {f: squared_norm([p.grad for p in ps if p.grad is not None], pp_group, self.device)
                        for f, ps in self.params.items()}
        self.before = {f: [_local(p).detach().clone() for p in ps] for f, ps in self.params.items()}

    @torch.no_grad()
    def finish(self) -> Dict[str, float]:
        """{"optim/grad_norm/<family>", "optim/update_rms/<family>"} for every family present."""
        sums, counts = [], []
        for f, ps in self.params.items():
            diffs = []
            for p, before in zip(ps, self.before[f]):
                diff = _local(p).detach() - before
                if isinstance(p, DTensor):
                    diff = DTensor.from_local(diff, p.device_mesh, p.placements, run_check=False,
                                              shape=p.shape,
                                              stride=p.stride())
                diffs.append(diff)
            sums.append(squared_norm(diffs, self.pp_group, self.device))
            counts.append(float(sum(p.numel() for p in ps)))  # whole shapes: the same on a stage's ranks
        numel = torch.tensor(counts, dtype=torch.float64, device=self.device)
        if self.pp_group is not None:
            numel = funcol.all_reduce(numel, "sum", group=self.pp_group).wait()
        squares = torch.stack([torch.stack([self.grad_sq[f], s]) for f, s in zip(self.params, sums)])
        out: Dict[str, float] = {}
        for f, (grad_sq, update_sq), n in zip(self.params, squares.tolist(), numel.tolist()):
            if n:  # a family this optimizer has but this model gives no parameter is left out
                out[f"optim/grad_norm/{f}"] = grad_sq ** 0.5
                out[f"optim/update_rms/{f}"] = (update_sq / n) ** 0.5
        return out
