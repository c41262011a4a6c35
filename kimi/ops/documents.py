"""Document boundaries of packed rows, in the two forms the code needs, and the conversions between them.

A batch carries one form from the loader to the model: ``doc_starts``, a [B, T] bool mask, True where a
document segment starts (every row starts one, and so does the token after each EOS). It splits along any
dimension like the tokens it marks (pipeline micro-batches split rows; sequence shards split columns).
The kernels take flash-attention's form, ``cu_seqlens``: int32 offsets [N + 1] of the segments in the
flattened rows (0 first, the total last). The model converts once, at its input.
"""

from __future__ import annotations

import torch


def doc_starts_after_eos(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, T] ids -> the [B, T] mask of segment starts: each row's first token and every token after an
    EOS."""
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    starts[:, 0] = True
    return starts


def cu_seqlens_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """[B, T] bool, True where a segment starts -> int32 offsets into the flattened rows, plus the total."""
    idx = starts.flatten().nonzero().flatten()
    return torch.cat([idx, idx.new_tensor([starts.numel()])]).to(torch.int32)


def segment_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Document index of every position 0..length-1 given offsets [N + 1] (0 = start, last = length)."""
    positions = torch.arange(length, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)
