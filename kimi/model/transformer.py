"""The Kimi-style hybrid model: token embedding, blocks of (KDA or MLA token mixer, SwiGLU MLP) joined by
a residual stream (standard, or Attention Residuals over every sublayer or over blocks), final norm, LM head.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kimi.config import ModelConfig, mla_layer_indices
from kimi.optim.qk_clip import QKClipSpec

from .attnres import make_stream
from .cache import InferenceCache, KDACache, MLACache
from .kda import KDA
from .mla import MLA
from .mlp import SwiGLU
from .norm import RMSNorm

# Chunk size of the chunkwise KDA algorithm, used only to count its FLOPs.
KDA_CHUNK_SIZE = 64


class Block(nn.Module):
    """One token mixer and one MLP, each a sublayer with its own pre-norm and (with AttnRes) pseudo-query."""

    def __init__(self, cfg: ModelConfig, use_mla: bool, first: bool):
        super().__init__()
        d = cfg.d_model
        self.mixer_norm = RMSNorm(d, cfg.norm_eps)
        self.mixer = MLA(cfg) if use_mla else KDA(cfg)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.mlp = SwiGLU(d, cfg.mlp_hidden)
        attnres = cfg.residual != "standard"
        # The model's first sublayer has one source (the embedding), whose softmax weight is 1 whatever
        # its query: a query there would be a parameter with an identically zero gradient, so it has none.
        self.mixer_query = nn.Parameter(torch.zeros(d)) if attnres and not first else None
        self.mlp_query = nn.Parameter(torch.zeros(d)) if attnres else None

    def forward(self, stream, cu_seqlens: torch.Tensor | None = None, cache: KDACache | MLACache | None = None):
        """Advance the residual stream (see kimi.model.attnres) through both sublayers; returns it."""
        h = stream.mix(self.mixer_query)
        stream.push(self.mixer(self.mixer_norm(h), cu_seqlens=cu_seqlens, cache=cache))
        h = stream.mix(self.mlp_query)
        stream.push(self.mlp(self.mlp_norm(h)))
        return stream


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set (resolve it from the tokenizer first)")
        self.cfg = cfg
        mla = set(mla_layer_indices(cfg))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i in mla, first=i == 0) for i in range(cfg.num_layers))
        self.final_query = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.residual != "standard" else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter:

        * linears (and the untied LM head) and the embedding: normal(0, init_std); biases 0;
        * output projections of every sublayer (W_o of KDA/MLA, W_down of the MLPs): normal(0, init_std /
          sqrt(2 * num_layers)), GPT-2's rule: 2 * num_layers branches add into the residual sum, so this
          keeps its variance at init independent of depth (under AttnRes, a mix of the same outputs);
        * norms 1; AttnRes pseudo-queries 0 (every layer starts as a uniform average of its sources, which
          the paper reports matters for stability);
        * KDA: A_log = log U(1, 16), dt_bias = inverse-softplus of logU(1e-3, 1e-1), short convs as
          nn.Conv1d's default (see KDA.init_weights).
        """
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        nn.init.normal_(self.embed.weight, std=std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.blocks:
            block.mixer.init_weights(std, out_std)
            block.mlp.init_weights(std, out_std)
            block.mixer_norm.reset_parameters()
            block.mlp_norm.reset_parameters()
        for p in self.attnres_queries():
            p.zero_()
        self.norm.reset_parameters()

    def attnres_queries(self) -> list[nn.Parameter]:
        """Every AttnRes pseudo-query (empty in standard mode), in depth order, the final one last."""
        qs = [q for b in self.blocks for q in (b.mixer_query, b.mlp_query) if q is not None]
        return qs + ([self.final_query] if self.final_query is not None else [])

    def mla_modules(self) -> list[MLA]:
        """The MLA layers (build_optimizer sets their `track_max_logits` for QK-Clip)."""
        return [b.mixer for b in self.blocks.children() if isinstance(b.mixer, MLA)]

    def qk_clip_specs(self) -> list[QKClipSpec]:
        """One QK-Clip spec per MLA layer, named as in self.named_parameters(); KDA has no softmax logits."""
        return [m.qk_clip_spec(name) for name, m in self.named_modules() if isinstance(m, MLA)]

    def muon_splits(self) -> dict:
        """Fused weights that Muon orthogonalises per logical matrix (MLA's; see MLA.muon_splits)."""
        splits = {}
        for name, m in self.named_modules():
            if isinstance(m, MLA):
                splits.update(m.muon_splits(name))
        return splits

    def new_cache(self) -> InferenceCache:
        """An empty decoding state; the first forward with it (the prefill) fills it."""
        return InferenceCache([MLACache() if isinstance(b.mixer, MLA) else KDACache() for b in self.blocks])

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache: InferenceCache | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] in the activation dtype.

        cu_seqlens: offsets [N + 1] of documents packed into one row (B = 1); nothing crosses a boundary.
        cache: continue the sequences held in it (see new_cache); it is updated in place.
        """
        x = self.embed(input_ids)
        stream = make_stream(self.cfg.residual, x, self.cfg.attnres_block_size, self.cfg.norm_eps)
        for i, block in enumerate(self.blocks):
            stream = block(stream, cu_seqlens=cu_seqlens, cache=None if cache is None else cache.layers[i])
        if cache is not None:
            cache.seen_tokens += input_ids.shape[1]
        return self.lm_head(self.norm(stream.mix(self.final_query)))

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters counted once (a tied LM head is the embedding). exclude_embedding drops the token
        embedding table (and with it a tied LM head)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at sequence length T = seq_len:

            6 * N  +  3 * n_mla * H_mla * (Dqk + Dv) * T  +  3 * n_kda * H_kda * (6 K^2 + 3 C K + C^2)

        * N = num_params(exclude_embedding=True), plus vocab * d_model when the embeddings are tied: every
          parameter does one multiply-add per token forward and two backward, LM head included, the
          embedding lookup excluded (it is a gather). Norm weights, biases, A_log etc. are counted too,
          a negligible overcount.
        * Softmax attention, causal: per token and head, q.k over T/2 keys on average (2 Dqk T/2) and the
          weighted sum of values (2 Dv T/2), times 3 for fwd+bwd. Dqk = qk_nope + qk_rope.
        * KDA chunkwise (ALGORITHMS.md sec. 1): about 6 T K^2 + 3 T C K + T C^2 forward per head for a
          sequence of T, i.e. 6 K^2 + 3 C K + C^2 per token, times 3; K = kda_head_dim, C = 64.
        Not counted: the AttnRes depth mixing (O(sources * d) per sublayer), short convs, gates'
        elementwise work, softmax exponentials: all well under 1% at useful sizes.
        """
        c = self.cfg
        n_mla = len(mla_layer_indices(c))
        n_kda = c.num_layers - n_mla
        dense = self.num_params(exclude_embedding=True) + (c.vocab_size * c.d_model if c.tie_embeddings else 0)
        attn = 3 * n_mla * c.mla_num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * seq_len
        K, C = c.kda_head_dim, KDA_CHUNK_SIZE
        kda = 3 * n_kda * c.kda_num_heads * (6 * K * K + 3 * C * K + C * C)
        return float(6 * dense + attn + kda)
