"""parallel.cuda_graphs: what a CPU can check of it. The graphs themselves need a GPU (bench/gpu_check.py's
train_graphs step records and replays them); here: `regions` gives every region parallel.compile compiles
torch.compile's reduce-overhead mode and marks where a step begins for inductor's cudagraph trees (once per
optimizer step, once per evaluation batch); `step` (StepGraph) trains exactly as without graphs when a
stand-in for CUDA graphs runs nothing at capture and reruns the recorded function at replay without its
Python side effects; a failed capture falls back in one line; a run on a device without CUDA is refused in
one line."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from kimi.config import to_config
from kimi.data import Batch
from kimi.errors import ConfigError
from kimi.model import KimiModel
from kimi.model.attnres import compiled_depth_attention
from kimi.parallel import apply_compile
from kimi.parallel.cuda_graphs import StepGraph, records, recorded_since, undo
from kimi.parallel.dims import ParallelDims
from kimi.parallel.engine import TorchEngine

from helpers import run_cfg, tiny_model_cfg

pytestmark = pytest.mark.unit


def _config(tmp_path, *overrides: str):
    return to_config(run_cfg(tmp_path / "run", ["data.path=unused"], "model=tiny", "model.vocab_size=64",
                             "trainer.seq_len=16", "trainer.device=cpu", *overrides))


@pytest.mark.parametrize("cuda_graphs,mode", [("none", None), ("regions", "reduce-overhead"), ("step", None)])
def test_every_compiled_region_gets_the_mode(cuda_graphs, mode):
    """Each token mixer and MLP (Module.compile) and both depth mixes (with and without the pre-norm)."""
    model = KimiModel(tiny_model_cfg())
    modes = []

    def compile_(fn=None, **kwargs):
        modes.append(kwargs.get("mode"))
        return fn

    compiled_depth_attention.cache_clear()  # a cached mix would not call torch.compile again
    try:
        with mock.patch("torch.compile", compile_):
            apply_compile(model, cuda_graphs=cuda_graphs)
    finally:
        compiled_depth_attention.cache_clear()
    assert len(modes) == 2 * len(model.blocks) + 2
    assert set(modes) == {mode}


def test_a_step_begins_once_per_update_and_per_evaluation_batch(tmp_path, monkeypatch):
    """The cudagraph trees may overwrite earlier replays' outputs where a step begins: not between a step's
    micro-batches (the max logits QK-Clip reads at the step's end come from all of them)."""
    cfg = _config(tmp_path, "optim.qk_clip_tau=1")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = KimiModel(cfg.model)
    engine = TorchEngine(cfg, ParallelDims.from_config(cfg.parallel, 1), None, torch.device("cpu"), model)
    # graphs are refused on this CPU (below); the marks are what the engine asks of inductor around them
    engine.graph_regions = engine.graph_step_begins = True
    events = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: events.append("mark"))
    batch = _batch(0)

    def forward_backward():
        engine.forward_backward(batch, 0.5)
        events.append("fb")

    def evaluate():
        engine.eval_loss(batch)
        events.append("eval")

    def update():
        engine.step(1.0)
        events.append("step")

    for call in (forward_backward, forward_backward, update, evaluate, evaluate, forward_backward,
                 forward_backward, update, forward_backward):
        call()
    assert events == ["mark", "fb", "fb", "step", "mark", "eval", "mark", "eval", "mark", "fb", "fb", "step",
                      "mark", "fb"]


@pytest.mark.parametrize("mode", ["regions", "step"])
def test_a_device_without_cuda_is_refused_in_one_line(tmp_path, mode):
    """trainer.device=auto on a machine without CUDA passes validation (the rule sees only the name)."""
    cfg = _config(tmp_path, "parallel.compile=true", f"parallel.cuda_graphs={mode}")
    with pytest.raises(ConfigError, match=rf"^parallel\.cuda_graphs={mode} needs a CUDA GPU and this run's "
                                          r"device is cpu: set parallel\.cuda_graphs=none$"):
        TorchEngine(cfg, ParallelDims.from_config(cfg.parallel, 1), None, torch.device("cpu"), None)


def _batch(seed: int, rows: int = 2, T: int = 16) -> Batch:
    ids = torch.randint(0, 64, (rows, T + 1), generator=torch.Generator().manual_seed(seed))
    starts = torch.zeros(rows, T, dtype=torch.bool)
    starts[:, 0] = True
    return Batch(input_ids=ids[:, :-1], labels=ids[:, 1:], doc_starts=starts, epoch=0, step=seed)


class CpuGraphs:
    """CUDA graphs as a CPU can stand in for them. A capture records and runs nothing that lasts: the
    gradients and buffers the function changed are put back (its Python side effects stay, as a real
    capture's do). A replay reruns the recorded function on the same input tensors and writes its results
    into the captured outputs (the loss, the records' tensors), leaving no Python side effect behind: what
    a graph replay does and does not do."""

    def __init__(self, model):
        self.model = model

    @contextmanager
    def side_stream(self):
        yield

    def _state(self) -> list:
        return [p.grad for p in self.model.parameters() if p.grad is not None] + list(self.model.buffers())

    def capture(self, run):
        state = self._state()
        saved = [t.clone() for t in state]
        before = records(self.model)
        out = run()
        made = recorded_since(before)
        with torch.no_grad():
            for t, value in zip(state, saved):
                t.copy_(value)
        return SimpleNamespace(run=run, out=out, made=made), out

    def replay(self, graph):
        before = records(self.model)
        out = graph.run()
        made = recorded_since(before)
        undo(before)
        with torch.no_grad():
            graph.out.detach().copy_(out.detach())
            for (kind, *_, captured), (_, *_, fresh) in zip(graph.made, made, strict=True):
                pairs = zip(captured, fresh, strict=True) if kind == "append" else [(captured, fresh)]
                for a, b in pairs:
                    a.copy_(b)


def _train(cfg, graphs: bool, steps: int = 4, accum: int = 2, touch=None, backend=CpuGraphs,
           rows=(2, 2, 2, 2)):
    """Losses, QK-Clip's and the bias update's effects and final weights of `steps` steps of `accum`
    micro-batches, with a step graph over the CPU stand-in (warm-up 1) or without."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = KimiModel(cfg.model)
    engine = TorchEngine(cfg, ParallelDims.from_config(cfg.parallel, 1), None, torch.device("cpu"), model)
    lines = []
    if graphs:
        engine.step_graph = StepGraph(engine.model, engine._forward_backward, backend(engine.model),
                                      warmup=1, log=lines.append)
    losses = []
    for step in range(steps):
        for i in range(accum):
            losses.append(engine.forward_backward(_batch(step * accum + i, rows[step]), 1 / accum))
        losses.append(engine.step(1.0)["grad_norm"])
        if touch:
            touch(engine, step)
    weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
    return losses, weights, engine, lines


@pytest.mark.parametrize("model", ["tiny", "moe_tiny"])
def test_a_step_graph_trains_as_without_one(tmp_path, model):
    """Losses, gradient norms and every weight and buffer after 4 steps of 2 micro-batches: the same,
    QK-Clip clipping (it reads the max logits each micro-batch records) and, for MoE, the expert biases
    following the recorded loads."""
    cfg = _config(tmp_path, f"model={model}", "optim.qk_clip_tau=0.01")
    plain, plain_weights, _, _ = _train(cfg, graphs=False)
    graphed, graphed_weights, engine, lines = _train(cfg, graphs=True)
    assert engine.step_graph.captures == 1 and not lines
    assert [float(x) for x in graphed] == [float(x) for x in plain]
    assert graphed_weights.keys() == plain_weights.keys()
    for k in plain_weights:
        assert torch.equal(graphed_weights[k], plain_weights[k]), k


def test_what_the_graph_cannot_compute_is_captured_anew(tmp_path):
    """A zero_grad(set_to_none=True) from outside the engine (torchft's does) moves every gradient, and a
    batch of other rows has another shape: the next micro-batch captures a new graph instead of adding into
    memory no gradient uses or reading a batch cut to the old shape."""
    cfg = _config(tmp_path, "optim.qk_clip_tau=0.01")

    def free_grads(engine, step):
        if step == 1:
            engine.optimizer.zero_grad(set_to_none=True)

    plain, plain_weights, _, _ = _train(cfg, graphs=False, rows=[2, 2, 2, 3])
    graphed, graphed_weights, engine, _ = _train(cfg, graphs=True, touch=free_grads, rows=[2, 2, 2, 3])
    assert engine.step_graph.captures == 3  # the first, after the freed gradients, the 3-row batches
    assert [float(x) for x in graphed] == [float(x) for x in plain]
    assert all(torch.equal(graphed_weights[k], v) for k, v in plain_weights.items())


class FailingGraphs(CpuGraphs):
    def capture(self, run):
        super().capture(run)  # a host read part way: nothing ran, the records made so far stay
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")


def test_a_failed_capture_trains_on_without_graphs_in_one_line(tmp_path):
    cfg = _config(tmp_path, "optim.qk_clip_tau=0.01")
    plain, plain_weights, _, _ = _train(cfg, graphs=False)
    graphed, graphed_weights, engine, lines = _train(cfg, graphs=True, backend=FailingGraphs)
    assert lines == ["[kimi] parallel.cuda_graphs=step: capturing the micro-batch failed (RuntimeError: CUDA "
                     "error: operation not permitted when stream is capturing); training goes on without "
                     "CUDA graphs"]
    assert engine.step_graph.captures == 0 and engine.step_graph.failed
    assert [float(x) for x in graphed] == [float(x) for x in plain]
    assert all(torch.equal(graphed_weights[k], v) for k, v in plain_weights.items())
