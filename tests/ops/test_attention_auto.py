"""attention(backend="auto") (model.attention.backend=auto): each shape's first call times the Triton kernel
(interpreted here) against the SDPA path, keeps the faster one that agrees with SDPA, prints one line, and
every later call of that shape, compiled or not, runs the kept backend."""

import pytest
import torch

from kimi.config import ModelConfig
from kimi.model.mla import MLA
from kimi.ops import dispatch
from kimi.ops.attention import attention, auto

pytestmark = pytest.mark.unit


@pytest.fixture
def timed(monkeypatch):
    """Triton picked by default on CPU, an empty cache, the printed lines kept, and the measured seconds of
    the two candidates (triton first, as timed) replaced by `timed.seconds`."""
    monkeypatch.setattr(dispatch, "AUTO_TRITON_ON_CPU", True)
    dispatch.reset()
    auto.reset()
    lines = []
    monkeypatch.setattr(auto, "LOG", lines.append)
    state = type("Timed", (), {"lines": lines, "seconds": [1.0, 2.0]})()
    order = iter(range(2 * 100))
    monkeypatch.setattr(auto, "_seconds", lambda fn, device: (fn(), state.seconds[next(order) % 2])[1])
    yield state
    auto.reset()


def qkv(seed=0, T=24):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, T, 2, 16, generator=gen).bfloat16().requires_grad_() for _ in range(3)]


def run(backend, q, k, v):
    o, m = attention(q, k, v, return_max_logits=True, backend=backend)
    grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
    return o, m, grads


@pytest.mark.parametrize("faster", ["triton", "sdpa"])
def test_auto_keeps_the_faster_backend_and_times_each_shape_once(timed, faster):
    timed.seconds = [1e-3, 2e-3] if faster == "triton" else [2e-3, 1e-3]
    q, k, v = qkv()
    got = run("auto", q, k, v)
    assert len(timed.lines) == 1 and timed.lines[0].endswith(f"-> {faster}"), timed.lines
    assert ("triton 1.000 ms, sdpa 2.000 ms" in timed.lines[0]
            or "triton 2.000 ms, sdpa 1.000 ms" in timed.lines[0])
    again = run("auto", *qkv(seed=1))
    assert len(timed.lines) == 1  # the same shape: cached, not timed or printed again
    for a, b in zip(got[:2] + again[:2], run(faster, q, k, v)[:2] + run(faster, *qkv(seed=1))[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    run("auto", *qkv(T=40))
    assert len(timed.lines) == 2  # another shape is timed for itself


@pytest.mark.parametrize("selective", [True, False])
@pytest.mark.parametrize("faster", ["triton", "sdpa"])
def test_auto_times_outside_activation_checkpointing(timed, faster, selective):
    """A shape's first call falls inside a checkpointed sublayer in the first step of
    parallel.activation_checkpointing=full or selective. The timing runs outside the region's saved-tensor
    hooks and selective checkpointing's dispatch mode: under them each candidate's own backward stopped in a
    recompute of the region (both "failed", auto fell to SDPA), and the step's backward then stopped too
    (full: CheckpointError, a different number of tensors saved; selective: "Trying to backward an extra
    time"). Output and gradients equal an uncheckpointed run's of the chosen backend."""
    from kimi.parallel.activation_checkpointing import _checkpointed

    timed.seconds = [1e-3, 2e-3] if faster == "triton" else [2e-3, 1e-3]
    q, k, v = qkv(seed=3)
    fn = lambda q, k, v: attention(q, k, v, backend="auto").float().square()  # noqa: E731
    out = _checkpointed(selective)(fn, q, k, v)
    assert len(timed.lines) == 1 and timed.lines[0].endswith(f"-> {faster}"), timed.lines
    got = (out.detach(), *torch.autograd.grad(out.sum(), (q, k, v)))
    out = attention(q, k, v, backend=faster).float().square()
    want = (out.detach(), *torch.autograd.grad(out.sum(), (q, k, v)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_auto_skips_a_backend_that_disagrees_with_sdpa(timed, monkeypatch):
    real = auto.CANDIDATES["triton"]

    def wrong(*args):
        o, m = real(*args)
        return o * 1.5, m

    monkeypatch.setitem(auto.CANDIDATES, "triton", wrong)
    timed.seconds = [1e-3, 2e-3]  # only sdpa is timed: the faster-looking triton never gets there
    q, k, v = qkv()
    o, m, _ = run("auto", q, k, v)
    assert any("triton differs from SDPA" in line for line in timed.lines), timed.lines
    assert timed.lines[-1].endswith("-> sdpa") and "triton" not in timed.lines[-1].split(":")[-1]
    torch.testing.assert_close(o, run("sdpa", q, k, v)[0], rtol=0, atol=0)


def test_auto_decides_while_compiling_without_a_graph_break(timed):
    """Under torch.compile the timing runs at trace time on real tensors and the graph holds the choice."""
    timed.seconds = [1e-3, 2e-3]

    def f(q, k, v):
        o, m = attention(q, k, v, return_max_logits=True, backend="auto")
        return o * 2, m

    q, k, v = qkv()
    assert torch._dynamo.explain(f)(q, k, v).graph_break_count == 0
    assert len(timed.lines) == 1 and timed.lines[0].endswith("-> triton")
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(q, k, v), f(q, k, v)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(timed.lines) == 1


def test_auto_on_cpu_times_nothing(monkeypatch):
    """model.attention.backend=auto (the default) reaches attention() as "auto"; on CPU tensors only SDPA
    runs natively, so nothing is timed and the layer equals its SDPA twin."""
    auto.reset()
    lines = []
    monkeypatch.setattr(auto, "LOG", lines.append)
    mla = dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=8)
    outs = []
    for backend in ("auto", "sdpa"):
        torch.manual_seed(0)
        layer = MLA(ModelConfig(d_model=32, mla=mla, attention=dict(backend=backend)))
        assert layer.attention_options["backend"] == backend
        outs.append(layer(torch.randn(2, 12, 32)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert lines == [] and auto._CHOSEN == {}


def test_auto_skips_a_backend_whose_backward_cannot_run(timed, monkeypatch):
    """The candidate's backward runs once before it is timed: one that fails is not chosen, it does not raise
    out of the training step."""
    real = auto.CANDIDATES["triton"]

    class Broken(torch.autograd.Function):
        @staticmethod
        def forward(ctx, o):
            return o.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("backward kernel cannot run here")

    monkeypatch.setitem(auto.CANDIDATES, "triton", lambda *a: (Broken.apply(real(*a)[0]), real(*a)[1]))
    q, k, v = qkv()
    o = run("auto", q, k, v)[0]
    assert any("triton failed on this shape" in line for line in timed.lines), timed.lines
    assert timed.lines[-1].endswith("-> sdpa")
    torch.testing.assert_close(o, run("sdpa", q, k, v)[0], rtol=0, atol=0)
