"""One diagnostic forward, observed from outside the model: this rank's sums of what each block computed.

The AttnRes weights come from forward pre-hooks: a block's hook holds the residual stream it is handed
(the mixer's sources), its MLP norm's hook sees the stream after the mixer's push (the MLP's sources), the
final norm's hook the stream after the last block; each recomputes the softmax over the sources with the
sublayer's own query and the model's own function (attnres.depth_weights), inside the forward, so under the
same autocast and with the parameters FSDP has gathered for it. KDA's decay and beta, MLA's per-head max
logits and the MoE experts' choices are values inside a forward that no module returns: the layers hand
them to the probe (kimi/model/probe.py) while it is on. Everything is registered only inside `observe`.

The sums are plain numbers (a `Tally`), so every rank's can be gathered with all_gather_object and
combined on rank 0 (record.py) whatever each rank saw: other tokens (data and context parallelism), other
heads (tensor parallelism: MLA's heads are placed by `head_rank`) or other blocks (pipeline stages).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from kimi.model.attnres import depth_weights
from kimi.model.config import ModelConfig
from kimi.model.probe import PROBE

from .record import attnres_sources, sublayers


@dataclass
class Tally:
    """One rank's sums over the diagnostic forward (all its micro-batches), as plain Python numbers.

    attnres  sublayer ("0.mixer", "0.mlp", ..., "final") -> (sum over tokens of each source's weight, tokens)
    kda      block -> [sum exp(g), elements, min exp(g), elements below 0.5, sum beta, beta elements]
    mla      layer (QK-Clip's name) -> (first head it computed, max scaled logit per head)
    moe      block -> tokens routed to each expert (top-k choices counted)
    qk_clip  layer -> QK-Clip's per-head max logits of the last step (already over all ranks; empty when off)
    """

    attnres: Dict[str, Tuple[List[float], int]] = field(default_factory=dict)
    kda: Dict[int, List[float]] = field(default_factory=dict)
    mla: Dict[str, Tuple[int, List[float]]] = field(default_factory=dict)
    moe: Dict[int, List[float]] = field(default_factory=dict)
    qk_clip: Dict[str, List[float]] = field(default_factory=dict)


class _Sums:
    """The running sums as tensors on the device (one host copy at the end, not one per layer)."""

    def __init__(self, head_rank: int, labels: Dict[str, List[str]]):
        self.head_rank, self.labels = head_rank, labels  # labels: each sublayer's sources (record.py)
        self.attnres: Dict[str, list] = {}
        self.kda: Dict[int, list] = {}
        self.mla: Dict[str, torch.Tensor] = {}
        self.moe: Dict[int, torch.Tensor] = {}

    def add_attnres(self, sublayer: str, query, sources: Sequence[torch.Tensor], eps: float) -> None:
        if query is None:  # the model's first sublayer: one source, weight 1 (attnres.depth_attention)
            tokens = sources[0][..., 0].numel()
            weights = torch.full((1,), float(tokens), dtype=torch.float64, device=sources[0].device)
        else:
            w = depth_weights(query, sources, eps)  # [sources, *tokens]
            weights, tokens = w.flatten(1).sum(1, dtype=torch.float64), w[0].numel()
        if len(self.labels[sublayer]) != weights.numel():  # the stream and record.py disagree: a bug
            raise RuntimeError(f"AttnRes diagnostics: sublayer {sublayer} has {weights.numel()} sources, "
                               f"expected {self.labels[sublayer]}")
        prev = self.attnres.get(sublayer)
        self.attnres[sublayer] = [weights, tokens] if prev is None else [prev[0] + weights, prev[1] + tokens]

    def add_kda(self, block: int, g: torch.Tensor, beta: torch.Tensor) -> None:
        decay = g.exp()
        sums = torch.stack([decay.sum(dtype=torch.float64), (decay < 0.5).sum().double(),
                            beta.sum(dtype=torch.float64)])
        low, n, n_beta = decay.min().double(), decay.numel(), beta.numel()
        prev = self.kda.get(block)
        if prev is None:
            self.kda[block] = [sums, low, n, n_beta]
        else:
            self.kda[block] = [prev[0] + sums, torch.minimum(prev[1], low), prev[2] + n, prev[3] + n_beta]

    def add_mla(self, layer: str, max_logits: torch.Tensor) -> None:
        prev = self.mla.get(layer)
        self.mla[layer] = max_logits.float() if prev is None else torch.maximum(prev, max_logits.float())

    def add_moe(self, block: int, experts: torch.Tensor, num_experts: int) -> None:
        counts = torch.bincount(experts.reshape(-1), minlength=num_experts).double()
        self.moe[block] = counts if block not in self.moe else self.moe[block] + counts

    def tally(self) -> Tally:
        kda = {}
        for block, (sums, low, n, n_beta) in self.kda.items():
            decay_sum, below, beta_sum = sums.tolist()
            kda[block] = [decay_sum, float(n), low.item(), below, beta_sum, float(n_beta)]
        return Tally(attnres={k: (w.tolist(), n) for k, (w, n) in self.attnres.items()}, kda=kda,
                     mla={k: (self.head_rank * v.numel(), v.tolist()) for k, v in self.mla.items()},
                     moe={k: v.tolist() for k, v in self.moe.items()})


def _block_of(name: str) -> int:
    """The block index in a module name "blocks.<i>.mixer" / "blocks.<i>.mlp"."""
    return int(name.split(".")[1])


def _attnres_hooks(part: nn.Module, eps: float, sums: _Sums) -> list:
    held = {}  # the stream this part's forward carries, from the latest block hook

    def block_hook(i: int):
        def hook(block, args):
            held["stream"] = args[0]
            sums.add_attnres(f"{i}.mixer", block.site_query("mixer"), args[0].sources(), eps)
        return hook

    def mlp_hook(i: int, block: nn.Module):
        def hook(norm, args):
            sums.add_attnres(f"{i}.mlp", block.site_query("mlp"), held["stream"].sources(), eps)
        return hook

    def final_hook(norm, args):
        sums.add_attnres("final", part.final_site_query(), held["stream"].sources(), eps)

    handles = []
    for name, block in part.blocks.items():
        handles.append(block.register_forward_pre_hook(block_hook(int(name))))
        handles.append(block.mlp_norm.register_forward_pre_hook(mlp_hook(int(name), block)))
    if part.norm is not None:
        handles.append(part.norm.register_forward_pre_hook(final_hook))
    return handles


@contextmanager
def observe(parts: Sequence[nn.Module], cfg: ModelConfig, head_rank: int = 0) -> Iterator[_Sums]:
    """Record the forwards run inside the block into the yielded sums (``.tally()`` afterwards). `parts`: the
    model parts this rank runs (an engine's ``parts``); head_rank: this rank's tensor-parallel rank."""
    sums = _Sums(head_rank, {s: attnres_sources(cfg, s) for s in sublayers(cfg)})
    names: Dict[int, str] = {id(m): n for part in parts for n, m in part.sublayers() if m.PROBES}

    def sink(module: nn.Module, **values: torch.Tensor) -> None:
        """By the names of the values a sublayer declares it hands over (its PROBES)."""
        name = names[id(module)]
        if "g" in values:
            sums.add_kda(_block_of(name), values["g"], values["beta"])
        if "max_logits" in values:
            sums.add_mla(name, values["max_logits"])
        if "experts" in values:
            sums.add_moe(_block_of(name), values["experts"], module.num_experts)

    handles = []
    try:
        if cfg.residual != "standard":
            for part in parts:
                handles += _attnres_hooks(part, cfg.norm_eps, sums)
        PROBE.start(sink)
        yield sums
    finally:
        PROBE.stop()
        for h in handles:
            h.remove()
