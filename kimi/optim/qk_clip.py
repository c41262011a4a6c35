"""QK-Clip (Kimi K2, docs/algorithms.md section 3): after each update, shrink the query/key rows of every
softmax-attention head whose max scaled logit S_max^h of this step's forwards exceeded tau.

    gamma_h = min(1, tau / S_max^h)

A head's logit is a sum of q.k products, so scaling q rows by gamma^a and k rows by gamma^b scales the logit
by gamma^(a+b); every rule below makes a + b = 1, so the head's max logit becomes exactly tau (for the same
inputs). Plain MHA: q and k rows both get exponent 0.5. MLA: q_nope and k_nope rows 0.5, q_rope rows 1.0
(its partner, the rotary key, is shared by all heads and so cannot be scaled per head: it is never listed,
nor are value rows, which do not enter the logit).

Nothing here knows the model class or the optimizer: a layer describes itself with a QKClipSpec over
parameter names (kimi.model.layouts), apply_qk_clip scales those rows in place, and :class:`QKClip` is the
post-step hook that runs it after any optimizer's step (K2's clip does not depend on Muon: AdamW + QK-Clip
is one of the ablations), over plain or sharded parameters on any number of ranks.
"""

from __future__ import annotations

import math
from collections import abc
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from kimi.model.layouts import QKClipSpec, RowRule
from kimi.optim.owners import Fragment, local_block, local_tensor

__all__ = ["QKClip", "QKClipSpec", "RowRule", "apply_qk_clip"]


def _row_scale(rule: RowRule, gamma: torch.Tensor) -> torch.Tensor:
    """[num_heads * stride, 1] multipliers: gamma_h ** exponent on listed rows, exactly 1 elsewhere."""
    scale = torch.ones(gamma.shape[0], rule.stride, dtype=gamma.dtype, device=gamma.device)
    for offset, length, exponent in rule.segments:
        scale[:, offset : offset + length] = gamma.pow(exponent)[:, None]
    return scale.reshape(-1, 1)


@torch.no_grad()
def apply_qk_clip(
    params_by_name: Mapping[str, torch.Tensor],
    specs: Sequence[QKClipSpec],
    tau: float,
    max_logits: Sequence[torch.Tensor | None] | None = None,
    rows: Mapping[str, Tuple[int, int]] | None = None,
    fragments: Mapping[str, Fragment] | None = None,
) -> Dict[str, Dict[str, float]]:
    """Scale the q/k rows of heads whose max logit exceeds tau, in place.

    ``max_logits`` (aligned with specs) are the S_max already reduced over ranks; by default each spec's
    own. A tensor may be a block of rows of its weight (a shard): ``rows[name] = (first row, total rows)``
    of the full weight, and only the block's rows are scaled; or a flat piece of it, ``fragments[name]``
    (kimi.optim.owners.Fragment), whose elements are scaled by the factor of the row each belongs to.
    Returns {layer: {"max_logit": max over heads, "clipped_frac": fraction of heads clipped}} for the layers
    that reported logits. Unclipped heads are multiplied by exactly 1.0 (gamma = min(1, .) is exactly 1 and
    1 ** e == 1), so their weights stay bit-identical.
    """
    reported = []
    if max_logits is None:
        max_logits = [spec.max_logits() for spec in specs]
    for spec, s_max in zip(specs, max_logits):
        if s_max is None:
            continue
        s_max = s_max.float()
        if s_max.shape != (spec.num_heads,):
            raise ValueError(f"{spec.layer}: max_logits has shape {tuple(s_max.shape)}, want "
                             f"({spec.num_heads},)")
        clipped = s_max > tau
        reported.append((spec.layer, s_max.max(), clipped.float().mean()))
        # tau / s_max where clipped; non-clipped heads (also s_max <= 0) get exactly 1.
        gamma = torch.where(clipped, tau / s_max, torch.ones_like(s_max))
        for rule in spec.rows:
            p = params_by_name[rule.param]
            frag = (fragments or {}).get(rule.param)
            if frag is not None:
                first, total = 0, frag.shape[0]
            else:
                first, total = (0, p.shape[0]) if rows is None else rows[rule.param]
            if total != spec.num_heads * rule.stride:
                raise ValueError(f"{rule.param}: {total} rows, want {spec.num_heads} heads x {rule.stride}")
            scale = _row_scale(rule, gamma.to(p.device))
            if frag is not None:
                row_len = math.prod(frag.shape[1:])
                element_rows = torch.arange(frag.start, frag.start + frag.numel, device=p.device) // row_len
                p.mul_(scale.view(-1)[element_rows].to(p.dtype))
            else:
                scale = scale[first : first + p.shape[0]]
                p.mul_(scale.to(p.dtype).view(-1, *([1] * (p.ndim - 1))))
    if not reported:
        return {}
    return LayerStats([layer for layer, _, _ in reported], torch.stack([torch.stack([m, f])
                                                                        for _, m, f in reported]))


class LayerStats(abc.Mapping):
    """{layer: {"max_logit", "clipped_frac"}} read from the device only when first looked at (the trainer's
    logging steps): one host read for all layers then, none in the steps that do not log."""

    def __init__(self, layers: Sequence[str], values: torch.Tensor):
        self._layers, self._tensor, self._read = list(layers), values, None

    def _table(self) -> dict:
        if self._read is None:
            rows = self._tensor.tolist()
            self._read = {layer: {"max_logit": m, "clipped_frac": f}
                          for layer, (m, f) in zip(self._layers, rows)}
        return self._read

    def __getitem__(self, layer: str) -> dict:
        return self._table()[layer]

    def __iter__(self):
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


class QKClip:
    """QK-Clip as a hook to call after ``optimizer.step()``: gathers each layer's per-head max logits (from
    its spec), max-reduces them over ``group`` so every replica scales alike, and scales this rank's rows.

    Parameters may be plain tensors (whole, or replicated over ``group``) or DTensors sharded by FSDP2 and
    tensor parallelism: each rank scales the rows of its own block, located in the full weight by its
    placements, or the elements of its flat fragment of the weight (``fragments``: DeepSpeed's ZeRO
    partitions). Under tensor parallelism a layer reports only the heads it computed, a contiguous share in
    head order; ``head_group`` (the tensor-parallel ranks) says which share this rank computed. ``stats``
    holds {layer: {"max_logit", "clipped_frac"}} of the last call, ``head_max_logits`` {layer: S_max [H]}
    (every head, reduced over ``group``; kept as tensors, read only by diagnostics: kimi/diagnostics).
    """

    def __init__(self, named_params: Iterable[Tuple[str, torch.Tensor]], specs: Sequence[QKClipSpec],
                 tau: float,
                 group: Optional[dist.ProcessGroup] = None, head_group: Optional[dist.ProcessGroup] = None,
                 fragments: Optional[Mapping[str, Fragment]] = None):
        if not tau > 0:
            raise ValueError(f"qk_clip_tau={tau} must be > 0")
        self.specs, self.tau, self.group, self.head_group = list(specs), tau, group, head_group
        self.fragments = dict(fragments or {})
        params = dict(named_params)
        missing = [r.param for s in self.specs for r in s.rows if r.param not in params]
        if missing:
            raise ValueError(f"QK-Clip specs name parameters that are not given: {missing}")
        self.params = {r.param: params[r.param] for s in self.specs for r in s.rows}
        self.collectives = 0
        self.stats: Dict[str, Dict[str, float]] = {}
        self.head_max_logits: Dict[str, torch.Tensor] = {}
        self.gathered: Optional[list] = None  # gather()'s max logits, for the next call

    def _all_heads(self, spec: QKClipSpec, local: torch.Tensor, device: torch.device) -> torch.Tensor:
        full = torch.full((spec.num_heads,), float("-inf"), device=device)
        h = local.numel()
        if h != spec.num_heads:
            if self.head_group is None or spec.num_heads % h:
                raise ValueError(f"{spec.layer}: {h} of {spec.num_heads} heads reported and no "
                                 "tensor-parallel group to place them")
            start = dist.get_rank(self.head_group) * h
            full[start : start + h] = local.float().to(device)
            return full
        return local.float().to(device)

    @torch.no_grad()
    def gather(self, replica_max: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """Take this step's max logits now, before the update: max-reduced over ``group``, then by
        ``replica_max`` (an in-place max over replica groups that each run their own step, called before they
        agree to commit it: kimi/parallel/fault_tolerance.py). The next call clips with them; setting
        ``gathered = None`` drops them (a step that is not committed)."""
        self.gathered = self._reduced(replica_max)

    def _reduced(self, replica_max: Optional[Callable[[torch.Tensor], None]] = None) -> list:
        device = local_tensor(next(iter(self.params.values()))).device
        reported = [spec.max_logits() for spec in self.specs]
        s_max: list = [None if r is None else self._all_heads(spec, r, device)
                       for spec, r in zip(self.specs, reported)]
        grouped = self.group is not None and dist.get_world_size(self.group) > 1
        if grouped or replica_max is not None:
            # one collective for all layers; -inf marks heads a rank did not compute (or layers it did not
            # run)
            full = torch.stack([torch.full((spec.num_heads,), float("-inf"), device=device) if s is None
                                else s
                                for spec, s in zip(self.specs, s_max)])
            if grouped:
                dist.all_reduce(full, op=dist.ReduceOp.MAX, group=self.group)
                self.collectives += 1
            if replica_max is not None:
                replica_max(full)
            s_max = [None if torch.isneginf(row).all() else row for row in full]
        return s_max

    @torch.no_grad()
    def __call__(self) -> Dict[str, Dict[str, float]]:
        if not self.specs:
            return {}
        s_max, self.gathered = (self._reduced() if self.gathered is None else self.gathered), None
        self.head_max_logits = {spec.layer: s for spec, s in zip(self.specs, s_max) if s is not None}
        blocks, rows = {}, {}
        for name, p in self.params.items():
            offset, _ = local_block(p)
            blocks[name], rows[name] = local_tensor(p), (offset[0], p.shape[0])
        self.stats = apply_qk_clip(blocks, self.specs, self.tau, s_max, rows, self.fragments)
        return self.stats
