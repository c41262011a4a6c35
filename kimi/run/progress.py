"""What the console shows while training: the start-up banner, the progress line every trainer.log_every
steps (loss, lr, tokens/s, MFU, the step's time and its parts, ETA) and the first step's own line."""

from __future__ import annotations

import math
import resource
import time
from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Tuple

import torch

from kimi.config import mixer_pattern
from kimi.model.registry import legend
from kimi.run import cpu
from kimi.schema.run import tokens_per_step
from kimi.run.peaks import PeakFlops, busy_cpu_hint
from kimi.run.step_time import StepClock, breakdown, short_form

def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_count(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def progress_line(step: int, max_steps: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
                  mfu: Optional[float], eta_s: float, memory_gib: Optional[float] = None,
                  loss_steps: int = 1, moe_imbalance: Optional[float] = None,
                  times: Optional[Dict[str, float]] = None) -> str:
    """One line per logging window. `loss` is the mean over the window's `loss_steps` steps (metrics.jsonl's
    `loss`), labelled `loss(avg N)` when N > 1; lr, gnorm and the experts' load imbalance (max/mean tokens
    per expert, the worst MoE layer) are the last step's; `times`: the window's step-time breakdown
    (kimi.run.step_time.breakdown), shown short."""
    label = f"loss(avg {loss_steps})" if loss_steps > 1 else "loss"
    parts = [f"step {step:>{len(str(max_steps))}}/{max_steps}", f"{label} {loss:.4f}", f"lr {lr:.2e}",
             f"gnorm {grad_norm:.3f}"]
    if moe_imbalance is not None:
        parts.append(f"moe {moe_imbalance:.2f}x")
    parts.append(f"{format_count(tokens_per_s)} tok/s")
    if mfu is not None and math.isfinite(mfu):
        parts.append(f"MFU {100 * mfu:.1f}%")
    if times is not None:
        parts.append(short_form(times))
    if memory_gib is not None:
        parts.append(f"mem {memory_gib:.1f} GiB")
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


def window_peak_memory_gib(device: torch.device) -> float:
    """The memory peak since the last call: CUDA, what this rank allocated at most (its peak is reset);
    elsewhere the process's peak resident memory so far (an operating system's peak cannot be reset)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux counts KiB


class ProgressWindow:
    """The steps since the last progress line: their losses, their training time (evaluations, checkpoints
    and diagnostics excluded with `paused`, their own time reported by `pauses`), where that time went (the
    steps' `clock`, kimi.run.step_time), and what they give: the progress line and metrics.jsonl's record,
    which agree."""

    def __init__(self, peak: PeakFlops, tokens_per_step: int, flops_per_token: float, start_step: int,
                 max_steps: int, device: torch.device, clock: Optional[StepClock] = None):
        self.peak, self.tokens_per_step, self.flops_per_token = peak, tokens_per_step, flops_per_token
        self.start_step, self.max_steps, self.device = start_step, max_steps, device
        self.clock = clock or StepClock()
        self.clock.take()  # what train_step timed before the window (a warm-up, a benchmark) is not its
        self.t_start = self.t0 = time.perf_counter()
        self.losses: List[float] = []
        self.windows, self.hinted, self.memory_peak = 0, False, 0.0
        self.paused_s: Dict[str, float] = {}

    @staticmethod
    def header(log_every: int) -> str:
        if log_every == 1:
            return "[kimi] a progress line every step: tok/s and MFU over its training time"
        return (f"[kimi] a progress line every {log_every} steps: loss is the mean of those steps "
                "(metrics.jsonl's loss), lr and gnorm the last one's, tok/s and MFU over their training time")

    def add(self, loss: float) -> None:
        self.losses.append(loss)

    def due(self, step: int, out: Dict[str, Any], log_every: int) -> Tuple[Optional[str], Dict[str, Any]]:
        """(the console text due after `step`, or None; its metrics record, or {}): the progress line and its
        record every log_every steps and at the end, and after a start's first step its pace (first_step)."""
        if step % log_every == 0 or step == self.max_steps:
            line, record, note = self.report(step, out)
            return (line if note is None else f"{line}\n{note}"), record
        if step == self.start_step + 1:  # a slow run's pace at once, not after log_every steps
            return self.first_step(step, log_every), {}
        return None, {}

    def first_step(self, step: int, log_every: int) -> str:
        """The line after a start's first step, before its first progress line: a slow run (a large model on
        a CPU) says at once how fast it goes and when it ends, not after log_every steps. The window goes on
        (its line and record at log_every are unchanged). This step includes one-off work (allocations, the
        kernels' first calls), so its ETA is an upper bound."""
        took = time.perf_counter() - self.t0
        seconds = f"{took:.2f} s" if took < 60 else format_duration(took)
        eta = format_duration(took * (self.max_steps - step))
        return (f"[kimi] step {step}/{self.max_steps} took {seconds} (start-up work included): "
                f"{format_count(self.tokens_per_step / took)} tok/s, ETA {eta} at that pace; a progress line "
                f"every {log_every} steps follows")

    @contextmanager
    def paused(self, kind: str = "other"):
        """Time outside training (evaluation, checkpoint, diagnostics): not the window's; its seconds per kind
        go to the next record logged (pauses)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - t
            self.t0 += took
            self.paused_s[kind] = self.paused_s.get(kind, 0.0) + took

    def pauses(self) -> Dict[str, float]:
        """{time/<kind>_s: seconds} of the pauses since the last call (the record logged at an evaluation
        step has that evaluation's time; a checkpoint's comes with the next record logged)."""
        out = {f"time/{kind}_s": s for kind, s in self.paused_s.items()}
        self.paused_s = {}
        return out

    def report(self, step: int, out: Dict[str, float]) -> Tuple[str, Dict[str, Any], Optional[str]]:
        """(progress line, metrics record, a note on the MFU peak or a busy CPU, or None); starts the next
        window."""
        now, n = time.perf_counter(), len(self.losses)
        tps = n * self.tokens_per_step / (now - self.t0)
        mfu, note = self.peak.mfu(tps * self.flops_per_token)
        self.windows += 1
        if not self.hinted and mfu is not None and self.peak.measured_cpu and self.windows > 1:
            # the first window holds the start's one-off work; a hint once, from the second window on
            threads = torch.get_num_threads()
            hint = busy_cpu_hint(mfu, threads, cpu.usable_cores(), cpu.cpu_load())
            self.hinted = hint is not None
            note = "\n".join(x for x in (note, hint) if x) or None
        eta = (now - self.t_start) / max(1, step - self.start_step) * (self.max_steps - step)
        loss = sum(self.losses) / n
        times = breakdown((now - self.t0) / n, self.clock.take(), n)
        window_memory = window_peak_memory_gib(self.device)
        self.memory_peak = max(self.memory_peak, window_memory)
        # this rank's peak allocation on its GPU so far (ranks differ little but for pipeline stages)
        memory = self.memory_peak if self.device.type == "cuda" else None
        line = progress_line(step, self.max_steps, loss, out["lr"], out["grad_norm"], tps, mfu, eta, memory,
                             loss_steps=n, moe_imbalance=out.get("moe_imbalance"), times=times)
        record = {"step": step, "loss": loss, "lr": out["lr"], "grad_norm": out["grad_norm"],
                  "tokens_per_s": tps, "mfu": mfu, "tokens": step * self.tokens_per_step, **times,
                  "memory/window_peak_gib": window_memory}
        record.update({k: v for k, v in out.items() if k.startswith("moe_")})
        if memory is not None:
            record["peak_memory_gib"] = memory
        self.t0, self.losses = time.perf_counter(), []
        return line, record, note


# Parameters from which a run on a CPU gets a note: the presets made for a CPU (tiny, moe_tiny, k3_tiny) have
# at most 2M, small (126M) and up are sized for GPUs, where their steps take seconds, not minutes.
CPU_NOTE_PARAMS = 50_000_000


def cpu_size_note(device: torch.device, num_params: int) -> Optional[str]:
    """A note for a GPU-sized model on a CPU (before its first step, which may take minutes), else None."""
    if device.type != "cpu" or num_params < CPU_NOTE_PARAMS:
        return None
    return (f"[kimi] note: {num_params / 1e6:.1f}M parameters on a CPU: a model this size is meant for a GPU "
            "and its steps take long here (the first step's time and an ETA follow it); the CPU presets are "
            "model=tiny, moe_tiny and k3_tiny")


def _count(meta) -> str:
    n = meta["num_tokens"]
    return f"{n:,}" if isinstance(n, int) else str(n)  # a stream's size is not known ahead


def banner(cfg, dims, num_params, flops_per_token: float, data, device, routing: Optional[str] = None,
           layout: Optional[str] = None, threads: str = "") -> str:
    """The lines printed before training: model, data and batch, the device (`threads`: its CPU threads and
    why, kimi.run.cpu.set_threads), the engine's line on the layout (Engine.layout), and the optimizer's
    parameter routing (a one-line summary: the table itself is a file, see kimi.run.runlog.write_routing)."""
    m, t = cfg.model, cfg.trainer
    n, n_emb = num_params[0], num_params[0] - num_params[1]
    tokens = tokens_per_step(t, dims.dp)
    ranks = f" x {dims.dp} data-parallel ranks" if dims.enabled else ""
    moe = (f", MLPs from block {m.moe.first_dense} on: {m.moe.num_experts} experts, top-{m.moe.top_k} + "
           f"{m.moe.shared_experts} shared" if m.moe.num_experts else "")
    lines = [f"[kimi] model {m.name}: {n / 1e6:.2f}M parameters ({n_emb / 1e6:.2f}M embedding), blocks "
             f"{mixer_pattern(m)} ({legend(m)}){moe}, residual={m.residual}, vocab {m.vocab_size}, "
             f"{flops_per_token / 1e6:.1f} MFLOP/token (train)",
             f"[kimi] data {cfg.data.name}: {_count(data.train_meta)} train / {_count(data.val_meta)} "
             f"val tokens; batch {t.micro_batch_size}x{t.seq_len}x{t.grad_accum_steps}{ranks} = {tokens:,} "
             f"tokens/step; device {device}{threads}; run dir {t.run_dir}"]
    if layout:
        lines.append(layout)
    if routing:  # MuonClip: which parameters Muon and AdamW each update
        lines.append(routing)
    return "\n".join(lines)
