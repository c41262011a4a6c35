"""trainer.profile: torch.profiler over a few training steps, and on CUDA the allocator's memory history.

``trainer.profile.steps=[a,b]`` records steps a..b (1-based, inclusive) on the ranks in
``trainer.profile.ranks`` and writes, per rank, into ``<run_dir>/profile/``:

  trace_rank<r>.json     a Chrome trace of every op and kernel (open in https://ui.perfetto.dev or
                         chrome://tracing); each step is a range named "step <n>"
  ops_rank<r>.txt        the top ops by self time (CUDA time on a GPU, CPU time otherwise), the table
                         ``key_averages`` prints
  memory_rank<r>.pickle  CUDA only, with profile.memory: the allocator's snapshot with the stack of every
                         live and freed block of those steps (drag it onto https://pytorch.org/memory_viz)

Only the training step is recorded: evaluation, diagnostics and checkpoints that fall on those steps run
outside it. Recording slows the steps it covers (the trace keeps input shapes), so the run's tokens/s of
those steps is not its speed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# Allocation events the CUDA memory history keeps (the newest): enough for a few steps of a large model.
_MEMORY_EVENTS = 200_000


class StepProfiler:
    def __init__(self, steps, ranks, memory: bool, top: int, rank: int, device: torch.device, run_dir: Path,
                 log: Callable[[str], None]):
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (0, -1)
        self.on = bool(steps) and rank in set(ranks)
        self.cuda = device.type == "cuda"
        self.memory, self.top, self.rank = memory and self.cuda, top, rank
        self.dir = Path(run_dir) / "profile"
        self.log = log
        self._prof: Optional[profile] = None

    @classmethod
    def from_config(cls, cfg, rank: int, device: torch.device, run_dir: Path, log) -> "StepProfiler":
        p = cfg.trainer.profile
        return cls(p.steps, p.ranks, p.memory, p.top, rank, device, run_dir, log)

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        """Wrap training step `step` (1-based): recording starts before the first and ends after the last."""
        if not self.on or not self.first <= step <= self.last:
            yield
            return
        if self._prof is None:
            self._start()
        with record_function(f"step {step}"):
            yield
        if step == self.last:
            self._finish()

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=_MEMORY_EVENTS)
        self._prof.__enter__()

    def _finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # the last step's kernels belong in the trace
        prof, self._prof, self.on = self._prof, None, False
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        written = [self.dir / f"trace_rank{self.rank}.json", self.dir / f"ops_rank{self.rank}.txt"]
        prof.export_chrome_trace(str(written[0]))
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        written[1].write_text(prof.key_averages().table(sort_by=sort, row_limit=self.top) + "\n")
        if self.memory:
            written.append(self.dir / f"memory_rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(str(written[2]))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.log(f"[kimi] profile of steps {self.first}-{self.last}: " + ", ".join(str(p) for p in written)
                 + " (the trace opens in ui.perfetto.dev, the memory snapshot in pytorch.org/memory_viz)")

    def close(self) -> None:
        """Stop a recording that the run's end (or a stop) cut short; nothing is written for it."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            if self.memory:
                torch.cuda.memory._record_memory_history(enabled=None)
