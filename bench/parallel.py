"""Communication, throughput and memory of a training step per parallel layout, and the AttnRes pipeline
payload.

For each layout the trainer runs under torchrun (the one-process layout without it), with MuonClip and
--batch sequences per step, split over the data-parallel ranks, so every layout trains the same batch. After
a warm-up step, one step is counted on every rank below DTensor (calls and bytes per collective type, and
what the pipeline stages send: the AttnRes sources, measured at each stage's output), then --steps steps
are timed: tokens/s and its ratio to the one-process layout, MFU, and the peak memory of each rank (CUDA
allocations; resident memory on CPU).
gloo on CPU, NCCL on GPUs.

The payload table (printed when a layout has pipeline stages) compares, per stage boundary, what kimi sends
(the stream's sources: completed block sums plus the running partial sum) with sending every sublayer output
so far (what a pipeline that forwards the whole residual history, as Full AttnRes needs, would send), for the
tiny and small presets.

    python bench/parallel.py [--layouts single dp_shard2 tp2 pp2 ...] [--model tiny] [--set key=value ...]
    # expert parallelism against FSDP alone, on the mixture-of-experts preset:
    python bench/parallel.py --model moe_tiny --layouts single dp_shard2 ep2 dp_shard4 dp4_ep2 ep4 \
        --out bench/results/moe_parallel.json
    # the 1b preset on one GPU:
    python bench/parallel.py --layouts single --model 1b --batch 4 --set trainer.seq_len=4096 \
trainer.precision=bf16

Prints markdown tables and writes bench/results/parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

# torch is imported where a step runs (the worker), not here: the parent only launches and prints, and torch's
# start there delayed each layout's worker by about 4 s on a CPU

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {  # name: (processes, data-parallel ranks, overrides)
    "single": (1, 1, []),
    "dp_shard2": (2, 2, ["parallel.dp_shard=2"]),
    "dp_replicate2": (2, 2, ["parallel.dp_replicate=2"]),
    "tp2": (2, 1, ["parallel.tp=2"]),
    "pp2": (2, 1, ["parallel.pp=2", "parallel.pp_microbatches=4"]),
    "hsdp2x2": (4, 4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "dp2xtp2": (4, 2, ["parallel.dp_shard=2", "parallel.tp=2"]),
    "pp2xdp2": (4, 2, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.pp_microbatches=4"]),
    "pp2xtp2": (4, 1, ["parallel.pp=2", "parallel.tp=2", "parallel.pp_microbatches=4"]),
    "pp2xtp2_sp": (4, 1, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                          "parallel.pp_microbatches=4"]),
    "dp_shard4": (4, 4, ["parallel.dp_shard=4"]),
    # expert parallelism: a mixture-of-experts model only (--model moe_tiny)
    "ep2": (2, 2, ["parallel.dp_shard=2", "parallel.ep=2"]),
    "dp4_ep2": (4, 4, ["parallel.dp_shard=4", "parallel.ep=2"]),
    "ep4": (4, 4, ["parallel.dp_shard=4", "parallel.ep=4"]),
    # one process in each precision (bench/gpu_check.py's train_fp8 step; no trainer.precision in --set)
    "bf16": (1, 1, ["trainer.precision=bf16"]),
    "fp8_tensorwise": (1, 1, ["trainer.precision=fp8", "precision.fp8.recipe=tensorwise"]),
    "fp8_rowwise": (1, 1, ["trainer.precision=fp8", "precision.fp8.recipe=rowwise"]),
    # one process with fla-core's KDA kernels (CUDA only): gpu-check's train step beside single, with
    # --step-args train="--layouts single kda_fla"
    "kda_fla": (1, 1, ["model.kda.backend=fla"]),
    # one process on one CUDA GPU with CUDA graphs (bench/gpu_check.py's train_graphs step; CUDA only)
    "graphs_step": (1, 1, ["parallel.cuda_graphs=step"]),
    "graphs_regions": (1, 1, ["parallel.cuda_graphs=regions"]),
}
PRECISION_LAYOUTS = ("bf16", "fp8_tensorwise", "fp8_rowwise")
DEFAULT_LAYOUTS = [name for name in LAYOUTS
                   if name not in ("dp_shard4", "ep2", "dp4_ep2", "ep4", "kda_fla", "graphs_step",
                                   "graphs_regions", *PRECISION_LAYOUTS)]


def _dispatch_state() -> dict:
    """Which guarded Triton ops fell back to PyTorch in this process, and why (kimi.ops.dispatch)."""
    import kimi.ops.attention as attention
    import kimi.ops.kda as kda
    import kimi.ops.kda.gate as gate

    guards = {"chunk_kda": kda._CHUNK_GUARD, "fused_recurrent_kda": kda._RECURRENT_GUARD,
              "kda_gate/l2norm": gate._GUARD, "attention": attention._GUARD}
    return {name: g.reason for name, g in guards.items() if g.failed}


def _kda_dtypes() -> set:
    """Records the dtypes of q, k, v, g, beta at every chunk_kda call (which kernel precision ran)."""
    import kimi.model.kda as layer

    seen, chunk = set(), layer.chunk_kda

    def recording(q, k, v, g, beta, *args, **kwargs):
        seen.add(tuple(str(x.dtype).removeprefix("torch.") for x in (q, k, v, g, beta)))
        return chunk(q, k, v, g, beta, *args, **kwargs)

    layer.chunk_kda = recording
    return seen


def _busy_us(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals: the time a device ran at least one kernel."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def _profile(trainer, top: int = 25) -> dict:
    """One training step under torch.profiler on CUDA: the kernels that took the most device time, the ops
    that allocated the most device memory (net of what they freed), and where the step's time went: the GPU's
    busy time (the union of its kernels' intervals) against the step's wall time, the kernels launched and
    the aten ops the host dispatched. The profiler slows the host, so the wall time set beside the busy time
    is the unprofiled steps' (`step_s`): 1 - busy / step_s is the share of the step the GPU waited."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
        trainer.train_step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    memory = sorted(events, key=lambda e: e.self_device_memory_usage, reverse=True)[:10]
    every = prof.events()
    kernels = [e for e in every if e.device_type == DeviceType.CUDA]
    aten = [e for e in every if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    roots = [e for e in every if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    return {"top_kernels": [{"kernel": e.key[:120], "ms": e.self_device_time_total / 1e3, "calls": e.count}
                            for e in busy if e.self_device_time_total > 0],
            "device_ms": sum(e.self_device_time_total for e in events) / 1e3,
            "memory_ops": [{"op": e.key[:120], "mib": e.self_device_memory_usage / 2**20, "calls": e.count}
                           for e in memory if e.self_device_memory_usage > 0],
            "host": {"gpu_busy_ms": _busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3,
                     "profiled_step_ms": 1e3 * wall, "kernels": len(kernels), "aten_ops": len(aten),
                     # the host's top-level ops, profiled: CPU time the step spent issuing work
                     "host_ops_ms": sum(e.time_range.elapsed_us() for e in roots) / 1e3}}


def worker(out: Path, model: str, overrides: list[str], steps: int, profile: bool = False) -> None:
    import torch
    from comm_count import CommCounter, write_every_rank

    from kimi.config import register_configs
    from kimi.model import KimiModel
    from kimi.parallel import destroy_distributed
    from kimi.precision.registry import precision_for
    from kimi.run.peaks import peak_flops
    from kimi.trainer import Trainer

    register_configs()
    run = Path(tempfile.mkdtemp(prefix="kimi_bench_parallel_"))
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"model={model}", f"trainer.run_dir={run}",
                                           "logging.wandb.mode=disabled",
                                           "trainer.checkpoint_every=0", "trainer.eval_every=0",
                                           "trainer.threads=1",
                                           "trainer.resume=false", *overrides])
    trainer = Trainer(cfg)
    sent = []  # bytes each stage hands to the next, per micro-batch

    def recording(module, inputs, outputs):
        if isinstance(module, KimiModel) and isinstance(outputs, tuple):  # a stage's sources, not logits
            sent.append(sum(t.numel() * t.element_size() for t in outputs))

    torch.nn.modules.module.register_module_forward_hook(recording)
    kda_dtypes = _kda_dtypes()
    losses = [trainer.train_step()["loss"]]  # warm-up: optimizer state, MuonClip's exchange, pipeline shapes
    if trainer.cfg.parallel.cuda_graphs != "none":
        # the graphs recorded before the timing: a step graph after WARMUP micro-batches, cudagraph trees
        # at a region's second call
        from kimi.parallel.cuda_graphs import WARMUP

        losses += [trainer.train_step()["loss"] for _ in range(WARMUP + 1)]
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(trainer.train_step()["loss"])
    sync()
    seconds = (time.perf_counter() - t0) / steps
    # the peak of the warm-up and timed steps alone: the profiled step and the counted one below (whose
    # dispatch mode compiles the regions again) may hold more than training does
    timed_peak = torch.cuda.max_memory_allocated() if cuda else None
    # The counted step comes last: under a dispatch mode the compiled regions are compiled again, and the
    # steps after it ran 1,037 ms instead of 600 on an H200 (2026-12-04, bench/results/gpu/2026-12-04-h200/
    # diagnose): timed after it, parallel.compile=true was measured 1.7x slow.
    profiled = _profile(trainer) if profile and cuda else {}
    sent.clear()
    counter = CommCounter()
    if trainer.cfg.parallel.cuda_graphs == "none":  # one GPU with graphs: nothing to count, and a replay
        with counter:  # dispatches nothing a mode could see (regions would be compiled again under it)
            losses.append(trainer.train_step()["loss"])
    t = cfg.trainer
    tokens = t.micro_batch_size * t.seq_len * t.grad_accum_steps * trainer.dims.dp
    # against the rate the trainer divides by: a CPU's in the run's compute dtype
    peak = peak_flops(trainer.device, t.peak_flops, precision_for(t.precision).compute_dtype())
    record = {"calls": dict(counter.calls), "bytes": dict(counter.bytes), "stage_sends": sent,
              "losses": losses, "fallbacks": _dispatch_state(), "kda_dtypes": sorted(kda_dtypes),
              "top_kernels": [],
              "step_s": seconds, "tokens_per_s": tokens / seconds,
              "mfu": tokens / seconds * trainer.flops_per_token / (peak * trainer.dims.world),
              # what this rank's device allocated at most (CUDA), or the process's peak resident memory
              "peak_mem_bytes": (torch.cuda.max_memory_allocated() if cuda
                                 else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
              "peak_mem_timed_bytes": timed_peak,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if profiled:
        record.update(profiled)
        record["host"]["gpu_idle_share"] = max(0.0, 1 - record["host"]["gpu_busy_ms"] / (1e3 * seconds))
    write_every_rank(out, record)
    destroy_distributed()


def run_layout(name: str, args) -> list[dict]:
    nproc, dp, extra = LAYOUTS[name]
    out = Path(tempfile.mkdtemp()) / "result.json"
    # one process joins no group (ParallelDims.enabled), so it runs without torchrun: a start of torch saved
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1
                else [])
    cmd = [sys.executable, *launcher, __file__,
           "--worker", str(out), "--model", args.model, "--steps", str(args.steps),
           *(["--profile"] if args.profile else []), "--", *extra,
           f"trainer.micro_batch_size={args.batch // dp}", *args.set]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"layout {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def attnres_payloads(model: str, pp: int, seq_len: int) -> list[dict]:
    """Per boundary of a `pp`-stage split: tensors [tokens, d_model] kimi sends (the stream's sources) and
    the count if every sublayer output so far were sent."""
    from kimi.config import ModelConfig, register_configs
    from kimi.parallel.pipeline import split_blocks

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"model={model}"])
    fields = {k: v for k, v in cfg.model.items()}
    fields["vocab_size"] = fields["vocab_size"] or cfg.data.tokenizer.vocab_size
    mcfg = ModelConfig(**fields)
    rows = []
    for stage, blocks in enumerate(split_blocks(mcfg, pp, seq_len)[:-1]):
        done = 2 * blocks.stop  # sublayers before the boundary
        if mcfg.residual == "attnres_block":
            ours = 1 + done // mcfg.attnres.block_size + (done % mcfg.attnres.block_size > 0)
        else:
            ours = 1 if mcfg.residual == "standard" else 1 + done
        rows.append({"model": model, "pp": pp, "boundary": f"{stage}->{stage + 1}",
                     "after_block": blocks.stop,
                     "tensors": ours, "all_outputs": 1 + done,
                     "bytes_per_token_fp32": ours * mcfg.d_model * 4,
                     "all_outputs_bytes_per_token_fp32": (1 + done) * mcfg.d_model * 4})
    return rows


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n:.0f} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, choices=list(LAYOUTS))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step over all data-parallel "
                        "ranks")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (after two untimed "
                        "ones)")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for every layout, e.g. "
                        "trainer.seq_len=2048 trainer.precision=bf16")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "parallel.json")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: also profile one step and keep its 25 costliest kernels and its 10 "
                             "most memory-hungry ops")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.overrides, args.steps, args.profile)

    results = {}
    for name in args.layouts:  # written after each layout: a run stopped by a time limit keeps the others
        results[name] = run_layout(name, args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "batch": args.batch, "set": args.set,
                                        "steps": args.steps, "layouts": results}, indent=2) + "\n")
    kinds = sorted({k for ranks in results.values() for r in ranks for k in r["bytes"]})
    device = next(iter(results.values()))[0]["device"]
    settings = " ".join(args.set) or "defaults"
    print(f"\n{args.model} model, {args.batch} sequences per step in every layout ({settings}), one training "
          f"step (MuonClip), per rank (mean over ranks), {device}\n")
    print("| layout | ranks | " + " | ".join(kinds) + " | stage sends per micro-batch |")
    print("|---" * (len(kinds) + 3) + "|")
    for name, ranks in results.items():
        cells = []
        for k in kinds:
            calls = sum(r["calls"].get(k, 0) for r in ranks) / len(ranks)
            sent = sum(r["bytes"].get(k, 0) for r in ranks) / len(ranks)
            cells.append(f"{fmt_bytes(sent)} ({calls:.0f})" if calls else "-")
        stage = [s for r in ranks for s in r["stage_sends"]]
        cells.append(fmt_bytes(sum(stage) / len(stage)) if stage else "-")
        print(f"| {name} | {len(ranks)} | " + " | ".join(cells) + " |")
    print("\n(bytes, with the number of calls in brackets)")

    base = results.get("single", [None])[0]
    print(f"\nthroughput ({args.steps} timed steps; tokens/s of all ranks together, MFU against all ranks' "
          "peak, peak memory of the fullest rank: CUDA allocations, or resident memory on CPU)\n")
    print("| layout | ranks | step | tokens/s | vs single | MFU | peak memory per rank |")
    print("|---|---|---|---|---|---|---|")
    for name, ranks in results.items():
        r = ranks[0]  # every rank times the same steps
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        memory = max(x["peak_mem_bytes"] for x in ranks)
        print(f"| {name} | {len(ranks)} | {r['step_s'] * 1e3:.0f} ms | {r['tokens_per_s']:,.0f} | {ratio} | "
              f"{100 * r['mfu']:.2f}% | {fmt_bytes(memory)} |")

    # beside a run with pipeline stages only: it composes four configs, seconds a one-process run need not pay
    piped = any(o.startswith("parallel.pp=") for name in args.layouts for o in LAYOUTS[name][2])
    payloads = [row for model in ("tiny", "small") for pp in (2, 4)
                for row in attnres_payloads(model, pp, 128)] if piped else []
    if payloads:
        print("\nAttnRes payload per pipeline boundary: tensors of [tokens, d_model] sent\n")
        print("| model | pp | boundary (after block) | kimi: block sums + partial | every sublayer output so "
              "far | ratio |")
        print("|---|---|---|---|---|---|")
        for r in payloads:
            print(f"| {r['model']} | {r['pp']} | {r['boundary']} ({r['after_block']}) | {r['tensors']} | "
                  f"{r['all_outputs']} | {r['all_outputs'] / r['tensors']:.1f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "batch": args.batch, "set": args.set,
                                    "steps": args.steps,
                                    "layouts": results, "payloads": payloads}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
