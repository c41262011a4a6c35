"""Kimi Delta Attention layer (Kimi Linear, arXiv 2510.26692; docs/algorithms.md section 1).

    q, k, v = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x))   heads of K = V dims
    q, k    = L2-normalised per head
    g       = -exp(A_log[h]) * softplus(W_f_up W_f_down x + dt_bias)     per-channel log decay, <= 0
              or L * sigmoid(exp(A_log[h]) * (W_f_up W_f_down x + dt_bias))  in (L, 0): Kimi K3's safe gate
    beta    = sigmoid(W_b x)                                              one per head
    o       = W_o( sigmoid(W_g_up W_g_down x + b_g) * RMSNorm_per_head(KDA(q, k, v, g, beta)) )
              (b_g: optional)
              with a full-rank output gate (Kimi K3) sigmoid(W_g x + b_g) instead

Head counts come from tensor shapes, so a tensor-parallel shard (a slice of heads) runs this same code.
"""

from __future__ import annotations

import math

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kimi.model.config import ModelConfig
from kimi.ops.documents import segment_ids
from kimi.ops.kda import CHUNK_SIZE, chunk_kda, fused_recurrent_kda
from kimi.ops.kda.chunk import chunk_flops_per_token
from kimi.ops.kda.gate import normalize_and_gate

from .cache import KDACache
from .init import Rules, apply_rules, constant, dt_bias, log_uniform_decay, normal, prefixed, uniform
from .layouts import RowSplit
from .norm import RMSNorm
from .probe import PROBE
from .sublayer import Sublayer, TPPlan
from .views import ParamViews

# Below one chunk the chunked form has nothing to parallelise: step the recurrence instead.
_RECURRENT_MAX_T = CHUNK_SIZE
# model.kda.backend -> the `backend=` of chunk_kda, of fused_recurrent_kda and of the fused l2norm + gate
# (None: chosen by device). fla-core has no separate gate op here: ours, chosen by device, feeds its kernels.
_BACKENDS = {"auto": (None, None, None), "torch": ("chunk", "recurrent", "torch"),
             "triton": ("triton", "triton", "triton"), "fla": ("fla", "fla", None)}


class ShortConv(ParamViews, nn.Module):
    """Depthwise causal conv1d over time (no bias): y_t = sum_j w[:, j] * x_{t - (K-1) + j}.

    Written as K shifted multiply-adds rather than F.conv1d so that one mask per tap can stop packed
    documents (cu_seqlens) from reading their predecessor's last tokens.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        # nn.Conv1d's depthwise layout [C, 1, K]: being 3-D also keeps it out of Muon's "2-D matrix" group.
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def init_rules(self) -> Rules:
        # nn.Conv1d's default for a depthwise kernel (fan_in = K): keeps the output scale of the input.
        bound = 1 / math.sqrt(self.weight.shape[-1])
        return {"weight": uniform(-bound, bound)}

    def reset_parameters(self) -> None:
        apply_rules(self, self.init_rules())

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, prev: torch.Tensor | None = None,
        continues: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C]; prev: the (K-1) inputs before each row ([R, K-1, C], zeros when None), R = B, or
        with cu_seqlens the R rows packed along x's T (context parallelism: each row's previous shard's
        last inputs), whose first segments continue prev's documents. continues [R] bool (default: every
        row when prev is given): which rows read their prev; the others start a document.

        Returns (y [B, T, C], each row's last K-1 inputs [R, K-1, C], i.e. the `prev` of the next call).
        """
        B, T, C = x.shape
        weight = self.param("weight")
        K = weight.shape[-1]
        rows = prev.shape[0] if prev is not None else B if continues is None else continues.numel()
        n = B * T // rows
        if prev is None:
            prev, continues = x.new_zeros(rows, K - 1, C), torch.zeros(rows, dtype=torch.bool,
                                                                       device=x.device)
        elif continues is None:
            continues = torch.ones(rows, dtype=torch.bool, device=x.device)
        else:
            prev = prev * continues[:, None, None].to(prev.dtype)
        xp = torch.cat([prev, x.reshape(rows, n, C)], dim=1)
        doc_pos = None
        if cu_seqlens is not None:  # position of each token inside its own document, per row
            segment = segment_ids(cu_seqlens, B * T)
            doc_pos = (torch.arange(B * T, device=x.device) - cu_seqlens[segment]).view(rows, n)
            first = segment.view(rows, n)
            # a row's first segment continues prev's document: its taps may read prev
            doc_pos = doc_pos + ((first == first[:, :1]) & continues[:, None]) * (K - 1)
        # Sums in fp32 (fp64 for fp64), output in x's dtype: under autocast x is bf16 while the weight is
        # fp32, and a bf16 x times an fp32 weight would promote q, k and v, and so the KDA kernels, to fp32.
        acc = torch.promote_types(x.dtype, torch.float32)
        y = torch.zeros(rows, n, C, dtype=acc, device=x.device)
        for j in range(K):
            tap = xp[:, j : j + n].to(acc) * weight[:, 0, j].to(acc)
            lag = K - 1 - j  # this tap reads x_{t - lag}
            if doc_pos is not None and lag > 0:
                tap = tap * (doc_pos >= lag).to(acc)[:, :, None]
            y = y + tap
        return y.to(x.dtype).view(B, T, C), xp[:, xp.shape[1] - (K - 1) :]


class KDA(Sublayer, ParamViews, nn.Module):
    LABEL, FAMILY = "KDA", "KDA mixers"
    TP_DIVIDES = ("kda.num_heads",)
    PROBES = ("g", "beta")  # the per-channel log decay and the delta rule's beta
    # transformers' Kimi Linear (its files keep these names; A_log as [1, 1, H, 1])
    HF_NAMES = {**{f"{ours}.weight": f"self_attn.{theirs}.weight" for ours, theirs in (
        ("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("q_conv", "q_conv1d"),
        ("k_conv", "k_conv1d"), ("v_conv", "v_conv1d"), ("f_proj_down", "f_a_proj"),
        ("f_proj_up", "f_b_proj"), ("b_proj", "b_proj"), ("g_proj_down", "g_a_proj"),
        ("g_proj_up", "g_b_proj"), ("g_proj", "g_proj"), ("o_norm", "o_norm"), ("o_proj", "o_proj"))},
        "dt_bias": "self_attn.dt_bias", "A_log": ("self_attn.A_log", (1, 1, -1, 1))}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, H, K = cfg.d_model, cfg.kda.num_heads, cfg.kda.head_dim
        self.head_dim = K
        self.chunk_backend, self.recurrent_backend, self.gate_backend = _BACKENDS[cfg.kda.backend]
        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, H * K, bias=False)
        self.q_conv = ShortConv(H * K, cfg.conv_size)
        self.k_conv = ShortConv(H * K, cfg.conv_size)
        self.v_conv = ShortConv(H * K, cfg.conv_size)
        self.f_proj_down = nn.Linear(d, K, bias=False)  # low-rank gate: d -> head_dim -> H*K
        self.f_proj_up = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.b_proj = nn.Linear(d, H, bias=False)
        self.lower_bound = cfg.kda.gate_lower_bound
        if cfg.kda.full_rank_gate:
            self.g_proj = nn.Linear(d, H * K, bias=cfg.kda.gate_bias)
        else:  # low rank, its bias on the up-projection
            self.g_proj_down = nn.Linear(d, K, bias=False)
            self.g_proj_up = nn.Linear(K, H * K, bias=cfg.kda.gate_bias)
        # one weight over each head's V channels, shared by the heads; its eps is rms_norm_eps in Kimi Linear
        self.o_norm = RMSNorm(K, eps=cfg.norm_eps)
        self.o_proj = nn.Linear(H * K, d, bias=False)

    def init_rules(self, std: float, out_std: float) -> Rules:
        """Linears normal(0, std), the output projection normal(0, out_std), the output gate's bias 0,
        convs as nn.Conv1d, the output norm 1, A_log and dt_bias as Kimi Linear / Mamba (kimi.model.init)."""
        gates = ("g_proj",) if self.full_rank_gate else ("g_proj_down", "g_proj_up")
        rules = {f"{name}.weight": normal(std) for name in ("q_proj", "k_proj", "v_proj", "f_proj_down",
                                                             "f_proj_up", "b_proj", *gates)}
        rules.update({"o_proj.weight": normal(out_std), "o_norm.weight": constant(1.0),
                      "A_log": log_uniform_decay, "dt_bias": dt_bias})
        if self.gate_up.bias is not None:
            rules[f"{gates[-1]}.bias"] = constant(0.0)
        for name in ("q_conv", "k_conv", "v_conv"):
            rules.update(prefixed(name, getattr(self, name).init_rules()))
        return rules

    def init_weights(self, std: float, out_std: float) -> None:
        apply_rules(self, self.init_rules(std, out_std))

    def tp_plan(self) -> TPPlan:
        """By heads: q/k/v, the gates' and beta's up-projections column-parallel, short-conv channels,
        A_log and dt_bias per head; the low-rank down-projections replicated; the output norm's weight,
        shared by the heads, sums its gradient over them; o_proj row-parallel."""
        gate = "g_proj" if self.full_rank_gate else "g_proj_up"
        return TPPlan(colwise=("q_proj", "k_proj", "v_proj", "f_proj_up", "b_proj", gate),
                      rowwise=("o_proj",),
                      by_heads=("A_log", "dt_bias", "q_conv.weight", "k_conv.weight", "v_conv.weight"),
                      sum_grads=("o_norm.weight",))

    def flops_per_token(self, seq_len: int) -> float:
        """Chunkwise KDA (docs/algorithms.md section 1.3): 6 K^2 + 5 C K + C^2 / 3 per token and head forward
        (K = head dim = V, C = the chunk size; kimi.ops.kda.chunk.chunk_flops_per_token), times 3 for forward
        and backward."""
        return 3.0 * self.A_log.shape[0] * chunk_flops_per_token(self.head_dim, self.head_dim)

    def new_cache(self) -> KDACache:
        return KDACache()

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache: KDACache | None = None,
        context=None,
    ) -> torch.Tensor:
        """context: this rank's shard of a sequence split over ranks (kimi.parallel.context_parallel's
        SequenceShard): the convs read the previous shard's last inputs, the state comes from earlier
        shards."""
        B, T, _ = x.shape
        if cache is not None and cu_seqlens is not None:
            raise ValueError("KDA decoding with a cache takes one sequence per batch row, not cu_seqlens")
        names = ("q", "k", "v")
        projected = [proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj)]
        conv_prev, continues = {} if cache is None else cache.conv, None
        if context is not None:
            rows, halo = context.rows, self.q_conv.weight.shape[-1] - 1
            tails = [p.reshape(rows, -1, p.shape[-1])[:, context.length - halo:] for p in projected]
            conv_prev, continues = dict(zip(names, context.halo(tails))), context.continues
        qkv = []
        for name, p, conv in zip(names, projected, (self.q_conv, self.k_conv, self.v_conv)):
            y, tail = conv(p, cu_seqlens, conv_prev.get(name), continues)
            if cache is not None:
                cache.conv[name] = tail
            qkv.append(F.silu(y).view(B, T, -1, self.head_dim))
        q, k, v = qkv
        # Gates in fp32 (fp64 in fp64 models): they are summed over a chunk and exponentiated.
        f = self.f_proj_up(self.f_proj_down(x)).view(B, T, -1, self.head_dim)
        q, k, g = normalize_and_gate(q, k, f, self.param("A_log"), self.param("dt_bias"), self.gate_backend,
                                     self.lower_bound)
        gdt = g.dtype
        beta = torch.sigmoid(self.b_proj(x).to(gdt))
        if PROBE.on:  # a diagnostic pass (kimi/diagnostics) summarises the decay exp(g) and beta
            PROBE.record(self, g=g, beta=beta)
        if cache is not None and T <= _RECURRENT_MAX_T:
            kda, backend = fused_recurrent_kda, self.recurrent_backend
        else:
            kda, backend = partial(chunk_kda, lower_bound=self.lower_bound), self.chunk_backend
        if context is not None:
            o = context.kda(q, k, v, g, beta, cu_seqlens=cu_seqlens, backend=backend,
                            lower_bound=self.lower_bound)
        else:
            o, state = kda(q, k, v, g, beta, initial_state=None if cache is None else cache.state,
                           output_final_state=cache is not None, cu_seqlens=cu_seqlens, backend=backend)
        if cache is not None:
            cache.state = state
        gate = self.g_proj(x) if self.full_rank_gate else self.g_proj_up(self.g_proj_down(x))
        gate = torch.sigmoid(gate).view(B, T, -1, self.head_dim)
        return self.o_proj((self.o_norm(o) * gate).reshape(B, T, -1))

    def muon_splits(self, prefix: str, per_head: bool = False) -> dict[str, RowSplit]:
        """per_head (Kimi K3's per-head Muon): the query, key and value projections head by head."""
        if not per_head:
            return {}
        return {f"{prefix}.{p}_proj.weight": RowSplit(self.head_dim, ((0, self.head_dim),), per_head=True)
                for p in "qkv"}

    @property
    def full_rank_gate(self) -> bool:
        return hasattr(self, "g_proj")

    @property
    def gate_up(self) -> nn.Linear:
        """The output gate's last projection (its bias and head-sized rows)."""
        return self.g_proj if self.full_rank_gate else self.g_proj_up
