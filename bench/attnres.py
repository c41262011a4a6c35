"""The fused AttnRes depth mix (kimi/ops/attnres, model.attnres.backend=triton) against the unfused one, by
bytes, on a CPU: no GPU needed.

Default (the bytes report), for a model preset's shape (`1b`: d_model 2048, Block AttnRes over 8 blocks, so
1 to 9 sources per mix), each depth mix together with the pre-norm that follows it, three ways:

  eager     depth_attention, then RMSNorm (model.attnres.backend=torch without parallel.compile)
  compiled  compiled_depth_attention (torch.compile, Inductor), then the eager RMSNorm: what
            parallel.compile=true runs (the norm sits outside the compiled sublayer)
  fused     the Triton op, the norm folded in (model.attnres.backend=triton)

and for each, per token of a mix with N sources (bf16 sources, fp32 query and norm weight, as in training):

  saved     bytes autograd keeps for the backward that are not the inputs themselves (the sources, the
            query, the weight: the stream and the parameters hold those anyway), through saved-tensor hooks
  roofline  bytes read and written, forward and backward: eager and fused as bench/step_audit.py's roofline
            prices ops (each op's inputs read and outputs written once; the fused op traced through its fake
            kernel on the meta device), compiled as Inductor counts its fused kernels' reads and writes
            (metrics.num_bytes_accessed of its forward and backward graphs, compiled for this CPU)

plus the totals over one forward and backward of the model (its mixes, by number of sources).

    python bench/attnres.py [--model 1b] [--tokens 512]
    python bench/attnres.py --compile-check [--arch 90|80|all] [--quick]
    python bench/attnres.py --gpu [--tokens 16384] [--sources 2 5 9] [--dry-run]

--compile-check compiles both kernels for sm_90 and sm_80 with triton's ptxas (bench/compile_check.py) at
the presets' widths and reports registers, spills and shared memory (attnres_sm90_compile.json, ...).
--gpu (make gpu-check's attnres step) runs on a CUDA GPU: for each number of sources, the fused mix with its
pre-norm and every gradient against fp64 (the unfused composition on upcast inputs), beside the unfused bf16
path's own error, then the forward+backward milliseconds of eager, compiled, fused and fla-core's fused
AttnRes (--fla, where installed) with the bytes report's roofline at the measured time; --dry-run: the same
code on CPU at toy sizes under the Triton interpreter (no measurement).
Writes bench/results/attnres_bytes.json (--out to choose) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)
# The bytes report traces the fused op on the meta device (its fake kernel), which the op's CPU check allows
# only under the interpreter, as --gpu --dry-run runs it on CPU tensors; --compile-check and --gpu need real
# kernels. Before triton is first imported.
if not {"--compile-check", "--gpu"} & set(sys.argv) or "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

RESULTS = HERE / "results"
EPS = 1e-5  # the model's norm_eps, for the mix and the norm alike


# ---- the model's mixes ---------------------------------------------------------------------------------
def mixes_per_step(model: str) -> Counter:
    """Number of sources -> how many depth mixes of one forward have that many (the final one included),
    from the stream's own bookkeeping; 1 source is the model's first sublayer (no query: only the norm)."""
    from omegaconf import OmegaConf

    from kimi.model.attnres import make_stream

    m = OmegaConf.load(ROOT / "conf/model" / f"{model}.yaml")
    block_size = int(m.get("attnres", {}).get("block_size", 4))
    stream = make_stream(m.get("residual", "attnres_block"), torch.zeros(1), block_size, EPS)
    counts = Counter()
    for _ in range(2 * int(m.num_layers)):
        counts[len(stream.sources())] += 1
        stream.push(torch.zeros(1))
    counts[len(stream.sources())] += 1
    return counts


def inputs(N: int, T: int, D: int, device: str, norm: bool = True):
    """bf16 sources [T, D], fp32 query and norm weight (None without the norm), all requiring grad; query
    None for one source."""
    sources = [torch.randn(T, D, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(N)]
    query = torch.randn(D, device=device).requires_grad_() if N > 1 else None
    weight = torch.ones(D, device=device).requires_grad_() if norm else None
    return query, sources, weight


def paths() -> dict:
    """name -> fn(query, sources, eps, weight, norm_eps): each path's mix and pre-norm."""
    from kimi.model.attnres import compiled_depth_attention
    from kimi.ops.attnres.reference import mix_then_norm
    from kimi.ops.attnres.triton import depth_mix_triton

    compiled = compiled_depth_attention()

    def fused(query, sources, eps, weight, norm_eps):  # the op itself: FusedDepthMix would first probe it
        if query is None:  # as FusedDepthMix runs the first sublayer: a zero query, weight 1
            query = torch.zeros(sources[0].shape[-1], device=sources[0].device)
        return depth_mix_triton(query, sources, eps, weight, norm_eps)

    return {"eager": mix_then_norm,
            "compiled": lambda q, s, e, w, ne: mix_then_norm(q, s, e, w, ne, mix=compiled),
            "fused": fused}


# ---- measurements --------------------------------------------------------------------------------------
def saved_bytes(fn, query, sources, weight) -> int:
    """Bytes autograd saves in fn's forward beyond the inputs' own storage."""
    def storage(t):  # the storage itself (meta tensors all have data_ptr 0)
        return t.untyped_storage()._cdata

    own = {storage(t) for t in [*sources, query, weight] if t is not None}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        if storage(t) not in own | seen:
            seen.add(storage(t))
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(query, sources, EPS, weight, EPS)
    return total


def traced_bytes(fn, query, sources, weight) -> tuple[float, float]:
    """(forward, backward) bytes of fn's ops priced as step_audit's roofline does, on meta tensors."""
    from torch.utils.module_tracker import ModuleTracker

    from step_audit import OpCost

    cost = OpCost(ModuleTracker())
    seed = torch.ones_like(sources[0])  # the output's gradient, made outside what is counted
    with cost:
        out = fn(query, sources, EPS, weight, EPS)
        forward = sum(v[2] for v in cost.ops.values())
        cost.in_forward = False
        out.backward(seed)
    return forward, sum(v[2] for v in cost.ops.values()) - forward


def inductor_bytes(fn, query, sources, weight) -> tuple[float, float]:
    """(forward, backward) bytes that Inductor counts for the kernels it generates for fn (compiled on first
    call; run once per shape)."""
    from torch._inductor import metrics

    torch._logging.set_logs(inductor_metrics=True)
    try:
        metrics.reset()
        out = fn(query, sources, EPS, weight, EPS)
        forward = metrics.num_bytes_accessed
        out.backward(torch.ones_like(out))  # eager: Inductor counts only its own kernels
        return forward, metrics.num_bytes_accessed - forward
    finally:
        torch._logging.set_logs()


@functools.cache
def compiled_mix_bytes(N: int, T: int, D: int) -> tuple[float, float]:
    """inductor_bytes of the compiled mix, once per shape: Inductor counts only when it compiles."""
    return inductor_bytes(paths()["compiled"], *inputs(N, T, D, "cpu", False))


def measure(N: int, T: int, D: int, norm: bool) -> dict:
    """Per-token bytes of one mix with N sources (and its pre-norm if `norm`), each way: saved for the
    backward, and read+written [forward, backward]."""
    fns = paths()
    out = {}
    for name in ("eager", "fused"):
        out[name] = {"saved": saved_bytes(fns[name], *inputs(N, T, D, "meta", norm)) / T,
                     "roofline": [b / T for b in traced_bytes(fns[name], *inputs(N, T, D, "meta", norm))]}
    torch.manual_seed(N)
    if N == 1:  # no query: compiled_depth_attention hands the source on, the norm runs eagerly
        fwd, bwd = traced_bytes(fns["compiled"], *inputs(N, T, D, "meta", norm))
    else:
        from kimi.ops.attnres.reference import pre_norm

        fwd, bwd = compiled_mix_bytes(N, T, D)
        if norm:  # the eager norm on the compiled mix's output
            h = torch.zeros(T, D, device="meta", dtype=torch.bfloat16).requires_grad_()
            weight = inputs(1, T, D, "meta", True)[2]
            f, b = traced_bytes(lambda q, s, e, w, ne: pre_norm(s[0], w, ne), None, [h], weight)
            fwd, bwd = fwd + f, bwd + b
    out["compiled"] = {"saved": saved_bytes(fns["compiled"], *inputs(N, T, D, "cpu", norm)) / T,
                       "roofline": [fwd / T, bwd / T]}
    return out


WAYS = ("eager", "compiled", "fused")
ROW = 4096  # tokens of step_audit's roofline row


def bytes_report(args) -> dict:
    """Both tables: each mix with its pre-norm (what the model runs; 1 source: the first sublayer, only the
    norm) and the mixes alone (2 sources and more); their totals over one step's mixes."""
    from omegaconf import OmegaConf

    D = int(OmegaConf.load(ROOT / "conf/model" / f"{args.model}.yaml").d_model)
    counts = mixes_per_step(args.model)
    tables = {}
    for part, norm in (("normed", True), ("mix", False)):
        rows = []
        for N in sorted(n for n in counts if norm or n > 1):
            start = time.perf_counter()
            rows.append({"sources": N, "mixes": counts[N], **measure(N, args.tokens, D, norm)})
            print(f"{part}, {N} sources: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        total = {way: {"saved": sum(r["mixes"] * r[way]["saved"] for r in rows),
                       "roofline": [sum(r["mixes"] * r[way]["roofline"][i] for r in rows) for i in (0, 1)]}
                 for way in WAYS}
        tables[part] = {"rows": rows, "total": {"sources": "all", "mixes": sum(r["mixes"] for r in rows),
                                                **total}}
    from step_audit import GPUS

    # every mix of one step of a 4096-token row (step_audit's roofline row) at the H200's datasheet bandwidth
    seconds = {part: {way: sum(t["total"][way]["roofline"]) * ROW / GPUS["H200"]["bandwidth"] for way in WAYS}
               for part, t in tables.items()}
    return dict(model=args.model, d_model=D, tokens=args.tokens, mixes=dict(sorted(counts.items())),
                tables=tables, h200_seconds_per_row=seconds, row_tokens=ROW, torch=torch.__version__)


def print_bytes(result: dict) -> None:
    titles = {"normed": "each depth mix and the pre-norm after it", "mix": "the depth mixes alone"}
    for part, table in result["tables"].items():
        print(f"\n## {result['model']} (d_model {result['d_model']}, bf16 sources): {titles[part]}, bytes "
              f"per token (traced at {result['tokens']} tokens)\n")
        print("| sources | mixes | saved: eager | compiled | fused | read+written, fwd+bwd: eager | "
              "compiled | fused | fused / compiled |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in table["rows"] + [table["total"]]:
            saved = " | ".join(f"{r[way]['saved']:,.0f}" for way in WAYS)
            moved = [sum(r[way]["roofline"]) for way in WAYS]
            print(f"| {r['sources']} | {r['mixes']} | {saved} | {' | '.join(f'{m:,.0f}' for m in moved)} | "
                  f"{moved[2] / moved[1]:.2f} |")
        seconds = result["h200_seconds_per_row"][part]
        times = ", ".join(f"{way} {1e3 * t:.1f} ms" for way, t in seconds.items())
        print(f"\nAll of them in one step of a {result['row_tokens']}-token row at the H200's bandwidth: "
              f"{times}")


# ---- on a GPU: correctness and speed ------------------------------------------------------------------
def random_inputs(N: int, T: int, D: int, device: str, seed: int):
    """N bf16 sources of very different scales (a softmax far from uniform), an fp32 query and norm weight,
    the output's gradient: fresh random values (never zeros, which hide unwritten outputs)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    sources = [(torch.randn(T, D, device=device, generator=gen) * 3.0 ** (i % 4 - 1)).to(torch.bfloat16)
               for i in range(N)]
    query = torch.randn(D, device=device, generator=gen) * 0.5
    weight = torch.rand(D, device=device, generator=gen) + 0.5
    dy = torch.randn(T, D, device=device, generator=gen).to(torch.bfloat16)
    return [s.requires_grad_() for s in sources], query.requires_grad_(), weight.requires_grad_(), dy


def grads_of(fn, sources, query, weight, dy) -> list[torch.Tensor]:
    """[output, d query, d sources..., d weight] of fn(query, sources, EPS, weight, EPS)."""
    out = fn(query, sources, EPS, weight, EPS)
    return [out, *torch.autograd.grad(out, [query, *sources, weight], dy)]


def errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """Relative L2 error of the output and the worst of the gradients; NaN where anything is not finite."""
    def rel(a, b):
        if not torch.isfinite(a).all():
            return float("nan")
        return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()

    return {"out": rel(got[0], ref[0]), "grad": max(rel(a, b) for a, b in zip(got[1:], ref[1:]))}


def predicted_ms(N: int, T: int, D: int, bandwidth: float) -> float | None:
    """The bytes report's roofline (fused, with the norm) for N sources at T tokens of width D over
    `bandwidth`; None where the report is of another width."""
    path = RESULTS / "attnres_bytes.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    rows = report["tables"]["normed"]["rows"] if report.get("d_model") == D else []
    row = next((r for r in rows if r["sources"] == N), None)
    return None if row is None else 1e3 * sum(row["fused"]["roofline"]) * T / bandwidth


def gpu_check(args) -> dict:
    """Per number of sources: errors against fp64 and milliseconds of each way (module docstring); written
    to args.out after each, so a run cut short keeps what it measured."""
    from step_audit import GPUS

    from kimi.ops.attnres.fla import missing

    device = "cpu" if args.dry_run else "cuda"
    T, D = (8, 32) if args.dry_run else (args.tokens, args.d_model)
    ways = dict(paths())
    fla_missing = ("a dry run (fla-core needs CUDA)" if args.dry_run else missing() if args.fla else
                   "not asked for (--fla; its autotuning took 40 s per shape on an H200)")
    if fla_missing is None:
        from kimi.ops.attnres.fla import fla_depth_mix

        ways["fla"] = fla_depth_mix
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", T=T, D=D,
                  dtype="bfloat16", torch=torch.__version__, fla=fla_missing or "ran", rows=[])
    start = time.perf_counter()
    for N in args.sources:
        sources, query, weight, dy = random_inputs(N, T, D, device, seed=N)
        up = [s.detach().double().requires_grad_() for s in sources]
        ref = [t.detach() for t in grads_of(ways["eager"], up, query.detach().double().requires_grad_(),
                                            weight.detach().double().requires_grad_(), dy.double())]
        row = {"sources": N, "errors": {}, "ms": {}}
        for name, fn in ways.items():
            row["errors"][name] = errors(grads_of(fn, sources, query, weight, dy), ref)
            print(f"[{time.perf_counter() - start:.0f} s] {N} sources, {name}: {row['errors'][name]}",
                  flush=True)
        # ours may round differently from the unfused bf16 path, not be worse than it by much
        limit = max(2 * max(row["errors"]["eager"].values()), 5e-3)
        row["ok"] = all(e == e and e <= limit for e in row["errors"]["fused"].values())
        row["limit"] = limit
        leaves = [query, weight, *sources]
        for name, fn in ways.items():
            row["ms"][name] = timed(lambda: fn(query, sources, EPS, weight, EPS).backward(dy), leaves, device)
            print(f"[{time.perf_counter() - start:.0f} s] {N} sources, {name}: {row['ms'][name]:.3f} ms",
                  flush=True)
        row["predicted_ms"] = predicted_ms(N, T, D, GPUS["H200"]["bandwidth"])
        result["rows"].append(row)
        print(row, flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    result["ok"] = all(r["ok"] for r in result["rows"])
    return result


def timed(fn, leaves, device: str) -> float:
    """Median milliseconds of fn (a forward and backward), its leaves' gradients cleared between calls; on
    CPU (a dry run) one call after a warm-up: the code path, not a measurement."""
    if device == "cpu":
        fn()
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")


def print_gpu(result: dict) -> None:
    ways = list(result["rows"][0]["ms"]) if result["rows"] else []
    print(f"\n## fused AttnRes on {result['device']}: T {result['T']}, d {result['D']}, bf16 sources, the "
          f"pre-norm folded in; forward+backward ms (median); fla-core: {result['fla']}\n")
    print("| sources | error out / grad (fused) | limit | " + " | ".join(ways) + " | roofline | ok |")
    print("|---|---|---|" + "---|" * len(ways) + "---|---|")
    for r in result["rows"]:
        e = r["errors"]["fused"]
        pred = "" if r["predicted_ms"] is None else f"{r['predicted_ms']:.3f}"
        print(f"| {r['sources']} | {e['out']:.1e} / {e['grad']:.1e} | {r['limit']:.1e} | "
              + " | ".join(f"{r['ms'][w]:.3f}" for w in ways) + f" | {pred} | {r['ok']} |")


# ---- compile check -------------------------------------------------------------------------------------
WIDTHS = {"small": 768, "1b": 2048, "48b": 2304, "kimi_k3": 7168}
# Why the spills left are left (written into the JSONs beside the numbers).
NOTES = {
    "d_model 7168": "Kimi K3's width: a row is 8192 values padded, 16 per thread at 16 warps, and the "
                    "backward holds about ten such vectors (query, norm weight, their gradients, dy, h, dh, "
                    "a source and its gradient) in at most 128 registers: 24-128 B of spills; sm_80's "
                    "forward spills too without the norm (32 B bf16, 144 B fp32). 32 warps would halve the "
                    "registers a thread may use; splitting the row would reread it for every reduction. "
                    "Every width up to 2304 (small, 1b, 48b) compiles without spills.",
}


def compile_variants(quick: bool) -> list[dict]:
    """`1b`'s mix (bf16, d 2048, 9 sources, norm folded) and, in full, every preset width, 2 and 9 sources,
    with and without the norm, bf16 and fp32."""
    if quick:
        return [dict(dtype="bf16", D=2048, N=9, norm=True)]
    return [dict(dtype=dtype, D=D, N=N, norm=norm) for dtype in ("bf16", "fp32") for D in WIDTHS.values()
            for N in (2, 9) for norm in (True, False)]


def kernel_signature(fn, variant: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource: the sources (and their gradients) a tuple of N pointers,
    every pointer 16-byte aligned as torch allocates."""
    import triton.language as tl

    from kimi.ops.attnres.triton.op import launch

    N, D, dtype = variant["N"], variant["D"], variant["dtype"]
    constexprs = dict(N=N, D=D, BD=launch(D, False)[0], HAS_NORM=variant["norm"], ACC=tl.float32)
    types = dict(srcs=("*" + dtype,) * N, dsrcs=("*" + dtype,) * N, out="*" + dtype, dout="*" + dtype,
                 eps="fp32", norm_eps="fp32", T="i32", rows="i32")
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constexprs:
            signature[arg] = "constexpr"
            continue
        signature[arg] = types.get(arg, "*fp32")  # q, w, the statistics and partial sums are fp32
        if isinstance(signature[arg], tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(N)})
        elif signature[arg].startswith("*"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_check(args, arch: int) -> dict:
    import triton

    from compile_check import ARCHS, compile_kernel, kernels_and_helpers, spilled
    from kimi.ops.attnres.triton import kernels as module
    from kimi.ops.attnres.triton.common import INTERPRET
    from kimi.ops.attnres.triton.op import launch

    if INTERPRET:
        raise SystemExit("--compile-check needs TRITON_INTERPRET unset")
    names, helpers = kernels_and_helpers([Path(module.__file__)])
    rows = []
    for name in names:
        fn = getattr(module, name)
        for variant in compile_variants(args.quick):
            warps = launch(variant["D"], backward=name == "mix_bwd_kernel")[1]
            row = dict(kernel=name, **variant, warps=warps, stages=3)  # the launches leave stages at 3
            row.update(compile_kernel(fn, *kernel_signature(fn, variant), arch, warps, 3))
            rows.append(row)
            print(row, flush=True)
    target = ARCHS[arch][0]
    print(f"\n## {target}\n")
    print("| kernel | dtype | D | sources | norm | warps | regs | spill st/ld B | stack | smem B |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tail = (f"FAILED: {r['error']} | | |" if "error" in r else
                f"{r['regs']} | {r['spill_stores']}/{r['spill_loads']} | {r['spill_stack']} | {r['smem']}")
        print(f"| {r['kernel']} | {r['dtype']} | {r['D']} | {r['N']} | {r['norm']} | {r['warps']} | {tail} |")
    failed = sum("error" in r for r in rows)
    print(f"\n{len(rows) - failed} of {len(rows)} compiled for {target}; {sum(map(spilled, rows))} spill")
    return dict(target=f"{target}, compiled, not run", triton=triton.__version__, kernels=names,
                helpers_inlined=helpers, notes=NOTES, rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1b", help="a conf/model preset (Block or Full AttnRes)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per traced mix")
    parser.add_argument("--out", type=Path, default=None, help="the bytes report's JSON")
    parser.add_argument("--compile-check", action="store_true", help="compile both kernels for --arch")
    parser.add_argument("--arch", default="90", choices=["90", "80", "all"], help="--compile-check target")
    parser.add_argument("--quick", action="store_true", help="--compile-check: `1b`'s shape only")
    parser.add_argument("--gpu", action="store_true", help="errors and timings on a CUDA GPU")
    parser.add_argument("--dry-run", action="store_true", help="--gpu's code on CPU at toy sizes")
    parser.add_argument("--sources", type=int, nargs="+", default=[2, 5, 9], help="--gpu: sources per mix")
    parser.add_argument("--d-model", type=int, default=2048, help="--gpu: the width (1b's)")
    parser.add_argument("--fla", action="store_true", help="--gpu: fla-core's fused AttnRes too")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.gpu:
        if not args.dry_run and not torch.cuda.is_available():
            raise SystemExit("--gpu needs a CUDA GPU (--dry-run runs its code on CPU)")
        result = gpu_check(args)
        print_gpu(result)
        if not result["ok"]:
            raise SystemExit(1)
        return
    if args.compile_check:
        from compile_check import write_archs

        write_archs(compile_check, args, RESULTS, "attnres")
        return
    torch.set_num_threads(min(2, torch.get_num_threads()))
    result = bytes_report(args)
    print_bytes(result)
    path = args.out or RESULTS / "attnres_bytes.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
