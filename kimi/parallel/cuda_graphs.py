"""parallel.cuda_graphs (kimi.parallel.config.CUDA_GRAPHS): a training micro-batch's kernels launched from
CUDA graphs, so that the host issues a few launches where it issued a thousand (bench/host_audit.py counts
them and predicts both ways).

  none     every kernel launched by the host, as always
  regions  each region parallel.compile compiles (every token mixer and MLP, every depth mix) replays as a
           graph of its own: torch.compile's reduce-overhead mode, inductor's cudagraph trees (applied in
           apply_compile; the engine marks where a step begins). Torch's own path; the Python between the
           regions still runs, and each region's call pays the trees' checks
  step     the whole micro-batch, forward, loss and backward into the gradients, captured once as one graph
           after WARMUP micro-batches and then replayed (StepGraph, below): the host copies the batch in and
           launches one graph

What `step` relies on, and how it keeps to it:
  - fixed shapes: every training batch has the same [B, T] (a batch of another shape, or another gradient
    scale, captures anew); evaluation runs outside the graph;
  - no host read inside a micro-batch: packed documents (data.varlen) read their offsets on the host and are
    refused by the rules; a capture that fails for any other reason falls back to running without a graph,
    saying why in one line;
  - fixed addresses: the batch is copied into the graph's own input tensors, and the gradients are
    accumulated into in place, zeroed but never freed between steps (the engine's zero_grad keeps them);
    every replay first checks that each gradient is still where the graph adds into it, and captures anew
    when one moved. A parameter the backward never reaches (tiny, moe_tiny and k3_tiny have none) gets a zero
    gradient instead of none, which an optimizer steps like any other (weight decay applies);
  - what a training forward records besides its output (each sublayer's RECORDS: MLA's max logits for
    QK-Clip, a MoE layer's auxiliary loss) is Python, which a replay does not run: the capture's records are
    noted and undone, and every replay records copies of those tensors again. Records updated in place (a
    MoE layer's expert load) are in the graph itself.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch import nn

# micro-batches run as usual before the capture, on a side stream as torch's CUDA-graph notes ask: they
# compile, autotune and allocate what a capture must not
WARMUP = 3
BATCH_FIELDS = ("input_ids", "labels", "doc_starts")


def compile_mode(cuda_graphs: str) -> Optional[str]:
    """torch.compile's mode for parallel.cuda_graphs: reduce-overhead records each compiled region's kernels
    as a CUDA graph and replays it."""
    return "reduce-overhead" if cuda_graphs == "regions" else None


# ---- what a forward records ----------------------------------------------------------------------------
Records = List[Tuple[nn.Module, str, object, Optional[int]]]


def records(model: nn.Module) -> Records:
    """(sublayer, attribute, its value, the list's length if it is a list) of every declared record."""
    out = []
    for _, m in model.sublayers():
        for name in m.RECORDS:
            value = getattr(m, name)
            out.append((m, name, value, len(value) if isinstance(value, list) else None))
    return out


def recorded_since(before: Records) -> list:
    """What a forward recorded since `before`: ("append", module, name, [tensors]) for a list it extended,
    ("set", module, name, tensor) for an attribute it rebound to a new tensor. A record changed in place (a
    buffer) is not listed; any other change cannot be replayed (ValueError)."""
    found = []
    for m, name, value, length in before:
        now = getattr(m, name)
        if length is not None and now is value and len(now) > length:
            found.append(("append", m, name, now[length:]))
        elif now is not value:
            if not isinstance(now, torch.Tensor):
                raise ValueError(f"{type(m).__name__}.{name} is recorded as {type(now).__name__}, which a "
                                 "graph cannot replay")
            found.append(("set", m, name, now))
    return found


def undo(before: Records) -> None:
    """Put every record back as `before` holds it."""
    for m, name, value, length in before:
        if length is not None:
            del value[length:]
        setattr(m, name, value)


def record_again(effects: list) -> None:
    """After a replay: record copies of what the capture recorded (the graph rewrote those tensors; copies
    keep each micro-batch's values apart until the step reads them)."""
    for kind, m, name, value in effects:
        if kind == "append":
            getattr(m, name).extend(t.clone() for t in value)
        else:
            setattr(m, name, value.clone())


# ---- the device side ------------------------------------------------------------------------------------
class CudaGraphs:
    """What StepGraph asks of CUDA (tests give it a stand-in that runs on a CPU)."""

    @contextmanager
    def side_stream(self) -> Iterator[None]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self, run: Callable[[], torch.Tensor]) -> Tuple[object, torch.Tensor]:
        """(the graph, run's output): run's kernels recorded, not run. The graph allocates from a pool of its
        own: the blocks the allocator keeps cached from the warm-up go back to the device first. Only this
        thread's calls are held to the capture's rules (an asynchronous checkpoint's copies may run beside
        it)."""
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = run()
        return graph, out

    def replay(self, graph) -> None:
        graph.replay()


@dataclasses.dataclass
class Captured:
    graph: object
    scale: float
    batch: object  # the graph's own input tensors (a Batch)
    loss: torch.Tensor
    effects: list
    grads: List[Tuple[torch.Tensor, int]]  # each parameter and the address of the gradient the graph adds to


class StepGraph:
    """parallel.cuda_graphs=step: `run(batch, scale)` (one micro-batch's forward and backward, returning its
    loss) captured once and replayed (module docstring)."""

    def __init__(self, model: nn.Module, run: Callable, backend=None, warmup: int = WARMUP,
                 log: Callable[[str], None] = print):
        self.model, self.run, self.log = model, run, log
        self.backend = backend if backend is not None else CudaGraphs()
        self.warmup = warmup
        self.captured: Optional[Captured] = None
        self.failed: Optional[str] = None  # why a capture failed: the run goes on without graphs
        self.captures = 0

    def __call__(self, batch, scale: float) -> torch.Tensor:
        """The micro-batch's loss (detached, the caller's to keep); its gradients added to the parameters'."""
        if self.failed:
            return self.run(batch, scale).detach()
        if self.warmup > 0:
            self.warmup -= 1
            with self.backend.side_stream():
                return self.run(batch, scale).detach()
        c = self.captured
        if c is None or not self._fits(c, batch, scale):
            c = self._capture(batch, scale)
            if c is None:
                return self.run(batch, scale).detach()
        for name in BATCH_FIELDS:
            getattr(c.batch, name).copy_(getattr(batch, name), non_blocking=True)
        self.backend.replay(c.graph)
        record_again(c.effects)
        return c.loss.clone()

    @staticmethod
    def _fits(c: Captured, batch, scale: float) -> bool:
        """Whether the captured graph computes this micro-batch: the same gradient scale and batch shape, and
        every gradient still where the graph adds into it."""
        return (c.scale == scale
                and all(getattr(c.batch, k).shape == getattr(batch, k).shape for k in BATCH_FIELDS)
                and all(p.grad is not None and p.grad.data_ptr() == ptr for p, ptr in c.grads))

    def _capture(self, batch, scale: float) -> Optional[Captured]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:  # the graph adds into these: they must exist before it is recorded
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        static = dataclasses.replace(batch, **{name: getattr(batch, name).clone() for name in BATCH_FIELDS})
        before = records(self.model)
        self.captured = None
        try:
            graph, loss = self.backend.capture(lambda: self.run(static, scale))
            effects = recorded_since(before)
        except Exception as e:  # e.g. a host read inside the step: run on without graphs
            self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            self.log(f"[kimi] parallel.cuda_graphs=step: capturing the micro-batch failed ({self.failed}); "
                     "training goes on without CUDA graphs")
            return None
        finally:
            undo(before)
        self.captures += 1
        self.captured = Captured(graph, scale, static, loss.detach(), effects,
                                 [(p, p.grad.data_ptr()) for p in params])
        return self.captured
