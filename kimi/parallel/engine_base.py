"""What every engine does alike after its update, written once: the lr schedule's step, the MoE layers'
aux-loss-free bias update and its statistics, QK-Clip's statistics, and whether a batch's document starts
reach the model (data.varlen). TorchEngine and DeepSpeedEngine differ in how they reduce, clip and update;
they share this."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from kimi.data import Batch
from kimi.model.moe import update_expert_bias

from .dims import sum_over
from .interface import Engine


class EngineBase(Engine):
    """An engine's shared half. A subclass sets cfg, dims, mesh, device, model, scheduler and qk_clip (None
    without QK-Clip) and calls `after_update` once per step, after the optimizer's update."""

    qk_clip: Any

    def doc_starts(self, batch: Batch) -> Optional[torch.Tensor]:
        """The document starts the model masks attention by (data.varlen), else None: one sequence per row."""
        return batch.doc_starts if self.cfg.data.varlen else None

    def after_update(self) -> Dict[str, float]:
        """Advance the lr schedule and update the MoE layers' expert bias; the bias update's statistics."""
        self.scheduler.step()
        return self._balance_experts()

    def _balance_experts(self) -> Dict[str, float]:
        """The aux-loss-free bias update of every MoE layer, from the step's loads summed over the ranks that
        hold the same layers (tensor-parallel ranks count the same tokens again: that scales all loads alike,
        which changes neither the update's sign nor max/mean); statistics as their max over the stages."""
        if not self.cfg.model.moe.num_experts:
            return {}
        stats = update_expert_bias(self.model, self.cfg.model.moe.bias_rate,
                                   sum_over(self.dims.stage_group(self.mesh)))
        if self.dims.pp > 1:  # every stage joins, one without MoE layers with zeros
            keys = ["moe_imbalance", "moe_bias_range"]
            keys += ["moe_aux_loss"] if self.cfg.model.moe.aux_loss_coef else []  # same keys on every stage
            values = torch.tensor([stats.get(k, 0.0) for k in keys], device=self.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.mesh["pp"].get_group())
            stats = dict(zip(keys, values.tolist()))
        return stats

    @property
    def qk_clip_stats(self) -> Dict[str, Dict[str, float]]:
        """{layer: {"max_logit", "clipped_frac"}} of the last step (empty without QK-Clip)."""
        return self.qk_clip.stats if self.qk_clip is not None else {}

    @property
    def qk_clip_head_max_logits(self) -> Dict[str, torch.Tensor]:
        return self.qk_clip.head_max_logits if self.qk_clip is not None else {}
