"""What one training step wastes on a GPU, found on a CPU: fp32 matmuls, graph breaks, host syncs, activation
memory per token, and a roofline of every op for an H200 and an H100.

For each model family (FAMILIES; vocabulary 32768 as `1b`'s), one step as the trainer runs it with
`trainer.precision=bf16` (fp32 weights, bf16 autocast), the loss as the engines ask for it (model(ids,
labels=...)):

* dtype: every matmul-class op (mm, bmm, addmm, baddbmm, attention, convolution) and its floating input
  dtypes, by module. One that runs in fp32 is listed; ALLOWED_FP32 says which are fp32 on purpose (why).
* graphs: each sublayer compiled (as parallel.compile=true does) with a backend that counts dynamo's graphs
  and runs them as traced (graph breaks and recompiles are dynamo's, whatever the backend) over 3 steps:
  graph breaks with their reasons, graphs compiled after the first step (recompiles).
* host syncs: device-to-host reads (aten._local_scalar_dense, which .item(), float(), bool() and
  comparisons of tensors reach; nonzero-class ops whose output size depends on data; tolist) in the
  forward and backward and in the optimizer update (MuonClip, QK-Clip, the MoE bias update). The trainer's
  own per-step reads (the loss and gradient norm, for the non-finite check and the log) are outside.
* memory: peak activation and temporary bytes (the CPU allocator's live bytes after every op; parameters
  and gradients excluded) at two sequence lengths; the slope is bytes per token, at activation
  checkpointing none, selective, full.
* roofline: the same step traced on the meta device at the GPU shape (bf16 weights, no compute), each
  op's FLOPs (torch's flop counter) and bytes (inputs read and outputs written once, as unfused kernels do);
  its time on each GPU is max(FLOPs / peak, bytes / bandwidth) with datasheet peaks (dense bf16 tensor
  cores for bf16 matmuls, fp32 non-tensor peak for fp32 ones); the predicted MFU ceiling is the model's
  FLOPs (kimi.summary's count) over the peak, divided by the summed predicted time; the ten memory-bound
  op kinds that cost most are the fusion candidates.
* compiled (not in the default --parts): the roofline of the step as parallel.compile=true runs it, its
  compiled regions' elementwise work replaced by the kernels Inductor generates (bench/compiled_roofline.py).
* host (not in the default --parts): the host side of one micro-batch, eager and compiled, next to the
  roofline's GPU time (bench/host_audit.py says how each is measured and why its proxy is fair).

    python bench/step_audit.py [--families tiny,small] [--quick] [--baseline] [--parts ...,compiled,host]

Writes bench/results/step_audit.json (--baseline: its `baseline` entry, the figures of the tree before a
change, kept beside the current ones) and prints the tables. --quick: tiny only, short sequences.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import inspect
import json
import sys
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VOCAB = ["model.vocab_size=32768"]
FAMILIES = {
    "tiny": ["model=tiny", *VOCAB],
    "small": ["model=small", *VOCAB],
    "1b": ["model=1b", *VOCAB],
    "moe": ["model=moe_tiny", *VOCAB],
    "attnres_full": ["model=tiny", "model.residual=attnres_full", *VOCAB],
    "standard": ["model=tiny", "model.residual=standard", *VOCAB],
}
# (tokens per row at the two memory points, tokens per row of the roofline)
SHAPES = {"tiny": (256, 512, 4096), "small": (256, 512, 4096), "1b": (128, 256, 4096),
          "moe": (256, 512, 4096),
          "attnres_full": (256, 512, 4096), "standard": (256, 512, 4096)}
QUICK = (64, 128, 1024)
# Memory runs in bf16 autocast as the trainer does; --memory-precision fp32 measures fp32 activations instead,
# an upper bound of bf16's that runs at MKL's speed where the CPU has no bf16 matmul (torch's fallback loops
# then make a bf16 run of `small` take many minutes)
PRECISION = "bf16"

aten = torch.ops.aten
MATMULS = {"mm", "bmm", "_grouped_mm", "addmm", "baddbmm", "convolution", "convolution_backward",
           "_convolution",
           "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
           "_scaled_dot_product_flash_attention_for_cpu_backward",
           "_scaled_dot_product_flash_attention_backward",
           "_scaled_dot_product_efficient_attention_backward", "_flash_attention_forward",
           "_flash_attention_backward", "_efficient_attention_forward", "_efficient_attention_backward"}
SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
         "unique_consecutive",
         "equal", "is_nonzero", "repeat_interleave", "bincount", "histc"}
# fp32 on purpose: (fragment of where it runs, op) -> why
ALLOWED_FP32 = {
    ("LinalgSolveTriangular", "bmm"): "KDA's PyTorch path (the CPU one) solves each chunk's unit-triangular "
    "system in fp32: torch has no bf16 triangular solve; on a GPU the Triton kernels run instead",
}
# host reads on purpose: (fragment of where it runs, op) -> why
ALLOWED_SYNCS = {
    ("_adamw_block", "_local_scalar_dense"):
        "AdamW's step count, a CPU tensor as torch.optim.AdamW keeps it: "
    "reading it does not wait for the GPU",
    ("update_expert_bias", "tolist"): "the MoE balance statistics, one read for all layers per step (the "
    "trainer logs them with the loss, which it reads every step for the non-finite check)",
    ("expert_parallel.py", "tolist"): "expert parallelism's all-to-all takes its split sizes as host lists: "
    "one read per MoE layer",
}
GPUS = {  # dense peaks from the vendor datasheets (SXM parts)
    "H200": {"bf16": 989e12, "fp32": 67e12, "bandwidth": 4.8e12},
    "H100": {"bf16": 989e12, "fp32": 67e12, "bandwidth": 3.35e12},
}


def compose(overrides: list[str]):
    from kimi.summary import compose_config

    return compose_config(overrides)


def build(cfg, device="cpu", dtype=None):
    from kimi.model import KimiModel

    torch.manual_seed(0)
    with torch.device(device):
        model = KimiModel(cfg.model)
    return model if dtype is None else model.to(dtype)


def loss_of(model, ids, labels):
    """The training loss as the engines ask for it (the plain way on a tree whose model takes no labels)."""
    from kimi.model import lm_loss

    if "labels" in inspect.signature(model.forward).parameters:
        return model(ids, labels=labels)
    return lm_loss(model(ids), labels)


def batch(vocab: int, T: int, device="cpu"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, T + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def _module_name(tracker) -> str:
    names = [p for p in tracker.parents if p != "Global"]
    return max(names, key=len) if names else "Global"


# ---- dtype and host-sync audit ------------------------------------------------------------------------
class OpAudit(TorchDispatchMode):
    """Records matmul-class ops with their input dtypes, and device-to-host reads, by module."""

    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker
        self.matmuls: Counter = Counter()
        self.syncs: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in MATMULS:
            # the two operands' dtype (attention's backward also takes an fp32 logsumexp: not an operand)
            operands = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()][:2]
            dtypes = sorted({str(a.dtype).replace("torch.", "") for a in operands})
            self.matmuls[(where(self.tracker), name, ",".join(dtypes))] += 1
        if name in SYNCS:
            self.syncs[(where(self.tracker), name)] += 1
        return func(*args, **(kwargs or {}))


def where(tracker) -> str:
    """The innermost line of the project's code that called the op (forward, optimizer), else the module
    the backward is in."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/kimi/" in path and "/site-packages/" not in path:
            return f"{path.split('/kimi/', 1)[1]}:{frame.lineno} {frame.name}"
    node = torch._C._current_autograd_node()
    return (f"backward of {_module_name(tracker).removeprefix('KimiModel.')}"
            + (f" ({node.name()})" if node is not None else ""))


@contextlib.contextmanager
def counting_tolist(counter: Counter, tracker):
    original = torch.Tensor.tolist

    def tolist(self):
        counter[(where(tracker), "tolist")] += 1
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = original


@contextlib.contextmanager
def kernel_inputs(seen: Counter):
    """Record the dtypes the KDA and attention kernels are called with (on a GPU, Triton kernels that run in
    the dtype they are given: fp32 q, k, v there mean the slow fp32 kernels)."""
    import kimi.model.kda as kda_layer
    import kimi.model.maxlogits as attention_call  # where MLA and softmax attention call attention()

    def recording(module, name, args):
        original = getattr(module, name)

        def call(*a, **kw):
            dtypes = [str(x.dtype).replace("torch.", "") for x in a[:len(args)]]
            seen[(name, ", ".join(f"{n} {d}" for n, d in zip(args, dtypes)))] += 1
            return original(*a, **kw)

        return original, call

    patches = [(kda_layer, "chunk_kda", ("q", "k", "v", "g", "beta")),
               (attention_call, "attention", ("q", "k", "v"))]
    saved = []
    for module, name, args in patches:
        original, call = recording(module, name, args)
        saved.append((module, name, original))
        setattr(module, name, call)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def audit_ops(overrides: list[str], T: int) -> dict:
    """One bf16-autocast training step of the family: matmul dtypes and host syncs."""
    from torch.utils.module_tracker import ModuleTracker

    from kimi.model.moe import update_expert_bias
    from kimi.optim import build_optimizer, build_qk_clip

    cfg = compose([*overrides, "optim=muonclip"])
    model = build(cfg)
    optimizer = build_optimizer(model, cfg.optim)
    qk_clip = build_qk_clip(model, cfg.optim)
    ids, labels = batch(cfg.model.vocab_size, T)
    tracker = ModuleTracker()
    fwd_bwd, update = OpAudit(tracker), OpAudit(tracker)
    kernels: Counter = Counter()
    with tracker, fwd_bwd, counting_tolist(fwd_bwd.syncs, tracker), kernel_inputs(kernels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, ids, labels)
        loss.backward()
    with update, counting_tolist(update.syncs, tracker):
        optimizer.step()
        if qk_clip is not None:
            qk_clip()
        if cfg.model.moe.num_experts:
            update_expert_bias(model, cfg.model.moe.bias_rate)
    rows = [{"module": m, "op": op, "dtypes": d, "calls": n}
            for (m, op, d), n in sorted(fwd_bwd.matmuls.items())]
    fp32 = []
    for r in rows:
        if "float32" not in r["dtypes"]:
            continue
        fp32.append({**r, "allowed": _allowed(ALLOWED_FP32, r["module"], r["op"])})
    syncs = {part: [{"module": m, "op": op, "calls": n, "allowed": _allowed(ALLOWED_SYNCS, m, op)}
                    for (m, op), n in sorted(audit.syncs.items())]
             for part, audit in (("forward_backward", fwd_bwd), ("update", update))}
    kernel_rows = [{"kernel": k, "inputs": d, "calls": n} for (k, d), n in sorted(kernels.items())]
    slow = [r for r in kernel_rows if any(f"{x} float32" in r["inputs"] for x in ("q", "k", "v"))]
    return {"matmuls": rows, "fp32": fp32, "unexplained_fp32": sum(1 for r in fp32 if r["allowed"] is None),
            "kernels": kernel_rows, "fp32_kernel_calls": len(slow), "syncs": syncs,
            "unexplained_syncs": sum(r["calls"] for rows in syncs.values() for r in rows
                                     if r["allowed"] is None)}


def _allowed(table: dict, where: str, op: str) -> str | None:
    return next((why for (fragment, o), why in table.items() if fragment in where and o == op), None)


# ---- graphs --------------------------------------------------------------------------------------------
def audit_graphs(overrides: list[str], T: int, steps: int = 3) -> dict:
    """Graph breaks and recompiles of the sublayers compiled as parallel.compile=true does, over `steps`."""
    import torch._dynamo

    from kimi.parallel.activation_checkpointing import sublayers

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = []

    def backend(gm, example_inputs):  # dynamo's graphs, run as traced (AOT autograd is not dynamo's business)
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    cfg = compose(overrides)
    model = build(cfg)
    for module in sublayers(model):
        module.compile(backend=backend)
    per_step = []
    for step in range(steps):
        ids, labels = batch(cfg.model.vocab_size, T)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(model, ids, labels)
        loss.backward()
        model.zero_grad(set_to_none=True)
        per_step.append(len(compiled))
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return {"graphs_first_step": per_step[0], "graphs_after_first_step": per_step[-1] - per_step[0],
            "graph_breaks": sum(breaks.values()), "break_reasons": breaks}


# ---- memory --------------------------------------------------------------------------------------------
class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]


def _malloc_in_use():
    """Bytes glibc's malloc has handed out and not taken back (heap plus mmapped blocks): the CPU allocator's
    live bytes, read in microseconds; None where glibc is not the C library."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


class _Peak(TorchDispatchMode):
    """The highest live byte count seen after any op."""

    def __init__(self, in_use):
        super().__init__()
        self.in_use, self.top = in_use, in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.top = max(self.top, self.in_use())
        return out


def peak_activation_bytes(overrides: list[str], T: int, ac: str) -> int:
    """Peak bytes a forward and backward of T tokens adds to what the model holds (parameters, and gradients
    here dropped as soon as accumulated: kimi.summary counts those): the allocator's live bytes sampled after
    every op (within 6% of torch's MemTracker on `tiny`, at 1/25 of its time), or MemTracker's ACT + TEMP peak
    where glibc is not the C library."""
    from kimi.config import ModelConfig
    from kimi.parallel import apply_activation_checkpointing

    # chunks of 16 tokens: the lengths measured here are many chunks, as real ones are (there a chunk's logits
    # are a constant, model.loss_chunk_mib of them in fp32: kimi.ops.linear_ce.chunk_tokens)
    chunked = ["model.loss_chunk=16"] if hasattr(ModelConfig, "loss_chunk") else []  # (not on older trees)
    cfg = compose([*overrides, *chunked])
    model = build(cfg)
    apply_activation_checkpointing(model, ac)
    ids, labels = batch(cfg.model.vocab_size, T)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=PRECISION == "bf16"):
            loss = loss_of(model, ids, labels)
        loss.backward()

    in_use = _malloc_in_use()
    if in_use is not None:
        gc.collect()
        base = in_use()
        with _Peak(in_use) as peak:
            step()
        return peak.top - base
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    kinds = {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items()}
    return kinds.get("ACT", 0) + kinds.get("TEMP", 0)


def audit_memory(overrides: list[str], t1: int, t2: int, modes=("none", "selective", "full")) -> dict:
    out = {}
    for ac in modes:
        a, b = peak_activation_bytes(overrides, t1, ac), peak_activation_bytes(overrides, t2, ac)
        out[ac] = {"T": [t1, t2], "peak": [a, b], "bytes_per_token": (b - a) / (t2 - t1)}
    return out


# ---- roofline ------------------------------------------------------------------------------------------
class OpCost(TorchDispatchMode):
    """FLOPs and bytes of every op, by op kind and dtype class."""

    def __init__(self, tracker, inside=None):
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry, self.tracker = flop_registry, tracker
        # inside(): whether the op runs in a compiled region (bench/compiled_roofline.py's Regions)
        self.inside = inside or (lambda: False)
        # (op, module kind, dtype, in a compiled region) -> calls, flops, bytes
        self.ops: dict = defaultdict(lambda: [0, 0.0, 0.0])
        # the same for the forward alone: ModuleTracker names the module of a forward op reliably, but a
        # backward op only by whichever module's backward hook fired last
        self.forward_ops: dict = defaultdict(lambda: [0, 0.0, 0.0])
        self.in_forward = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet.__name__ in ("detach", "view", "_unsafe_view", "t", "transpose", "permute", "expand",
                               "unsqueeze", "squeeze", "slice", "select", "as_strided", "alias", "split",
                               "split_with_sizes", "unbind", "reshape", "empty", "empty_like", "zeros",
                               "new_empty", "new_empty_strided", "empty_strided", "lift_fresh"):
            return out
        # torch's formulas and ours (kimi/ops/flops.py: the Triton KDA and attention ops, the grouped GEMM)
        flops = self.registry[packet](*args, **kwargs, out_val=out) if packet in self.registry else 0
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                   if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        dtypes = {t.dtype for t in tensors if t.is_floating_point()}
        dtype = "fp32" if torch.float32 in dtypes and packet.__name__ in MATMULS else "bf16"
        name = packet.__name__ if func.namespace == "aten" else f"{func.namespace}::{packet.__name__}"
        key = (name, _kind_of(_module_name(self.tracker)), dtype, self.inside())
        for table in (self.ops, self.forward_ops) if self.in_forward else (self.ops,):
            entry = table[key]
            entry[0] += 1
            entry[1] += flops
            entry[2] += nbytes
        return out


def _kind_of(module: str) -> str:
    """A module name without block indices: blocks.3.mixer.q_proj -> mixer.q_proj."""
    parts = [p for p in module.split(".") if not p.isdigit() and p not in ("blocks", "KimiModel", "Global")]
    return ".".join(parts[-2:]) or "model"


def trace_step(overrides: list[str], T: int, regions=None):
    """(OpCost of one forward and backward at T tokens on the meta device with bf16 weights, the model's
    FLOPs), dispatched as on CUDA (host_audit.as_on_cuda); KDA and attention as the GPU runs them: the Triton
    custom ops (their fake kernels trace on meta), one op each way;
    the MoE experts as a Hopper GPU runs them in bf16: grouped GEMMs, whose sizes need no host read of the
    counts (the per-expert loop, meta's default, would read them). regions: a compiled_roofline.Regions,
    applied to the model so that each op says whether parallel.compile would run it in a compiled region."""
    from unittest import mock

    from host_audit import as_on_cuda  # bench/, beside this script
    from torch.utils.module_tracker import ModuleTracker

    # attention as our Triton op (bf16, its FLOPs registered): on meta, SDPA would trace its math fallback,
    # fp32 batched matmuls a GPU never runs (24.6 of 1b's 152.9 ms before this)
    cfg = compose([*overrides, "model.kda.backend=triton", "model.attention.backend=triton"])
    model = build(cfg, device="meta", dtype=torch.bfloat16)
    if regions is not None:
        regions.apply(model)
    ids, labels = (x.to("meta") for x in batch(cfg.model.vocab_size, T))
    tracker = ModuleTracker()
    cost = OpCost(tracker, regions.inside if regions is not None else None)
    with as_on_cuda(), tracker, cost, mock.patch("kimi.model.moe.grouped_mm_ok", lambda rows: True):
        loss = loss_of(model, ids, labels)
        cost.in_forward = False
        loss.backward()
    return cost, model.flops_per_token(T) * T


def priced(ops: dict, peak: dict) -> list[dict]:
    """Each op kind's predicted time on a GPU (peak: GPUS' entry): max(FLOPs / peak, bytes / bandwidth)."""
    rows = []
    for (op, kind, dtype, region), (calls, flops, nbytes) in ops.items():
        compute = flops / peak["bf16" if dtype == "bf16" else "fp32"]
        memory = nbytes / peak["bandwidth"]
        rows.append({"op": op, "module": kind, "dtype": dtype, "region": region, "calls": calls,
                     "flops": flops,
                     "bytes": nbytes, "time_s": max(compute, memory),
                     "bound": "memory" if memory > compute else "compute"})
    return sorted(rows, key=lambda r: -r["time_s"])


def audit_roofline(overrides: list[str], T: int) -> dict:
    """The unfused roofline of one step at T tokens (trace_step), on each GPU."""
    cost, model_flops = trace_step(overrides, T)
    gpus = {}
    for gpu, peak in GPUS.items():
        rows = priced(cost.ops, peak)
        total = sum(r["time_s"] for r in rows)
        by_class, by_module = defaultdict(float), defaultdict(lambda: [0.0, 0.0])
        for r in rows:
            by_class["matmul" if r["op"] in MATMULS else "kda" if "kda_chunk" in r["op"] else
                     "other"] += r["time_s"]
        for r in priced(cost.forward_ops, peak):
            by_module[r["module"]][r["bound"] == "memory"] += r["time_s"]
        modules = sorted(by_module.items(), key=lambda kv: -sum(kv[1]))[:12]
        gpus[gpu] = {"predicted_step_s": total, "mfu_ceiling": model_flops / peak["bf16"] / total,
                     "time_by_class": dict(by_class),
                     # the forward's, by module kind (`model`: between the sublayers, i.e. the depth
                     # mixes): seconds of compute- and of memory-bound ops
                     "forward_time_by_module": [{"module": m, "compute_s": c, "memory_s": b}
                                                for m, (c, b) in modules],
                     "memory_bound_top10": [r for r in rows if r["bound"] == "memory"][:10]}
    return {"T": T, "model_flops": model_flops, "traced_flops": sum(v[1] for v in cost.ops.values()),
            "traced_bytes": sum(v[2] for v in cost.ops.values()), "gpus": gpus}


def audit_compiled(overrides: list[str], T: int, lengths: tuple[int, int]) -> dict:
    """The compiled roofline at T tokens (bench/compiled_roofline.py): the meta trace with its compiled
    regions marked, and Inductor's kernels counted at two short lengths on this CPU."""
    import compiled_roofline as cr  # bench/, beside this script

    overrides = [*overrides, *cr.OVERRIDES]
    regions = cr.Regions()
    cost, model_flops = trace_step(overrides, T, regions)
    cfg = compose([*overrides, "model.attention.backend=triton"])  # our op, a null kernel on the CPU run
    counts = [cr.inductor_kernels(cfg, t, build, batch, loss_of) for t in lengths]
    fused, sums = cr.at(T, *counts), cr.at(T, *counts, key="accumulation_bytes")
    gpus = cr.price({gpu: priced(cost.ops, peak) for gpu, peak in GPUS.items()}, fused, model_flops, GPUS,
                    MATMULS, sums)
    return {"T": T, "model_flops": model_flops, "inductor": counts, "inductor_bytes": fused,
            "accumulation_bytes": sums, "accumulations": counts[-1]["accumulations"],
            "kernels_per_step": counts[-1]["kernels"], "region_calls": len(regions.spans), "gpus": gpus}


# ---- driver --------------------------------------------------------------------------------------------
def audit(name: str, quick: bool, parts: set[str], modes=("none", "selective", "full")) -> dict:
    overrides = FAMILIES[name]
    t1, t2, t_roof = QUICK if quick else SHAPES[name]
    row: dict = {"overrides": overrides}
    start = time.perf_counter()
    runs = {"ops": lambda: audit_ops(overrides, t1), "graphs": lambda: audit_graphs(overrides, min(t1, 128)),
            "memory": lambda: {**audit_memory(overrides, t1, t2, modes), "precision": PRECISION},
            "roofline": lambda: audit_roofline(overrides, t_roof),
            "compiled": lambda: audit_compiled(overrides, t_roof, (t1, t2)),
            "host": lambda: audit_host(name, overrides, t_roof, row)}
    for part in (p for p in runs if p in parts):
        try:
            row[part] = runs[part]()
        # one part that cannot run here (e.g. MoE's dispatch on the meta device) says why
        except Exception as e:
            row[f"{part}_error"] = f"{type(e).__name__}: {e}"[:300]
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def audit_host(name: str, overrides: list[str], T: int, row: dict) -> dict:
    from host_audit import audit_host  # bench/, beside this script

    return audit_host(name, overrides, T, compose, build, batch, loss_of, predicted_gpu_s(name, row))


def predicted_gpu_s(name: str, row: dict) -> dict:
    """{gpu: the roofline's predicted step seconds} for the host table: this run's roofline part, else the
    one already in bench/results/step_audit.json (empty when neither has one)."""
    roof = row.get("roofline")
    if roof is None:
        saved = HERE / "results" / "step_audit.json"
        if saved.exists():
            roof = json.loads(saved.read_text()).get("families", {}).get(name, {}).get("roofline")
    return {gpu: x["predicted_step_s"] for gpu, x in roof["gpus"].items()} if roof else {}


def gpu_step_s(row: dict, host: dict, gpu: str = "H200") -> float | None:
    """The GPU time a micro-batch's host side is compared with: the compiled roofline (the host side measured
    is the compiled step's) where this family has one, else the unfused roofline, else the host part's own."""
    if "compiled" in row:
        return row["compiled"]["gpus"][gpu]["compiled_step_s"]
    if "roofline" in row:
        return row["roofline"]["gpus"][gpu]["predicted_step_s"]
    return host.get("gpu_s", {}).get(gpu)


def host_report(results: dict) -> list[str]:
    """The host table (--parts host): per family, eager on the meta device at full shape, the proxy eager
    and compiled, and the compiled host time with its launches against the roofline's GPU time."""
    rows = [(name, r["host"]) for name, r in results["families"].items() if "host" in r]
    if not rows:
        return []
    lines = ["", "Host side of one micro-batch (one row of T tokens; bench/host_audit.py):", "",
             "| family | T | eager ops (meta, full shape) | eager launches | eager host ms (meta) | proxy "
             "eager ms | proxy compiled ms | compiled launches (ops + inductor kernels) | compiled regions | "
             "compiled host ms + launches | H200 roofline ms (compiled, else unfused) | host / roofline | "
             "eager ops / compiled | cuda_graphs=regions: host ms, predicted (/ roofline) | "
             "cuda_graphs=step: host ms, predicted (/ roofline) |", "|" + "---|" * 15]
    for name, h in rows:
        e, pe, pc = h["eager_meta"], h["proxy"]["eager"], h["proxy"]["compiled"]
        gpu = gpu_step_s(results["families"][name], h)
        lines.append(f"| {name} | {h['T']} | {e['ops']:,} | {e['launches']:,} | {e['host_ms']:,.0f} | "
                     f"{pe['host_ms']:,.1f} | {pc['host_ms']:,.1f} | {pc['launches']:,} "
                     f"({pc['dispatched']:,} + {pc['inductor_kernels']:,}) | {pc['compiled_regions']} | "
                     f"{h['compiled_host_ms_gpu']:,.0f} | "
                     + (f"{1e3 * gpu:,.0f} | {h['compiled_host_ms_gpu'] / (1e3 * gpu):.0%}"
                        if gpu else "- | -")
                     + f" | {h['ops_eager_over_compiled']:.1f}x | "
                     + " | ".join(f"{h[k]:,.1f}" + (f" ({h[k] / (1e3 * gpu):.0%})" if gpu else "")
                                  for k in ("regions_host_ms_gpu", "step_graph_host_ms_gpu")) + " |")
    return lines


def report(results: dict) -> str:
    lines = ["| family | unexplained fp32 matmuls | host syncs (fwd+bwd / update) | graph breaks | "
             "recompiles | "
             "KiB/token AC none / selective / full | H200 MFU ceiling | H100 MFU ceiling |", "|" + "---|" * 8]
    for name, r in results["families"].items():
        ops, g, m, roof = r.get("ops"), r.get("graphs"), r.get("memory"), r.get("roofline")
        syncs = (f"{sum(s['calls'] for s in ops['syncs']['forward_backward'])} / "
                 f"{sum(s['calls'] for s in ops['syncs']['update'])}") if ops else "-"
        mem = " / ".join(f"{m[ac]['bytes_per_token'] / 1024:,.0f}" if ac in m else "-"
                         for ac in ("none", "selective", "full")) if m else "-"
        ceil = [f"{roof['gpus'][gpu]['mfu_ceiling']:.0%}" if roof else "-" for gpu in GPUS]
        lines.append(f"| {name} | {ops['unexplained_fp32'] if ops else '-'} | {syncs} | "
                     f"{g['graph_breaks'] if g else '-'} | "
                     f"{g['graphs_after_first_step'] if g else '-'} | {mem} | "
                     f"{ceil[0]} | {ceil[1]} |")
    base = results.get("baseline", {}).get("families", {})
    if base:
        tree = results["baseline"].get("tree", "?")
        lines += ["", f"Activation bytes per token against the baseline ({tree}):", "",
                  "| family | AC | baseline KiB/token | now KiB/token | now / baseline |",
                  "|---|---|---|---|---|"]
        for name, r in results["families"].items():
            b = base.get(name, {}).get("memory")
            if not b or "memory" not in r:
                continue
            for ac in (a for a in ("none", "selective", "full") if a in b and a in r["memory"]):
                x, y = b[ac]["bytes_per_token"], r["memory"][ac]["bytes_per_token"]
                lines.append(f"| {name} | {ac} | {x / 1024:,.0f} | {y / 1024:,.0f} | {y / x:.3f} |")
    for name, r in results["families"].items():
        roof = r.get("roofline")
        if not roof:
            continue
        lines += ["", f"{name}: top memory-bound op kinds on an H200 (T={roof['T']}, predicted time, "
                  "unfused):", "",
                  "| op | module | calls | GB | predicted ms |", "|---|---|---|---|---|"]
        for x in roof["gpus"]["H200"]["memory_bound_top10"]:
            lines.append(f"| {x['op']} | {x['module']} | {x['calls']} | {x['bytes'] / 1e9:.2f} | "
                         f"{x['time_s'] * 1e3:.3f} |")
        by_module = roof["gpus"]["H200"].get("forward_time_by_module", [])
        lines += ["", f"{name}: the forward's predicted H200 time by module kind (ms, unfused):", "",
                  "| module | compute-bound ops | memory-bound ops | share of the forward |",
                  "|---|---|---|---|"]
        forward = sum(x["compute_s"] + x["memory_s"] for x in by_module) or 1.0
        for x in by_module:
            lines.append(f"| {x['module']} | {x['compute_s'] * 1e3:.1f} | {x['memory_s'] * 1e3:.1f} | "
                         f"{(x['compute_s'] + x['memory_s']) / forward:.0%} |")
    import compiled_roofline

    return "\n".join(lines + host_report(results) + compiled_roofline.report(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--parts", default="ops,graphs,memory,roofline",
                    help="any of ops, graphs, memory, roofline, compiled (the roofline as parallel.compile "
                         "runs the step: minutes per family) and host (the host side of a micro-batch: "
                         "minutes per family, most of it compiling the proxy)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ac", default="none,selective,full", help="activation checkpointing modes to measure")
    ap.add_argument("--memory-precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--baseline", action="store_true", help="store the results as the baseline entry")
    ap.add_argument("--out", default=str(HERE / "results" / "step_audit.json"))
    ap.add_argument("--report", action="store_true", help="reprint the tables of --out")
    args = ap.parse_args()
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else {}
    global PRECISION
    PRECISION = args.memory_precision
    if args.report:
        print(report(old))
        return
    families = {}
    for name in args.families.split(","):
        print(f"[step_audit] {name} ...", flush=True)
        families[name] = audit(name, args.quick, set(args.parts.split(",")), tuple(args.ac.split(",")))
        print(f"[step_audit] {name}: {families[name]['seconds']} s", flush=True)
    run = {"torch": torch.__version__, "quick": args.quick, "families": families}
    if args.baseline:
        results = {**{k: v for k, v in old.items() if k != "baseline"}, "baseline": {**run, "tree": _tree()}}
    else:
        results = {**run, "tree": _tree(), **({"baseline": old["baseline"]} if "baseline" in old else {})}
        merged = dict(old.get("families", {}))  # a family's parts measured now replace those measured before
        measured = set(args.parts.split(","))  # and their earlier errors
        for name, parts in families.items():
            kept = {k: v for k, v in merged.get(name, {}).items() if k.removesuffix("_error") not in measured}
            merged[name] = {**kept, **parts}
        results["families"] = merged
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(report(results))


def _tree() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
