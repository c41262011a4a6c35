"""Decoding state: what each token mixer keeps between calls so new tokens need not re-read the prompt.

Attention Residuals need nothing here: they mix over depth, per token, so every source a token needs is
computed when that token goes through the model. The per-layer states start empty and are filled by the
first forward (the prefill), so a cache needs no batch size, device or dtype up front.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDACache:
    """A KDA layer's fixed-size state: constant in sequence length.

    state: recurrent matrix [B, H, K, V] (fp32, fp64 for fp64 models); conv: the last (conv_size - 1)
    inputs of each short conv ("q", "k", "v"), [B, conv_size - 1, H*K], the causal padding of the next call.
    """

    state: torch.Tensor | None = None
    conv: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class MLACache:
    """An MLA layer's compressed KV cache: per past token the normalised latent c_kv [B, t, kv_lora_rank]
    and the rotated shared rotary key [B, t, qk_rope_head_dim]. Keys and values are up-projected from the
    latent at every step, so the cache is (kv_lora_rank + rope) wide instead of H * (Dqk + Dv)."""

    c_kv: torch.Tensor | None = None
    k_rope: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.c_kv is None else self.c_kv.shape[1]

    def append(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens' entries and return the whole cache (past + new)."""
        if self.c_kv is not None:
            c_kv = torch.cat([self.c_kv, c_kv], dim=1)
            k_rope = torch.cat([self.k_rope, k_rope], dim=1)
        self.c_kv, self.k_rope = c_kv, k_rope
        return c_kv, k_rope


@dataclass
class KVCache:
    """A softmax-attention layer's (kimi/model/mha.py) keys, rotated, and values of every past token:
    [B, t, Hkv, head_dim] each."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens' keys and values and return all of them (past + new)."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
        self.k, self.v = k, v
        return k, v


@dataclass
class InferenceCache:
    """One entry per transformer block, in order: its token mixer's state (``new_cache()``: a KDACache, an
    MLACache, ...)."""

    layers: list
    seen_tokens: int = 0  # tokens already consumed per sequence (advanced by KimiModel.forward)
