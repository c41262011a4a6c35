"""What autograd keeps per token, traced from a model's shapes on the meta device (no memory, no FLOPs).

The model is built on the meta device and one row of T tokens runs forward and backward under a dispatch
mode that follows every storage an op creates until it is freed: the bytes alive, and the most ever alive.
That is the model's own code deciding what autograd keeps (each sublayer's saved tensors, the AttnRes
mixes' stacks, what activation checkpointing keeps and recomputes, the chunked loss's buffers), so nothing
is fitted to measurements: run at two lengths it gives bytes per token and per row. The backward's
transient beyond what the forward kept is taken at its two moments: an activation gradient or recompute
(per token, from peaks that leave the weights' gradients out) and a weight's gradient made (the short row's
whole transient). Bytes are attributed per block (what is still alive at the next block's start: kept
until the backward) and split by shape: tensors as wide as d_model (the residual stream between sublayers,
which tensor parallelism keeps whole unless sequence parallelism splits it) and the rest (inside the
sublayers: split by tp).

A trace follows the run's compute dtype and device (`Mode`). An fp32 run on the CPU is traced on the meta
device. Any other runs on fake CPU tensors (FakeTensorMode: shapes and dtypes, no memory): a bf16 or fp16
run under CPU autocast, so what stays fp32 (the gates, norms' sums, the loss) is kept as fp32 op by op, and
autocast's copies of the weights in the compute dtype are a third class, kept once per micro-batch whatever
its rows and tokens; a GPU run with the kernels a GPU takes where they keep other tensors than the CPU's
paths (model.kda.backend=auto: the Triton KDA ops, which save their inputs; model.attnres.backend=auto: the
fused mix, which saves per-token statistics; model.attention.backend=auto: the Triton flash attention, which
keeps what SDPA's GPU kernels keep, where the CPU's SDPA keeps a T x T matrix when the query's and value's
head sizes differ), through those ops' fake implementations (plus what their launchers allocate inside the
call beside the outputs, kimi.ops.SCRATCH: the Triton KDA chunk ops' intermediates), and its forward
under CUDA autocast's casting rules (kimi.plan.cuda_autocast: CPU autocast made to cast as CUDA's does, which
keeps exp, softmax, rms_norm and their like in fp32). The routed experts' grouped GEMM runs through a
stand-in that saves what torch's kernel saves (its two inputs): torch._grouped_mm takes only bf16 on the
meta device, and the per-expert loop needs the routing's counts on the host. Its gradients are dropped as
they arrive: kimi.summary counts gradients. A compiled step (`Mode.compiled`, parallel.compile on the CPU)
runs each sublayer and depth mix as inductor's partitioner cuts it (kimi.plan.compiled), selective
checkpointing inside each sublayer's region as apply_compile puts it there, its graphs traced in a first
step that is not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Dict, List, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kimi.config import ModelConfig
from kimi.ops import SCRATCH
from kimi.plan import disk_cache
from kimi.plan.compiled import compile_regions, fused_away
from kimi.plan.shapes import section_key

T1, T2 = 64, 128  # the two lengths traced: a KDA chunk and two, short enough to trace a 93-block model fast
SMALL_CHUNK = 8  # tokens per loss chunk in the traces that separate the loss's logits from the rest


class _Live(TorchDispatchMode):
    """Bytes alive per class (0: d_model wide, 1: the rest, 2: copies of the weights, autocast's) among
    storages created under it, and the most alive at once. It also keeps the order in which classes 0 and
    1 were made and freed, so that `peak_without` can leave out storages known only later to have been a
    weight's gradient (`mark`)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d, self.now, self.peak, self.seen, self.weights = d_model, [0, 0, 0], 0, set(), set()
        self.ids: Dict[int, int] = {}  # storage -> the id of its allocation, while alive
        self.events: List[Tuple[int, int]] = []  # (allocation id, bytes made or -freed), classes 0 and 1
        self.parent: Dict[int, int] = {}  # allocation id -> the allocation it was cast from
        self.marked: Set[int] = set()
        self.made = 0

    def _free(self, key: int, cls: int, n: int, uid: int) -> None:
        self.seen.discard(key)
        self.ids.pop(key, None)
        self.now[cls] -= n
        if cls < 2:
            self.events.append((uid, -n))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if fused_away():  # a compiled region's value that inductor's kernels never write
            return out
        copy = func is torch.ops.aten._to_copy.default
        source = args[0].untyped_storage()._cdata if copy else None
        cast = copy and source in self.weights
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self.seen:
                continue
            n, cls = st.nbytes(), 2 if cast else 0 if t.dim() and t.shape[-1] == self.d else 1
            self.made += 1
            uid = self.made
            self.seen.add(key)
            self.ids[key] = uid
            self.now[cls] += n
            if cls < 2:
                self.events.append((uid, n))
            if copy and source in self.ids:
                self.parent[uid] = self.ids[source]
            weakref.finalize(st, self._free, key, cls, n, uid)
        # what the op's launcher allocates beside its outputs and frees inside the call (a fake op makes only
        # the outputs): alive at once with everything alive now
        scratch = SCRATCH[func](*args, **(kwargs or {})) if func in SCRATCH else 0
        if scratch:
            self.made += 1
            self.events += [(self.made, scratch), (self.made, -scratch)]
        # the weight copies stay out of the peak: a recompute's are sized by the unsharded model here, and a
        # layout that gathers its weights in bf16 makes none (the kept ones are counted apart)
        self.peak = max(self.peak, self.now[0] + self.now[1] + scratch)
        return out

    def snap(self) -> Tuple[int, int, int]:
        return tuple(self.now)

    def mark(self, t: torch.Tensor) -> None:
        """Note that `t` (alive now) is a weight's gradient, and so is what it was cast from."""
        uid = self.ids.get(t.untyped_storage()._cdata)
        while uid is not None and uid not in self.marked:
            self.marked.add(uid)
            uid = self.parent.get(uid)

    def peak_without(self) -> int:
        """The most of classes 0 and 1 alive at once, the marked storages left out."""
        now = peak = 0
        for uid, n in self.events:
            if uid not in self.marked:
                now += n
                peak = max(peak, now)
        return peak


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


class _GroupedMMGraph(torch.autograd.Function):
    """The same for a compiled region's partitioner (kimi.plan.compiled), which reads what the backward
    uses from the graph: matmuls of the right shapes (one expert's weight; nothing is computed on these
    tensors) whose backward needs both inputs, as torch's kernel's does. With empty tensors it would
    recompute the output for free and save neither input."""

    @staticmethod
    def forward(ctx, a, b, offs=None):
        ctx.save_for_backward(a, b)
        return a @ b[0]

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b[0].mT, (a.mT @ grad).expand_as(b).contiguous(), None


@contextlib.contextmanager
def _meta_experts(compiled: bool = False):
    import kimi.model.moe as moe

    saved = moe.grouped_mm_ok, torch._grouped_mm
    moe.grouped_mm_ok = lambda x: True
    stand_in = _GroupedMMGraph if compiled else _GroupedMM
    torch._grouped_mm = lambda a, b, offs=None, **kw: stand_in.apply(a, b, offs)
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


def _track(live: _Live, tensors, weights=()) -> None:
    """Storages created before tracing (parameters, inputs) are never counted, views of them neither; a copy
    of one of `weights` in another dtype is class 2."""
    live.seen |= {t.untyped_storage()._cdata for t in tensors}
    live.weights |= {t.untyped_storage()._cdata for t in weights}


@dataclass(frozen=True)
class Mode:
    """How a run computes, as far as what it keeps goes: the compute dtype's bytes (4: fp32; 2: bf16
    autocast) and whether it runs on a GPU (the kernels a GPU takes; module docstring)."""

    compute_bytes: int = 4
    gpu: bool = False
    compiled: bool = False  # parallel.compile: each region's graphs as inductor's partitioner cuts them
    # parallel.cp: the last of cp context-parallel ranks, the heaviest, with its exchanges answered locally
    # (kimi.parallel.context_parallel.LastRankOf): the traced tokens are its shard's
    cp: int = 1

    @property
    def on_meta(self) -> bool:
        return self.compute_bytes == 4 and not self.gpu


def _as_run(m: ModelConfig, mode: Mode) -> ModelConfig:
    """m with the backends a GPU's auto picks where they keep other tensors than the CPU paths."""
    if not mode.gpu:
        return m

    def triton(section):
        return dataclasses.replace(section, backend="triton") if section.backend == "auto" else section

    return dataclasses.replace(m, kda=triton(m.kda), attnres=triton(m.attnres), attention=triton(m.attention))


def _on_fake_cpu(module: torch.nn.Module, fake) -> None:
    """Replace a meta module's parameters and buffers by fake CPU tensors of the same shapes and dtypes."""
    with fake:
        for mod in module.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    mod._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                               requires_grad=p.requires_grad)
            for name, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype)


@contextlib.contextmanager
def _running(mode: Mode, module: torch.nn.Module):
    """Where `module` (built on the meta device) runs as `mode` says; yields the device of its inputs and
    the context its forward runs in (autocast; the backward runs outside it, as in training, so its copies
    of the weights outlive the forward only where autograd saved them)."""
    if mode.on_meta:
        yield "meta", contextlib.nullcontext
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kimi.plan.cuda_autocast import cuda_policy

    fake = FakeTensorMode()
    _on_fake_cpu(module, fake)
    dtype = {2: torch.bfloat16}.get(mode.compute_bytes)
    policy = cuda_policy() if mode.gpu and dtype is not None else contextlib.nullcontext()
    with fake, policy:
        yield "cpu", lambda: torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


Bytes = Tuple[int, int, int]  # d_model wide, other, weight copies (_Live's classes)


@dataclass(frozen=True)
class Run:
    """One traced forward and backward of one row of T tokens through the blocks (no loss)."""

    first: Bytes  # kept by the embedding and the stream's start
    blocks: List[Bytes]  # kept by each block until its backward
    last: Bytes  # kept by the final mix and norm
    extra: int  # the most alive at once beyond what the forward keeps (recompute, activation gradients)
    extra_act: int  # the same, the weights' gradients left out


def _body(m: ModelConfig, ac: str, T: int, mode: Mode) -> Run:
    from kimi.model import KimiModel
    from kimi.parallel.activation_checkpointing import apply_activation_checkpointing

    with torch.device("meta"):
        model = KimiModel(_as_run(m, mode))
    model.lm_head = _NoHead()
    if mode.cp > 1:
        from kimi.parallel.context_parallel import LastRankOf

        model.context_parallel = LastRankOf(mode.cp)
    live = _Live(m.d_model)
    marks: List[Bytes] = []
    with _running(mode, model) as (device, forward):
        ids = torch.zeros(1, T, dtype=torch.long, device=device)
        if mode.compiled:  # the regions' graphs traced in a first step, not counted (kimi.plan.compiled)
            compile_regions(model, selective=ac == "selective")
            with _meta_experts(compiled=True):
                with forward():
                    loss = model(ids, labels=ids)
                loss.backward()
            model.zero_grad(set_to_none=True)
        apply_activation_checkpointing(model, ac, compiled=mode.compiled)
        hooks = [b.register_forward_pre_hook(lambda *_: marks.append(live.snap()))
                 for b in model.blocks.values()]
        run = model.__dict__.get("_runners", {}).get("final")

        def final(function, *args):  # marks the final mix's start
            marks.append(live.snap())
            return run(function, *args) if run else function(*args)

        model.set_runner("final", final)

        def drop(p):  # as kimi.summary counts gradients apart: dropped as they arrive, marked first
            live.mark(p.grad)
            p.grad = None

        for p in model.parameters():
            p.register_hook(live.mark)  # before it is accumulated (a copy may follow)
            p.register_post_accumulate_grad_hook(drop)
        _track(live, [*model.parameters(), *model.buffers(), ids], model.parameters())
        with _meta_experts(mode.compiled), live:
            with forward():
                loss = model(ids, labels=ids)
                done = live.snap()
            end = live.snap()  # leaving autocast freed its copies of the weights that autograd did not save
            kept = end[0] + end[1]
            loss.backward()
    for h in hooks:
        h.remove()
    n = len(model.blocks)
    share = end[2] / done[2] if done[2] else 0.0  # of the copies made, those kept to the backward

    def diff(a, b):
        (u0, u1, u2), (v0, v1, v2) = a, b
        return v0 - u0, v1 - u1, (v2 - u2) * share

    return Run(diff((0, 0, 0), marks[0]), [diff(marks[i], marks[i + 1]) for i in range(n)],
               diff(marks[n], done), max(0, live.peak - kept), max(0, live.peak_without() - kept))


def _head(m: ModelConfig, T: int, chunk: int, mode: Mode, weight_grad: bool = True) -> Tuple[int, int]:
    """(bytes the loss keeps from its forward to its backward, the most alive at once beyond the hidden
    states) for T tokens, `chunk` tokens per loss chunk (-1: the plain loss on whole logits); weight_grad
    False: the head's weight takes no gradient."""
    from kimi.model.transformer import LMHead, lm_loss

    with torch.device("meta"):
        head = LMHead(m.d_model, m.vocab_size, chunk, m.loss_chunk_mib)
    head.weight.requires_grad_(weight_grad)
    live = _Live(m.d_model)
    with _running(mode, head) as (device, forward):
        hidden = torch.empty(1, T, m.d_model, device=device, requires_grad=True)
        labels = torch.zeros(1, T, dtype=torch.long, device=device)
        _track(live, [head.weight, hidden, labels], [head.weight])
        with live:
            with forward():
                loss = lm_loss(head(hidden), labels) if chunk < 0 else head(hidden, labels)
            kept = sum(live.snap()[:2])  # the head's weight copy apart, as the blocks' (the body's trace)
            loss.backward()
    return kept, live.peak


@dataclass(frozen=True)
class Trace:
    """Bytes of one micro-batch row as the traced Mode runs it, as per-token slopes (and the transient's
    per-row constant), and the weight copies a micro-batch keeps whatever its rows."""

    first: Tuple[float, float]  # per token: d_model wide, other
    blocks: List[Tuple[float, float]]  # per token, per block of the whole model
    last: Tuple[float, float]  # per token: the final mix and norm
    blocks_row: List[Tuple[float, float]]  # per row, per block: what a row keeps beside its tokens' share
    casts: List[float]  # per micro-batch, per block: autocast's copies of its weights (0 in fp32)
    casts_ends: Tuple[float, float]  # the same of the embedding and the stream's start, and of the end
    extra: float  # per token of the backward's transient (recompute, activation gradients)
    extra_row: float  # per micro-batch: the transient where a weight's gradient is made (see _trace)
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


def _trace(m: ModelConfig, ac: str, mode: Mode) -> Trace:
    from kimi.config import mixer_pattern
    from kimi.model.registry import mlp_kinds

    a, b = (_body(_cut(m), ac, T, mode) for T in (T1, T2))

    def slope(x, y):  # of the first two classes; the weight copies (class 2) do not grow with T
        return tuple((v - u) / (T2 - T1) for u, v in zip(x[:2], y[:2]))

    def constant(x, y):
        return tuple(u - (v - u) / (T2 - T1) * T1 for u, v in zip(x[:2], y[:2]))

    blocks = [slope(x, y) for x, y in zip(a.blocks, b.blocks)]
    rows = [constant(x, y) for x, y in zip(a.blocks, b.blocks)]
    casts = [float(x[2]) for x in a.blocks]
    if len(blocks) < m.num_layers:  # each later block as the last traced one of its kind
        kinds = list(zip(mixer_pattern(m), mlp_kinds(m)))
        last = {kind: i for i, kind in enumerate(kinds[:CUT])}
        for per_block in (blocks, rows, casts):
            per_block += [per_block[last.get(kind, CUT - 1)] for kind in kinds[CUT:]]
    # the transient's part that grows with the tokens, from the peaks without the weights' gradients: with
    # them, a short row peaks where a weight's gradient is made, late in the backward when most of what the
    # forward kept is freed, and the line through two such peaks falls
    extra = max(0.0, (b.extra_act - a.extra_act) / (T2 - T1))
    (k1, p1), (k2, _) = (_head(m, T, SMALL_CHUNK, mode) for T in (T1, T2))
    head_token = (k2 - k1) / (T2 - T1)
    head_row = k1 - head_token * T1
    # the logits: the peaks' growth with the chunk, and the plain loss's peak beyond what it keeps; off the
    # meta device sized without the weight's gradient, whose two copies in bf16 (bf16, then fp32) outweigh
    # these short traces' logits, so the peaks would not see them
    grad = mode.on_meta
    base, p8 = head_row, p1
    if not grad:
        kept, p8 = _head(m, T1, SMALL_CHUNK, mode, grad)
        base = kept - head_token * T1
    wide = _head(m, T1, 2 * SMALL_CHUNK, mode, grad)[1]
    plain_peak = _head(m, T1, -1, mode, grad)[1]
    logit = (wide - p8) / (SMALL_CHUNK * m.vocab_size)
    plain = (plain_peak - base) / (T1 * m.vocab_size)
    # the transient at the other moment, a weight's gradient made (the largest, before it is dropped), beside
    # what is still alive then: the short row's whole transient, which falls with the tokens; whole here (the
    # trace is unsharded) and in the dtypes autocast's backward makes of it; the layout shards it in ways
    # memory.py does not follow, so off the meta device it stays the fp32 trace's, scaled by the compute
    # dtype, as the plans have sized it (docs/planning.md says where it is off)
    extra_row = float(a.extra) if mode.on_meta else trace(m, ac).extra_row * mode.compute_bytes / 4
    return Trace(slope(a.first, b.first), blocks, slope(a.last, b.last), rows, casts,
                 (float(a.first[2]), float(a.last[2])), extra, extra_row, head_token, head_row,
                 max(0.0, logit), max(0.0, plain))


_CACHE: Dict[Tuple[str, str, Mode], Trace] = {}


def trace(m: ModelConfig, ac: str, mode: Mode = Mode()) -> Trace:
    """The activation trace of model shape `m` under activation checkpointing `ac`, run as `mode` says
    (cached per shape)."""
    key = (section_key(m), ac, mode)
    if key not in _CACHE:
        _CACHE[key] = disk_cache.cached("activations", repr(key), lambda: _trace(m, ac, mode),
                                        dataclasses.asdict, _trace_from)
    return _CACHE[key]


def _trace_from(fields: dict) -> Trace:
    """The Trace whose dataclasses.asdict (through JSON: tuples read back as lists) `fields` is."""
    fields = dict(fields)
    for name in ("first", "last", "casts_ends"):
        fields[name] = tuple(fields[name])
    for name in ("blocks", "blocks_row"):
        fields[name] = [tuple(x) for x in fields[name]]
    return Trace(**fields)
