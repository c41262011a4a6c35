"""What an optimizer step costs: MuonClip vs AdamW vs torch.optim.Muon (with AdamW for the rest).

One process: optimizer.step() time on the tiny and small models with random gradients (the optimizers
interleaved in every repeat, so a shared machine slows them alike), as ratios to torch.optim.Muon + AdamW and
to AdamW. With --ranks N (gloo, CPU; this script relaunches itself under torchrun): the model fully sharded
with FSDP2 over N ranks, and per rank per step the bytes it puts into collectives, the number of collectives
and the matmul FLOPs it runs (both counted below DTensor, on the local tensors), ours against torch.optim.Muon
on the same DTensors. Beside them, the global gradient-norm clip over the ranks: torch's clip_grad_norm_ on
the DTensor gradients against the trainer's (kimi.parallel.tensor_parallel.clip_grad_norm_, on their local
pieces), at its first call and after, on that model's gradients and on the gradients of --clip-model's shapes
cut to 8 per dim (DTensor's sharding rules see shapes and placements, not sizes) over a 1-D mesh (FSDP) and a
2-D one (HSDP: replicate x shard).

    python bench/optim.py [--models tiny small] [--repeats 3] [--ranks 4] [--dist-model tiny]
                          [--clip-model 1b]
    python bench/optim.py --models --ranks 4 --out bench/results/optim_ranks.json   # only the ranks' tables
    python bench/optim.py --device cuda --models 1b --ranks 0    # one GPU: the step on CUDA tensors

Prints markdown tables and writes bench/results/optim.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor, distribute_tensor

from comm_count import CommCounter
from kimi.config import ModelConfig, OptimConfig, register_configs
from kimi.model.transformer import KimiModel
from kimi.optim import MuonClip, build_optimizer
from kimi.optim.groups import weight_decay_groups
from kimi.optim.muonclip import DEFAULT_ADAMW_PATTERNS, route

ROOT = Path(__file__).resolve().parents[1]
def model_config(name: str) -> ModelConfig:
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"model={name}"])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    # the vocabulary the preset is meant for: the default corpus's for tiny, a 32k tokenizer's otherwise
    model["vocab_size"] = model["vocab_size"] or (cfg.data.tokenizer.vocab_size if name == "tiny" else 32000)
    return ModelConfig(**model)


def torch_muon(model: torch.nn.Module, lr: float, adamw_patterns=DEFAULT_ADAMW_PATTERNS) -> list:
    """torch.optim.Muon on the parameters MuonClip sends to Muon, AdamW on the rest (how one combines
    them)."""
    named = list(model.named_parameters())
    muon = [p for n, p in named if route(n, p, adamw_patterns, ()) == "muon"]
    rest = [(n, p) for n, p in named if route(n, p, adamw_patterns, ()) == "adamw"]
    return [torch.optim.Muon(muon, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(weight_decay_groups(rest, 0.1), lr=lr, betas=(0.9, 0.95))]


def optimizers(model: torch.nn.Module) -> dict[str, list[torch.optim.Optimizer]]:
    lr = 3e-3
    return {"adamw": [build_optimizer(model, OptimConfig(name="adamw", lr=lr))],
            "muonclip": [build_optimizer(model, OptimConfig(name="muonclip", lr=lr))],
            "muonclip_bf16": [build_optimizer(model, OptimConfig(name="muonclip", lr=lr, ns_dtype="bf16"))],
            "torch_muon": torch_muon(model, lr)}


def fill_grads(model: torch.nn.Module, seed: int = 0) -> None:
    first = next(model.parameters())
    device = "cpu" if isinstance(first, DTensor) else first.device  # full DTensor gradients, then sharded
    g = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g, device=device)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full, p.device_mesh, p.placements)
        else:
            p.grad = full


def time_steps(opts: list[torch.optim.Optimizer], repeats: int) -> float:
    """Median seconds of one step of all `opts` after a warm-up step (which also creates the state)."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        for o in opts:
            o.step()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def side_by_side(optims: dict[str, list[torch.optim.Optimizer]], repeats: int,
                 sync=lambda: None) -> dict[str, float]:
    """Median seconds of one step of each entry, the entries interleaved within every repeat (so a shared,
    noisy machine slows them alike) in an order reversed every other repeat (so none always runs right
    after the same one: after MuonClip's fp32 step the caches hold other data than after AdamW's), after a
    warm-up step each (which also creates the state). sync waits for the device (CUDA runs asynchronously)."""
    for opts in optims.values():
        for o in opts:
            o.step()
    times = {k: [] for k in optims}
    for r in range(repeats):
        for k, opts in (optims.items() if r % 2 == 0 else reversed(optims.items())):
            sync()
            start = time.perf_counter()
            for o in opts:
                o.step()
            sync()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")),
               "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{cpu}, {os.cpu_count()} logical CPUs visible, load average {load} at the end of the run"


def single_process(models: list[str], repeats: int, device: str = "cpu") -> list[dict]:
    cuda = torch.device(device).type == "cuda"
    rows = []
    for name in models:
        torch.manual_seed(0)
        # built in place: a 1b model initialised on CPU would take longer than its steps
        with torch.device(device):
            model = KimiModel(model_config(name))
        fill_grads(model)
        times = side_by_side(optimizers(model), repeats, torch.cuda.synchronize if cuda else lambda: None)
        rows.append({"model": name, "params": model.num_params(), "step_s": times,
                     "ratio_to_adamw": {k: t / times["adamw"] for k, t in times.items()},
                     "ratio_to_torch_muon": {k: t / times["torch_muon"] for k, t in times.items()}})
        del model
        gc.collect()
        if cuda:
            rows[-1]["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
            torch.cuda.empty_cache()
    return rows


def clip_times(params: list, repeats: int) -> dict:
    """Seconds of the first call and the median of `repeats` later calls of each global-norm clip on the
    gradients of `params` (scaled in place; the time does not depend on their values). The trainer's runs
    first: it dispatches no DTensor op, so torch's sharding-propagation cache it leaves is empty."""
    from kimi.parallel.tensor_parallel import clip_grad_norm_

    out: dict = {"tensors": len(params)}
    for name, clip in (("kimi", clip_grad_norm_), ("torch", torch.nn.utils.clip_grad_norm_)):
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            clip(params, 1.0)
            times.append(time.perf_counter() - start)
        out[name] = {"first_s": times[0], "later_s": statistics.median(times[1:])}
    return out


def cut_grads(model_name: str, mesh, placements) -> list:
    """Parameters with gradients shaped as `model_name`'s, every dim cut to 8, as DTensors on `mesh`."""
    with torch.device("meta"):
        shapes = [p.shape for p in KimiModel(model_config(model_name)).parameters()]
    params = []
    for shape in shapes:
        cut = [min(n, 8) for n in shape]
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(cut), mesh, placements))
        p.grad = distribute_tensor(torch.randn(cut), mesh, placements)
        params.append(p)
    return params


def distributed(model_name: str, repeats: int, out: Path, clip_model: str) -> None:
    """Runs under torchrun: FSDP2 over all ranks, both Muon implementations on the same sharded weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = KimiModel(model_config(model_name))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fill_grads(model)
    # torch.optim.Muon fails on FSDP2 weights with fewer rows than ranks (measured on torch 2.13: "in-place
    # operations that require placement changes are not supported"), so both sides give those to AdamW.
    fewer = tuple(n for n, p in model.named_parameters() if p.ndim == 2 and p.shape[0] < world)
    patterns = (*DEFAULT_ADAMW_PATTERNS, *fewer)
    result = {"adamw_instead": list(fewer)}
    for name, opts in (("muonclip", [MuonClip(model.named_parameters(), lr=3e-3, adamw_patterns=patterns)]),
                       ("torch_muon", torch_muon(model, 3e-3, patterns))):
        for o in opts:  # warm-up: state, and MuonClip's one-time layout exchange
            o.step()
        counter = CommCounter()
        with counter:
            for o in opts:
                o.step()
        seconds = time_steps(opts, repeats)
        result[name] = {"bytes": counter.total_bytes, "collectives": counter.collectives,
                        "flops": counter.flops,
                        "step_s": seconds}
    # the clip, on this model's FSDP2 gradients and on clip_model's shapes over a 1-D and a 2-D mesh
    from torch.distributed.tensor import Replicate, Shard

    fill_grads(model)
    result["clip"] = {f"{model_name}, FSDP2": clip_times(list(model.parameters()), repeats),
                      f"{clip_model} shapes, 1-D mesh": clip_times(cut_grads(clip_model, mesh, [Shard(0)]),
                                                                   repeats)}
    if world % 2 == 0 and world > 2:
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        result["clip"][f"{clip_model} shapes, 2-D mesh"] = clip_times(
            cut_grads(clip_model, mesh2, [Replicate(), Shard(0)]), repeats)
    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        out.write_text(json.dumps(everyone))
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def launch_distributed(ranks: int, model_name: str, repeats: int, clip_model: str) -> list[dict]:
    tmp = ROOT / "bench" / "results" / ".optim_dist.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           __file__, "--worker", str(tmp), "--dist-model", model_name, "--repeats", str(repeats),
           "--clip-model", clip_model]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    per_rank = json.loads(tmp.read_text())
    tmp.unlink()
    return per_rank


def clip_table(per_rank: list[dict], ranks: int, repeats: int) -> dict:
    """Prints the clip's times (the slowest rank's) and returns them by case."""
    print(f"\nglobal gradient-norm clip over the {ranks} ranks, the slowest rank's time: the first call, and "
          f"the median of {repeats} later calls\n")
    print("| gradients | tensors | kimi first | kimi later | torch first | torch later | torch / kimi, 1st |")
    print("|---|---|---|---|---|---|---|")
    cases = {}
    for case, first in per_rank[0]["clip"].items():
        t = {k: {m: max(r["clip"][case][k][m] for r in per_rank) for m in ("first_s", "later_s")}
             for k in ("kimi", "torch")}
        cases[case] = {"tensors": first["tensors"], **t}
        ms = [f"{t[k][m] * 1e3:.1f} ms" for k in ("kimi", "torch") for m in ("first_s", "later_s")]
        print(f"| {case} | {first['tensors']} | {' | '.join(ms)} | "
              f"{t['torch']['first_s'] / t['kimi']['first_s']:.0f}x |")
    return cases


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["tiny", "small"],
                        help="of the single-process table; none: only the distributed tables")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4, help="0 skips the distributed table")
    parser.add_argument("--dist-model", default="tiny")
    parser.add_argument("--clip-model", default="1b", help="whose gradient shapes the clip table cuts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="of the single-process table: cpu or cuda")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "optim.json")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return distributed(args.dist_model, args.repeats, args.worker, args.clip_model)

    torch.set_num_threads(args.threads)
    record = {"threads": args.threads, "torch": torch.__version__, "device": args.device,
              "single": single_process(args.models, args.repeats, args.device)}
    record["machine"] = machine() + (f"; {torch.cuda.get_device_name()}" if args.device.startswith("cuda")
                                     else "")
    print(f"\n({record['machine']})")
    if args.models:
        print(f"\noptimizer.step() on random gradients on {args.device}, {args.threads} threads, median of "
              f"{args.repeats} interleaved repeats; in brackets: x AdamW, x torch.optim.Muon + AdamW\n")
        print("| model | params | AdamW | MuonClip fp32 NS | MuonClip bf16 NS | torch.optim.Muon + AdamW |")
        print("|---|---|---|---|---|---|")
    for r in record["single"]:
        t, x, y = r["step_s"], r["ratio_to_adamw"], r["ratio_to_torch_muon"]
        cells = [f"{t[k] * 1e3:.1f} ms ({x[k]:.1f}x, {y[k]:.2f}x)"
                 for k in ("muonclip", "muonclip_bf16", "torch_muon")]
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {t['adamw'] * 1e3:.1f} ms | "
              + " | ".join(cells) + " |")

    if args.ranks > 1:
        per_rank = launch_distributed(args.ranks, args.dist_model, args.repeats, args.clip_model)
        record["distributed"] = {"ranks": args.ranks, "model": args.dist_model, "per_rank": per_rank}
        print(f"\n{args.dist_model} model, FSDP2 over {args.ranks} gloo ranks (CPU), one optimizer step, per "
              "rank\n")
        print("| rank | ours: bytes sent | collectives | matmul GFLOP | torch.optim.Muon: bytes sent | "
              "collectives | matmul GFLOP |")
        print("|---|---|---|---|---|---|---|")
        if per_rank[0]["adamw_instead"]:
            print("(on AdamW in both, as torch.optim.Muon fails on them: "
                  f"{', '.join(per_rank[0]['adamw_instead'])})\n")
        for rank, r in enumerate(per_rank):
            a, b = r["muonclip"], r["torch_muon"]
            print(f"| {rank} | {fmt_bytes(a['bytes'])} | {a['collectives']} | {a['flops'] / 1e9:.3f} | "
                  f"{fmt_bytes(b['bytes'])} | {b['collectives']} | {b['flops'] / 1e9:.3f} |")
        total = {k: {m: sum(r[k][m] for r in per_rank) for m in ("bytes", "collectives", "flops")}
                 for k in ("muonclip", "torch_muon")}
        record["distributed"]["total"] = total
        print(f"\nall ranks: bytes {total['torch_muon']['bytes'] / max(1, total['muonclip']['bytes']):.1f}x "
              "fewer, collectives "
              f"{total['torch_muon']['collectives'] / max(1, total['muonclip']['collectives']):.1f}x fewer, "
              f"matmul FLOPs {total['torch_muon']['flops'] / max(1, total['muonclip']['flops']):.1f}x fewer "
              "with ours than with torch.optim.Muon")
        record["distributed"]["clip"] = clip_table(per_rank, args.ranks, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
