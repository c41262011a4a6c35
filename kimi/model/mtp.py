"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2; Kimi K3 pretrains with one such layer).

Depth k (1-based) predicts token t+k+1 at every position t from two inputs: the hidden state of depth k-1 at t
(depth 0: the trunk's final depth mix, before the final norm) and the embedding of token t+k:

    h_k = Block(W_k [RMSNorm(Emb(x_{t+k})); RMSNorm(h_{k-1})]),   loss_k = CE(head(RMSNorm_k(h_k)), x_{t+k+1})

with the model's own embedding and LM head (shared, as in DeepSeek-V3), and one decoder block of its own: the
last trunk block's token mixer with a dense MLP (routed experts stay in the trunk, where balancing and expert
parallelism act), joined by a plain residual. The training loss is L + model.mtp.loss_weight * mean_k loss_k;
evaluation and decoding never run it, and checkpoint export drops it (K3's release has none).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .attnres import StandardStream
from .norm import RMSNorm

IGNORE = -100  # the cross-entropy's ignore_index: past a row's end there is no token to predict


class MTPLayer(nn.Module):
    """One prediction depth: the two norms, the projection of their concatenation, a block, its final norm."""

    def __init__(self, d_model: int, eps: float, block: nn.Module):
        super().__init__()
        self.embed_norm = RMSNorm(d_model, eps)
        self.hidden_norm = RMSNorm(d_model, eps)
        self.proj = nn.Linear(2 * d_model, d_model, bias=False)
        self.block = block
        self.norm = RMSNorm(d_model, eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, **block_kwargs) -> torch.Tensor:
        """This depth's hidden state (before its final norm)."""
        x = self.proj(torch.cat([self.embed_norm(embedded), self.hidden_norm(hidden)], dim=-1))
        return self.block(StandardStream(x), **block_kwargs).hidden


def shifted(labels: torch.Tensor, k: int) -> torch.Tensor:
    """labels [B, T] moved k places left within each row, IGNORE where the row has no such token."""
    if k == 0:
        return labels
    return torch.cat([labels[:, k:], labels.new_full((labels.shape[0], min(k, labels.shape[1])), IGNORE)],
                     dim=1)


def mtp_loss(layers: nn.ModuleList, embed: nn.Embedding, loss: Callable, trunk: torch.Tensor,
             labels: torch.Tensor, **block_kwargs) -> torch.Tensor:
    """mean_k loss_k over the prediction depths; trunk: [B, T, d] (or the packed [1, B*T, d]), labels: [B, T]
    the next tokens; loss(hidden, targets): the model's mean cross-entropy through its LM head."""
    hidden, total = trunk, 0.0
    for k, layer in enumerate(layers, start=1):
        inputs, targets = shifted(labels, k - 1), shifted(labels, k)  # tokens t+k and t+k+1
        unknown = inputs == IGNORE  # no token t+k: it embeds token 0 and predicts nothing
        hidden = layer(hidden, embed(inputs.masked_fill(unknown, 0).reshape(trunk.shape[:2])), **block_kwargs)
        total = total + loss(layer.norm(hidden), targets.masked_fill(unknown,
                                                                     IGNORE).reshape(trunk.shape[:2]))
    return total / len(layers)
