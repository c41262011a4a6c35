"""QK-Clip (Kimi K2, ALGORITHMS.md section 3): after each update, shrink the query/key rows of every
softmax-attention head whose max scaled logit S_max^h of this step's forwards exceeded tau.

    gamma_h = min(1, tau / S_max^h)

A head's logit is a sum of q.k products, so scaling q rows by gamma^a and k rows by gamma^b scales the logit
by gamma^(a+b); every rule below makes a + b = 1, so the head's max logit becomes exactly tau (for the same
inputs). Plain MHA: q and k rows both get exponent 0.5. MLA: q_nope and k_nope rows 0.5, q_rope rows 1.0
(its partner, the rotary key, is shared by all heads and so cannot be scaled per head: it is never listed,
nor are value rows, which do not enter the logit).

The optimizer never knows the model class: a layer describes itself with a QKClipSpec over parameter names
(the names of model.named_parameters()), and apply_qk_clip scales those rows in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Sequence, Tuple

import torch


@dataclass(frozen=True)
class RowRule:
    """Rows of one weight (nn.Linear rows = outputs) that QK-Clip scales.

    Head h owns rows [h * stride, (h + 1) * stride); within a head, each (offset, length, exponent) segment
    is multiplied by gamma_h ** exponent. Rows of a head that no segment covers are never touched.
    """

    param: str
    stride: int
    segments: Tuple[Tuple[int, int, float], ...]

    def __post_init__(self) -> None:
        for offset, length, _ in self.segments:
            if offset < 0 or length <= 0 or offset + length > self.stride:
                raise ValueError(f"{self.param}: segment ({offset}, {length}) outside a head of {self.stride} rows")


@dataclass
class QKClipSpec:
    """One softmax-attention layer: its heads, the rows to scale, and where its per-head max logits come from.

    ``max_logits()`` returns the [num_heads] max scaled logits of the forwards since the last call (and
    forgets them), or None when the layer ran no recorded forward, in which case the layer is left alone.
    """

    layer: str
    num_heads: int
    rows: list[RowRule]
    max_logits: Callable[[], torch.Tensor | None]


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
) -> Dict[str, Dict[str, float]]:
    """Scale the q/k rows of heads whose max logit exceeds tau, in place.

    ``max_logits`` (aligned with specs) are the S_max already reduced over ranks; by default each spec's
    own. A tensor may be a block of rows of its weight (a shard): ``rows[name] = (first row, total rows)``
    of the full weight, and only the block's rows are scaled.
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
            raise ValueError(f"{spec.layer}: max_logits has shape {tuple(s_max.shape)}, want ({spec.num_heads},)")
        clipped = s_max > tau
        reported.append((spec.layer, s_max.max(), clipped.float().mean()))
        # tau / s_max where clipped; non-clipped heads (also s_max <= 0) get exactly 1.
        gamma = torch.where(clipped, tau / s_max, torch.ones_like(s_max))
        for rule in spec.rows:
            p = params_by_name[rule.param]
            first, total = (0, p.shape[0]) if rows is None else rows[rule.param]
            if total != spec.num_heads * rule.stride:
                raise ValueError(f"{rule.param}: {total} rows, want {spec.num_heads} heads x {rule.stride}")
            scale = _row_scale(rule, gamma.to(p.device))[first : first + p.shape[0]]
            p.mul_(scale.to(p.dtype).view(-1, *([1] * (p.ndim - 1))))
    if not reported:
        return {}
    # One host sync for all layers, not two per layer.
    values = torch.stack([torch.stack([m, f]) for _, m, f in reported]).tolist()
    return {layer: {"max_logit": m, "clipped_frac": f} for (layer, _, _), (m, f) in zip(reported, values)}
