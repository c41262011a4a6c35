"""KDA speed: our kernels against the references, on whatever this machine has.

On a CUDA GPU (compiled Triton; do not set TRITON_INTERPRET): forward and forward+backward time of our
Triton chunk_kda, fla-core's chunk_kda (when installed) and causal softmax attention (SDPA) at
T = 2k..32k with B*T = 32k tokens, H = 16, d = 128, bf16; achieved TFLOP/s against a measured bf16 matmul
peak; and one decoding step (our fused recurrent kernel, fla-core's, and attention over a KV cache of T
tokens). It first checks every KDA Triton op against the PyTorch path and fp64 (kda_check: chunk forward and
backward, fp32 and bf16, packed documents with an initial state; fused recurrent prefill and decoding; the
layer's l2norm and gate kernels); --check runs that check alone (kda_gpu_check.json, exit 1 on a failure),
--no-self-check skips it. Writes bench/results/kda_cuda.json. --dry-run runs this GPU code on CPU with the
Triton kernels interpreted, at whatever (tiny) sizes are given: plumbing, not measurements
(bench/gpu_check.py --dry-run).

On CPU: forward+backward time of the token-by-token reference, the PyTorch chunkwise path and SDPA, fp32,
B = 1 (the shape of the cost, not peak speed: KDA grows linearly in T, attention quadratically once the
T^2 term dominates). Writes bench/results/kda_cpu.json. --safe-gate: the PyTorch chunk path told Kimi K3's \
gate
bound (lower_bound=-5: 16-token diagonal blocks as anchored matmuls) against its general form, on the same
safe-gate inputs, calls alternating; writes bench/results/kda_cpu_safe_gate.json. --context: a continuing
context-parallel rank's KDA (one run over V + K columns, then its incoming state's share; kimi/ops/kda/
context.py) against one device that has the shard's incoming state, calls alternating; writes
bench/results/kda_cpu_context.json.

    python bench/kda.py [--T ...] [--repeats 3] [--skip-naive-above 4096] [--threads N]   (CPU)
    python bench/kda.py [--T 2048 4096 8192 16384 32768] [--tokens 32768] [--heads 16] [--dim 128]  (GPU)
    python bench/kda.py --check [--check-docs 100 1 199 137 63] [--check-heads 4] [--check-dim 128]  (GPU)
    python bench/kda.py --compile-check [--arch 90|80|all] [--quick] [--jobs N]   (no GPU needed)
    python bench/kda.py --safe-gate [--T 1024 2048 4096] [--repeats 7] [--threads 1]   (CPU: bounded vs \
general)
    python bench/kda.py --context [--T 1024 2048 4096] [--repeats 7] [--threads 1]   (CPU: cp rank vs \
known state)

--compile-check compiles every KDA Triton kernel (kimi/ops/kda/triton/) for sm_90 and sm_80 with triton's
bundled ptxas, over head dims K, V in {64, 128} (and V = 256 at K = 128: a context-parallel rank's V + K value
columns), bf16/fp32 inputs and the constexpr switches, and writes
registers, spills and shared memory to bench/results/kda_sm90_compile.json / kda_sm80_compile.json.
TRITON_INTERPRET must be unset. --quick: K = V = 128, bf16 only (plus each switch and cu_seqlens dtype),
written to kda_sm*_compile_quick.json. cu_seqlens is not a constexpr switch (every launch is varlen; a
[B, T] batch is packed with int32 offsets): it is compiled as int32 and, at K = V = 128, int64 pointers.

Prints markdown tables. FLOP counts are nominal, the same formula for every KDA implementation: forward
6 d^2 + 5 C d per token and head (C = 64: scores, W/U, state read, write and intra-chunk output; the
triangular solve left out), forward+backward 3x that; causal attention 2 T^2 d per head forward, 3.5x that
for forward+backward.
"""

import argparse
import functools
import itertools
import json
import os
import sys
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kimi.ops.kda import CHUNK_SIZE as CHUNK, chunk_kda, fused_recurrent_kda

RESULTS = Path(__file__).parent / "results"
NAIVE_LIMIT_S = 60.0  # CPU: a naive call slower than this is not repeated, and longer T are not tried
DEVICE = "cuda"  # of the GPU section (a dry run of its code on CPU can swap it)


def kda_inputs(B: int, T: int, heads: int, dim: int, dtype=torch.float32, device="cpu", seed: int = 0):
    """Inputs as the layer feeds them: unit-norm q, k; gates -softplus(x) (fp32); beta in (0, 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, g = (torch.randn(B, T, heads, dim, generator=gen, device=device) for _ in range(4))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = -F.softplus(g)
    beta = torch.sigmoid(torch.randn(B, T, heads, generator=gen, device=device))
    return [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)]


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


# ---------------------------------------------------------------------------------------------------- CPU


def time_call(step, repeats: int, limit_s: float = float("inf")) -> float:
    """Median wall time of `repeats` calls after one warm-up call (returned alone if it exceeds limit_s)."""
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    if first > limit_s:
        return first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def growth(times: dict[int, float | None]) -> dict[int, float | None]:
    """Time ratio from each T to the next listed one (per doubling when the list doubles)."""
    Ts = sorted(times)
    return {b: (times[b] / times[a] if times[a] and times[b] else None) for a, b in zip(Ts, Ts[1:])}


def cpu_kda_step(backend: str, T: int, heads: int, dim: int):
    inputs = [x.requires_grad_() for x in kda_inputs(1, T, heads, dim)]

    def step():
        o, _ = chunk_kda(*inputs, backend=backend)
        o.sum().backward()

    return step


def safe_gate(shape, lower_bound: float = -5.0, device="cpu") -> torch.Tensor:
    """Kimi K3's safe-gate log decays, lower_bound * sigmoid(x), fp32 (as the layer feeds them)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return (lower_bound * torch.sigmoid(x)).to(device)


def cpu_safe_gate_step(T: int, heads: int, dim: int, lower_bound: float | None):
    """The PyTorch chunk path on Kimi K3's safe-gate inputs (g = -5 sigmoid(x)), told the bound or not."""
    inputs = kda_inputs(1, T, heads, dim)
    inputs[3] = safe_gate(inputs[3].shape)
    inputs = [x.requires_grad_() for x in inputs]

    def step():
        o, _ = chunk_kda(*inputs, backend="chunk", lower_bound=lower_bound)
        o.sum().backward()

    return step


def cpu_context_steps(T: int, heads: int, dim: int) -> dict:
    """A continuing context-parallel rank's KDA on a T-token shard (kimi/ops/kda/context.py: one run over
    the values [v, 0] from [0, I], then its incoming state's share added; the summary's gradient flows
    back as later ranks return it) and one device running the same shard from a state it already has."""
    from kimi.ops.kda.context import add_incoming, shard_pass

    inputs = [x.requires_grad_() for x in kda_inputs(1, T, heads, dim)]
    S_in = torch.randn(1, heads, dim, dim, generator=torch.Generator().manual_seed(2), requires_grad=True)

    def known():
        o, _ = chunk_kda(*inputs, initial_state=S_in, backend="chunk")
        o.sum().backward()

    def rank():
        o, reach, P, S = shard_pass(*inputs, backend="chunk")
        (add_incoming(o, reach, S_in, None, True).sum() + P.sum() + S.sum()).backward()

    return {"known": known, "rank": rank}


# --safe-gate and --context: (first column's name, second's, what the table times, the steps, results file)
AB = {"safe_gate": ("general path (s)", "bounded path, lower_bound=-5 (s)",
                    "the PyTorch chunk path on safe-gate inputs (g = -5 sigmoid(x))",
                    lambda T, h, d: {"general": cpu_safe_gate_step(T, h, d, None),
                                     "bounded": cpu_safe_gate_step(T, h, d, -5.0)},
                    "kda_cpu_safe_gate.json"),
      "context": ("one device from a known state (s)", "a continuing cp rank (s)",
                  "one shard's KDA (PyTorch chunk path) on a context-parallel rank that continues the "
                  "sequence, against one device that has the shard's incoming state",
                  cpu_context_steps, "kda_cpu_context.json")}


def run_cpu_ab(args, which: str) -> None:
    """Two ways to compute the same KDA on the same inputs (AB[which]), calls alternating."""
    first, second, what, steps_for, out = AB[which]
    if args.threads:
        torch.set_num_threads(args.threads)
    Ts = sorted(args.T or [1024, 2048, 4096])
    heads, dim = args.heads or 4, args.dim or 64
    rows = {}
    for T in Ts:
        steps = steps_for(T, heads, dim)
        a, b = steps
        times = {name: [] for name in steps}
        for step in steps.values():
            step()  # warm-up
        for _ in range(args.repeats):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        rows[T] = {name: statistics.median(t) for name, t in times.items()}
        rows[T]["paired_ratios"] = sorted(y / x for x, y in zip(times[a], times[b]))
    setup = (f"B=1, H={heads}, d={dim}, {torch.get_num_threads()} threads, median of {args.repeats} "
             "alternating calls")
    print(f"\nforward+backward of {what}, fp32 CPU, {setup}\n")
    print(f"| T | {first} | {second} | {b} / {a} (paired min-max) |")
    print("|---|---|---|---|")
    for T, r in rows.items():
        lo, hi = r["paired_ratios"][0], r["paired_ratios"][-1]
        print(f"| {T} | {r[a]:.3f} | {r[b]:.3f} | {r[b] / r[a]:.2f}x ({lo:.2f}-{hi:.2f}) |")
    write(args.out or RESULTS / out,
          {"config": {"B": 1, "H": heads, "d": dim, "dtype": "float32", "repeats": args.repeats,
                      "threads": torch.get_num_threads(), "torch": torch.__version__},
           "seconds_fwd_bwd": {str(T): r for T, r in rows.items()}})


def cpu_sdpa_step(T: int, heads: int, dim: int):
    q, k, v = (x.transpose(1, 2).detach().requires_grad_() for x in kda_inputs(1, T, heads, dim)[:3])

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return step


def run_cpu(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    Ts = sorted(args.T or [512, 1024, 2048, 4096])
    heads, dim = args.heads or 4, args.dim or 64
    methods = ("naive", "chunk", "sdpa")
    results: dict[str, dict[int, float | None]] = {m: {} for m in methods}
    naive_too_slow = False
    for T in Ts:
        shape = (T, heads, dim)
        if T > args.skip_naive_above or naive_too_slow:
            results["naive"][T] = None
        else:
            results["naive"][T] = time_call(cpu_kda_step("naive", *shape), args.repeats, NAIVE_LIMIT_S)
            naive_too_slow = results["naive"][T] > NAIVE_LIMIT_S
        results["chunk"][T] = time_call(cpu_kda_step("chunk", *shape), args.repeats)
        results["sdpa"][T] = time_call(cpu_sdpa_step(*shape), args.repeats)
        print(f"T={T}: " + ", ".join(f"{m} {fmt(results[m][T], '.3f')} s" for m in methods), flush=True)

    growths = {m: growth(results[m]) for m in methods}
    setup = f"B=1, H={heads}, d={dim}, {torch.get_num_threads()} threads"
    print(f"\nforward+backward, fp32 CPU, {setup}; seconds per call (median), (factor over the previous T)\n")
    print("| T | naive recurrent | PyTorch chunkwise | softmax attention (SDPA) | chunkwise / SDPA |")
    print("|---|---|---|---|---|")
    for T in Ts:
        cells = [
            f"{fmt(results[m][T], '.3f')}" + (f" ({fmt(growths[m][T], '.2f')}x)" if T in growths[m] else "")
            for m in methods
        ]
        ratio = (results["chunk"][T] / results["sdpa"][T] if results["chunk"][T] and results["sdpa"][T]
                 else None)
        print(f"| {T} | " + " | ".join(cells) + f" | {fmt(ratio, '.2f')}x |")

    record = {
        "config": {"B": 1, "H": heads, "d": dim, "dtype": "float32", "repeats": args.repeats,
                   "threads": torch.get_num_threads(), "torch": torch.__version__},
        "seconds_fwd_bwd": {m: {str(T): t for T, t in results[m].items()} for m in methods},
        "growth_from_previous_T": {m: {str(T): r for T, r in growths[m].items()} for m in methods},
    }
    write(args.out or RESULTS / "kda_cpu.json", record)


# ---------------------------------------------------------------------------------------------------- GPU


def cuda_ms(fn) -> float:
    """Median milliseconds of fn() on the GPU (Triton's do_bench: warm-up, cache flush, CUDA events). In a
    dry run on CPU: the wall time of one call after one warm-up, which only shows the code path runs."""
    if DEVICE == "cpu":
        fn()
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run, Triton interpreted)"


def matmul_peak_tflops(dtype=torch.bfloat16) -> float:
    n = 8192 if DEVICE == "cuda" else 256  # a dry run only needs the code path
    a, b = (torch.randn(n, n, device=DEVICE, dtype=dtype) for _ in range(2))
    return 2 * n**3 / cuda_ms(lambda: a @ b) / 1e9


def kda_flops(B: int, T: int, H: int, d: int) -> float:
    return B * H * T * (6 * d * d + 5 * CHUNK * d)


def load_fla(skip: bool = False):
    """(fla-core's chunk_kda and fused_recurrent_kda or None, what became of them in words)."""
    if skip or DEVICE == "cpu":  # fla's kernels are not meant for the interpreter
        return None, "skipped"
    try:
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent
    except ImportError as exc:
        return None, f"fla not installed ({exc})"
    except Exception as exc:  # installed but broken here (a triton it does not know): still our numbers
        return None, f"fla failed to import ({type(exc).__name__}: {exc})"
    import fla

    return (fla_chunk, fla_recurrent), f"fla-core {getattr(fla, '__version__', '?')}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Pass marks of kda_check: relative error (norm of the difference / norm of the fp64 result on the same
# rounded inputs). fp32: the kernels multiply in IEEE fp32 (no TF32) with fp32 sums, ~1e-6 when interpreted;
# 1e-4 leaves room for longer compiled sums and exp(g) spans inside a chunk, while a wrong mask, index or
# state hand-over gives errors of order 1. bf16: the kernels feed the tensor cores bf16 operands (8-bit
# mantissa, 2^-9 = 2e-3 per rounding, then sums over a chunk): ~5e-3 expected; 2e-2 as the attention check.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _errors(got: dict, want: dict) -> dict:
    return {name: rel(got[name], want[name]) for name in want}


_LOST = []  # the row after which the CUDA context was lost, if one was


def _context_lost() -> bool:
    """After an illegal memory access every later CUDA call fails too: tell that apart from a kernel error."""
    if DEVICE != "cuda":
        return False
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device=DEVICE).item()
        return False
    except Exception:
        return True


def _row(op: str, what: str, dtype, fn) -> dict:
    """One row of kda_check. fn() -> (Triton, PyTorch path, fp64 reference) results as {tensor: value} on the
    same rounded inputs. Passes when Triton is within the dtype's mark of fp64 and the PyTorch path (fp32)
    within the fp32 mark; a kernel that raises fails its row and the check goes on, unless it took the CUDA
    context with it: then the later rows say they did not run, rather than repeat that row's error."""
    name = str(dtype).removeprefix("torch.")
    row = {"op": op, "what": what, "dtype": name, "tol": TOLERANCE[name]}
    if _LOST:
        return {**row, "error": f"not run: the CUDA context was lost in '{_LOST[0]}'", "ok": False}
    try:
        ours, torch_path, fp64 = fn()
    except Exception as exc:
        from kimi.ops.dispatch import describe

        if _context_lost():
            _LOST.append(f"{what} ({name})")
        return {**row, "error": describe(exc), "ok": False}
    row.update(triton_vs_fp64=_errors(ours, fp64), triton_vs_torch=_errors(ours, torch_path),
               torch_vs_fp64=_errors(torch_path, fp64),
               finite=all(t.isfinite().all().item() for t in ours.values()))
    worst = max(row["triton_vs_fp64"], key=row["triton_vs_fp64"].get)
    row.update(worst=worst, max_vs_fp64=row["triton_vs_fp64"][worst],
               ok=row["finite"] and row["triton_vs_fp64"][worst] < row["tol"]
               and max(row["torch_vs_fp64"].values()) < TOLERANCE["float32"])
    return row


def _chunk_case(dtype, cu_seqlens, H: int, d: int, plant: bool, lower_bound: float | None = None,
                impl: str = "triton"):
    """chunk_kda on packed documents with an initial state: Triton (impl="fla": fla-core's kernels) vs the
    PyTorch chunk path (fp32) and the naive recurrence (fp64), on the same rounded inputs and output
    gradients; output, final state and every input gradient (dh0 included). lower_bound: Kimi K3's safe-gate
    inputs, g = lower_bound * sigmoid(x), with both chunk paths told the bound (their bounded form)."""
    T, N = int(cu_seqlens[-1]), len(cu_seqlens) - 1
    q, k, v, g, beta = kda_inputs(1, T, H, d, dtype, DEVICE, seed=2)
    if lower_bound is not None:
        g = safe_gate(g.shape, lower_bound, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    h0 = torch.randn(N, H, d, d, device=DEVICE, generator=gen)
    do = torch.randn(1, T, H, d, device=DEVICE, generator=gen).to(dtype)
    dht = torch.randn(N, H, d, d, device=DEVICE, generator=gen)
    out = {}
    for backend, cast in ((impl, None), ("chunk", torch.float32), ("naive", torch.float64)):
        leaves = [x.detach().to(cast or x.dtype).requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, s = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                         cu_seqlens=cu_seqlens, backend=backend, lower_bound=lower_bound)
        grads = torch.autograd.grad((o, s), leaves, (do.to(o.dtype), dht.to(s.dtype)))
        out[backend] = dict(o=o, final_state=s, **dict(zip(GRAD_NAMES, grads)))
    if plant:  # tests: a result the check must catch
        out[impl]["dq"] = out[impl]["dq"] * 1.1
    return out[impl], out["chunk"], out["naive"]


def _context_case(dtype, cu_seqlens, H: int, d: int, shards: int):
    """chunk_kda split into `shards` consecutive shards as context-parallel ranks run it (kimi/ops/kda/
    context.py: each shard's one run over the values [v, 0] from the state [0, I], the summaries joined, each
    incoming state's share added through its tokens' reach), on packed documents that cross the shard edges:
    Triton in `dtype` (reach rounded to it, as the values are) vs the PyTorch chunk path split the same way
    (fp32) and the whole sequence's naive recurrence (fp64); the output and every input gradient."""
    from kimi.ops.kda.context import sharded_kda

    T = int(cu_seqlens[-1])
    q, k, v, g, beta = kda_inputs(1, T, H, d, dtype, DEVICE, seed=7)
    do = torch.randn(1, T, H, d, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(8))
    out = {}
    for backend, cast in (("triton", None), ("chunk", torch.float32), ("naive", torch.float64)):
        leaves = [x.detach().to(cast or x.dtype).requires_grad_() for x in (q, k, v, g, beta)]
        if backend == "naive":
            o, _ = chunk_kda(*leaves, cu_seqlens=cu_seqlens, backend="naive")
        else:
            o, _ = sharded_kda(*leaves, shards, cu_seqlens=cu_seqlens, backend=backend)
        grads = torch.autograd.grad(o, leaves, do.to(dtype).to(o.dtype))
        out[backend] = dict(o=o, **dict(zip(GRAD_NAMES, grads)))
    return out["triton"], out["chunk"], out["naive"]


@torch.no_grad()
def _recurrent_case(dtype, cu_seqlens, H: int, d: int, decode: bool):
    """fused_recurrent_kda (forward only): Triton vs the PyTorch recurrence (fp32) and fp64. decode: one
    token for each of N sequences from a state (the decoding step); else the packed documents at once."""
    N = len(cu_seqlens) - 1
    B, T, cu = (N, 1, None) if decode else (1, int(cu_seqlens[-1]), cu_seqlens)
    inputs = kda_inputs(B, T, H, d, dtype, DEVICE, seed=4)
    h0 = torch.randn(N, H, d, d, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(5))
    out = {}
    for backend, cast in (("triton", None), ("recurrent", torch.float32), ("naive", torch.float64)):
        args = [x.to(cast or x.dtype) for x in (*inputs, h0)]
        o, s = fused_recurrent_kda(*args[:5], initial_state=args[5], output_final_state=True, cu_seqlens=cu,
                                   backend=backend)
        out[backend] = {"o": o, "final_state": s}
    return out["triton"], out["recurrent"], out["naive"]


def _gate_case(dtype, T: int, H: int, d: int):
    """The layer's fused l2norm and gate kernels (kimi/model/kda.py) vs its PyTorch formulas: forward and
    gradients, fp64 reference and fp32 PyTorch; gate inputs span softplus's regimes (x > 20 passes
    through)."""
    from kimi.ops.kda.triton.gate import kda_gate, l2norm

    gen = torch.Generator(device=DEVICE).manual_seed(6)
    x = torch.randn(1, T, H, d, device=DEVICE, generator=gen).to(dtype)
    f = (torch.rand(1, T, H, d, device=DEVICE, generator=gen) * 60 - 30).to(dtype)
    A_log = torch.randn(H, device=DEVICE, generator=gen)
    dt_bias = torch.randn(H * d, device=DEVICE, generator=gen)
    dy = torch.randn(1, T, H, d, device=DEVICE, generator=gen).to(dtype)
    dg = torch.randn(1, T, H, d, device=DEVICE, generator=gen)

    def torch_path(x, f, A_log, dt_bias):
        y = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
        return y, -A_log.exp()[:, None] * F.softplus(f + dt_bias.view(H, d))

    out = {}
    for name, fn, cast in (("triton", lambda *a: (l2norm(a[0]), kda_gate(*a[1:])), None),
                           ("torch", torch_path, torch.float32), ("fp64", torch_path, torch.float64)):
        leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (x, f, A_log, dt_bias)]
        y, g = fn(*leaves)
        grads = torch.autograd.grad((y, g), leaves, (dy.to(y.dtype), dg.to(g.dtype)))
        out[name] = dict(zip(("y", "g", "dx", "df", "dA_log", "ddt_bias"), (y, g, *grads)))
    return out["triton"], out["torch"], out["fp64"]


# kda_check's rows, in their order
CHECK_OPS = ("chunk", "chunk_safe", "context_2", "context_4", "recurrent", "decode", "gate")


def kda_check(docs: list[int], H: int, d: int, plant: bool = False,
              dtypes: tuple[str, ...] = ("float32", "bfloat16"), fla: str = "",
              done=lambda result: None, ops: tuple[str, ...] | None = None) -> dict:
    """Every KDA Triton op against the PyTorch path and fp64, in each of `dtypes` (q, k, v), on packed
    documents of these lengths (ones of length 1 and not multiples of 64 exercise the chunk edges); g, beta
    and states fp32, as the layer feeds them. Tests cover the kernels interpreted; on a GPU this covers them
    compiled. fla: what load_fla said ("fla-core <version>" when it loaded: its chunk_kda then gets the same
    two rows as ours, which are reported but pass or fail only fla-core, not this check). done(result so
    far) after each row. ops: only these rows (CHECK_OPS; None: all)."""
    cu_seqlens = torch.tensor([0, *itertools.accumulate(docs)], device=DEVICE)
    rows, start = [], time.perf_counter()

    def add(row: dict) -> None:  # each row as it ends: a check cut short by its cap shows how far it got
        rows.append(row)
        print(f"[{time.perf_counter() - start:.0f} s] {row['what']} ({row['dtype']}): "
              + (row["error"] if "error" in row else f"{row['max_vs_fp64']:.1e} vs fp64"), flush=True)
        done(result(rows))

    def result(rows: list) -> dict:
        return {"device": device_name(), "torch": torch.__version__, "H": H, "d": d, "docs": list(docs),
                "tolerance": TOLERANCE, "planted_failure": plant, "fla": fla or "not checked",
                "ok": all(r["ok"] for r in rows if r.get("ours", True)), "rows": rows}
    for dtype in (getattr(torch, name) for name in dtypes):
        cases = [("chunk", "chunk_kda forward and backward, packed documents, initial state",
                  lambda: _chunk_case(dtype, cu_seqlens, H, d, plant)),
                 ("chunk_safe", "chunk_kda bounded form (safe gate, lower_bound=-5), as above",
                  lambda: _chunk_case(dtype, cu_seqlens, H, d, False, lower_bound=-5.0))]
        cases += [(f"context_{n}", f"chunk_kda in {n} shards as cp ranks run it, packed documents",
                   lambda n=n: _context_case(dtype, cu_seqlens, H, d, n))
                  for n in (2, 4)]  # context parallelism's split (docs/algorithms.md, section 1.6)
        cases += [("recurrent", "fused_recurrent_kda, packed documents, initial state",
                   lambda: _recurrent_case(dtype, cu_seqlens, H, d, decode=False)),
                  ("decode", "fused_recurrent_kda, one token per sequence from a state",
                   lambda: _recurrent_case(dtype, cu_seqlens, H, d, decode=True)),
                  ("gate", "the layer's l2norm and kda_gate kernels, forward and backward",
                   lambda: _gate_case(dtype, sum(docs), H, d))]
        for op, what, fn in cases:
            if ops is None or op in ops:
                add(_row(op, what, dtype, fn))
        if fla.startswith("fla-core") and (ops is None or "chunk" in ops or "chunk_safe" in ops):
            for op, bound in (("fla_chunk", None), ("fla_chunk_safe", -5.0)):
                row = _row(op, f"{fla} chunk_kda" + (" bounded form" if bound else "") + ", as ours", dtype,
                           lambda: _chunk_case(dtype, cu_seqlens, H, d, False, bound, impl="fla"))
                add({**row, "ours": False})
    print(f"\nKDA Triton ops vs fp64 (and vs the PyTorch path), {device_name()}, H={H}, d={d}, "
          f"documents {docs}\n")
    print("| op | dtype | worst tensor | rel. error vs fp64 | PyTorch path vs fp64 | tolerance | ok |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['what']} | {r['dtype']} | - | {r['error']} | - | {r['tol']:.0e} | FAILED |")
            continue
        print(f"| {r['what']} | {r['dtype']} | {r['worst']} | {r['max_vs_fp64']:.1e} | "
              f"{max(r['torch_vs_fp64'].values()):.1e} | {r['tol']:.0e} | {'ok' if r['ok'] else 'FAILED'} |")
    return result(rows)


def timed(where: str, row: dict, errors: list, name: str, fn) -> None:
    """fn() (which fills row); a kernel that cannot run here records its error in row and errors, and the
    other measurements go on."""
    try:
        fn()
    except Exception as exc:
        from kimi.ops.dispatch import describe

        row[f"{name}_error"] = describe(exc)
        errors.append({"where": where, "impl": name, "error": row[f"{name}_error"]})
        print(f"{where} {name} failed: {row[f'{name}_error']}", flush=True)


def run_cuda(args) -> None:
    Ts = sorted(args.T or [2048, 4096, 8192, 16384, 32768])
    H, d = args.heads or 16, args.dim or 128
    dtype = torch.bfloat16
    peak = matmul_peak_tflops(dtype)
    fla, fla_status = load_fla(args.no_fla)
    print(f"{device_name()}: measured bf16 matmul peak {peak:.0f} TFLOP/s; {fla_status}", flush=True)
    check = None if args.no_self_check else kda_check(args.check_docs, args.check_heads, args.check_dim)

    impls = {"ours": lambda *a, **kw: chunk_kda(*a, **kw, backend="triton")}
    from kimi.ops.kda.triton import common  # here: --dry-run sets TRITON_INTERPRET before triton's import

    args.scores_grid = args.scores_grid or list(common.SCORES_GRIDS)
    if fla:
        impls["fla"] = lambda q, k, v, g, beta, **kw: fla[0](q, k, v, g, beta, **kw)
    import triton

    rows, errors = [], []
    record = {"config": {"H": H, "d": d, "tokens": args.tokens, "dtype": "bfloat16", "device": device_name(),
                         "torch": torch.__version__, "triton": triton.__version__, "fla": fla_status,
                         "matmul_peak_tflops": peak},
              "self_check": check, "errors": errors, "rows": rows, "complete": False}
    out = args.out or RESULTS / "kda_cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for T in Ts:
        B = max(1, args.tokens // T)
        q, k, v, g, beta = kda_inputs(B, T, H, d, dtype, DEVICE)
        row = {"T": T, "B": B}
        do = torch.randn_like(v)
        results = {}  # output and input gradients of one call, to compare ours with fla's
        for name, fn in impls.items():
            leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]

            def measure():
                o = fn(*leaves)[0]
                results[name] = [o.detach(), *torch.autograd.grad(o, leaves, do)]
                row[f"{name}_fwd_ms"] = cuda_ms(lambda: fn(q, k, v, g, beta))
                row[f"{name}_fwdbwd_ms"] = cuda_ms(lambda: fn(*leaves)[0].backward(do))

            timed(f"T={T}", row, errors, name, measure)
        if "fla" in results and "ours" in results:
            names = "o dq dk dv dg dbeta".split()
            pairs = zip(names, results["ours"], results["fla"])
            row["rel_diff_ours_vs_fla"] = {n: rel(a, b) for n, a, b in pairs}
        # Kimi K3's safe gate: our kernels' general and bounded forms on the same safe-gate inputs
        leaves = [x.detach().requires_grad_() for x in (q, k, v, safe_gate(g.shape, device=DEVICE), beta)]
        for form, lb in (("general", None), ("bounded", -5.0)):
            def step(lb=lb):
                impls["ours"](*leaves, lower_bound=lb)[0].backward(do)

            timed(f"T={T}", row, errors, f"safe_{form}",
                  lambda form=form, step=step: row.update({f"safe_{form}_fwdbwd_ms": cuda_ms(step)}))
        scores_layouts(row, errors, (q, k, v, g, beta), do, args.scores_grid)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        row["sdpa_fwd_ms"] = cuda_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
        qa, ka, va = (x.detach().requires_grad_() for x in (qt, kt, vt))
        do_a = torch.randn_like(qa)
        row["sdpa_fwdbwd_ms"] = cuda_ms(
            lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True).backward(do_a))
        flops, attn_flops = kda_flops(B, T, H, d), 2 * B * H * T * T * d
        for name in impls:
            if f"{name}_fwd_ms" in row:
                row[f"{name}_fwd_tflops"] = flops / row[f"{name}_fwd_ms"] / 1e9
                row[f"{name}_fwdbwd_tflops"] = 3 * flops / row[f"{name}_fwdbwd_ms"] / 1e9
        row["sdpa_fwd_tflops"] = attn_flops / row["sdpa_fwd_ms"] / 1e9
        row["sdpa_fwdbwd_tflops"] = 3.5 * attn_flops / row["sdpa_fwdbwd_ms"] / 1e9
        row.update(decode_step(B, T, H, d, dtype, fla, errors))
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps(record, indent=2) + "\n")  # what is done so far, should a later T hang
        torch.cuda.empty_cache()

    print(f"\nbf16, H={H}, d={d}, B*T={args.tokens}; ms per call (TFLOP/s, % of the {peak:.0f} TFLOP/s "
          "matmul peak); ratio = fla time / our time (>= 1: ours as fast or faster)\n")
    for mode in ("fwd", "fwdbwd"):
        print(f"| T | B | ours {mode} | fla {mode} | ratio | SDPA {mode} |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            def cell(name):
                ms = r.get(f"{name}_{mode}_ms")
                if ms is None:
                    return "-"
                tf = r[f"{name}_{mode}_tflops"]
                return f"{ms:.2f} ({tf:.0f}, {100 * tf / peak:.0f}%)"

            mine, theirs = r.get(f"ours_{mode}_ms"), r.get(f"fla_{mode}_ms")
            ratio = theirs / mine if mine and theirs else None
            print(f"| {r['T']} | {r['B']} | {cell('ours')} | {cell('fla')} | {fmt(ratio, '.2f')} | "
                  f"{cell('sdpa')} |")
        print()
    print("our chunk KDA per launch layout of the two scores kernels (common.scores_grid), ms per call\n")
    print("| T | B | " + " | ".join(f"{g} fwd / fwd+bwd" for g in args.scores_grid) + " |")
    print("|---|---|" + "---|" * len(args.scores_grid))
    for r in rows:
        cells = [f"{fmt(r.get(f'grid_{g}_fwd_ms'), '.2f')} / {fmt(r.get(f'grid_{g}_fwdbwd_ms'), '.2f')}"
                 for g in args.scores_grid]
        print(f"| {r['T']} | {r['B']} | " + " | ".join(cells) + " |")
    print()
    print("one decoding step (B sequences, state or KV cache of T tokens each), microseconds\n")
    print("| T | B | ours (fused recurrent) | fla fused recurrent | attention over the KV cache |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['B']} | {fmt(r.get('decode_ours_us'), '.1f')} | "
              f"{fmt(r.get('decode_fla_us'), '.1f')} | {r['decode_sdpa_us']:.1f} |")
    record["complete"] = True
    write(out, record)


def scores_layouts(row: dict, errors: list, inputs, do, specs: list[str]) -> None:
    """Our chunk KDA forward and forward+backward under each launch layout of the scores kernels (the
    process's own layout restored after): the side-by-side that picks common.SCORES_GRID's default. Each
    layout's output and input gradients are held to the first layout's (the same sums in another order
    or grouping): grid_<spec>_rel_diff, and an error where it exceeds bf16's TOLERANCE, so a layout that
    computes something else on this GPU is never picked (gpu_check.fastest_scores_layout)."""
    from kimi.ops.kda.triton import common

    kept, first = dict(common.SCORES_GRID), []
    leaves = [x.detach().requires_grad_() for x in inputs]
    try:
        for spec in specs:
            common.SCORES_GRID.update(common.scores_grid(spec))

            def measure(spec=spec):
                o = chunk_kda(*leaves, backend="triton")[0]
                results = [o.detach(), *torch.autograd.grad(o, leaves, do)]
                if first:
                    diff = max(rel(a, b) for a, b in zip(results, first))
                    row[f"grid_{spec}_rel_diff"] = diff
                    if not diff <= TOLERANCE["bfloat16"]:  # NaN included
                        raise RuntimeError(f"{spec} differs from {specs[0]} by {diff:.1e} (relative)")
                else:
                    first.extend(results)
                row[f"grid_{spec}_fwd_ms"] = cuda_ms(lambda: chunk_kda(*inputs, backend="triton"))
                row[f"grid_{spec}_fwdbwd_ms"] = cuda_ms(
                    lambda: chunk_kda(*leaves, backend="triton")[0].backward(do))

            timed(f"T={row['T']}", row, errors, f"grid {spec}", measure)
    finally:
        common.SCORES_GRID.update(kept)


@torch.no_grad()
def decode_step(B: int, T: int, H: int, d: int, dtype, fla, errors: list | None = None) -> dict:
    """One token for B sequences: KDA reads and updates a [H, d, d] fp32 state per sequence; attention
    reads a KV cache of T tokens per sequence."""
    q, k, v, g, beta = kda_inputs(B, 1, H, d, dtype, DEVICE, seed=1)
    state = torch.randn(B, H, d, d, device=DEVICE)
    out = {}

    def ours():
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                   backend="triton")

    errors = [] if errors is None else errors
    timed(f"T={T}", out, errors, "decode_ours", lambda: out.update(decode_ours_us=1e3 * cuda_ms(ours)))
    if fla:
        def theirs():
            return fla[1](q, k, v, g, beta, initial_state=state, output_final_state=True)

        def both():
            out["decode_fla_us"] = 1e3 * cuda_ms(theirs)
            if "decode_ours_us" in out:
                out["decode_rel_diff_state_ours_vs_fla"] = rel(ours()[1], theirs()[1])

        timed(f"T={T}", out, errors, "decode_fla", both)
    cache_k, cache_v = (torch.randn(B, H, T, d, device=DEVICE, dtype=dtype) for _ in range(2))
    q_a = q.transpose(1, 2)
    out["decode_sdpa_us"] = 1e3 * cuda_ms(lambda: F.scaled_dot_product_attention(q_a, cache_k, cache_v))
    return out


# ------------------------------------------------------------------------------------------ compile check

KDA_MODULES = ("common", "chunk_fwd", "chunk_bwd", "recurrent", "gate")
HOT = {"scores_kernel": "chunk fwd", "solve_kernel": "chunk fwd", "wu_kernel": "chunk fwd",
       "output_kernel": "chunk fwd", "state_kernel": "state pass fwd", "state_bwd_kernel": "state pass bwd",
       "chunk_bwd_kernel": "chunk bwd", "scores_bwd_kernel": "chunk bwd"}
# pointers typed by the inputs' dtype: inputs, outputs and the intermediates that only feed matmuls (the rest
# are fp32: gates, G, L, U, final states, score gradients, fp32 partial grads)
INPUT_TYPED = {"q", "k", "v", "beta", "o", "do", "dq", "dk", "dv", "dbeta", "x", "y", "dy", "dx", "f",
               "Aqk", "Ainv", "W", "KG", "QG", "Hs", "VN", "DH", "DVN"}
# constexpr booleans: both values compiled
SWITCHES = ("HAS_INIT", "HAS_DFINAL", "REVERSE", "WITH_QG", "SAFE", "BOUNDED")
BASE = dict(dtype="bf16", K=128, V=128)  # the model's shape: where the cu_seqlens dtype is varied too
# Why the spills left in hot kernels are left (written into the JSONs beside the numbers).
NOTES = {
    "scores_kernel": "bf16 K = 128, layout serial:8 (common.scores_grid): 247-254 registers, no spills, "
                     "except sm_80's BOUNDED=1 (Kimi K3's safe gate), 40 B / 72 B from its tf32x3 diagonal "
                     "products (bf16 ones spill less but put the output 1.5x further from fp64). One "
                     "program of 8 warps fits a multiprocessor. split:4 takes the diagonal block before the "
                     "anchored rows: 168 registers, 12 warps resident; tokens:4 (every product over key "
                     "slices, the diagonal one key token at a time instead of [16, 16, BKD] tiles) 126-128, "
                     "16 warps.",
    "scores_bwd_kernel": "bf16 K = 128, layout serial:8 (one program walks its chunk's 4 sub-chunks x 4 key "
                         "slices): 80-180 B of spills on sm_90 (8-40 B on sm_80) at 255 registers, from the "
                         "[16, 16, BKD] diagonal tiles (three of them: dq, dk by row and by column) and the "
                         "state kept across units. split:4 spills nothing but still takes 255 registers "
                         "(8 warps resident, as serial:8); tokens:4 (the diagonal one key token at a time) "
                         "takes 96 on sm_90 and 128 on sm_80: 20 and 16 warps resident, the layout the next "
                         "GPU call times against the others (bench/kda.py --scores-grid).",
    "chunk_bwd_kernel": "sm_90: ~130 B, since its two products with a [C, BKC] operand multiply as tf32x3 "
                        "on fp32 operands there (a 32-wide bf16 operand faults on Hopper, "
                        "common.HALF_MIN_ROW; 0 B before that change); storing dA_qk before the key-block "
                        "loop instead of after it took it from ~250 B. sm_80: ~88 B, its ptxas keeps a few "
                        "more registers live across the key-block loop; smaller key blocks would reread dO, "
                        "V_new and dV_new more often, and 64-wide ones (bf16 operands) spilled ~420 B.",
    "wu_kernel": "sm_80 only, at K = 128 with V = 64 (no preset's head shape: theirs are 128 / 128): "
                 "~630 B at 255 registers; sm_90, and sm_80 at V = 128, spill nothing.",
    "state_kernel": "sm_80 only, at BVS = 64, 12-48 B; BVS = 32 (chosen for fp32 inputs when the sequences "
                    "and heads do not fill the GPU; half precision always takes 64, common.HALF_MIN_ROW) "
                    "does not spill.",
    "state_bwd_kernel": "sm_80 only, at BVS = 64, ~50 B; BVS = 32 (fp32 inputs only, as for "
                        "state_kernel) does not spill.",
    "fp32": "fp32 inputs (trainer.precision=fp32 on a GPU) multiply as tf32x3 (three TF32 tensor-core "
            "products, about fp32 accuracy); some fp32 variants at K = 128 still spill, and sm_80's "
            "ptxas puts whole operand tiles on the stack (its '32 registers' rows). Train in bf16 for "
            "speed; fp32 is for checking.",
}


def kda_kernel_paths() -> list[Path]:
    root = Path(__file__).resolve().parent.parent / "kimi/ops/kda/triton"
    return [root / f"{m}.py" for m in KDA_MODULES]


@functools.cache
def kda_kernels() -> dict:
    """name -> (module, JITFunction, [(constexpr overrides, num_warps, num_stages)]): every @triton.jit
    function in kimi/ops/kda/triton that no other calls (the launched ones), autotuned ones with each of
    their configs, plain ones with the num_warps / num_stages of their launch (triton's 4 / 3 if none), the
    state passes once per value-block candidate (common.STATE_BLOCKS)."""
    import importlib

    import triton

    from compile_check import kernels_and_helpers, launch_options
    from kimi.ops.kda.triton import common

    names, _ = kernels_and_helpers(kda_kernel_paths())
    out = {}
    for mod in KDA_MODULES:
        module = importlib.import_module(f"kimi.ops.kda.triton.{mod}")
        source = Path(module.__file__).read_text()
        for name in names:
            obj = module.__dict__.get(name)
            if obj is None or getattr(getattr(obj, "fn", obj), "__module__", None) != module.__name__:
                continue
            if isinstance(obj, triton.runtime.Autotuner):
                configs = [(c.kwargs, c.num_warps, c.num_stages) for c in obj.configs]
                obj = obj.fn
            else:
                launch = launch_options(source, name)
                warps, stages = launch.get("num_warps", 4), launch.get("num_stages", 3)
                # the state passes' value block is chosen per launch (common.state_block): compile each
                blocks = [{"BVS": b} for b in common.STATE_BLOCKS] if "BVS" in obj.arg_names else [{}]
                configs = [(b, warps, stages) for b in blocks]
                if "SPLIT" in obj.arg_names:  # the scores kernels: each launch layout a benchmark may pick
                    grids = map(common.scores_grid, common.SCORES_GRIDS)
                    configs = [({"SPLIT": g["split"], "TOKENS": g["tokens"]}, g["warps"], stages)
                               for g in grids]
            out[name] = (mod, obj, configs)
    missing = set(names) - set(out)
    if missing:
        raise SystemExit(f"jit kernels not found in the imported modules: {sorted(missing)}")
    return out


def kda_variants(fn, quick: bool) -> list[dict]:
    """The specialisations of one kernel: head dims and dtypes where its constexprs / pointers depend on
    them, each boolean switch both ways, cu_seqlens int32 (what a [B, T] batch is packed with) and, at the
    base shape, int64 (a caller's cu_seqlens)."""
    args = set(fn.arg_names)
    axes = {"dtype": ["bf16"] if quick else ["bf16", "fp32"], "K": [128] if quick else [64, 128],
            "V": [128] if quick else [64, 128]}
    if not (args & INPUT_TYPED or "PREC" in args):
        axes["dtype"] = ["fp32"]
    if not args & {"K", "D"}:
        axes["K"] = [None]
    if "V" not in args:
        axes["V"] = [None]
    switches = [s for s in SWITCHES if s in args]
    shapes = list(itertools.product(*axes.values()))
    if not quick and axes["V"] != [None] and axes["K"] != [None]:
        # a context-parallel rank's one run carries V + K value columns (kimi/ops/kda/context.py): 1b's 256
        shapes.append(("bf16" if "bf16" in axes["dtype"] else axes["dtype"][0], 128, 256))
    variants = []
    for dtype, K, V in shapes:
        for flags in itertools.product((False, True), repeat=len(switches)):
            variants.append(dict(dtype=dtype, K=K, V=V, cu="i32", **dict(zip(switches, flags))))
    if "cu_seqlens" in args:
        base = next((v for v in variants if all(v[k] in (BASE[k], None) for k in BASE)), variants[0])
        variants.append(dict(base, cu="i64"))
    return variants


def kda_signature(fn, variant: dict, extra: dict, hopper: bool) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource, with the tiles the launch sites use."""
    from kimi.ops.kda.triton import common, gate

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[variant["dtype"]]
    K, V = variant["K"] or 64, variant["V"] or 64
    BK, BKD, BV, BVS, BKC = common.tiles(K, V)
    values = dict(K=K, D=K, V=V, BK=BK, BD=BK, BKD=BKD, BV=BV, BVS=BVS, BKC=BKC, C=common.CHUNK,
                  BC=common.SUB,
                  BR=gate.ROWS, PREC=common.dot_precision(dtype))
    values["PREC_KB"] = common.key_block_precision(values["PREC"], BKC, hopper)
    values["PREC_D"] = common.dot_precision(torch.float32)  # the bounded diagonal blocks' (scores kernels)
    values.update({s: variant[s] for s in SWITCHES if s in variant})
    values.update(extra)
    if fn.__name__ == "chunk_cumsum_kernel":  # launched with tiles(K, 16)[0]
        values["BK"] = common.tiles(K, 16)[0]
    signature, constexprs, attrs = {}, {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in _constexpr_names(fn):
            signature[arg] = "constexpr"
            constexprs[arg] = values.get(arg)
        elif arg in ("H", "N"):
            signature[arg] = "i32"
        elif arg in ("scale", "eps", "lower"):
            signature[arg] = "fp32"
        else:  # a pointer; torch allocations are 16-byte aligned
            if arg == "cu_seqlens":
                signature[arg] = "*" + variant["cu"]
            elif arg in ("chunks", "first_chunk"):
                signature[arg] = "*i32"
            else:
                signature[arg] = "*" + (variant["dtype"] if arg in INPUT_TYPED else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _constexpr_names(fn) -> set[str]:
    return {p.name for p in fn.params if p.is_constexpr}


def launched(variant: dict, extra: dict, arch: int) -> bool:
    """Whether state_block can pick this value block for this dtype there (Hopper, half precision: 64
    only)."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[variant["dtype"]]
    from kimi.ops.kda.triton import common

    return "BVS" not in extra or extra["BVS"] in common.state_blocks(dtype, arch == 90)


def _compile_job(job: tuple) -> dict:
    name, variant, config, arch = job
    from compile_check import compile_kernel

    _, fn, _ = kda_kernels()[name]
    extra, warps, stages = config
    signature, constexprs, attrs = kda_signature(fn, variant, extra, arch == 90)
    missing = {k for k, v in constexprs.items() if v is None}
    row = dict(kernel=name, hot=HOT.get(name, ""), arch=arch, **variant, config=dict(extra),
               warps=warps, stages=stages)
    if missing:
        row["error"] = f"no value for constexprs {sorted(missing)}"
        return row
    row.update(compile_kernel(fn, signature, constexprs, attrs, arch, warps, stages))
    return row


def _variant_text(r: dict) -> str:
    flags = [f"{s}={int(r[s])}" for s in SWITCHES if s in r]
    dims = "/".join(str(r[d]) for d in ("K", "V") if r.get(d) is not None)
    return " ".join(x for x in (r["dtype"], dims, f"cu {r['cu']}", *flags) if x)


def _report(arch: int, mine: list[dict], kernels, helpers, seconds: float, args) -> None:
    """Print one architecture's tables and write its JSON."""
    import triton

    from compile_check import ARCHS, spilled

    name, per_sm, per_block = ARCHS[arch]
    print(f"\n## {name}: per block {per_block} B of shared memory\n")
    print("| kernel | hot | variant | config | warps | stages | regs | spill st/ld B | stack | smem B | "
          "warps/SM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in mine:
        tail = (f"FAILED: {r['error']} | | | | " if "error" in r else
                f"{r['regs']} | {r['spill_stores']}/{r['spill_loads']} | {r['spill_stack']} | {r['smem']}"
                + (" OVER" if r["smem_over_limit"] else "") + f" | {r['resident_warps']}")
        print(f"| {r['kernel']} | {r['hot']} | {_variant_text(r)} | {r['config'] or '-'} | "
              f"{r['warps']} | {r['stages']} | {tail} |")
    failed = [r for r in mine if "error" in r]
    narrow = [r for r in mine if r.get("narrow_half")]
    spills = [r for r in mine if spilled(r)]
    over = [r for r in mine if r.get("smem_over_limit")]
    hot = [r for r in mine if r["hot"] and "error" not in r and r["cu"] == "i32"
           and all(r[k] in (v, None) for k, v in BASE.items())]
    print(f"\nhot kernels at bf16 K = V = 128 on {name}:\n")
    print("| kernel | part | variant | config | warps | regs | spill st/ld B | smem B | warps/SM |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in hot:
        print(f"| {r['kernel']} | {r['hot']} | {_variant_text(r)} | {r['config'] or '-'} | {r['warps']} | "
              f"{r['regs']} | {r['spill_stores']}/{r['spill_loads']} | {r['smem']} | {r['resident_warps']} |")
    print(f"\n{len(mine) - len(failed)} of {len(mine)} compiled for {name}; "
          f"{len(spills)} spill, {len(over)} over {per_block} B of shared memory, "
          f"{len(narrow)} with narrow half-precision operands")
    for r in failed:
        print(f"  FAILED {r['kernel']} [{_variant_text(r)}]: {r['error']}")
    for r in narrow:
        print(f"  FAILED {r['kernel']} [{_variant_text(r)}, {r['config'] or '-'}]: narrow half-precision "
              f"operands ({', '.join(r['narrow_half'])}), which fault on Hopper (common.HALF_MIN_ROW)")
    for r in spills:
        print(f"  spills {r['kernel']} [{_variant_text(r)}, warps {r['warps']}]: "
              f"{r['spill_stores']} B stores / {r['spill_loads']} B loads, {r['regs']} regs")
    for r in over:
        print(f"  shared memory over the limit {r['kernel']} [{_variant_text(r)}]: {r['smem']} B")
    result = dict(target=f"{name}, compiled, not run", triton=triton.__version__, quick=args.quick,
                  smem_limit_per_block=per_block, smem_per_sm=per_sm, kernels=sorted(kernels),
                  helpers_inlined=helpers, hot=HOT, seconds_so_far=round(seconds, 1),
                  failed=len(failed), spilled=len(spills), smem_over_limit=len(over),
                  narrow_half=len(narrow), notes=NOTES,
                  rows=mine)
    suffix = "_quick" if args.quick else ""
    write(RESULTS / f"kda_sm{arch}_compile{suffix}.json", result)


HOT_NAMES = {"scores_kernel": "scores (chunk forward)", "solve_kernel": "solve",
             "wu_kernel": "wu (W, U, decayed keys)", "output_kernel": "output",
             "state_kernel": "state pass", "state_bwd_kernel": "state pass backward",
             "chunk_bwd_kernel": "chunk backward", "scores_bwd_kernel": "scores backward"}


def hot_table(results: dict[int, dict]) -> str:
    """The hot kernels at the model's shape (bf16, K = V = 128, cu_seqlens int32) from the sm_90 and sm_80
    compile checks, as docs/benchmarks.md shows them: per kernel (per launch layout for the scores kernels,
    per value block for the state passes), the range of registers over its switches, the most spilled bytes
    and the warps resident per multiprocessor (compile_check.resident_warps)."""
    def span(values):
        lo, hi = min(values), max(values)
        return f"{lo}" if lo == hi else f"{lo}-{hi}"

    groups: dict = {}
    for arch, result in results.items():
        for r in result["rows"]:
            if (r["hot"] and r["dtype"] == "bf16" and r["K"] in (128, None) and r.get("V") in (128, None)
                    and r["cu"] == "i32" and "error" not in r):
                config = r["config"]
                if "SPLIT" in config:  # the scores kernels: per launch layout and gate form
                    form = "serial" if not config["SPLIT"] else "tokens" if config.get("TOKENS") else "split"
                    label = f"{form}:{r['warps']}" + (", bounded gate" if r.get("BOUNDED") else "")
                else:
                    label = f"BVS {config['BVS']}" if "BVS" in config else ""
                groups.setdefault((r["kernel"], label), {}).setdefault(arch, []).append(r)
    archs = sorted(results, reverse=True)
    head = " | ".join(f"sm_{a} {c}" for a in archs for c in ("regs", "spills st/ld B", "warps/SM"))
    lines = [f"| kernel | layout | {head} |", "|---|---|" + "---|" * 3 * len(archs)]
    order = list(HOT_NAMES)
    for (kernel, label), by_arch in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        cells = []
        for a in archs:
            rows = by_arch.get(a)
            if not rows:
                cells += ["-", "-", "-"]
                continue
            st, ld = max(r["spill_stores"] for r in rows), max(r["spill_loads"] for r in rows)
            cells += [span([r["regs"] for r in rows]), f"{st}/{ld}" if st or ld else "0",
                      span([r["resident_warps"] for r in rows])]
        lines.append(f"| {HOT_NAMES[kernel]} | {label or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compile_check(args) -> None:
    """Compile every KDA kernel, specialisation and config for each --arch; write one JSON per arch."""
    from concurrent.futures import ProcessPoolExecutor

    from compile_check import arch_list, kernels_and_helpers
    from kimi.ops.kda.triton import common

    if common.INTERPRET:
        raise SystemExit("--compile-check needs TRITON_INTERPRET unset")
    start = time.perf_counter()
    kernels = kda_kernels()
    _, helpers = kernels_and_helpers(kda_kernel_paths())
    jobs = [(name, variant, config, arch) for arch in arch_list(args.arch)
            for name, (_, fn, configs) in kernels.items() for config in configs
            for variant in kda_variants(fn, args.quick) if launched(variant, config[0], arch)]
    print(f"{len(jobs)} compilations ({len(kernels)} kernels) on {args.jobs} processes", flush=True)
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:  # results in job order: each arch written once complete
        for row in pool.map(_compile_job, jobs):
            rows.append(row)
            arch = row["arch"]
            if sum(r["arch"] == arch for r in rows) == sum(j[3] == arch for j in jobs):
                _report(arch, [r for r in rows if r["arch"] == arch], kernels, helpers,
                        time.perf_counter() - start, args)
    seconds = time.perf_counter() - start
    suffix = "_quick" if args.quick else ""
    written = {a: json.loads((RESULTS / f"kda_sm{a}_compile{suffix}.json").read_text())
               for a in arch_list(args.arch)}
    print("\nhot kernels at bf16 K = V = 128 (docs/benchmarks.md):\n\n" + hot_table(written))
    print(f"compile check: {seconds:.0f} s")
    if any("error" in r or r.get("narrow_half") for r in rows):
        raise SystemExit(1)


def write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=None, help="lengths (default per device)")
    parser.add_argument("--heads", type=int, default=None, help="default: 16 on GPU, 4 on CPU")
    parser.add_argument("--dim", type=int, default=None, help="head dim; default: 128 on GPU, 64 on CPU")
    parser.add_argument("--tokens", type=int, default=32768, help="GPU: B * T, B = tokens // T")
    parser.add_argument("--repeats", type=int, default=3, help="CPU: timed calls per point")
    parser.add_argument("--skip-naive-above", type=int, default=4096, help="CPU")
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch intra-op threads")
    parser.add_argument("--cpu", action="store_true", help="the CPU table even when a GPU is present")
    parser.add_argument("--safe-gate", action="store_true",
                        help="CPU: the chunk path's bounded form (Kimi K3's safe gate) against its "
                             "general one")
    parser.add_argument("--context", action="store_true",
                        help="CPU: a continuing context-parallel rank's KDA against one device's run from a "
                             "known state")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--check", action="store_true",
                        help="GPU: only the correctness check of every KDA Triton op (exit 1 when one fails)")
    parser.add_argument("--check-docs", type=int, nargs="+", default=[100, 1, 199, 137, 63],
                        help="GPU check: lengths of the packed documents")
    parser.add_argument("--check-heads", type=int, default=4, help="GPU check: heads")
    parser.add_argument("--check-dim", type=int, default=128, help="GPU check: head dim")
    parser.add_argument("--check-dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"], help="GPU check: input dtypes")
    parser.add_argument("--check-ops", nargs="+", default=None, choices=CHECK_OPS,
                        help="GPU check: only these ops (default: all; fla-core's rows come with chunk's)")
    parser.add_argument("--check-fla", action="store_true",
                        help="GPU check: fla-core's chunk_kda on the same cases (reported, not failing)")
    parser.add_argument("--no-self-check", action="store_true", help="GPU timing without the check first")
    parser.add_argument("--no-fla", action="store_true", help="GPU: leave fla-core out")
    parser.add_argument("--scores-grid", nargs="+", default=None,
                        help="GPU: launch layouts of the scores kernels timed side by side (layout:warps; "
                             "default: kimi.ops.kda.triton.common.SCORES_GRIDS)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the GPU path's code on CPU, Triton interpreted: plumbing only (tiny sizes)")
    parser.add_argument("--plant-failure", action="store_true",
                        help="tests: perturb one Triton result, so --check must fail")
    parser.add_argument("--compile-check", action="store_true",
                        help="no GPU needed: compile every KDA kernel for --arch, report regs and spills")
    parser.add_argument("--arch", default="all", choices=["90", "80", "all"], help="--compile-check target")
    parser.add_argument("--quick", action="store_true", help="--compile-check: bf16, K = V = 128 only")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="--compile-check processes")
    args = parser.parse_args()
    if args.safe_gate or args.context:
        run_cpu_ab(args, "safe_gate" if args.safe_gate else "context")
        return
    if args.compile_check:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        compile_check(args)
        return
    if args.dry_run:
        global DEVICE
        DEVICE = "cpu"
        if "triton" not in sys.modules:  # triton reads it at import, when the kernels are decorated
            os.environ["TRITON_INTERPRET"] = "1"
    elif args.check and not torch.cuda.is_available():
        raise SystemExit("--check needs a CUDA GPU (or --dry-run, which runs its code on CPU)")
    if args.check:
        fla = load_fla()[1] if args.check_fla else ""
        path = args.out or RESULTS / "kda_gpu_check.json"
        result = kda_check(args.check_docs, args.check_heads, args.check_dim, args.plant_failure,
                           tuple(args.check_dtypes), fla,
                           lambda r: path.write_text(json.dumps(r, indent=2) + "\n"), args.check_ops)
        write(path, result)
        if not result["ok"]:
            failed = [f"{r['what']} ({r['dtype']})" for r in result["rows"]
                      if not r["ok"] and r.get("ours", True)]
            raise SystemExit(f"KDA check FAILED: {'; '.join(failed)}")
    elif args.dry_run or (torch.cuda.is_available() and not args.cpu):
        run_cuda(args)
    else:
        run_cpu(args)


if __name__ == "__main__":
    main()
