"""The peak FLOP/s that MFU is measured against: a GPU's datasheet bf16 peak, or this CPU's measured one
(kimi.run.cpu), and the hint a CPU run far below it gets."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional, Tuple

import torch

from kimi.folders import default_cache_dir
from kimi.run import cpu


# Dense bf16 tensor-core peak per device (FLOP/s), from the vendors' datasheets (no sparsity); the first
# key found in the device's name applies (so "H100 PCIe" before "H100", "A100" before "A10").
_CUDA_PEAK_BF16 = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                   "A10": 125e12, "4090": 165e12}
_CUDA_UNKNOWN = 100e12  # a GPU not in the table: MFU against this, and the start-up line says so


def _cuda_peak(device: torch.device) -> Tuple[float, str]:
    name = torch.cuda.get_device_name(device)
    for key, value in _CUDA_PEAK_BF16.items():
        if key in name:
            return value, f"{name}, datasheet dense bf16 peak"
    return _CUDA_UNKNOWN, f"{name}, not in kimi/run/peaks.py's table: assumed; set trainer.peak_flops"


def peak_flops(device: torch.device, configured: Optional[float],
               dtype: torch.dtype = torch.float32) -> float:
    """Per-device FLOP/s: trainer.peak_flops, else the datasheet's (CUDA) or the measured CPU rate (in
    `dtype`, the run's compute dtype: Precision.compute_dtype)."""
    return PeakFlops(device, configured, dtype=dtype).per_device


def format_flops(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(x) >= div:
            return f"{x / div:.1f} {unit}FLOP/s"
    return f"{x:.0f} FLOP/s"


class PeakFlops:
    """What MFU divides by (`world` devices' peak) and where the number comes from. On a CPU: one core's
    matmul rate in the run's compute dtype (kimi.run.cpu.per_core_peak, cached per machine and dtype) times
    the threads training uses; a bf16 run on a CPU that multiplies bf16 far slower than fp32 gets a warning
    (`warning`). An achieved rate above the peak means the peak is wrong (a trainer.peak_flops set too low, a
    CPU rate measured while something else ran): MFU is then n/a, said once, and null in metrics.jsonl, not
    a number that looks exact."""

    def __init__(self, device: torch.device, configured: Optional[float], world: int = 1,
                 cache_dir: Optional[Path] = None, dtype: torch.dtype = torch.float32):
        self.world, self.unreliable, self.measured_cpu, self.warning = world, False, False, None
        if configured:
            self.per_device, self.source = float(configured), "trainer.peak_flops"
            self.kind, self.fix = self.source, "set trainer.peak_flops to the device's peak"
        elif device.type == "cuda":
            (self.per_device, self.source), self.kind = _cuda_peak(device), "the datasheet peak"
            self.fix = "set trainer.peak_flops to the device's peak"
        else:
            cache = Path(cache_dir) if cache_dir else default_cache_dir()
            cores = cpu.usable_cores()
            remeasure = os.environ.get(cpu.REMEASURE_ENV, "") not in ("", "0")
            key = cpu.peak_key(cpu.cpu_model(), cores)
            per_core, cached = cpu.per_core_peak(cache, key, remeasure)
            name = "fp32"
            if dtype == torch.bfloat16:  # autocast's matmuls: without bf16 instructions, far below fp32's
                fp32, name = per_core, "bf16"
                per_core, cached = cpu.per_core_peak(cache, f"{key} | bf16", remeasure, functools.partial(
                    cpu.measure_cpu_peak_flops, dtype=torch.bfloat16))
                if per_core < fp32 / 2:
                    self.warning = (f"[kimi] warning: this CPU multiplies bf16 matrices at "
                                    f"{format_flops(per_core)} per core, 1/{fp32 / per_core:.0f} of its fp32 "
                                    f"rate ({format_flops(fp32)}; no bf16 matrix instructions): "
                                    "trainer.precision=fp32 trains faster here")
            n = min(torch.get_num_threads(), cores)
            self.per_device, self.kind, self.measured_cpu = per_core * n, "the measured CPU rate", True
            self.fix = f"{cpu.REMEASURE_ENV}=1 measures this CPU again"
            self.source = (f"{n} thread{'s' * (n != 1)} x this CPU's {name} matmul rate per core "
                           f"({format_flops(per_core)}, {'cached in' if cached else 'measured now, kept in'} "
                           f"{cache / cpu.PEAK_FILE}; {cpu.REMEASURE_ENV}=1 measures again), not a datasheet "
                           "peak")

    @property
    def total(self) -> float:
        return self.per_device * self.world

    def describe(self) -> str:
        devices = f" x {self.world} devices" if self.world > 1 else ""
        line = f"[kimi] MFU against {format_flops(self.per_device)}{devices}: {self.source}"
        return f"{line}\n{self.warning}" if self.warning else line

    def mfu(self, flops_per_s: float) -> Tuple[Optional[float], Optional[str]]:
        """(MFU in [0, 1], or None from the first achieved rate above the peak on; a note that first time)."""
        if flops_per_s > self.total and not self.unreliable:
            self.unreliable = True
            return None, (f"[kimi] MFU n/a (peak unreliable: achieved {format_flops(flops_per_s)}, more than "
                          f"{self.kind} {format_flops(self.total)}): logged as null from now on; {self.fix}")
        return (None if self.unreliable else flops_per_s / self.total), None


# Below this MFU a CPU run is far slower than its threads can go (a healthy tiny run: about 25% on 1 thread
# of a 2-core machine; 2 threads on the same machine kept busy by other processes: 1 to 4%).
SLOW_CPU_MFU = 0.1


def busy_cpu_hint(mfu: float, threads: int, cores: int, load: float) -> Optional[str]:
    """One line for a CPU run at under SLOW_CPU_MFU of its measured rate, naming the threads and the load;
    None for a run that is not."""
    if mfu >= SLOW_CPU_MFU:
        return None
    return (f"[kimi] hint: training runs at {100 * mfu:.1f}% of this CPU's measured rate for {threads} "
            f"thread{'s' * (threads != 1)} with a load of {load:.1f} on {cores} cores over the last minute: "
            "threads that other processes keep waiting slow every step; set trainer.threads lower (1 on a "
            "busy machine), or null to take the cores free at the start")
