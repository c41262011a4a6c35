"""Context parallelism's memory and traffic, measured on CPU, and a memory model for long sequences.

1. Peak activation memory per rank vs sequence length T for cp = 1, 2, 4 (the `tiny` and `small` presets,
   one row of T tokens, bf16, activation checkpointing `full`): each rank builds the model, runs
   the forward and backward of its shard, and torch's MemTracker records the peak of the activation and
   temporary bytes (parameters and gradients excluded: kimi.summary counts those) in each of the step's
   three phases (PHASES): up to the end of the loss's backward (the forward and the chunked loss), the
   blocks' backward (each block recomputed and differentiated), and the embedding's backward. The last rank
   is the heaviest (its MLA layers read the latents of every earlier shard).
2. Bytes one rank puts into collectives per layer, forward + backward, vs T: a one-block model of each
   mixer (KDA: the conv halo and the shard summaries, constant in T; MLA: the gathered latents, linear).
3. A memory model of the heaviest (last) rank's peak, the largest of the three phases' (`fit`, n = T / cp):
   the loss's, n * (a . features) + c - l * max(0, K - n); the blocks' backward's, n * (a . features + t +
   e) + (T - n) * b + c'; the embedding's, about constant. The features are 1, the sublayers and the
   Attention-Residual sources summed over the sublayers (what activation checkpointing keeps per token: each
   sublayer's input, each depth mix's sources); t is one block's recompute and backward per token, which
   does not grow with depth; e is what a rank that continues the sequence holds more per token (its KDA runs
   over V + K value columns, kimi/ops/kda/context.py; 0 at cp 1); b is MLA's prefix per token of the
   earlier shards (an estimate from the shapes); K is the loss's chunk (512 tokens at a 32k vocabulary,
   kimi/ops/linear_ce.py) and l what the loss holds per token of it: a rank with fewer than K tokens holds
   a shorter chunk. The coefficients are fitted per model from short measured runs of cut-down models (4, 6
   and 8 blocks at T 256 and 512, the 4-block one at 1024 too; cp 2 at T 512 and 1024) and checked against
   the full-depth measurements of (1), at lengths and cp the fit never saw. With kimi.summary's persistent
   state (fp32 weights, gradients and optimizer state, FSDP-sharded over the cp ranks, plus one gathered
   FSDP unit) it gives the longest trainable sequence per GPU for the `1b` and `kimi_linear_48b_a3b`
   presets at cp = 1..64 (one GPU per cp rank) on 80 GB and 141 GB devices, after a reserve for the CUDA
   context and allocator. Measured on the PyTorch paths (SDPA, the chunked KDA), whose backward keeps more
   per token than the GPU's kernels; `1b+triton` is `1b` with the GPU's Triton ops (KDA, attention, AttnRes),
   run interpreted with every kernel launch a no-op: what they allocate, not what they compute (their
   launchers' intermediates included, which MemTracker cannot see inside an op: LauncherScratch).
4. The same table by the planner (kimi.plan.memory_per_rank) with the kernels a GPU runs: what a GPU run
   is sized by. Its traces of the CPU paths are checked against (1) beside the fit.

    python bench/context.py [--quick]

Prints markdown tables and writes bench/results/context.json. Its bf16 matmuls run in fp32 (Fp32Matmuls,
the same bytes): on this project's 2-core machine a cut-down `1b` run takes 20-60 s, Kimi Linear's 1-6 min
(2026-12-06). --work keeps each finished measurement, so a rerun (or a run stopped and started again)
measures only what is missing. --report reprints the tables of a results file.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

from comm_count import CommCounter  # noqa: E402

MEASURED = {"tiny": ["model=tiny", "model.vocab_size=32768"],
            "small": ["model=small", "model.vocab_size=32768"]}
# cut-down models for the fit: which blocks are MLA (0-based), every other block KDA
CUTS = {"A": (4, [3]), "B": (8, [3, 7]), "C": (6, [3])}
PRESETS = {"1b": ["model=1b", "model.vocab_size=32768"],
           # 16 routed experts instead of 256: a token's activations depend on top_k and moe_hidden, not on
           # how many experts there are (the router's scores are 4 bytes per expert: added back below)
           "kimi_linear_48b_a3b": ["model=kimi_linear_48b_a3b", "model.moe.num_experts=16"]}
# the kernels a GPU runs, measured for their allocations: the Triton ops run interpreted with every kernel
# launch a no-op (what they allocate is the same tensors whatever the kernels write), in bf16 as the rest
GPU_KERNELS = ["model.kda.backend=triton", "model.attention.backend=triton", "model.attnres.backend=triton"]
PRESETS["1b+triton"] = [*PRESETS["1b"], *GPU_KERNELS]
DEVICES = {"80 GB": 80e9, "141 GB": 141e9}
CPS = (1, 2, 4, 8, 16, 32, 64)  # the long-sequence tables' context-parallel sizes
# the three parts of a step whose peaks measure records: the forward with the loss's forward and backward,
# the blocks' backward, the embedding's backward (its weight's gradient: constant in T)
PHASES = ("loss", "blocks", "embedding")
GIB = 1024**3


# ---- what one rank measures (under torchrun) ------------------------------------------------------------
def build(overrides: list[str]):
    from kimi.model import KimiModel
    from kimi.summary import compose_config

    cfg = compose_config(overrides)
    torch.manual_seed(0)
    return KimiModel(cfg.model)


def shard_inputs(vocab: int, T: int, rank: int, cp: int):
    ids = torch.randint(0, vocab, (1, T + 1), generator=torch.Generator().manual_seed(1))
    n = T // cp
    return ids[:, rank * n:(rank + 1) * n], ids[:, rank * n + 1:(rank + 1) * n + 1]


class Fp32Matmuls(TorchDispatchMode):
    """Runs bf16 matmuls (mm, bmm, addmm, baddbmm, and the experts' _grouped_mm) in fp32 and rounds their
    results to bf16: the same result tensors, so what torch's MemTracker sees is unchanged. Entered before
    the tracker (the tracker's mode above this one), the fp32 copies made here are not seen by it, as a real
    bf16 matmul's workspace is not. Why: a CPU without bf16 instructions multiplies bf16 matrices 10 to 300
    times slower than fp32 ones, by layout (on this project's 2-core machine, 2026-12-06: 9.7 GFLOP/s by a
    transposed weight as nn.Linear multiplies, 0.3 for [512, 2048] x [2048, 2048] both row-major, fp32
    87-95), which made each fit run of the `1b` cut-down models take 11-30 minutes instead of 20-60 s, for the
    same bytes (equal to the byte in the four jobs rerun both ways, of `1b`, `small` and Kimi Linear;
    `test_fp32_matmuls_leave_the_measured_peak_as_it_is` checks a small one)."""

    OPS = {getattr(torch.ops.aten, name).default for name in ("mm", "bmm", "addmm", "baddbmm", "_grouped_mm")
           if hasattr(torch.ops.aten, name)}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.OPS or args[0].dtype != torch.bfloat16:
            return func(*args, **kwargs)
        self.count += 1
        up = functools.partial(tree_map_only, torch.Tensor,
                               lambda t: t.float() if t.dtype == torch.bfloat16 else t)
        return func(*up(args), **up(kwargs)).to(torch.bfloat16)


class LauncherScratch(TorchDispatchMode):
    """Makes what an op's launcher allocates inside the call beside its outputs (kimi.ops.SCRATCH: the Triton
    KDA chunk ops' intermediates) visible to a tracker entered before this mode: MemTracker, a dispatch mode
    itself, sees an op's outputs only. A buffer of those bytes is allocated (never written) while the op
    runs, so it is alive with the op's outputs, as the launcher's are."""

    def __init__(self):
        from kimi.ops import SCRATCH

        super().__init__()
        self.scratch = SCRATCH

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.scratch:
            return func(*args, **kwargs)
        held = torch.empty(self.scratch[func](*args, **kwargs), dtype=torch.uint8, device=args[0].device)
        out = func(*args, **kwargs)
        del held  # freed after the op, as the launcher's are at its return
        return out


def measure(job: dict) -> dict:
    """One forward and backward of this rank's shard: the peak activation bytes and each phase's (PHASES), or
    collective bytes (with bf16 matmuls run in fp32 where the caller enters Fp32Matmuls)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from kimi.parallel import apply_activation_checkpointing
    from kimi.parallel.context_parallel import ContextParallel

    rank, cp = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    # bf16 weights rather than autocast: autocast would keep a bf16 copy of every weight for the whole step,
    # which under FSDP is one gathered unit at a time (kimi.summary counts that unit with the weights)
    model = build(job["overrides"]).to(torch.bfloat16)
    if model.cfg.mtp.layers:  # its head and embedding run twice: more phase ends than PHASES
        raise ValueError("bench/context.py measures models without multi-token prediction: set "
                         "model.mtp.layers=0")
    if cp > 1:
        model.context_parallel = ContextParallel(dist.group.WORLD)
    apply_activation_checkpointing(model, job.get("ac", "full"))
    ids, labels = shard_inputs(model.cfg.vocab_size, job["T"], rank, cp)

    def step():
        # the loss as the engines ask for it (chunked, kimi/ops/linear_ce.py)
        model(ids, labels=labels).backward()

    if job["what"] == "bytes":
        counter = CommCounter()
        with counter:
            step()
        return {"bytes": counter.total_bytes, "by_kind": dict(counter.bytes)}
    # drop each gradient once accumulated: the peak is then the activations' (kimi.summary counts gradients)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tracker = MemTracker()
    tracker.track_external(model)
    phases, ends = {}, iter(PHASES)

    def activations(snapshot) -> int:
        kinds = {str(k).rsplit(".", 1)[-1]: v for k, v in snapshot[torch.device("cpu")].items()}
        return kinds["ACT"] + kinds["TEMP"]

    def phase_ends(grad):
        # a phase ends where a tensor it differentiates toward gets its gradient: the head's input (the loss's
        # backward is done), the embedding's output (every block's is). MemTracker has no public way to
        # restart its peak; its two private records of it are cleared (the next allocation sets them).
        phases[next(ends)] = activations(tracker.get_tracker_snapshot("peak"))
        tracker._peak_mem.clear()
        tracker._peak_mem_snap.clear()

    def watch(tensor):
        tensor.register_hook(phase_ends)

    model.lm_head.register_forward_pre_hook(lambda module, args: watch(args[0]))
    model.embed.register_forward_hook(lambda module, args, out: watch(out))
    with tracker, LauncherScratch():
        step()
    phases[next(ends)] = activations(tracker.get_tracker_snapshot("peak"))
    return {"bytes": max(phases.values()), "phases": phases}


def on_gpu_kernels(job: dict) -> bool:
    return GPU_KERNELS[0] in job["overrides"]


def worker(spec: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = []
    jobs = json.loads(spec.read_text())
    if any(map(on_gpu_kernels, jobs)):  # launched with TRITON_INTERPRET=1: launches do nothing
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = lambda self, *args, **kwargs: None
    for job in jobs:
        with Fp32Matmuls():
            got = measure(job)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, got)
        results.append({**job, "per_rank": [g["bytes"] for g in every], "by_kind": got.get("by_kind")}
                       | ({"phases": [g["phases"] for g in every]} if "phases" in got else {}))
        print(f"[context] {job['name']} T={job['T']}: {[g['bytes'] for g in every]}", flush=True)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    from kimi.parallel import destroy_distributed

    destroy_distributed()


def launch(cp: int, jobs: list[dict], tmp: Path) -> list[dict]:
    """The jobs on cp ranks: traffic counts in one torchrun, each memory run in its own (torch's MemTracker
    keeps every model it tracked alive). Results are kept in ``tmp`` by job, so a rerun measures only what
    is missing."""
    batches = [[j for j in jobs if j["what"] == "bytes"]] + [[j] for j in jobs if j["what"] == "memory"]
    rows = []
    for batch in (b for b in batches if b):
        key = hashlib.sha1(json.dumps([cp, batch], sort_keys=True).encode()).hexdigest()[:16]
        spec, out = tmp / f"jobs_{key}.json", tmp / f"out_{key}.json"
        done = json.loads(out.read_text()) if out.exists() else None
        if done and all(set(r.get("phases", [{}])[0]) == set(PHASES) for r in done if r["what"] == "memory"):
            rows += [{**r, "cp": cp} for r in done]
            continue
        spec.write_text(json.dumps(batch))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
               str(Path(__file__).resolve()), "--worker", str(spec), str(out)]
        print(f"[context] cp {cp}: {', '.join(sorted({j['name'] for j in batch}))} "
              f"T={','.join(str(j['T']) for j in batch)}", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1"} | (
            {"TRITON_INTERPRET": "1"} if any(map(on_gpu_kernels, batch)) else {})
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"torchrun on {cp} ranks exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                             f"{proc.stderr[-4000:]}")
        rows += [{**r, "cp": cp} for r in json.loads(out.read_text())]
    return rows


# ---- the model -----------------------------------------------------------------------------------------
def cut(overrides: list[str], name: str) -> list[str]:
    layers, mla = CUTS[name]
    return [*overrides, f"model.num_layers={layers}", f"model.mla_layers=[{','.join(map(str, mla))}]"]


def fit_jobs(preset: str, overrides: list[str]) -> list[tuple[int, dict]]:
    """(cp, job) of the short runs the fit needs."""
    jobs = [(1, {"name": f"{preset}/{c}", "fit": preset, "cut": c, "overrides": cut(overrides, c), "T": T,
                 "what": "memory"}) for c in CUTS for T in (256, 512)]
    # past the loss's chunk (512 tokens at a 32k vocabulary): how much of the slope below it was the chunk's
    jobs += [(1, {"name": f"{preset}/A", "fit": preset, "cut": "A", "overrides": cut(overrides, "A"),
                  "T": 1024, "what": "memory"})]
    jobs += [(2, {"name": f"{preset}/A", "fit": preset, "cut": "A", "overrides": cut(overrides, "A"), "T": T,
                  "what": "memory"}) for T in (512, 1024)]
    return jobs


def features(m) -> list[float]:
    """[1, sublayers, AttnRes sources summed over the sublayers and the final mix] of a model config: under
    activation checkpointing a sublayer keeps its input, and each AttnRes mix keeps its sources' norms and
    weights, so per token the kept bytes are affine in these (a standard residual has one source)."""
    sublayers = 2 * m.num_layers
    if m.residual == "standard":
        sources = sublayers + 1
    elif m.residual == "attnres_full":
        sources = sum(1 + done for done in range(sublayers + 1))
    else:
        bs = m.attnres.block_size
        sources = sum(1 + done // bs + (done % bs > 0) for done in range(sublayers + 1))
    return [1.0, float(sublayers), float(sources)]


def _keys_values(m) -> int:
    """Elements per token of one MLA layer's up-projected keys and values and their gradients."""
    return 2 * m.mla.num_heads * (2 * m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim + 2 * m.mla.v_head_dim)


def prefix_bytes(m, blockwise: bool = False) -> float:
    """What the last rank holds per token of the earlier shards while one MLA layer is recomputed and
    differentiated (an estimate, not fitted: at cp 2 on CPU it is lost beside KDA's wider run), bf16: the
    gathered latent three times (all-gather buffers, stacked, the prefix), and, on the whole-prefix path
    (CPU's SDPA, packed documents), the keys and values up-projected from it with their gradients. The
    blockwise path (kimi/ops/attention/latent.py: Triton, no packed documents) up-projects one shard-long
    block at a time instead: `block_bytes` per token of the rank's shard."""
    latent = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
    return 2 * (3 * latent + (0 if blockwise else _keys_values(m)))


def block_bytes(m) -> float:
    """The blockwise path's one block of keys and values with their gradients, per token of the shard."""
    return 2 * _keys_values(m)


def loss_chunk(m) -> int:
    """Tokens of the longest chunk the loss works on (kimi.ops.linear_ce), 0 for the plain loss: a rank
    with fewer tokens holds a shorter chunk's logits."""
    from kimi.ops.linear_ce import chunk_tokens

    if m.loss_chunk < 0:
        return 0
    return m.loss_chunk or chunk_tokens(1 << 40, m.vocab_size, m.loss_chunk_mib << 20)


def fit(rows: list[dict], name: str) -> dict:
    """The coefficients of the three phases' peaks on the last of cp > 1 ranks (n = T / cp tokens on it; K =
    loss_chunk), each fitted on its own peak in the same short runs of ``name``'s cut-down models (measure
    records each):
    - the loss: n * (features . a) + c - l * max(0, K - n). l is what the loss holds per token of its chunk
      (a short rank's chunk is shorter): cut A's slope in T below K less its slope above it;
    - the blocks' backward: n * (features . a + e) + (T - n) * b + c, with the loss's a and one block's
      recompute and backward added to its constant term (below). e is what a rank that continues the
      sequence holds more than the first, per token of its shard (its KDA's K more value columns), from the
      cp 2 runs (0 at cp 1); b is MLA's prefix per token of the earlier shards, prefix_bytes;
    - the embedding's backward: n * (features . a) + c, a near 0 (its weight's gradient as it is made).
    Each cut's slope at cp 1 from 256 to 512 tokens (less the chunk's share in the loss) is features . a,
    least squares over the cuts (with standard residuals two features move together), except in the blocks'
    phase; c is the largest of the cuts' intercepts."""

    mine = [r for r in rows if r.get("fit") == name]
    m = composed(*mine[0]["overrides"]).model
    K = loss_chunk(m)

    def peaks(c, phase):  # (T, the phase's peak) of cut c at cp 1, by T
        return sorted((r["T"], r["phases"][0][phase]) for r in mine if r["cut"] == c and r["cp"] == 1)

    def chunk_share(t0, t1):  # how much of the chunk the loss holds grows from t0 to t1 tokens
        return min(t1, K) - min(t0, K)

    coef, cut_slopes = {}, {}
    for phase in PHASES:  # the loss's first: the blocks' phase builds on it
        lam = 0.0
        if phase == "loss":  # cut A's two slopes: the per-token bytes plus l times the chunk's share of them
            (t0, p0), (t1, p1), (t2, p2) = peaks("A", phase)
            below, above = (p1 - p0) / (t1 - t0), (p2 - p1) / (t2 - t1)
            shares = chunk_share(t0, t1) / (t1 - t0) - chunk_share(t1, t2) / (t2 - t1)
            lam = max(0.0, (below - above) / shares) if shares > 0 else 0.0
        slopes, intercepts, feats = [], [], []
        for c in CUTS:
            (t0, p0), (t1, p1) = peaks(c, phase)[:2]
            slopes.append((p1 - p0 - lam * chunk_share(t0, t1)) / (t1 - t0))
            intercepts.append(p1 - slopes[-1] * t1 + lam * max(0, K - t1))
            feats.append(features(composed(*next(r["overrides"] for r in mine if r["cut"] == c)).model))
        if phase == "blocks":
            # what the loss's phase holds per token (every checkpointed input, the mixes' sources), plus one
            # block's recompute and backward, whose bytes per token do not grow with depth: the largest
            # excess of this phase's slope over the loss's among the cuts (a least-squares fit of its own
            # extrapolates the few cuts' differences, which hang on where the heaviest block sits)
            a = list(coef["loss"]["a"])
            a[0] += max(s - t for s, t in zip(slopes, cut_slopes["loss"]))
        else:
            a = torch.linalg.lstsq(torch.tensor(feats, dtype=torch.float64),
                                   torch.tensor(slopes, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
        cut_slopes[phase] = slopes
        coef[phase] = {"a": a, "c": max(0.0, max(intercepts)), "l": lam, "K": K, "e": 0.0, "b": 0.0}
    b = prefix_bytes(m, blockwise=on_gpu_kernels(mine[0]))
    excess = [((r["phases"][-1]["blocks"] - r["phases"][0]["blocks"]) - b * (r["T"] // 2)) / (r["T"] // 2)
              for r in mine if r["cp"] == 2]
    coef["blocks"] |= {"e": max(0.0, sum(excess) / len(excess)), "b": b}
    return coef


def predict_phase(coef: dict, m, T: int, cp: int, extra_per_token: float = 0.0) -> float:
    """One phase's peak on the last rank (fit's formula, with ``extra_per_token`` per token of its shard)."""
    n = T / cp
    per_token = (sum(a * f for a, f in zip(coef["a"], features(m))) + extra_per_token
                 + (coef["e"] if cp > 1 else 0))
    return n * per_token + (T - n) * coef["b"] + coef["c"] - coef["l"] * max(0.0, coef["K"] - n)


def predict(coef: dict, m, T: int, cp: int, extra_per_token: float = 0.0) -> float:
    """The last rank's peak: the largest of its three phases' (``extra_per_token``: more the blocks keep per
    token, e.g. the router's scores of experts the fit's models left out)."""
    return max(predict_phase(coef[ph], m, T, cp, extra_per_token if ph == "blocks" else 0.0) for ph in PHASES)


@functools.lru_cache(maxsize=None)
def composed(*overrides: str):
    """kimi.summary.compose_config of `overrides`, composed once (a report asks for the same few dozen
    configurations about a hundred times; Hydra takes a second or two for each). Read it, never change it."""
    from kimi.summary import compose_config

    return compose_config(list(overrides))


def persistent_bytes(overrides: list[str], cp: int) -> float:
    """kimi.summary's per-rank state with FSDP over the cp ranks (dp_shard 1), bf16, plus one gathered
    unit."""
    from kimi.summary import summarize

    s = summarize(composed(*overrides, f"parallel.cp={cp}", "trainer.precision=bf16"))
    return s.heaviest.persistent_bytes + s.heaviest.bytes.get("transient", 0)


def longest(fits: Callable[[int], bool], cp: int) -> int:
    """The longest T (a multiple of 1024 * cp) for which ``fits(T)`` holds, by bisection (the peak grows
    with T); 0 if none."""
    step = 1024 * cp
    lo, hi = 0, step
    while fits(hi) and hi < 2**40:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_config(overrides: list[str], T: int, cp: int, device: str):
    """The planner's run: one row of T tokens on cp ranks, FSDP over them, bf16, activation checkpointing
    full, on ``device`` (cuda: the kernels a GPU takes, the Triton KDA, attention and AttnRes ops)."""
    from kimi.summary import compose_config

    return compose_config([*overrides, f"trainer.seq_len={T}", f"parallel.cp={cp}", "trainer.precision=bf16",
                           "parallel.activation_checkpointing=full", "trainer.micro_batch_size=1",
                           "trainer.grad_accum_steps=1", f"trainer.device={device}"])


def planned_bytes(overrides: list[str], T: int, cp: int) -> float:
    """The heaviest rank's peak on a GPU by the planner (kimi.plan.memory_per_rank: persistent state and what
    the activation trace keeps)."""
    from kimi.plan.memory import memory_per_rank

    return float(sum(memory_per_rank(plan_config(overrides, T, cp, "cuda")).values()))


def planned_activations(overrides: list[str], T: int, cp: int, device: str = "cpu") -> float:
    """What the planner says the last rank's activations peak at (on the CPU: its traces of the PyTorch
    paths), beside what (1) measures."""
    from kimi.plan.memory import activations, trace_mode
    from kimi.plan.activations import trace
    from kimi.plan.shapes import pipeline

    cfg = plan_config(overrides, T, cp, device)
    ((_, blocks, first, last),) = pipeline(cfg)
    return activations(cfg, trace(cfg.model, "full", trace_mode(cfg)), 0, blocks, first, last)


def planned_table(reserve: float) -> dict:
    """{preset: {device: {cp: longest T}}} by the planner, for the GPU table beside the fit's."""
    table: dict = {}
    for preset, overrides in PRESETS.items():
        if "+" in preset:  # the planner's GPU run takes the GPU's kernels already
            continue
        full = [o for o in overrides if not o.startswith("model.moe.num_experts")]
        for dev, cap in DEVICES.items():
            for cp in CPS:
                T = longest(lambda T: planned_bytes(full, T, cp) <= cap * (1 - reserve), cp)
                table.setdefault(preset, {}).setdefault(dev, {})[str(cp)] = T
                print(f"[context] planner: {preset} on {dev}, cp {cp}: {tokens(T) if T else '-'}", flush=True)
    return table


# ---- tables --------------------------------------------------------------------------------------------
def md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def tokens(T: int) -> str:
    return f"{T // 1024}K" if T < 1 << 20 else f"{T / (1 << 20):.2f}M"


def exchange_bytes(m, mixer: str, T: int, cp: int, rows: int = 1) -> int:
    """Bytes one rank puts into collectives per layer and step, bf16 activations, activation checkpointing
    full (the recomputed forward repeats its all-gather): 2 all-gathers of the forward's message and one
    all-reduce of all cp ranks' messages (its gradient; gloo has no reduce-scatter). KDA's message: the three
    convs' halos (bf16) and the shard summary P, S_zero (fp32); MLA's: the shard's latent and shared key."""
    if mixer == "KDA":
        width = m.kda.num_heads * m.kda.head_dim
        message = rows * (3 * (m.conv_size - 1) * width * 2 + m.kda.num_heads * m.kda.head_dim * 2
                          * m.kda.head_dim * 4)
    else:
        message = rows * T // cp * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * 2
    return (2 + cp) * message


def report(out: dict, reserve: float) -> str:
    """The markdown tables from the measured rows (and the fits) in ``out``; adds the model's to it."""

    rows = out["rows"]
    mem = [r for r in rows if r["what"] == "memory" and "fit" not in r]
    names = list(dict.fromkeys(r["name"] for r in mem))
    lengths = sorted({r["T"] for r in mem})
    cps = sorted({r["cp"] for r in mem})
    text = ["Peak activation memory per rank (MiB; the heaviest rank; bf16, activation checkpointing full, "
            "one row of T tokens), and its ratio to cp = 1:"]
    table = []
    for name in names:
        for T in lengths:
            peaks = {r["cp"]: max(r["per_rank"]) for r in mem if r["name"] == name and r["T"] == T}
            table.append([name, str(T)] + [f"{peaks[cp] / 2**20:.1f} "
                                           f"({peaks[cp] / peaks[1]:.2f}x)" for cp in cps])
    text.append(md(["model", "T"] + [f"cp {cp}" for cp in cps], table))

    traffic = [r for r in rows if r["what"] == "bytes"]
    tiny = composed(*MEASURED["tiny"]).model
    table = []
    for mixer in ("KDA", "MLA"):
        for T in sorted({r["T"] for r in traffic}):
            cells = []
            for cp in sorted({r["cp"] for r in traffic}):
                got = next(max(r["per_rank"]) for r in traffic
                           if r["name"] == f"{mixer} layer" and r["T"] == T and r["cp"] == cp)
                cells.append(f"{got / 1024:.1f} ({exchange_bytes(tiny, mixer, T, cp) / 1024:.1f})")
            table.append([f"{mixer} layer", str(T)] + cells)
    text += ["", "KiB one rank puts into collectives per layer and step, measured (and by formula: "
             "`exchange_bytes`), one block of `tiny`:",
             md(["layer", "T"] + [f"cp {cp}" for cp in sorted({r["cp"] for r in traffic})], table)]

    checks = []
    for name in names:
        coef = fit(rows, name)
        m = composed(*MEASURED[name]).model
        for r in (r for r in mem if r["name"] == name):
            got, want = predict(coef, m, r["T"], r["cp"]), max(r["per_rank"])
            heaviest = r["phases"][r["per_rank"].index(want)]
            modelled = {ph: predict_phase(coef[ph], m, r["T"], r["cp"]) for ph in PHASES}
            planned = out.get("planner_check", {}).get(f"{name}/{r['T']}/{r['cp']}")
            checks.append([name, str(r["T"]), str(r["cp"]),
                           f"{want / 2**20:.1f} ({max(heaviest, key=heaviest.get)})",
                           f"{got / 2**20:.1f} ({max(modelled, key=modelled.get)})", f"{got / want:.2f}",
                           f"{planned / 2**20:.1f} ({planned / want:.2f})" if planned else "-"])
    out["model_check"] = checks
    text += ["", "The memory model against those measurements (fitted on cut-down models of 4, 6 and 8 "
             "blocks, T 256-1024, cp 1-2), and the phase that sets each peak (the loss, the blocks' "
             "backward or the embedding's):", md(["model", "T", "cp", "measured MiB", "model MiB",
                                                 "model / measured", "planner MiB (/ measured)"], checks)]

    # GPUs run the blockwise MLA prefix (Triton attention, no packed documents): its b and its block
    presets = [p for p in PRESETS if any(r.get("fit") == p for r in rows)]
    table, fitted_answers, cps = [], {}, CPS
    for preset in presets:
        full = [o for o in PRESETS[preset] if not o.startswith("model.moe.num_experts")]
        m = composed(*full).model
        coef = fit(rows, preset)
        coef["blocks"]["b"] = prefix_bytes(m, blockwise=True)  # a PyTorch-path fit measured the whole prefix
        extra = 4 * (m.moe.num_experts - 16) * (m.num_layers - m.moe.first_dense) if m.moe.num_experts else 0
        if m.attention.backend != "triton":  # the blockwise path's block, measured where it ran
            extra += block_bytes(m)
        out.setdefault("fits", {})[preset] = coef
        for dev, cap in DEVICES.items():
            cells = []
            for cp in cps:
                budget = cap * (1 - reserve) - persistent_bytes(full, cp)
                T = longest(lambda T: predict(coef, m, T, cp, extra) <= budget, cp) if budget > 0 else 0
                cells.append(tokens(T) if T else "-")
                if T >= 1 << 20:
                    fitted_answers.setdefault((preset, dev), cp)
            table.append([preset, dev] + cells)
        per_token = {ph: sum(a * f for a, f in zip(coef[ph]["a"], features(m))) / 1024 for ph in PHASES}
        blocks = coef["blocks"]
        text += ["", f"`{preset}`: {per_token['blocks']:.0f} KiB per token of the rank's shard in the "
                 f"blocks' backward ({per_token['loss']:.0f} in the loss; +{blocks['e'] / 1024:.0f} KiB on a "
                 f"continuing rank), {blocks['b'] / 1024:.1f} KiB per token "
                 f"of the earlier shards (MLA's prefix latent; {prefix_bytes(m) / 1024:.0f} KiB where the "
                 "prefix is up-projected whole); exchange per layer and step at T = 1M, cp 64: KDA "
                 f"{exchange_bytes(m, 'KDA', 1 << 20, 64) / 2**20:.0f} MiB, MLA "
                 f"{exchange_bytes(m, 'MLA', 1 << 20, 64) / 2**20:.0f} MiB"]
    if presets:
        text += ["", "Longest trainable sequence per GPU by the fits above (the PyTorch paths as measured "
                 "here, `+triton` the GPU's Triton ops' allocations; activation checkpointing full, bf16, "
                 "one GPU per cp rank, FSDP over them, MLA's prefix blockwise; "
                 f"{reserve:.0%} of memory reserved; '-': the weights and optimizer state alone do not fit):",
                 md(["preset", "device"] + [f"cp {c}" for c in cps], table)]
        text += ["By the fit, 1M tokens: " + "; ".join(f"{p} on {d} GPUs from cp = {cp}"
                                                       for (p, d), cp in fitted_answers.items())]
        out["longest"] = table
    if out.get("planned"):
        table, answers = [], {}
        for preset, by_device in out["planned"].items():
            for dev, by_cp in by_device.items():
                table.append([preset, dev] + [tokens(T) if T else "-" for T in by_cp.values()])
                answers[(preset, dev)] = next((int(cp) for cp, T in by_cp.items() if T >= 1 << 20), None)
        text += ["", "Longest trainable sequence per GPU by the planner (kimi.plan.memory_per_rank) with the "
                 "kernels a GPU runs (the Triton KDA, attention and AttnRes ops), as above:",
                 md(["preset", "device"] + [f"cp {c}" for c in CPS], table)]
        text += [f"- `{p}` on {d} GPUs: 1M tokens from cp = {cp}" for (p, d), cp in answers.items() if cp]
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, shorter sequences (a smoke run)")
    ap.add_argument("--reserve", type=float, default=0.1,
                    help="fraction of device memory kept for the CUDA context, NCCL and allocator slack")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "context.json")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kimi_bench_context",
                    help="where each measurement is kept: a rerun measures only what is missing")
    ap.add_argument("--report", type=Path, help="print the tables of an earlier run's JSON (no measuring)")
    ap.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    if args.report:
        print(report(json.loads(args.report.read_text()), args.reserve))
        return
    lengths = [256, 512] if args.quick else [512, 1024, 2048]
    measured = {"tiny": MEASURED["tiny"]} if args.quick else MEASURED
    presets = {} if args.quick else PRESETS
    by_cp: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    for name, ov in measured.items():
        for cp in by_cp:
            by_cp[cp] += [{"name": name, "overrides": ov, "T": T, "what": "memory"} for T in lengths]
            if name == "tiny" and cp > 1:  # one block of each mixer: bytes per layer
                for mixer, mla in (("KDA", "[]"), ("MLA", "[0]")):
                    by_cp[cp] += [{"name": f"{mixer} layer", "overrides": [*ov, "model.num_layers=1",
                                   f"model.mla_layers={mla}", "model.residual=standard"], "T": T,
                                   "what": "bytes"}
                                  for T in lengths]
    for name, ov in {**measured, **presets}.items():
        for cp, job in fit_jobs(name, ov):
            by_cp[cp].append(job)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = [r for cp, jobs in by_cp.items() for r in launch(cp, jobs, args.work)]
    out = {"device": "cpu", "torch": torch.__version__, "precision": "bf16", "ac": "full", "rows": rows,
           "planned": {} if args.quick else planned_table(args.reserve),
           "planner_check": {f"{r['name']}/{r['T']}/{r['cp']}": planned_activations(r["overrides"], r["T"],
                                                                                    r["cp"])
                             for r in rows if r["what"] == "memory" and "fit" not in r}}
    text = report(out, args.reserve)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(text)
    print(f"\n[context] wrote {args.out}")


if __name__ == "__main__":
    main()
