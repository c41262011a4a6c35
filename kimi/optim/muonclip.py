"""MuonClip: Muon on hidden weight matrices, AdamW on everything else, in one torch optimizer.

Math and sources: ALGORITHMS.md section 3. This is the single-device core; the distributed owner-compute
plugs into :meth:`MuonClip._muon_step` where its comment says. QK-Clip (kimi/optim/qk_clip.py) runs at the
end of :meth:`MuonClip.step` over the specs the model exports (KimiModel.qk_clip_specs()).

Routing (first rule that matches wins):
  1. name matches ``muon_patterns`` -> Muon (must have 2+ dims; a 3-D weight is a batch of matrices)
  2. name matches ``adamw_patterns`` (default: embeddings and the LM head) -> AdamW
  3. a 2-D tensor -> Muon
  4. anything else (norms, biases, A_log, dt_bias, AttnRes queries, [C, 1, K] conv kernels) -> AdamW
Embeddings and the LM head are matrices, but their rows are looked up or scored one token at a time, not
mixed as a linear map of the hidden state, so orthogonalising their update has no meaning (Muon's authors
and Moonlight keep them on AdamW). AdamW decays only tensors with 2+ dims, by kimi.optim.weight_decay_groups.
"""

from __future__ import annotations

import math
from collections import defaultdict
from fnmatch import fnmatchcase
from typing import Iterable, Sequence, Tuple

import torch

from kimi.config import ADJUST_LR_FNS
from kimi.ops.newton_schulz import DEFAULT_COEFFICIENTS, newton_schulz
from kimi.optim.groups import weight_decay_groups
from kimi.optim.qk_clip import QKClipSpec, apply_qk_clip

DEFAULT_ADAMW_PATTERNS = ("*embed*", "*lm_head*")


def update_scale(adjust_lr_fn: str, rows: int, cols: int) -> float:
    """Multiplier on lr for an orthogonalised [rows, cols] update.

    match_rms_adamw (Moonlight): an orthogonal update has RMS 1/sqrt(max(A, B)); 0.2 sqrt(max(A, B)) brings
    it to ~0.2, the RMS of a typical AdamW update, so AdamW's lr and weight decay carry over.
    original (Keller Jordan): sqrt(max(1, A/B)), which only corrects tall matrices.
    """
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: choose one of {'|'.join(ADJUST_LR_FNS)}")


def route(name: str, p: torch.Tensor, adamw_patterns: Sequence[str], muon_patterns: Sequence[str]) -> str:
    """'muon' or 'adamw' for one named parameter (rules in the module docstring)."""
    if any(fnmatchcase(name, pat) for pat in muon_patterns):
        if p.ndim < 2:
            raise ValueError(f"muon_patterns matched {name} of shape {tuple(p.shape)}; Muon needs 2+ dims")
        return "muon"
    if any(fnmatchcase(name, pat) for pat in adamw_patterns):
        return "adamw"
    return "muon" if p.ndim == 2 else "adamw"


class MuonClip(torch.optim.Optimizer):
    """One optimizer with a param group per family ("muon", then AdamW with and without decay).

    All groups share ``lr`` (Muon's per-matrix scale is applied inside the step), so an LR scheduler that
    multiplies every group's lr, like LambdaLR, schedules both families alike. Keyword names follow
    ``torch.optim.Muon`` where they mean the same: ``eps`` is Newton-Schulz's; AdamW's is ``adamw_eps``.
    Muon's momentum buffer is an average, B = mu B + (1 - mu) G, and the Nesterov update G' = (1 - mu) G +
    mu B, as torch.optim.Muon keeps them: B = (1 - mu) M and G' = (1 - mu) (G + mu M) for ALGORITHMS.md's
    M = mu M + G, the same update since Newton-Schulz normalises its input, and bf16 results bit-identical
    to torch.optim.Muon's (with M itself, bf16 rounds 20x larger inputs differently: 1.5e-2 apart).

    QK-Clip: after the update, the rows named by ``qk_clip_specs`` (over the same parameter names) are
    scaled per head by min(1, tau / S_max) with ``qk_clip_tau`` = tau; per-layer stats of the last step are
    in ``self.qk_clip_stats``. With no specs nothing is clipped.
    """

    def __init__(
        self,
        params: Iterable[Tuple[str, torch.nn.Parameter]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Tuple[float, float, float] = DEFAULT_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        ns_dtype: torch.dtype = torch.float32,
        betas: Tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_patterns: Sequence[str] = DEFAULT_ADAMW_PATTERNS,
        muon_patterns: Sequence[str] = (),
        qk_clip_tau: float = 100.0,
        qk_clip_specs: Sequence[QKClipSpec] = (),
    ) -> None:
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"lr={lr} and weight_decay={weight_decay} must be >= 0")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum={momentum} must be in [0, 1)")
        if ns_steps < 1:
            raise ValueError(f"ns_steps={ns_steps} must be >= 1")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: choose one of {'|'.join(ADJUST_LR_FNS)}")
        if not (len(betas) == 2 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"betas={betas} must be two numbers in [0, 1)")
        if not qk_clip_tau > 0:
            raise ValueError(f"qk_clip_tau={qk_clip_tau} must be > 0")

        named = list(params)
        if not all(isinstance(x, tuple) and isinstance(x[0], str) for x in named):
            raise TypeError("MuonClip routes by name: pass model.named_parameters(), not model.parameters()")
        named = [(n, p) for n, p in named if p.requires_grad]
        family = {n: route(n, p, tuple(adamw_patterns), tuple(muon_patterns)) for n, p in named}
        muon = [(n, p) for n, p in named if family[n] == "muon"]
        adamw = [(n, p) for n, p in named if family[n] == "adamw"]
        name_of = {id(p): n for n, p in adamw}

        groups = [{"params": muon, "family": "muon", "momentum": momentum, "nesterov": nesterov,
                   "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
                   "adjust_lr_fn": adjust_lr_fn, "ns_dtype": ns_dtype}]
        for g in weight_decay_groups(adamw, weight_decay):
            groups.append({"params": [(name_of[id(p)], p) for p in g["params"]], "family": "adamw",
                           "weight_decay": g["weight_decay"], "betas": tuple(betas), "eps": adamw_eps})
        super().__init__([g for g in groups if g["params"]], {"lr": lr, "weight_decay": weight_decay})

        self.qk_clip_tau, self.qk_clip_specs = qk_clip_tau, list(qk_clip_specs)
        self._params_by_name = dict(named)
        missing = [r.param for s in self.qk_clip_specs for r in s.rows if r.param not in self._params_by_name]
        if missing:
            raise ValueError(f"qk_clip_specs name parameters this optimizer does not update: {missing}")
        self.qk_clip_stats: dict = {}  # {layer: {"max_logit", "clipped_frac"}} of the last step

    def routing_table(self) -> str:
        """One line per parameter (name, shape, family, weight decay) and a per-family total."""
        rows, totals = [("name", "shape", "family", "wd")], defaultdict(lambda: [0, 0])
        for g in self.param_groups:
            for n, p in zip(g["param_names"], g["params"]):
                shape = "x".join(map(str, p.shape)) or "scalar"
                rows.append((n, shape, g["family"], f"{g['weight_decay']:g}"))
                totals[g["family"]][0] += 1
                totals[g["family"]][1] += p.numel()
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(", ".join(f"{f}: {k} tensors, {c:,} params" for f, (k, c) in totals.items()))
        return "\n".join(lines)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["family"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        # After the update (ALGORITHMS.md section 3). Distributed: the specs' max logits must be max-reduced
        # over data-parallel ranks before this, so every replica scales alike.
        if self.qk_clip_specs:
            self.qk_clip_stats = apply_qk_clip(self._params_by_name, self.qk_clip_specs, self.qk_clip_tau)
        return loss

    def _muon_step(self, group) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        # Matrices of one shape are orthogonalised in one batched call: fewer, larger matmuls.
        buckets = defaultdict(list)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
            buckets[(p.shape, p.dtype, p.device)].append((p, update))
        # Distributed owner-compute replaces this loop: each full matrix goes to one owner rank, is
        # orthogonalised there, and the update shards come back; momentum above stays shard-local.
        for (shape, _, _), items in buckets.items():
            rows, cols = shape[-2], shape[-1]
            stacked = torch.stack([u for _, u in items]).reshape(-1, rows, cols)
            ortho = newton_schulz(stacked, group["ns_steps"], group["ns_coefficients"], group["eps"],
                                  group["ns_dtype"]).reshape(len(items), *shape)
            step_size = lr * update_scale(group["adjust_lr_fn"], rows, cols)
            for (p, _), o in zip(items, ortho):
                p.mul_(1 - lr * wd)
                p.add_(o, alpha=-step_size)

    def _adamw_step(self, group) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                # step as a float tensor, as torch.optim.AdamW keeps it, so checkpoint tooling treats it alike
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = state["step"].item()
            m, v = state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - lr * wd)
            m.lerp_(p.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
