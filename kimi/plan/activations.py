"""What autograd keeps per token, traced from a model's shapes on the meta device (no memory, no FLOPs).

The model is built on the meta device and one row of T tokens runs forward and backward under a dispatch
mode that follows every storage an op creates until it is freed: the bytes alive, and the most ever alive.
That is the model's own code deciding what autograd keeps (each sublayer's saved tensors, the AttnRes
mixes' stacks, what activation checkpointing keeps and recomputes, the chunked loss's buffers), so nothing
is fitted to measurements: run at two lengths it gives bytes per token and per row. Bytes are attributed
per block (what is still alive at the next block's start: kept until the backward) and split by shape:
tensors as wide as d_model (the residual stream between sublayers, which tensor parallelism keeps whole
unless sequence parallelism splits it) and the rest (inside the sublayers: split by tp).

The trace runs in fp32 (autocast does not run on the meta device); `Trace.scaled` turns its bytes into a
bf16 run's by the compute dtype's size, an estimate (norms, softmaxes and the loss stay fp32 under
autocast). The routed experts' grouped GEMM runs through a stand-in that saves what torch's kernel saves
(its two inputs): torch._grouped_mm takes only bf16 on the meta device, and the per-expert loop needs the
routing's counts on the host. Its gradients are dropped as they arrive: kimi.summary counts gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kimi.config import ModelConfig
from kimi.plan.shapes import section_key

T1, T2 = 64, 128  # the two lengths traced: a KDA chunk and two, short enough to trace a 93-block model fast
SMALL_CHUNK = 8  # tokens per loss chunk in the traces that separate the loss's logits from the rest


class _Live(TorchDispatchMode):
    """Bytes alive per class (0: d_model wide, 1: the rest) among storages created under it, and the most
    alive at once."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d, self.now, self.peak, self.seen = d_model, [0, 0], 0, set()

    def _free(self, key: int, cls: int, n: int) -> None:
        self.seen.discard(key)
        self.now[cls] -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self.seen:
                continue
            n, cls = st.nbytes(), 0 if t.dim() and t.shape[-1] == self.d else 1
            self.seen.add(key)
            self.now[cls] += n
            weakref.finalize(st, self._free, key, cls, n)
        self.peak = max(self.peak, sum(self.now))
        return out

    def snap(self) -> Tuple[int, int]:
        return tuple(self.now)


class _GroupedMM(torch.autograd.Function):
    """torch._grouped_mm's shapes and saved tensors, for any dtype on the meta device."""

    @staticmethod
    def forward(ctx, a, b, offs=None):
        ctx.save_for_backward(a, b)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b), None


@contextlib.contextmanager
def _meta_experts():
    import kimi.model.moe as moe

    saved = moe.grouped_mm_ok, torch._grouped_mm
    moe.grouped_mm_ok = lambda x: True
    torch._grouped_mm = lambda a, b, offs=None, **kw: _GroupedMM.apply(a, b, offs)
    try:
        yield
    finally:
        moe.grouped_mm_ok, torch._grouped_mm = saved


CUT = 8  # a deeper model is traced through its first CUT blocks (module docstring)


class _NoHead(torch.nn.Module):
    """Stands in for the LM head in the body's trace: a sum, which keeps nothing (the head is traced
    apart)."""

    vocab_parallel = False

    def forward(self, hidden, labels=None):
        return hidden.float().sum()


def _track(live: _Live, tensors) -> None:
    """Storages created before tracing (parameters, inputs) are never counted, views of them neither."""
    live.seen |= {t.untyped_storage()._cdata for t in tensors}


@dataclass(frozen=True)
class Run:
    """One traced forward and backward of one row of T tokens through the blocks (no loss)."""

    first: Tuple[int, int]  # kept by the embedding and the stream's start (d_model wide, other)
    blocks: List[Tuple[int, int]]  # kept by each block until its backward
    last: Tuple[int, int]  # kept by the final mix and norm
    extra: int  # the most alive at once beyond what the forward keeps (recompute, activation gradients)


def _body(m: ModelConfig, ac: str, T: int) -> Run:
    from kimi.model import KimiModel
    from kimi.parallel.activation_checkpointing import apply_activation_checkpointing

    with torch.device("meta"):
        model = KimiModel(m)
    model.lm_head = _NoHead()
    apply_activation_checkpointing(model, ac)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    live = _Live(m.d_model)
    marks: List[Tuple[int, int]] = []
    hooks = [b.register_forward_pre_hook(lambda *_: marks.append(live.snap())) for b in model.blocks.values()]
    run = model.__dict__.get("_runners", {}).get("final")

    def final(function, *args):  # marks the final mix's start
        marks.append(live.snap())
        return run(function, *args) if run else function(*args)

    model.set_runner("final", final)
    ids = torch.zeros(1, T, dtype=torch.long, device="meta")
    _track(live, [*model.parameters(), *model.buffers(), ids])
    with _meta_experts(), live:
        loss = model(ids, labels=ids)
        end = live.snap()
        kept = sum(end)
        loss.backward()
    for h in hooks:
        h.remove()
    n = len(model.blocks)

    def diff(a, b):
        return (b[0] - a[0], b[1] - a[1])

    return Run(marks[0], [diff(marks[i], marks[i + 1]) for i in range(n)], diff(marks[n], end),
               max(0, live.peak - kept))


def _head(m: ModelConfig, T: int, chunk: int) -> Tuple[int, int]:
    """(bytes the loss keeps from its forward to its backward, the most alive at once beyond the hidden
    states) for T tokens, `chunk` tokens per loss chunk (-1: the plain loss on whole logits)."""
    from kimi.model.transformer import LMHead, lm_loss

    with torch.device("meta"):
        head = LMHead(m.d_model, m.vocab_size, chunk, m.loss_chunk_mib)
    hidden = torch.empty(1, T, m.d_model, device="meta", requires_grad=True)
    labels = torch.zeros(1, T, dtype=torch.long, device="meta")
    live = _Live(m.d_model)
    _track(live, [head.weight, hidden, labels])
    with live:
        loss = lm_loss(head(hidden), labels) if chunk < 0 else head(hidden, labels)
        kept = sum(live.snap())
        loss.backward()
    return kept, live.peak


@dataclass(frozen=True)
class Trace:
    """Bytes (fp32) of one micro-batch row, as per-token slopes (and the transient's per-row constant)."""

    first: Tuple[float, float]  # per token: d_model wide, other
    blocks: List[Tuple[float, float]]  # per token, per block of the whole model
    last: Tuple[float, float]  # per token: the final mix and norm
    blocks_row: List[Tuple[float, float]]  # per row, per block: what a row keeps beside its tokens' share
    extra: float  # per token of the backward's transient (recompute, activation gradients)
    extra_row: float  # per row: the transient's constant part
    head_token: float  # the loss's bytes kept per token (the hidden states' gradient)
    head_row: float  # the loss's bytes kept per row, for the whole vocabulary (the head's fp32 weight grad)
    logit: float  # per logit (token x vocabulary entry) alive at once in a loss chunk
    plain_logit: float  # per logit of the plain loss (a pipeline's last stage, a vocabulary-parallel head)

    def logits_alive(self, m: ModelConfig, tokens: int, vocab_shards: int, plain: bool) -> float:
        """The loss's logits alive at its peak for `tokens` tokens (one chunk's, or all of them plain)."""
        from kimi.ops.linear_ce import chunk_tokens

        if plain or m.loss_chunk < 0:
            return self.plain_logit * tokens * m.vocab_size / vocab_shards
        chunk = m.loss_chunk or chunk_tokens(tokens, m.vocab_size, m.loss_chunk_mib << 20)
        return self.logit * min(chunk, tokens) * m.vocab_size


def _cut(m: ModelConfig) -> ModelConfig:
    """The first CUT blocks of m, the same block by block (its mixers' letters, its dense and MoE MLPs)."""
    from kimi.config import mixer_pattern

    if m.num_layers <= CUT:
        return m
    return dataclasses.replace(m, num_layers=CUT, layer_pattern=mixer_pattern(m)[:CUT], mla_layers=None,
                               mtp=dataclasses.replace(m.mtp, layers=0))


def _trace(m: ModelConfig, ac: str) -> Trace:
    from kimi.config import mixer_pattern
    from kimi.model.registry import mlp_kinds

    a, b = (_body(_cut(m), ac, T) for T in (T1, T2))

    def slope(x, y):
        return tuple((v - u) / (T2 - T1) for u, v in zip(x, y))

    def constant(x, y):
        return tuple(u - (v - u) / (T2 - T1) * T1 for u, v in zip(x, y))

    blocks = [slope(x, y) for x, y in zip(a.blocks, b.blocks)]
    rows = [constant(x, y) for x, y in zip(a.blocks, b.blocks)]
    if len(blocks) < m.num_layers:  # each later block as the last traced one of its kind
        kinds = list(zip(mixer_pattern(m), mlp_kinds(m)))
        last = {kind: i for i, kind in enumerate(kinds[:CUT])}
        blocks += [blocks[last.get(kind, CUT - 1)] for kind in kinds[CUT:]]
        rows += [rows[last.get(kind, CUT - 1)] for kind in kinds[CUT:]]
    extra = (b.extra - a.extra) / (T2 - T1)
    (k1, p1), (k2, p2) = (_head(m, T, SMALL_CHUNK) for T in (T1, T2))
    _, wide = _head(m, T1, 2 * SMALL_CHUNK)
    plain_kept, plain_peak = _head(m, T1, -1)
    head_token = (k2 - k1) / (T2 - T1)
    logit = (wide - p1) / (SMALL_CHUNK * m.vocab_size)
    plain = (plain_peak - (k1 - head_token * T1)) / (T1 * m.vocab_size)
    return Trace(slope(a.first, b.first), blocks, slope(a.last, b.last), rows, extra,
                 max(0.0, a.extra - extra * T1), head_token, k1 - head_token * T1, max(0.0, logit),
                 max(0.0, plain))


_CACHE: Dict[Tuple[str, str], Trace] = {}


def trace(m: ModelConfig, ac: str) -> Trace:
    """The activation trace of model shape `m` under activation checkpointing `ac` (cached per shape)."""
    key = (section_key(m), ac)
    if key not in _CACHE:
        _CACHE[key] = _trace(m, ac)
    return _CACHE[key]


def scale(x: float, compute_bytes: int) -> float:
    """fp32 bytes as a run computing in `compute_bytes`-byte floats would keep them (an estimate)."""
    return x * compute_bytes / 4
