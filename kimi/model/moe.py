"""Mixture of experts as Kimi Linear and DeepSeek-V3 define it: a sigmoid router, a score-correction bias that
only steers the choice, grouped top-k, shared experts beside the routed ones, and load balancing without an
auxiliary loss (docs/algorithms.md section 5).

    s      = sigmoid(W_r x)                                   fp32, one score per expert
    chosen = top-k of (s + bias) among the experts of the top `topk_groups` of `groups` expert groups
             (a group's score: the sum of its two best biased scores)
    w_e    = routed_scale * s_e / sum_{chosen} s             (renormalised unless norm_topk=False)
    y      = sum_{e in chosen} w_e SwiGLU_e(x) + SharedSwiGLU(x)

(with model.mlp.activation=situ every one of those FFNs takes SiTU-GLU instead: kimi/model/activations.py)

Latent MoE (model.moe.latent_dim = L > 0, Kimi K3's Stable LatentMoE): the routed experts work at width L,
    y = W_up RMSNorm(sum_{e in chosen} w_e GLU_e(W_down x)) + Shared(x)
with the router and the shared experts on x at full width; dispatch moves L-wide tokens (no norm with
model.moe.latent_norm=false).

Routed experts keep their weights as 3-D tensors [E, out, in] (w_gate, w_up: [E, hidden, d]; w_down:
[E, d, hidden]); every token goes to all of its chosen experts (dropless). Two implementations of the
expert computation give the same result: "grouped" sorts the tokens by expert and runs one grouped GEMM per
projection (torch._grouped_mm where the dtype and device support it, else one matmul per expert on its
contiguous rows), "loop" gathers each expert's tokens by mask (the reference).

Optionally (model.moe.aux_loss_coef > 0) DeepSeek-V3's sequence-wise balance loss joins the training loss with
that weight, through the backward of the layer's output (`_AddGrad`), so no loss function needs to know about
it.

Load balancing: each forward with gradients adds the number of tokens routed to each expert to `load`; after
an optimizer step `update_expert_bias` moves every bias by `rate` towards balance (up for an expert below the
mean load, down above it: the sign of the difference), from the loads summed over all micro-batches and,
through the engine, all data-parallel ranks, so every replica makes the same update.

Quantile Balancing (model.moe.balance=quantile, Kimi K3) sets the bias instead of stepping it. A token i with
scores s_i goes to expert j iff s_ij + b_j beats its cutoff a_i, the (k+1)-th best biased score, i.e. iff b_j
exceeds its required bias r_ij = a_i - s_ij; so the bias that gives expert j a k/E share of the step's tokens
is the k/E quantile of r_.j. Each training forward bins every r_ij into `qb_hist` [E, bins] over
[min b - 1, max b + 1] (sigmoid scores keep every r_ij inside); after the step the histograms are summed over
the ranks like the loads (ranks that count the same tokens again scale every count alike, which leaves the
quantile as it is), the quantile read with linear interpolation inside its bin (error below one bin), the
biases mean-centred (a common shift changes no choice) and the histograms reset.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kimi.model.config import ModelConfig
from kimi.ops import autocast_dtype

from .activations import GLU, glu_of, swiglu
from .init import Rules, constant, normal
from .mlp import SwiGLU
from .norm import RMSNorm
from .probe import PROBE
from .sublayer import Sublayer, TPPlan
from .views import ParamViews


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int,
          topk_groups: int, norm_topk: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, d] -> (weights [N, top_k], experts [N, top_k] int64, scores [N, E]); fp32 (fp64 for fp64 x)."""
    dt = torch.promote_types(x.dtype, torch.float32)
    scores = F.linear(x.to(dt), weight.to(dt)).sigmoid()
    biased = scores + bias.to(dt)
    N, E = scores.shape
    if groups > 1:
        best_two = biased.view(N, groups, E // groups).topk(2, dim=-1).values.sum(-1)
        chosen = best_two.topk(topk_groups, dim=-1).indices
        keep = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, chosen, True)
        biased = biased.masked_fill(~keep.repeat_interleave(E // groups, dim=1), float("-inf"))
    experts = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, experts, scores


def grouped_mm_ok(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs for x: CPU fp32/bf16/fp16 (bf16 only under torch.compile, whose fake
    kernel accepts nothing else), CUDA bf16 on Hopper or newer."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        if torch.compiler.is_compiling():
            return x.dtype == torch.bfloat16
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def swiglu_sorted(rows: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, act: GLU = swiglu) -> torch.Tensor:
    """SwiGLU_e of rows sorted by expert (counts[e] rows for expert e, in expert order): one grouped GEMM per
    projection (torch._grouped_mm), or one matmul per expert where that kernel does not run."""
    dtype = autocast_dtype(rows.device.type)
    if dtype is not None:
        # autocast does not cover torch._grouped_mm: without this the experts ran in fp32 on CPU, and on a GPU
        # took the per-expert loop below (found by bench/step_audit.py); cast as autocast casts a linear's
        # inputs
        rows, w_gate, w_up, w_down = (t.to(dtype) for t in (rows, w_gate, w_up, w_down))
    if grouped_mm_ok(rows):
        ends = counts.cumsum(0).to(torch.int32)
        gate, up = (torch._grouped_mm(rows, w.mT, offs=ends) for w in (w_gate, w_up))
        return torch._grouped_mm(act(gate, up), w_down.mT, offs=ends)
    pieces, start = [], 0  # fp64, or devices without the grouped kernel
    for e, n in enumerate(counts.tolist()):
        r = rows[start:start + n]
        pieces.append(act(r @ w_gate[e].T, r @ w_up[e].T) @ w_down[e].T)
        start += n
    return torch.cat(pieces)


def expert_counts(experts: torch.Tensor, n: int) -> torch.Tensor:
    """How many entries of `experts` (expert indices, any shape) name each of n experts, int64: bincount's
    result without its host read (on CUDA torch.bincount reads the largest index first, a sync per layer)."""
    flat = experts.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def experts_grouped(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, act: GLU = swiglu) -> torch.Tensor:
    """sum over each token's chosen experts of weight * SwiGLU_e(token): tokens sorted by expert, one grouped
    GEMM per projection."""
    E, k = w_gate.shape[0], experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    y = swiglu_sorted(x[order // k], expert_counts(flat, E), w_gate, w_up, w_down, act)
    return combine(y, order, k, weights, x)


def combine(y: torch.Tensor, order: torch.Tensor, k: int, weights: torch.Tensor,
            x: torch.Tensor) -> torch.Tensor:
    """y [N k, d]: the expert outputs of the (token, choice) pairs in the order `order` sorted them; their
    weighted sum per token, [N, d] in x's dtype."""
    dtype = torch.promote_types(torch.promote_types(y.dtype, weights.dtype), x.dtype)
    y = y.to(dtype) * weights.reshape(-1)[order, None].to(dtype)
    return torch.zeros(x.shape, dtype=dtype, device=x.device).index_add_(0, order // k, y).to(x.dtype)


def experts_loop(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
                 w_up: torch.Tensor, w_down: torch.Tensor, act: GLU = swiglu) -> torch.Tensor:
    """The same sum, one expert at a time over the tokens that chose it (the reference)."""
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
    for e in range(w_gate.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel():
            r = x[token]
            y = act(r @ w_gate[e].T, r @ w_up[e].T) @ w_down[e].T
            out.index_add_(0, token, y * weights[token, slot, None])
    return out.to(x.dtype)


EXPERT_IMPLS = {"grouped": experts_grouped, "loop": experts_loop}


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences: for each sequence (a row of T
    tokens) sum_e f_e P_e with f_e = E / (top_k T) * (tokens choosing e) and P_e the mean over its tokens of
    e's score normalised over all experts. scores [B, T, E], experts [B, T, top_k]; 1 when perfectly
    balanced, up to E / top_k when one group of experts takes every token."""
    B, T, E = scores.shape
    counts = scores.new_zeros(B, E).scatter_add_(1, experts.reshape(B, -1), scores.new_ones(B, T * top_k))
    f = counts * (E / (top_k * T))
    P = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return (f * P).sum(-1).mean()


class _AddGrad(torch.autograd.Function):
    """Identity on y whose backward also gives `aux` the gradient `weight`: differentiating any loss through
    y then differentiates loss + weight * aux, on every layout (pipeline stages included) without the loss
    having to carry aux."""

    @staticmethod
    def forward(ctx, y, aux, weight: float):
        ctx.weight, ctx.aux_shape, ctx.aux_dtype = weight, aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full(ctx.aux_shape, ctx.weight, dtype=ctx.aux_dtype), None


class RoutedExperts(ParamViews, nn.Module):
    """The E routed SwiGLU experts as 3-D weights [E, out, in]: forward(x [N, d], experts [N, k], weights
    [N, k]) is the weighted sum over each token's chosen experts. A module of its own so parallelism can
    place these weights apart from the rest of the layer: expert parallelism keeps E / ep of them per rank
    (reading them through param views) and sets `dispatch` to its all-to-all version of the computation."""

    def __init__(self, E: int, hidden: int, d: int, impl: str, act: GLU = swiglu):
        super().__init__()
        self.act = act
        self.w_gate = nn.Parameter(torch.empty(E, hidden, d))
        self.w_up = nn.Parameter(torch.empty(E, hidden, d))
        self.w_down = nn.Parameter(torch.empty(E, d, hidden))
        self.impl = impl
        self.dispatch: Callable | None = None  # (x, experts, weights, w_gate, w_up, w_down, act) -> y
        # set by quantisation-aware training (kimi/precision): each weight as the forward computes with it
        self.weight_quant: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        fn = self.dispatch or EXPERT_IMPLS[self.impl]
        w = [self.param(name) for name in ("w_gate", "w_up", "w_down")]
        if self.weight_quant is not None:
            w = [self.weight_quant(t) for t in w]
        return fn(x, experts, weights, *w, act=self.act)


class MoE(Sublayer, nn.Module):
    """Routed SwiGLU experts plus shared ones (kimi.model.moe docstring). Buffers: ``expert_bias`` (the
    score-correction bias, saved in checkpoints) and ``load`` (tokens per expert since the last bias
    update, not saved)."""

    LABEL, FAMILY, FAMILY_OF = "MoE", "MLPs", {"experts": "routed experts"}
    RECORDS = ("load", "aux_loss")
    PROBES = ("experts",)  # each token's chosen experts
    EP_SPLIT = ("experts",)  # one expert per index of dim 0
    ZERO3_LEAF = True  # the forward reads the router's weight without calling the router
    HF_NAMES = {"router.weight": "block_sparse_moe.gate.weight",
                "expert_bias": "block_sparse_moe.gate.e_score_correction_bias",
                **{f"experts.w_{ours}": f"block_sparse_moe.experts.{{e}}.{theirs}.weight"
                   for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
                **{f"shared.w_{x}.weight": f"block_sparse_moe.shared_experts.{x}_proj.weight"
                   for x in ("gate", "up", "down")},
                **{f"latent_{x}.weight": f"block_sparse_moe.routed_expert_{y}.weight"
                   for x, y in (("down", "down_proj"), ("up", "up_proj"), ("norm", "norm"))}}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, E, hidden = cfg.d_model, cfg.moe.num_experts, cfg.moe.hidden
        self.top_k, self.groups, self.topk_groups = cfg.moe.top_k, cfg.moe.groups, cfg.moe.topk_groups
        self.norm_topk, self.scale = cfg.moe.norm_topk, cfg.moe.routed_scale
        self.router = nn.Linear(d, E, bias=False)
        width = cfg.moe.latent_dim or d
        self.latent_down = nn.Linear(d, width, bias=False) if cfg.moe.latent_dim else None
        self.experts = RoutedExperts(E, hidden, width, cfg.moe.impl, glu_of(cfg))
        self.latent_norm = RMSNorm(width,
                                   cfg.norm_eps) if cfg.moe.latent_dim and cfg.moe.latent_norm else None
        self.latent_up = nn.Linear(width, d, bias=False) if cfg.moe.latent_dim else None
        self.shared = SwiGLU(d, hidden * cfg.moe.shared_experts,
                             glu_of(cfg)) if cfg.moe.shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(E))
        self.register_buffer("load", torch.zeros(E), persistent=False)
        self.quantile = cfg.moe.balance == "quantile"
        if self.quantile:
            self.register_buffer("qb_hist", torch.zeros(E, cfg.moe.qb_bins), persistent=False)
        self.aux_coef = cfg.moe.aux_loss_coef
        # The multiplier of the auxiliary loss's gradient besides aux_coef: the engine sets it to the scale of
        # the step's loss (1 / gradient-accumulation steps) before each forward.
        self.aux_grad_scale = 1.0
        self.aux_loss: torch.Tensor | None = None  # the last training forward's, for metrics

    @property
    def num_experts(self) -> int:
        return self.load.numel()

    def tp_plan(self) -> TPPlan:
        """Router, routed and shared experts stay whole on every tp rank, which all compute the layer alike
        on the same (gathered) tokens: their gradients agree without communication. Splitting the experts
        is expert parallelism's job, not tensor parallelism's."""
        return TPPlan(replicate=True)

    def inactive_params(self) -> int:
        """Parameters a token does not use: the routed experts it is not sent to."""
        x = self.experts
        return (x.w_gate.shape[0] - self.top_k) * (x.w_gate[0].numel() + x.w_up[0].numel()
                                                   + x.w_down[0].numel())

    def init_rules(self, std: float, out_std: float) -> Rules:
        rules = {"router.weight": normal(std), "experts.w_gate": normal(std), "experts.w_up": normal(std),
                 "experts.w_down": normal(out_std)}
        if self.shared is not None:
            rules.update({f"shared.{n}": fill for n, fill in self.shared.init_rules(std, out_std).items()})
        if self.latent_down is not None:
            rules.update({"latent_down.weight": normal(std), "latent_up.weight": normal(out_std)})
        if self.latent_norm is not None:
            rules["latent_norm.weight"] = constant(1.0)
        return rules

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """x [B, T, d] (or [N, d]); rows: the batch rows of a packed x [1, B*T, d], for the sequence-wise
        loss, which is per row whatever the packing and the micro-batching (so every layout gives one
        process's loss)."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, experts, scores = route(h, self.router.weight, self.expert_bias, self.top_k, self.groups,
                                         self.topk_groups, self.norm_topk, self.scale)
        # Training forwards count, evaluation does not. Activation checkpointing's recomputation counts a
        # layer's tokens again, scaling all its loads alike: neither the bias update nor max/mean changes.
        if torch.is_grad_enabled():
            self.load += expert_counts(experts, self.load.numel()).to(self.load.dtype)
            if self.quantile:
                required_bias_histogram(scores, self.expert_bias, self.top_k, self.qb_hist)
        if PROBE.on:  # a diagnostic pass (kimi/diagnostics) counts the choices of its own forward
            PROBE.record(self, experts=experts)
        if self.latent_down is None:
            y = self.experts(h, experts, weights)
        else:
            y = self.experts(self.latent_down(h), experts, weights)
            y = self.latent_up(y if self.latent_norm is None else self.latent_norm(y))
        if self.shared is not None:
            y = y + self.shared(h)
        if self.aux_coef and torch.is_grad_enabled():
            rows = rows or (shape[0] if len(shape) == 3 else 1)
            aux = sequence_balance_loss(scores.view(rows, -1, scores.shape[-1]),
                                        experts.view(rows, -1, self.top_k), self.top_k)
            self.aux_loss = aux.detach()
            y = _AddGrad.apply(y, aux, self.aux_coef * self.aux_grad_scale)
        return y.view(shape)


@torch.no_grad()
def required_bias_histogram(scores: torch.Tensor, bias: torch.Tensor, k: int, hist: torch.Tensor) -> None:
    """Add to hist [E, bins] the binned required biases r_ij = a_i - s_ij of scores [N, E] (a_i: token i's
    (k+1)-th best biased score), bins uniform over [min bias - 1, max bias + 1]. A NaN score counts in no
    bin: a pipeline stage infers its shapes with a forward on uninitialised activations (kimi/parallel/
    pipeline.py undoes what it records), whose NaNs would otherwise become an out-of-range bin index."""
    cutoff = (scores + bias).topk(k + 1, dim=-1).values[:, -1:]
    lo, width = qb_range(bias, hist.shape[1])
    at = (cutoff - scores - lo) / width
    counted = ~at.isnan()
    bins = at.nan_to_num_(0.0).floor_().clamp_(0, hist.shape[1] - 1).long()
    hist.scatter_add_(1, bins.T, counted.T.to(hist.dtype))


def qb_range(bias: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lower edge, bin width) of Quantile Balancing's histogram for the current bias."""
    lo, hi = bias.min() - 1, bias.max() + 1
    return lo, (hi - lo) / bins


def histogram_quantile(hist: torch.Tensor, lo: torch.Tensor, width: torch.Tensor, q: float) -> torch.Tensor:
    """Per row of hist [E, bins], the value below which a fraction q of its counts lie: the bin where the
    cumulative count reaches it, linearly interpolated inside that bin."""
    cum = hist.cumsum(-1)
    target = cum[:, -1:] * q
    idx = (cum < target).sum(-1, keepdim=True).clamp_(max=hist.shape[1] - 1)
    count = hist.gather(-1, idx)
    before = cum.gather(-1, idx) - count
    frac = ((target - before) / count.clamp_min(1)).clamp_(0, 1)
    return (lo + (idx + frac) * width).squeeze(-1)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(model: nn.Module, rate: float,
                       sum_over_ranks: Callable[[torch.Tensor], None] | None = None) -> dict:
    """After an optimizer step: sum every MoE layer's `load` over the ranks that hold the same layers (the
    engine's `sum_over_ranks`, in place on the stacked loads: one all-reduce for all layers), move each bias
    by rate * sign(mean load - load), reset the loads. Returns the step's statistics:
    ``moe_imbalance`` (max over layers of max/mean tokens per expert) and ``moe_bias_range`` (max - min
    bias over all layers)."""
    layers = moe_layers(model)
    if not layers:
        return {}
    loads = torch.stack([m.load for m in layers])
    if sum_over_ranks is not None:
        sum_over_ranks(loads)
    mean = loads.mean(dim=1, keepdim=True)
    imbalance = (loads.max(dim=1).values / mean.squeeze(1).clamp_min(1e-9)).max()
    balanced = [m for m in layers if m.quantile]
    if balanced:  # Quantile Balancing's histograms, summed like the loads
        hists = torch.stack([m.qb_hist for m in balanced])
        if sum_over_ranks is not None:
            sum_over_ranks(hists)
        for m, hist in zip(balanced, hists):
            q = histogram_quantile(hist, *qb_range(m.expert_bias, hist.shape[1]), m.top_k / m.num_experts)
            seen = hist.sum() > 0  # a layer that saw no token keeps its bias
            m.expert_bias.copy_(torch.where(seen, q - q.mean(), m.expert_bias))
            m.qb_hist.zero_()
    for m, load, avg in zip(layers, loads, mean):
        if rate and not m.quantile:  # a layer that saw no token keeps its bias (masked on the device)
            m.expert_bias += rate * torch.sign(avg - load) * (load.sum() > 0)
        m.load.zero_()
    biases = torch.cat([m.expert_bias for m in layers])
    values = [imbalance, biases.max() - biases.min()]
    aux = [m.aux_loss for m in layers if m.aux_loss is not None]
    if aux:  # this rank's last training forward, averaged over the layers
        values.append(torch.stack(aux).mean())
    keys = ["moe_imbalance", "moe_bias_range", "moe_aux_loss"][:len(values)]
    return dict(zip(keys, torch.stack(values).float().tolist()))  # one host read for all


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """The scale of the loss the next backward differentiates (see MoE.aux_grad_scale)."""
    for m in moe_layers(model):
        m.aux_grad_scale = scale
