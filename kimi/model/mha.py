"""Softmax attention with rotary positions, as Llama has it: the dense peer's token mixer (letter A).

Per token x (width d), H query heads and Hkv key/value heads (grouped-query attention when Hkv < H) of
head_dim D:

    q_h = RoPE(W_q x)_h,  k_g = RoPE(W_k x)_g,  v_g = (W_v x)_g,   g = the group of query head h
    o = W_o concat_h softmax(q_h k_g^T / sqrt(D), causal) v_g

RoPE rotates every channel pair (i, i + D/2) (the half-split form, as transformers' Llama). It exists to
measure what Kimi's blocks cost against the transformer everybody knows (`model=dense_1b`, bench/peer.py),
and it trains like any mixer here: QK-Clip (query and key rows per head, sqrt(gamma) each; with grouped
heads only the queries, gamma whole, as a key row serves several heads), Muon (per head with
optim.muon_per_head), tensor parallelism by heads, context parallelism over the keys and values of earlier
shards, and decoding through a key/value cache.
"""

from __future__ import annotations

import torch
from torch import nn

from kimi.model.config import ModelConfig

from .cache import KVCache
from .init import Rules, normal
from .layouts import QKClipSpec, RowRule, RowSplit
from .maxlogits import RecordsMaxLogits
from .mla import apply_rope
from .sublayer import Sublayer, TPPlan


def attention_heads(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of model.attn_*: 0 kv heads is one per query head, head
    dim 0 is d_model / heads."""
    heads = cfg.mha.num_heads
    return heads, cfg.mha.kv_heads or heads, cfg.mha.head_dim or cfg.d_model // heads


class MHA(RecordsMaxLogits, Sublayer, nn.Module):
    LABEL, FAMILY = "attention", "attention mixers"
    TP_DIVIDES = ("mha.num_heads", "mha.kv_heads")
    HF_NAMES = {f"{ours}.weight": f"self_attn.{theirs}.weight"
                for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        heads, kv_heads, self.head_dim = attention_heads(cfg)
        self.groups = heads // kv_heads  # query heads per key/value head (kept under tensor parallelism)
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(d, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, d, bias=False)
        self._init_max_logits(cfg)

    def init_rules(self, std: float, out_std: float) -> Rules:
        return {"wq.weight": normal(std), "wk.weight": normal(std), "wv.weight": normal(std),
                "wo.weight": normal(out_std)}

    def tp_plan(self) -> TPPlan:
        """Queries, keys and values column-parallel by heads (each rank its query heads and their key/value
        groups), the output projection row-parallel."""
        return TPPlan(colwise=("wq", "wk", "wv"), rowwise=("wo",))

    def qk_clip_spec(self, prefix: str) -> QKClipSpec:
        heads = self.wq.weight.shape[0] // self.head_dim
        D = self.head_dim
        if self.groups == 1:
            rows = [RowRule(f"{prefix}.wq.weight", D, ((0, D, 0.5),)),
                    RowRule(f"{prefix}.wk.weight", D, ((0, D, 0.5),))]
        else:
            rows = [RowRule(f"{prefix}.wq.weight", D, ((0, D, 1.0),))]
        return QKClipSpec(prefix, heads, rows, self.consume_max_logits)

    def muon_splits(self, prefix: str, per_head: bool = False) -> dict[str, RowSplit]:
        """With per_head (Kimi K3's per-head Muon): each head's rows of W_q, W_k and W_v a matrix of its
        own."""
        if not per_head:
            return {}
        D = self.head_dim
        return {f"{prefix}.{name}.weight": RowSplit(D, ((0, D),), per_head=True)
                for name in ("wq", "wk", "wv")}

    def flops_per_token(self, seq_len: int) -> float:
        """Causal softmax attention: per token and query head, q.k over T/2 keys on average and the weighted
        sum of values, 2 D T/2 each, times 3 for forward and backward."""
        heads = self.wq.weight.shape[0] // self.head_dim
        return 3.0 * heads * 2 * self.head_dim * seq_len

    def new_cache(self) -> KVCache:
        return KVCache()

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache: KVCache | None = None,
                context=None) -> torch.Tensor:
        """context: this rank's shard of a sequence split over ranks (kimi.parallel.context_parallel's
        SequenceShard): its queries attend over the keys and values of every shard up to its own."""
        B, T, _ = x.shape
        D = self.head_dim
        q, k, v = (proj(x).view(B, T, -1, D) for proj in (self.wq, self.wk, self.wv))
        if context is not None:  # positions of the rows, each packed after the other under cu_seqlens
            positions = context.positions(x.device).repeat(context.rows if cu_seqlens is not None else 1)
        else:
            start = 0 if cache is None else cache.length
            positions = torch.arange(start, start + T, device=x.device)
        q, k = apply_rope(q, positions, self.rope_theta), apply_rope(k, positions, self.rope_theta)
        if cache is not None:
            k, v = cache.append(k, v)
        if context is not None:
            kv = torch.cat([k, v], dim=-1).reshape(context.rows, context.length, -1)
            kv = context.prefix(kv)
            k, v = kv.view(*kv.shape[:2], -1, 2 * D).split([D, D], dim=-1)
            q = q.reshape(context.rows, context.length, *q.shape[2:])
        return self.wo(self.attend(q, k, v, cu_seqlens, context).reshape(B, T, -1))
