"""MuonClip: Muon on hidden weight matrices, AdamW on everything else, in one torch optimizer.

Math, sources: docs/algorithms.md section 3. Parameters may be plain tensors (one process, or replicated over
the process group) or DTensors laid out by FSDP2 and/or tensor parallelism: kimi/optim/owners.py plans who
holds which block, and each Muon matrix is orthogonalised once per step, by one owner rank. QK-Clip
(kimi/optim/qk_clip.py) runs at the end of :meth:`MuonClip.step` over the specs the model exports
(KimiModel.qk_clip_specs()); fused projections are orthogonalised per logical matrix (RowSplit,
KimiModel.muon_splits()).

Routing (first rule that matches wins):
  1. name matches ``muon_patterns`` -> Muon (must have 2+ dims; a 3-D weight is a batch of matrices)
  2. name matches ``adamw_patterns`` (default: embeddings and the LM head) -> AdamW
  3. a 2-D tensor, or a 3-D batch of matrices (MoE experts' [E, out, in]) -> Muon, each matrix apart
  4. anything else (norms, biases, A_log, dt_bias, AttnRes queries, [C, 1, K] conv kernels) -> AdamW
Embeddings and the LM head are matrices, but their rows are looked up or scored one token at a time, not
mixed as a linear map of the hidden state, so orthogonalising their update has no meaning (Muon's authors
and Moonlight keep them on AdamW). AdamW decays only tensors with 2+ dims, by kimi.optim.weight_decay_groups.
"""

from __future__ import annotations

import math
from collections import defaultdict
from fnmatch import fnmatchcase
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kimi.model.layouts import QKClipSpec, RowSplit
from kimi.ops.newton_schulz import DEFAULT_COEFFICIENTS, newton_schulz, scratch
from kimi.optim.config import ADJUST_LR_FNS
from kimi.optim.groups import weight_decay_groups
from kimi.optim.owners import Fragment, ParamPlan, Router, build_plans, like_param, local_tensor, ns_flops
from kimi.optim.qk_clip import QKClip

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
    matrices = p.ndim == 2 or (p.ndim == 3 and min(p.shape[-2:]) > 1)  # a [C, 1, K] conv kernel is not
    return "muon" if matrices else "adamw"


def _slot(batch: torch.Tensor, start: int, k: int, tall: bool, shape: Tuple[int, ...]) -> torch.Tensor:
    """The view of a batch of wide matrices [N, rows, cols] that holds matrices start..start+k, as
    ``shape``."""
    block = batch[start : start + k]
    return (block.mT if tall else block).view(shape)


class MuonClip(torch.optim.Optimizer):
    """One optimizer with a param group per family ("muon", then AdamW with and without decay).

    All groups share ``lr`` (Muon's per-matrix scale is applied inside the step), so an LR scheduler that
    multiplies every group's lr, like LambdaLR, schedules both families alike. Keyword names follow
    ``torch.optim.Muon`` where they mean the same: ``eps`` is Newton-Schulz's; AdamW's is ``adamw_eps``.
    Muon's momentum buffer is an average, B = mu B + (1 - mu) G, and the Nesterov update G' = (1 - mu) G +
    mu B, as torch.optim.Muon keeps them: B = (1 - mu) M and G' = (1 - mu) (G + mu M) for the papers'
    M = mu M + G, the same update since Newton-Schulz normalises its input, and bf16 results bit-identical
    to torch.optim.Muon's (with M itself, bf16 rounds 20x larger inputs differently: 1.5e-2 apart).

    QK-Clip: after the update, the rows named by ``qk_clip_specs`` (over the same parameter names) are
    scaled per head by min(1, tau / S_max) with ``qk_clip_tau`` = tau; per-layer stats of the last step are
    in ``self.qk_clip_stats``. With no specs nothing is clipped. ``splits`` names fused weights to
    orthogonalise per logical matrix.

    Distributed: ``process_group`` (default: the world, when torch.distributed is initialised) is the set of
    ranks holding blocks of the same parameters; plain tensors are taken as replicated over it with
    gradients already averaged (DDP), DTensors as laid out by their placements. Every rank calls step(),
    state_dict() and load_state_dict() together. A parameter without a gradient is skipped on one process
    and treated as a zero gradient on several (the ranks must not disagree about it). Under pipeline
    parallelism pass the ranks of one stage. ``fragments`` names the parameters given as flat pieces
    (:class:`kimi.optim.owners.Fragment`: DeepSpeed's ZeRO partitions, kimi/parallel/zero_client.py); they are
    routed, decayed and orthogonalised by their full shapes. ``step_stats`` counts the last step's
    Newton-Schulz matrices and FLOPs on this rank, collectives and bytes sent.
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
        splits: Mapping[str, RowSplit] | None = None,
        process_group: Optional[dist.ProcessGroup] = None,
        fragments: Mapping[str, Fragment] | None = None,
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
        self.fragments = dict(fragments or {})
        # Routing and decay go by each parameter's full shape (a fragment's tensor is a flat piece of it).
        full = {n: torch.empty(self.fragments[n].shape, device="meta") if n in self.fragments else p
                for n, p in named}
        family = {n: route(n, full[n], tuple(adamw_patterns), tuple(muon_patterns)) for n, p in named}
        muon = [(n, p) for n, p in named if family[n] == "muon"]
        adamw = [(n, p) for n, p in named if family[n] == "adamw"]
        name_of = {id(p): n for n, p in adamw}

        groups = [{"params": muon, "family": "muon", "momentum": momentum, "nesterov": nesterov,
                   "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
                   "adjust_lr_fn": adjust_lr_fn, "ns_dtype": ns_dtype}]
        for g in weight_decay_groups(adamw, weight_decay, self.fragments):
            groups.append({"params": [(name_of[id(p)], p) for p in g["params"]], "family": "adamw",
                           "weight_decay": g["weight_decay"], "betas": tuple(betas), "eps": adamw_eps})
        super().__init__([g for g in groups if g["params"]], {"lr": lr, "weight_decay": weight_decay})

        self.splits = dict(splits or {})
        for name, split in self.splits.items():
            p = full.get(name)
            if p is None or family[name] != "muon" or p.ndim != 2 or p.shape[0] % split.stride:
                got = None if p is None else tuple(p.shape)
                raise ValueError(f"splits[{name!r}]: must name a 2-D Muon weight whose rows are a multiple "
                                 f"of {split.stride}, got {got}")
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group = process_group
        self._plans: dict[int, ParamPlan] | None = None  # by id(param), built at the first collective call
        self._router = Router(process_group)
        self._stepped = False  # the same on every rank: they step together
        self.qk_clip_tau, self.qk_clip_specs = qk_clip_tau, list(qk_clip_specs)
        self._qk_clip = QKClip(named, self.qk_clip_specs, qk_clip_tau, group=process_group,
                               fragments=self.fragments)
        self.step_stats: dict = {}
        # Newton-Schulz batches and scratch kept across steps on CPU (4 bytes per Muon parameter in bf16),
        # where tensors this large come from fresh mmaps whose page faults cost a few percent of a step
        # (`small`,
        # bench/optim.py); CUDA's caching allocator reuses its blocks anyway.
        self._ns_buffers: dict = {}

    def routing_table(self) -> str:
        """One line per parameter (name, shape, family, weight decay) and a per-family total."""
        rows, totals = [("name", "shape", "family", "wd")], defaultdict(lambda: [0, 0])
        for g in self.param_groups:
            for n, p in zip(g["param_names"], g["params"]):
                full = self.fragments[n].shape if n in self.fragments else tuple(p.shape)
                shape = "x".join(map(str, full)) or "scalar"
                rows.append((n, shape, g["family"], f"{g['weight_decay']:g}"))
                totals[g["family"]][0] += 1
                totals[g["family"]][1] += math.prod(full)
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append("; ".join(f"{f}: {k} tensors, {c:,} params" for f, (k, c) in totals.items()))
        return "\n".join(lines)

    def kept_buffers(self) -> List[torch.Tensor]:
        """The Newton-Schulz batches and scratch kept from one step to the next (CPU only; empty on a GPU):
        alive through the whole step, beside the state, which memory measurements count (kimi.plan)."""
        return [t for buffers in self._ns_buffers.values() for t in buffers.values()]

    # ---- layout -------------------------------------------------------------------------------------

    @property
    def qk_clip_stats(self) -> dict:
        """{layer: {"max_logit", "clipped_frac"}} of the last step (empty without specs)."""
        return self._qk_clip.stats

    @property
    def _distributed(self) -> bool:
        return self._router.world > 1

    def _members(self, family: str) -> List[Tuple[dict, torch.Tensor, ParamPlan]]:
        """(group, param, plan) of one family, in param-group order: the same order on every rank."""
        if self._plans is None:
            named = [(n, p) for g in self.param_groups for n, p in zip(g["param_names"], g["params"])]
            muon = [g["family"] == "muon" for g in self.param_groups for _ in g["params"]]
            plans = build_plans(named, muon, self.process_group, self.fragments)
            self._plans = {id(p): plan for (_, p), plan in zip(named, plans)}
        return [(g, p, self._plans[id(p)]) for g in self.param_groups if g["family"] == family
                for p in g["params"]]

    def _grad_block(self, p: torch.Tensor, plan: ParamPlan) -> Optional[torch.Tensor]:
        if plan.local is None:
            return None
        if p.grad is None:
            return torch.zeros(plan.local_piece().shape, dtype=plan.dtype, device=plan.device)
        grad = p.grad
        if isinstance(grad, DTensor) and grad.placements != p.placements:
            # e.g. a vocab-parallel embedding's gradient comes back replicated: take this rank's block
            grad = grad.redistribute(p.device_mesh, p.placements)
        return local_tensor(grad)

    # ---- step ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        router = self._router
        collectives, sent = router.collectives, router.bytes_sent
        # One process keeps torch's rule (no gradient: no update); several must move in lockstep.
        keep = (lambda p: True) if self._distributed else (lambda p: p.grad is not None)
        muon = [m for m in self._members("muon") if keep(m[1])]
        adamw = [m for m in self._members("adamw") if keep(m[1])]
        # 1. Gradient blocks of each Muon matrix travel to its owner (one all_to_all).
        grads = router.route([(plan, "to_owner", self._grad_block(p, plan)) for _, p, plan in muon])
        # 2. Owners: momentum, one Newton-Schulz per logical matrix (batched by shape), the scaled update.
        updates, ns_count, flops = self._orthogonalise(muon, grads)
        # 3. AdamW on the blocks this rank keeps.
        kept = [self._adamw_block(group, p, plan) for group, p, plan in adamw]
        # 4. Update blocks to every holder of a Muon matrix, new AdamW values to replicas (one all_to_all).
        back = router.route([(plan, "from_owner", u) for (_, _, plan), u in zip(muon, updates)]
                            + [(plan, "from_keeper", b) for (_, _, plan), b in zip(adamw, kept)])
        for (group, p, plan), block in zip(muon, back[: len(muon)]):
            if block is not None:
                local = local_tensor(p)
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(block, alpha=-group["lr"] * self._scale_of(group, plan))
        for (_, p, plan), block in zip(adamw, back[len(muon) :]):
            if block is not None and plan.keepers[plan.local] != router.rank:
                local_tensor(p).copy_(block)
        # 5. QK-Clip, after the update (docs/algorithms.md section 3).
        clip_collectives = self._qk_clip.collectives
        self._qk_clip()
        self._stepped = True
        # an entry per parameter on every rank, owner or not: see _import_state
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]
        self.step_stats = {"ns_matrices": ns_count, "ns_flops": flops,
                           "collectives": router.collectives - collectives + self._qk_clip.collectives
                           - clip_collectives,
                           "bytes_sent": router.bytes_sent - sent}
        return loss

    def _logical_shapes(self, plan: ParamPlan) -> List[Tuple[int, int]]:
        split = self.splits.get(plan.name)
        if split is None:
            return [tuple(plan.shape[-2:])]
        heads = 1 if split.per_head else plan.shape[0] // split.stride
        return [(heads * n, plan.shape[1]) for _, n in split.segments]

    def _scale_of(self, group: dict, plan: ParamPlan) -> float:
        """The lr multiplier every holder applies: that of the first logical matrix (owners pre-scale the
        others by their ratio to it, so an unsplit matrix is updated exactly as torch.optim.Muon does)."""
        return update_scale(group["adjust_lr_fn"], *self._logical_shapes(plan)[0])

    def _orthogonalise(self, muon, grads) -> Tuple[List[Optional[torch.Tensor]], int, int]:
        """On each owner: the full update of each matrix it owns (None elsewhere), to be applied with
        lr * _scale_of(); and this rank's count of orthogonalised matrices and their Newton-Schulz FLOPs.

        Logical matrices are batched by their wide shape (a tall one goes in transposed) and Newton-Schulz
        settings. The Nesterov update is written straight into its slot of the batch, cast to the NS dtype
        in the same pass; the batch is scaled in place, and an unsplit matrix's update comes back as a view
        of the NS output (in the NS dtype, as torch.optim.Muon applies its bf16 update), so one step makes
        no other copy of the Muon matrices than the ones Newton-Schulz itself needs."""
        blocks: List[Optional[list]] = [None] * len(muon)  # per member: its logical matrices' NS outputs
        # (rows, cols) of the wide orientation, ns settings -> [(member, logical index, count, tall, shape,
        # src)]
        buckets = defaultdict(list)
        for n, ((group, p, plan), g) in enumerate(zip(muon, grads)):
            if g is None:  # not the owner
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
            buf, mu = state["momentum_buffer"], group["momentum"]
            buf.lerp_(g, 1 - mu)
            split = self.splits.get(plan.name)
            if split is None:  # written into the batch below (None: the update of the whole tensor)
                mats = [None]
                shapes = [tuple(g.shape)]
            else:
                mats = split.split(g.lerp(buf, mu) if group["nesterov"] else buf)
                shapes = [tuple(m.shape) for m in mats]
            settings = (group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_dtype"])
            for j, (m, shape) in enumerate(zip(mats, shapes)):
                rows, cols = shape[-2], shape[-1]
                buckets[(min(rows, cols), max(rows, cols), settings)].append(
                    (n, j, math.prod(shape[:-2]), rows > cols, shape, m))
            blocks[n] = [None] * len(mats)
        count = flops = 0
        for (rows, cols, settings), items in buckets.items():
            steps, coefficients, eps, ns_dtype = settings
            like = grads[items[0][0]].new_empty(0, dtype=ns_dtype)
            # one set per bucket: every bucket's output must live until the updates are applied
            keep = like.device.type == "cpu"
            buffers = self._ns_buffers.setdefault((rows, cols, settings), {}) if keep else None
            X = scratch(buffers, "batch", (sum(k for _, _, k, *_ in items), rows, cols), like)
            start = 0
            for n, j, k, tall, shape, m in items:
                slot = _slot(X, start, k, tall, shape)
                start += k
                if m is not None:
                    slot.copy_(m)
                    continue
                group, p, _ = muon[n]
                buf = self.state[p]["momentum_buffer"]
                if group["nesterov"]:
                    torch.lerp(grads[n], buf, group["momentum"], out=slot)
                else:
                    slot.copy_(buf)
            ortho = newton_schulz(X, steps, coefficients, eps, ns_dtype, overwrite=True, buffers=buffers)
            count += X.shape[0]
            flops += ns_flops(X.shape, steps)
            start = 0
            for n, j, k, tall, shape, _ in items:
                blocks[n][j] = _slot(ortho, start, k, tall, shape)
                start += k
        updates: List[Optional[torch.Tensor]] = []
        for (group, _, plan), mats in zip(muon, blocks):
            split = self.splits.get(plan.name)
            if mats is None or split is None:
                updates.append(None if mats is None else mats[0])
                continue
            ref = self._scale_of(group, plan)
            shapes = self._logical_shapes(plan)
            scaled = [m.to(plan.dtype) * (update_scale(group["adjust_lr_fn"], *s) / ref)
                      for m, s in zip(mats, shapes)]
            updates.append(split.join(scaled, torch.empty(plan.shape, dtype=plan.dtype, device=plan.device)))
        return updates, count, flops

    def _adamw_block(self, group, p, plan: ParamPlan) -> Optional[torch.Tensor]:
        """Update this rank's block of an AdamW parameter if it keeps it; returns the block (or None)."""
        state = self.state[p]
        if "step" not in state:
            # step as a float tensor, as torch.optim.AdamW keeps it, so checkpoint tooling treats it alike
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        if plan.local is None or plan.keepers[plan.local] != self._router.rank:
            return None
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        local, grad = local_tensor(p), self._grad_block(p, plan)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(local, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(local, memory_format=torch.preserve_format)
        t = state["step"].item()
        m, v = state["exp_avg"], state["exp_avg_sq"]
        local.mul_(1 - lr * wd)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        local.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        return local

    # ---- state --------------------------------------------------------------------------------------

    def state_dict(self):
        """torch's format, each state tensor laid out like its parameter (a DTensor for a DTensor), so
        torch.distributed.checkpoint can reload it under another layout. Collective when distributed."""
        if not self._distributed or not self._stepped:
            return super().state_dict()
        internal, self.state = self.state, self._export_state()
        try:
            return super().state_dict()
        finally:
            self.state = internal

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._stepped = bool(state_dict["state"])
        if self._distributed:
            self.state = self._import_state()

    def _export_state(self):
        muon, adamw = self._members("muon"), self._members("adamw")
        items = [(plan, "from_owner", self.state[p].get("momentum_buffer")) for _, p, plan in muon]
        for _, p, plan in adamw:
            st = self.state[p]
            items += [(plan, "from_keeper", st.get("exp_avg")), (plan, "from_keeper", st.get("exp_avg_sq"))]
        blocks = self._router.route(items)
        out = defaultdict(dict)
        for (_, p, _), b in zip(muon, blocks):
            out[p]["momentum_buffer"] = like_param(self._or_empty(b, p), p)
        for k, (_, p, _) in enumerate(adamw):
            m, v = blocks[len(muon) + 2 * k : len(muon) + 2 * k + 2]
            out[p].update(step=self.state[p]["step"], exp_avg=like_param(self._or_empty(m, p), p),
                          exp_avg_sq=like_param(self._or_empty(v, p), p))
        return out

    @staticmethod
    def _or_empty(block: Optional[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
        local = local_tensor(p)
        return torch.zeros_like(local) if block is None else block.clone()

    def _import_state(self):
        """From loaded, parameter-shaped state to the working layout: full momentum on each owner, Adam
        moments on each keeper."""
        muon = [m for m in self._members("muon") if "momentum_buffer" in self.state.get(m[1], {})]
        full = self._router.route([(plan, "to_owner", self._local_state(p, plan, "momentum_buffer"))
                                   for _, p, plan in muon])
        # Every parameter keeps an entry, empty where another rank holds its state: DCP's get_state_dict
        # runs a zero-gradient step on an optimizer whose state is empty, which must never happen on only
        # some ranks.
        out = defaultdict(dict, {p: {} for g in self.param_groups for p in g["params"]})
        for (_, p, _), f in zip(muon, full):
            if f is not None:
                out[p]["momentum_buffer"] = f
        for _, p, plan in self._members("adamw"):
            st = self.state.get(p, {})
            if "step" not in st:
                continue
            out[p]["step"] = st["step"]
            if plan.local is not None and plan.keepers[plan.local] == self._router.rank:
                out[p]["exp_avg"] = self._local_state(p, plan, "exp_avg")
                out[p]["exp_avg_sq"] = self._local_state(p, plan, "exp_avg_sq")
        return out

    def _local_state(self, p, plan: ParamPlan, key: str) -> Optional[torch.Tensor]:
        if plan.local is None:
            return None
        return local_tensor(self.state[p][key]).to(plan.dtype).clone()
