"""Naive softmax attention with explicit scores: the obviously-correct reference for :func:`attention`.

It materialises the [B, H, Tq, Tk] score matrix in the inputs' dtype (fp64 included), so it is for tests
and tiny shapes only. Masking conventions are those of :func:`kimi.ops.attention.attention`.
"""

import torch

from kimi.ops.documents import segment_ids


def attention_mask(
    q_len: int, k_len: int, causal: bool, cu_seqlens: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean [Tq, Tk] mask (True = may attend), or None when every pair is allowed.

    Queries are the last Tq of the Tk key positions (bottom-right aligned), which is what decoding with a
    cache needs: query i sits at position Tk - Tq + i, as do a context-parallel rank's queries over the keys
    gathered up to its shard. cu_seqlens (packed documents) describes the Tk key positions and keeps each
    query to its own document's keys.
    """
    mask = None
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    if causal:
        mask = q_pos[:, None] >= torch.arange(k_len, device=device)[None, :]
    if cu_seqlens is not None:
        if q_len > k_len:
            raise ValueError(f"cu_seqlens needs at most as many queries as keys, got Tq={q_len}, Tk={k_len}")
        seg = segment_ids(cu_seqlens.to(device), k_len)
        same_doc = seg[q_pos][:, None] == seg[None, :]
        mask = same_doc if mask is None else mask & same_doc
    return mask


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, ...]:
    """q [B, Tq, H, D], k [B, Tk, Hkv, D], v [B, Tk, Hkv, Dv] -> (o [B, Tq, H, Dv], max_logits [B, H] fp32),
    and with return_lse the log-sum-exp of each query's scaled logits, lse [B, H, Tq] in the scores' dtype.

    max_logits is the largest scaled logit q.k * scale over the allowed (query, key) pairs. A query with no
    allowed key gets o = NaN and lse = -inf.
    """
    H, Hkv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(H // Hkv, dim=2)  # query head h reads kv head h // (H / Hkv)
    v = v.repeat_interleave(H // Hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    mask = attention_mask(q.shape[1], k.shape[1], causal, cu_seqlens, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    max_logits = scores.amax(dim=(-2, -1)).float()
    o = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)
    return (o, max_logits, scores.logsumexp(-1)) if return_lse else (o, max_logits)
