"""The CPU as a training device: how many threads to train with, and its fp32 matmul rate (what MFU divides by
on a CPU), measured once per machine and kept in the kimi cache.

On a CPU that other processes keep busy, torch's intra-op threads wait for each other at every operation: a
tiny model with 2 threads on a busy 2-core machine trained at a tenth of the speed of 1 thread. So the
default (trainer.threads=null) takes the cores this process may use less the ones the load keeps busy."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch

REMEASURE_ENV = "KIMI_MEASURE_PEAK"  # set to 1: measure the CPU's rate again and replace the cached one
PEAK_FILE = "cpu_peak.json"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def cpu_load() -> float:
    """Runnable processes averaged over the last minute (0 where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def auto_threads(cores: int, load: float) -> int:
    """Threads for `cores` usable cores under a one-minute `load`: the cores not busy, at least 1."""
    return max(1, cores - round(load))


def set_threads(configured: Optional[int], device: torch.device) -> str:
    """Set torch's intra-op threads for training on `device`; return what the banner says of it ("" off a
    CPU). trainer.threads wins; null (auto) leaves $OMP_NUM_THREADS in charge where it is set (torchrun sets
    it for several processes per machine), else takes auto_threads; 0 keeps torch's default."""
    if configured:
        torch.set_num_threads(configured)
        why = "trainer.threads"
    elif configured is None and os.environ.get("OMP_NUM_THREADS"):
        why = "OMP_NUM_THREADS"
    elif configured is None and device.type == "cpu":
        cores, load = usable_cores(), cpu_load()
        torch.set_num_threads(auto_threads(cores, load))
        why = f"auto: {cores} cores, load {load:.1f}"
    else:
        why = "torch's default"
    n = torch.get_num_threads()
    return f" ({n} thread{'s' * (n != 1)}, {why})" if device.type == "cpu" else ""


def measure_cpu_peak_flops(size: int = 512, seconds: float = 0.005, repeats: int = 100,
                           dtype: torch.dtype = torch.float32, budget: float = 2.0) -> float:
    """Achieved matmul FLOP/s in `dtype` with torch's current thread count: the best of `repeats` timed runs
    of `seconds` each, stopped after `budget` seconds. Short runs, many of them: other processes take the
    CPU for some, not all (one core at a load of 17 on 2 cores: 91-96 GFLOP/s this way, 59-62 as the best of
    25 runs of 20 ms). bf16 multiplies as nn.Linear does (by the transposed weight), the fastest of its
    layouts on a CPU without bf16 instructions (9.5 GFLOP/s on this project's 2-core EPYC, 1.3 with both
    operands row-major, fp32 88)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    if dtype != torch.float32:
        b = b.t()
    a @ b  # warm up
    best, start = 0.0, time.perf_counter()
    for _ in range(repeats):
        if time.perf_counter() - start > budget:
            break
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            n += 1
        best = max(best, 2 * size**3 * n / (time.perf_counter() - t0))
    return best


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def peak_key(model: str, cores: int) -> str:
    """What the cached rate holds for: the CPU, how many cores this process may use, and torch's kernels."""
    return f"{model} | {cores} cores | torch {torch.__version__}"


def per_core_peak(cache_dir: Path, key: str, remeasure: bool = False,
                  measure: Optional[Callable[[], float]] = None) -> Tuple[float, bool]:
    """(one core's matmul FLOP/s as `measure` takes it, fp32 by default, whether it came from the cache).
    Measured with one thread, which a busy machine disturbs far less than several (on a loaded 2-core
    machine: 100 GFLOP/s with 1 thread, 17 with 2), then kept in `cache_dir`/cpu_peak.json under `key`;
    `remeasure` replaces the cached value."""
    path = Path(cache_dir) / PEAK_FILE
    try:
        cached = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        cached = {}  # unreadable or cut short: measured again and rewritten
    cached = cached if isinstance(cached, dict) else {}
    entry = cached.get(key)
    if not remeasure and isinstance(entry, dict) and isinstance(entry.get("flops_per_core"), (int, float)) \
            and entry["flops_per_core"] > 0:
        return float(entry["flops_per_core"]), True
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rate = (measure or measure_cpu_peak_flops)()
    finally:
        torch.set_num_threads(threads)
    cached[key] = {"flops_per_core": rate, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:  # a read-only home only costs the next start another measurement
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{PEAK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
    return rate, False
