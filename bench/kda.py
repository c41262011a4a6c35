"""KDA speed: our kernels against the references, on whatever this machine has.

On a CUDA GPU (compiled Triton; do not set TRITON_INTERPRET): forward and forward+backward time of our
Triton chunk_kda, fla-core's chunk_kda (when installed) and causal softmax attention (SDPA) at
T = 2k..32k with B*T = 32k tokens, H = 16, d = 128, bf16; achieved TFLOP/s against a measured bf16 matmul
peak; and one decoding step (our fused recurrent kernel, fla-core's, and attention over a KV cache of T
tokens). Writes bench/results/kda_cuda.json.

On CPU: forward+backward time of the token-by-token reference, the PyTorch chunkwise path and SDPA, fp32,
B = 1 (the shape of the cost, not peak speed: KDA grows linearly in T, attention quadratically once the
T^2 term dominates). Writes bench/results/kda_cpu.json.

    python bench/kda.py [--T ...] [--repeats 3] [--skip-naive-above 4096] [--threads N]   (CPU)
    python bench/kda.py [--T 2048 4096 8192 16384 32768] [--tokens 32768] [--heads 16] [--dim 128]  (GPU)

Prints markdown tables. FLOP counts are nominal, the same formula for every KDA implementation: forward
6 d^2 + 5 C d per token and head (C = 64: scores, W/U, state read, write and intra-chunk output; the
triangular solve left out), forward+backward 3x that; causal attention 2 T^2 d per head forward, 3.5x that
for forward+backward.
"""

import argparse
import json
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
        ratio = results["chunk"][T] / results["sdpa"][T] if results["chunk"][T] and results["sdpa"][T] else None
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
    """Median milliseconds of fn() on the GPU (Triton's do_bench: warm-up, cache flush, CUDA events)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def matmul_peak_tflops(dtype=torch.bfloat16) -> float:
    n = 8192
    a, b = (torch.randn(n, n, device=DEVICE, dtype=dtype) for _ in range(2))
    return 2 * n**3 / cuda_ms(lambda: a @ b) / 1e9


def kda_flops(B: int, T: int, H: int, d: int) -> float:
    return B * H * T * (6 * d * d + 5 * CHUNK * d)


def load_fla():
    """fla-core's chunk_kda and fused_recurrent_kda, or None when it is not installed."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent
    except ImportError:
        return None
    return fla_chunk, fla_recurrent


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def self_check(H: int, d: int) -> dict:
    """Compiled kernels vs the PyTorch chunk path on one small packed batch (fp32 and bf16 inputs): the
    largest relative error over output, final state and all input gradients. Tests cover the kernels
    interpreted; this covers the compiled ones (expect ~1e-6 in fp32, ~1e-2 in bf16)."""
    errors = {}
    cu_seqlens = torch.tensor([0, 100, 300, 301, 500], device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        inputs = kda_inputs(1, 500, H, d, dtype, DEVICE, seed=2)
        h0 = torch.randn(4, H, d, d, device=DEVICE)
        results = []
        for backend in ("chunk", "triton"):
            leaves = [x.detach().float().requires_grad_() if backend == "chunk" else
                      x.detach().requires_grad_() for x in (*inputs, h0)]
            o, s = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                             cu_seqlens=cu_seqlens, backend=backend)
            gen = torch.Generator(device=DEVICE).manual_seed(0)
            do = torch.randn(o.shape, device=DEVICE, generator=gen)
            ds = torch.randn(s.shape, device=DEVICE, generator=gen)
            results.append([o, s, *torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), leaves)])
        errors[str(dtype).removeprefix("torch.")] = max(rel(a, b) for a, b in zip(results[1], results[0]))
    return errors


def run_cuda(args) -> None:
    Ts = sorted(args.T or [2048, 4096, 8192, 16384, 32768])
    H, d = args.heads or 16, args.dim or 128
    dtype = torch.bfloat16
    peak = matmul_peak_tflops(dtype)
    fla = load_fla()
    print(f"{torch.cuda.get_device_name()}: measured bf16 matmul peak {peak:.0f} TFLOP/s; "
          f"fla-core {'found' if fla else 'not installed: its columns stay empty'}", flush=True)
    check = self_check(H, d)
    print(f"self-check, compiled Triton vs PyTorch chunk path, max relative error: {check}", flush=True)

    impls = {"ours": lambda *a, **kw: chunk_kda(*a, **kw, backend="triton")}
    if fla:
        impls["fla"] = lambda q, k, v, g, beta, **kw: fla[0](q, k, v, g, beta, **kw)
    rows = []
    for T in Ts:
        B = max(1, args.tokens // T)
        q, k, v, g, beta = kda_inputs(B, T, H, d, dtype, DEVICE)
        row = {"T": T, "B": B}
        do = torch.randn_like(v)
        results = {}  # output and input gradients of one call, to compare ours with fla's
        for name, fn in impls.items():
            leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
            o = fn(*leaves)[0]
            results[name] = [o.detach(), *torch.autograd.grad(o, leaves, do)]
            row[f"{name}_fwd_ms"] = cuda_ms(lambda: fn(q, k, v, g, beta))

            def fwd_bwd():
                fn(*leaves)[0].backward(do)

            row[f"{name}_fwdbwd_ms"] = cuda_ms(fwd_bwd)
        if "fla" in results:
            row["rel_diff_ours_vs_fla"] = {n: rel(a, b) for n, a, b in
                                           zip("o dq dk dv dg dbeta".split(), results["ours"], results["fla"])}
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        row["sdpa_fwd_ms"] = cuda_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
        qa, ka, va = (x.detach().requires_grad_() for x in (qt, kt, vt))
        do_a = torch.randn_like(qa)
        row["sdpa_fwdbwd_ms"] = cuda_ms(
            lambda: F.scaled_dot_product_attention(qa, ka, va, is_causal=True).backward(do_a))
        flops, attn_flops = kda_flops(B, T, H, d), 2 * B * H * T * T * d
        for name in impls:
            row[f"{name}_fwd_tflops"] = flops / row[f"{name}_fwd_ms"] / 1e9
            row[f"{name}_fwdbwd_tflops"] = 3 * flops / row[f"{name}_fwdbwd_ms"] / 1e9
        row["sdpa_fwd_tflops"] = attn_flops / row["sdpa_fwd_ms"] / 1e9
        row["sdpa_fwdbwd_tflops"] = 3.5 * attn_flops / row["sdpa_fwdbwd_ms"] / 1e9
        row.update(decode_step(B, T, H, d, dtype, fla))
        rows.append(row)
        print(json.dumps(row), flush=True)
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

            ratio = r["fla_" + mode + "_ms"] / r["ours_" + mode + "_ms"] if f"fla_{mode}_ms" in r else None
            print(f"| {r['T']} | {r['B']} | {cell('ours')} | {cell('fla')} | {fmt(ratio, '.2f')} | "
                  f"{cell('sdpa')} |")
        print()
    print("one decoding step (B sequences, state or KV cache of T tokens each), microseconds\n")
    print("| T | B | ours (fused recurrent) | fla fused recurrent | attention over the KV cache |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['B']} | {r['decode_ours_us']:.1f} | {fmt(r.get('decode_fla_us'), '.1f')} | "
              f"{r['decode_sdpa_us']:.1f} |")
    record = {"config": {"H": H, "d": d, "tokens": args.tokens, "dtype": "bfloat16",
                         "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                         "matmul_peak_tflops": peak}, "self_check_max_rel_err": check, "rows": rows}
    write(args.out or RESULTS / "kda_cuda.json", record)


@torch.no_grad()
def decode_step(B: int, T: int, H: int, d: int, dtype, fla) -> dict:
    """One token for B sequences: KDA reads and updates a [H, d, d] fp32 state per sequence; attention
    reads a KV cache of T tokens per sequence."""
    q, k, v, g, beta = kda_inputs(B, 1, H, d, dtype, DEVICE, seed=1)
    state = torch.randn(B, H, d, d, device=DEVICE)
    def ours():
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                   backend="triton")

    out = {"decode_ours_us": 1e3 * cuda_ms(ours)}
    if fla:
        def theirs():
            return fla[1](q, k, v, g, beta, initial_state=state, output_final_state=True)

        out["decode_fla_us"] = 1e3 * cuda_ms(theirs)
        out["decode_rel_diff_state_ours_vs_fla"] = rel(ours()[1], theirs()[1])
    cache_k, cache_v = (torch.randn(B, H, T, d, device=DEVICE, dtype=dtype) for _ in range(2))
    q_a = q.transpose(1, 2)
    out["decode_sdpa_us"] = 1e3 * cuda_ms(lambda: F.scaled_dot_product_attention(q_a, cache_k, cache_v))
    return out


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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if torch.cuda.is_available() and not args.cpu:
        run_cuda(args)
    else:
        run_cpu(args)


if __name__ == "__main__":
    main()
