"""CPU forward+backward time of KDA (token-by-token reference, PyTorch chunkwise) and causal softmax
attention.

Shows the shape of the cost, not peak speed: the recurrent and chunkwise forms grow linearly in T (about 2x
per doubling), softmax attention quadratically (about 4x once the T^2 term dominates).

    python bench/kda_cpu.py [--T 512 1024 2048 4096] [--repeats 3] [--skip-naive-above 4096] [--threads N]

Prints a markdown table and writes bench/results/kda_cpu.json.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kimi.ops.kda import chunk_kda

# A naive call slower than this is not repeated, and longer sequences are not tried.
NAIVE_LIMIT_S = 60.0


def kda_inputs(T: int, heads: int, dim: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g = (torch.randn(1, T, heads, dim, generator=gen) for _ in range(4))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = -F.softplus(g)  # the layer's gate, before its per-head scale
    beta = torch.sigmoid(torch.randn(1, T, heads, generator=gen))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def kda_step(backend: str, T: int, heads: int, dim: int):
    inputs = kda_inputs(T, heads, dim)

    def step():
        o, _ = chunk_kda(*inputs, backend=backend)
        o.sum().backward()

    return step


def sdpa_step(T: int, heads: int, dim: int):
    q, k, v = (x.transpose(1, 2).detach().requires_grad_() for x in kda_inputs(T, heads, dim)[:3])

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return step


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


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--T", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-naive-above", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kda_cpu.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    methods = ("naive", "chunk", "sdpa")
    results: dict[str, dict[int, float | None]] = {m: {} for m in methods}
    naive_too_slow = False
    for T in sorted(args.T):
        shape = (T, args.heads, args.dim)
        if T > args.skip_naive_above or naive_too_slow:
            results["naive"][T] = None
        else:
            results["naive"][T] = time_call(kda_step("naive", *shape), args.repeats, NAIVE_LIMIT_S)
            naive_too_slow = results["naive"][T] > NAIVE_LIMIT_S
        results["chunk"][T] = time_call(kda_step("chunk", *shape), args.repeats)
        results["sdpa"][T] = time_call(sdpa_step(*shape), args.repeats)
        print(f"T={T}: " + ", ".join(f"{m} {fmt(results[m][T], '.3f')} s" for m in methods), flush=True)

    growths = {m: growth(results[m]) for m in methods}
    setup = f"B=1, H={args.heads}, d={args.dim}, {torch.get_num_threads()} threads"
    print(f"\nforward+backward, fp32 CPU, {setup}; seconds per call (median), (factor over the previous T)\n")
    print("| T | naive recurrent | PyTorch chunkwise | softmax attention (SDPA) |")
    print("|---|---|---|---|")
    for T in sorted(args.T):
        cells = [
            f"{fmt(results[m][T], '.3f')}" + (f" ({fmt(growths[m][T], '.2f')}x)" if T in growths[m] else "")
            for m in methods
        ]
        print(f"| {T} | " + " | ".join(cells) + " |")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "config": {"B": 1, "H": args.heads, "d": args.dim, "dtype": "float32", "repeats": args.repeats,
                   "threads": torch.get_num_threads(), "torch": torch.__version__},
        "seconds_fwd_bwd": {m: {str(T): t for T, t in results[m].items()} for m in methods},
        "growth_from_previous_T": {m: {str(T): r for T, r in growths[m].items()} for m in methods},
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
