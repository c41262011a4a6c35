"""Row layouts of fused weights, as the layers describe them to whoever needs to act per head or per logical
matrix: QK-Clip (which rows of which weights belong to a head's queries and keys) and Muon (which rows of a
fused projection form one matrix). Plain data over parameter names, so the optimizer never needs the model
class and the model never imports the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

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
                raise ValueError(f"{self.param}: segment ({offset}, {length}) outside a head of "
                                 f"{self.stride} rows")


@dataclass
class QKClipSpec:
    """One softmax-attention layer: its heads, the rows to scale, and where its per-head max logits come from.

    ``max_logits()`` returns the max scaled logits of the forwards since the last call (and forgets them),
    or None when the layer ran no recorded forward, in which case the layer is left alone. It returns the
    heads the layer computed: all of them, or under tensor parallelism this rank's contiguous share.
    """

    layer: str
    num_heads: int
    rows: list[RowRule]
    max_logits: Callable[[], torch.Tensor | None]


@dataclass(frozen=True)
class RowSplit:
    """A fused weight holding several logical matrices by rows, orthogonalised one by one.

    As in RowRule, head h owns rows [h * stride, (h + 1) * stride); segment (offset, length) picks rows
    [offset, offset + length) of every head, and the segments of all heads together are one logical matrix
    (MLA's wkv_b = [W_uk; W_uv] per head: keys and values are two matrices, as in DeepSeek-V2, whose
    singular values have nothing to do with each other). Segments must tile a head's rows. With per_head
    (Kimi K3's per-head Muon) every head's segment is a matrix of its own: split gives [heads, length, cols]
    batches, which Newton-Schulz orthogonalises matrix by matrix.
    """

    stride: int
    segments: Tuple[Tuple[int, int], ...]
    per_head: bool = False

    def __post_init__(self) -> None:
        ends = [0]
        for offset, length in self.segments:
            if offset != ends[-1] or length <= 0:
                raise ValueError(f"RowSplit segments {self.segments} must tile [0, {self.stride}) in order")
            ends.append(offset + length)
        if ends[-1] != self.stride:
            raise ValueError(f"RowSplit segments {self.segments} must tile [0, {self.stride}) in order")

    def split(self, u: torch.Tensor) -> List[torch.Tensor]:
        heads = u.view(-1, self.stride, u.shape[-1])
        if self.per_head:
            return [heads[:, o : o + n] for o, n in self.segments]
        return [heads[:, o : o + n].reshape(-1, u.shape[-1]) for o, n in self.segments]

    def join(self, blocks: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        heads = out.view(-1, self.stride, out.shape[-1])
        for (o, n), b in zip(self.segments, blocks):
            heads[:, o : o + n] = b.view(heads.shape[0], n, -1)
        return out
