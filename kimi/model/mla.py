"""Multi-head Latent Attention (DeepSeek-V2 style MLA, as used by Kimi Linear).

Per token x (width d), H heads read from tensor shapes (so a tensor-parallel shard of the head-sized
projections runs the same code):

    q      = W_q x                         or, with q_lora_rank > 0, W_uq RMSNorm(W_dq x)
    [c, r] = W_dkv x                       c: kv_lora_rank latent, r: qk_rope_head_dim shared rotary key
    c      = RMSNorm(c)                    (this normalised latent is what the decoding cache stores)
    [k_nope_h | v_h] = (W_ukv c)_h         per head
    q_h = [q_nope_h | RoPE(q_rope_h)],  k_h = [k_nope_h | RoPE(r)]   (one rotary key shared by all heads)
    o = W_o concat_h softmax(q_h k_h^T / sqrt(nope + rope), causal) v_h
        or, with mla_output_gate (Kimi K3's gated MLA), W_o [sigmoid(W_g x) * concat_h ...], one gate per
        element of the heads' outputs

Row layout of the head-sized weights (QK-Clip scales these rows per head; nn.Linear rows = outputs):
  * query projection (W_q, or W_uq with q_lora): head h owns rows [h*(nope+rope), (h+1)*(nope+rope)),
    its first `nope` rows are q_nope, the next `rope` rows q_rope.
  * KV up-projection W_ukv (`wkv_b`): head h owns rows [h*(nope+v), (h+1)*(nope+v)), first `nope` rows
    k_nope, then `v` rows of values.
  * W_dkv (`wkv_a`): rows [0, kv_lora_rank) the latent, the last `rope` rows the shared rotary key, which
    QK-Clip never touches.
qk_rope_head_dim = 0 is NoPE; RoPE uses the half-split rotation (NeoX style). model.mla.rotary=false keeps
the shared key part and its query part unrotated: Kimi Linear's MLA (64 such dims, NoPE throughout).
"""

from __future__ import annotations

import torch
from torch import nn

from kimi.model.config import ModelConfig

from kimi.ops.attention import runs_triton
from kimi.ops.attention.latent import latent_attention

from .cache import MLACache
from .init import Rules, apply_rules, constant, normal
from .layouts import QKClipSpec, RowRule, RowSplit
from .maxlogits import RecordsMaxLogits
from .norm import RMSNorm
from .sublayer import Sublayer, TPPlan


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [B, T, H, R] by angle position * theta^(-2i/R) on channel pairs (i, i + R/2), in fp32."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * inv_freq  # fp64 keeps large positions exact
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = (f(angles).to(dtype)[None, :, None, :] for f in (torch.cos, torch.sin))
    x1, x2 = x.to(dtype).split(half, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class MLA(RecordsMaxLogits, Sublayer, nn.Module):
    LABEL, FAMILY = "MLA", "MLA mixers"
    TP_DIVIDES = ("mla.num_heads",)
    HF_NAMES = {f"{ours}.weight": f"self_attn.{theirs}.weight" for ours, theirs in (
        ("wq", "q_proj"), ("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq_b", "q_b_proj"),
        ("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj"),
        ("wo", "o_proj"),
        ("wg", "g_proj"))}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, H, mla = cfg.d_model, cfg.mla.num_heads, cfg.mla
        self.nope, self.rope, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank, self.rope_theta = cfg.mla.kv_lora_rank, cfg.rope_theta
        self.rotary = cfg.mla.rotary
        eps = cfg.norm_eps if cfg.mla.norm_eps is None else cfg.mla.norm_eps
        qk = self.nope + self.rope
        self.q_lora = cfg.mla.q_lora_rank > 0  # compressed queries: W_uq RMSNorm(W_dq x)
        if self.q_lora:
            self.wq_a = nn.Linear(d, cfg.mla.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.mla.q_lora_rank, eps)
            self.wq_b = nn.Linear(cfg.mla.q_lora_rank, H * qk, bias=False)
        else:
            self.wq = nn.Linear(d, H * qk, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, d, bias=False)
        self.wg = nn.Linear(d, H * self.v_dim, bias=False) if cfg.mla.output_gate else None
        self._init_max_logits(cfg)

    @property
    def q_name(self) -> str:
        """The projection whose rows are per-head [q_nope | q_rope] (see the module docstring)."""
        return "wq_b" if self.q_lora else "wq"

    @property
    def q_proj(self) -> nn.Linear:
        return getattr(self, self.q_name)

    def qk_clip_spec(self, prefix: str) -> QKClipSpec:
        """QK-Clip rows of this layer (layout in the module docstring); prefix is the module's qualified name,
        so the parameter names are those of model.named_parameters()."""
        H = self.wkv_b.weight.shape[0] // (self.nope + self.v_dim)
        q_name = self.q_name
        q_segments = tuple(seg for seg in ((0, self.nope, 0.5), (self.nope, self.rope, 1.0)) if seg[1] > 0)
        rows = [RowRule(f"{prefix}.{q_name}.weight", self.nope + self.rope, q_segments)]
        if self.nope > 0:
            rows.append(RowRule(f"{prefix}.wkv_b.weight", self.nope + self.v_dim, ((0, self.nope, 0.5),)))
        return QKClipSpec(prefix, H, rows, self.consume_max_logits)

    def muon_splits(self, prefix: str, per_head: bool = False) -> dict[str, RowSplit]:
        """Fused weights that hold several of DeepSeek-V2's matrices, for Muon to orthogonalise one by one:
        the query projection [W_uq; W_qr] and W_ukv = [W_uk; W_uv] per head, W_dkv = [W_dkv; W_kr]. per_head
        (Kimi K3): each head's query rows one matrix, each head's keys and its values two."""
        q_name = self.q_name
        fused = {f"{q_name}.weight": (self.nope, self.rope), "wkv_b.weight": (self.nope, self.v_dim),
                 "wkv_a.weight": (self.kv_lora_rank, self.rope)}
        splits = {f"{prefix}.{name}": RowSplit(a + b, ((0, a), (a, b))) for name, (a, b) in fused.items()
                  if a > 0 and b > 0}
        if per_head:
            qk = self.nope + self.rope
            splits[f"{prefix}.{q_name}.weight"] = RowSplit(qk, ((0, qk),), per_head=True)
            kv = ((0, self.nope), (self.nope, self.v_dim)) if self.nope else ((0, self.v_dim),)
            splits[f"{prefix}.wkv_b.weight"] = RowSplit(self.nope + self.v_dim, kv, per_head=True)
        return splits

    def init_rules(self, std: float, out_std: float) -> Rules:
        """Projections normal(0, std), the output projection normal(0, out_std), norms 1."""
        names = [self.q_name, "wkv_a", "wkv_b"] + (["wq_a"] if self.q_lora else []) + (["wg"] if self.wg
                                                                                       else [])
        rules = {f"{name}.weight": normal(std) for name in names}
        rules.update({"wo.weight": normal(out_std), "kv_norm.weight": constant(1.0)})
        if self.q_lora:
            rules["q_norm.weight"] = constant(1.0)
        return rules

    def init_weights(self, std: float, out_std: float) -> None:
        apply_rules(self, self.init_rules(std, out_std))

    def tp_plan(self) -> TPPlan:
        """The query projection, W_ukv and the output gate column-parallel (by heads), wo row-parallel; W_dkv,
        its norm and q-LoRA's down-projection replicated. Each rank records the max logits of its own heads
        (QK-Clip places them by tp rank)."""
        return TPPlan(colwise=(self.q_name, "wkv_b") + (("wg",) if self.wg else ()), rowwise=("wo",))

    def flops_per_token(self, seq_len: int) -> float:
        """Causal softmax attention: per token and head, q.k over T/2 keys on average (2 Dqk T/2) and the
        weighted sum of values (2 Dv T/2), times 3 for forward and backward; Dqk = nope + rope."""
        heads = self.wkv_b.weight.shape[0] // (self.nope + self.v_dim)
        return 3.0 * heads * (self.nope + self.rope + self.v_dim) * seq_len

    def attend_latents(self, q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """Attention over a context-parallel prefix of latents, up-projected one shard-long block at a time
        (kimi/ops/attention/latent.py: the last rank would otherwise hold the whole sequence's keys and
        values), keeping its max logits when wanted."""
        record, measure = self.logits_wanted()
        w = self.wkv_b.weight
        w = w.to_local() if hasattr(w, "to_local") else w  # tensor parallelism: this rank's heads' rows
        # in the compute dtype, as autocast casts a matmul's weight: a no-op under FSDP's bf16 gathers, which
        # context parallelism always runs with, a copy where fp32 weights meet autocast (kimi.plan's trace)
        w = w.to(q.dtype)
        out = latent_attention(q, c_kv, k_rope, w, self.nope, q.shape[1], return_max_logits=measure,
                               deterministic=self.attention_options["deterministic"])
        if measure:
            out, max_logits = out
            self.keep_max_logits(max_logits, record)
        return out

    def new_cache(self) -> MLACache:
        return MLACache()

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache: MLACache | None = None,
        context=None,
    ) -> torch.Tensor:
        """context: this rank's shard of a sequence split over ranks (kimi.parallel.context_parallel's
        SequenceShard): its queries attend over the latents of every shard up to its own."""
        B, T, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora else self.wq(x)
        q = q.view(B, T, -1, self.nope + self.rope)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_norm(c_kv)
        if self.rope > 0 and self.rotary:
            # RoPE scores depend only on position differences, and packed documents never attend across
            # a boundary, so global positions are as good as per-document ones under cu_seqlens.
            if context is not None:  # the rows' positions, each row packed after the other under cu_seqlens
                positions = context.positions(x.device).repeat(context.rows if cu_seqlens is not None else 1)
            else:
                start = 0 if cache is None else cache.length
                positions = torch.arange(start, start + T, device=x.device)
            q = torch.cat([q[..., : self.nope], apply_rope(q[..., self.nope :], positions, self.rope_theta)],
                          -1)
            k_rope = apply_rope(k_rope.unsqueeze(2), positions, self.rope_theta).squeeze(2)
        if cache is not None:
            c_kv, k_rope = cache.append(c_kv, k_rope)
        if context is not None:  # the latent and the shared rotary key: a fraction of full keys and values
            latent = torch.cat([c_kv, k_rope], dim=-1).reshape(context.rows, context.length, -1)
            c_kv, k_rope = context.prefix(latent).split([self.kv_lora_rank, self.rope], dim=-1)
            q = q.reshape(context.rows, context.length, *q.shape[2:])
        if (context is not None and cu_seqlens is None and c_kv.shape[1] > q.shape[1]
                and runs_triton(q, self.attention_options["backend"])):
            out = self.attend_latents(q, c_kv, k_rope).reshape(B, T, -1)
        else:
            kv = self.wkv_b(c_kv).view(c_kv.shape[0], c_kv.shape[1], -1, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
            out = self.attend(q, k, v, cu_seqlens, context).reshape(B, T, -1)
        if self.wg is not None:
            out = out * torch.sigmoid(self.wg(x))
        return self.wo(out)
