"""The fused AttnRes depth mix (kimi.ops.attnres, model.attnres.backend), its Triton kernels run on CPU
tensors under the Triton interpreter (conftest sets TRITON_INTERPRET=1), against the unfused reference:
depth_attention followed by the sublayer's RMSNorm. Shapes stay small: the interpreter is slow."""

import ast
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

if sys.platform != "linux":  # elsewhere there is no triton to import (pyproject.toml)
    pytest.skip("triton is a dependency on Linux only", allow_module_level=True)

from triton.compiler.errors import CompilationError  # noqa: E402

from helpers import tiny_model_cfg  # noqa: E402
from kimi.model import KimiModel  # noqa: E402
from kimi.model.attnres import compiled_depth_attention, depth_attention, depth_mix  # noqa: E402
from kimi.ops import dispatch  # noqa: E402
from kimi.ops.attnres import FusedDepthMix  # noqa: E402
from kimi.ops.attnres.reference import mix_then_norm  # noqa: E402
from kimi.ops.attnres.triton import depth_mix_triton  # noqa: E402
from kimi.ops.attnres.triton import op as triton_op  # noqa: E402
from kimi.ops.dispatch import TritonKernelError  # noqa: E402
from kimi.parallel.activation_checkpointing import apply_activation_checkpointing  # noqa: E402

F64 = torch.float64
EPS, NORM_EPS = 1e-5, 1e-6  # different on purpose: each must reach its own norm


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def make(N, shape, dtype, norm=True, seed=0):
    """N sources of very different scales (so the softmax is far from uniform), a query, a norm weight."""
    gen = torch.Generator().manual_seed(seed)
    D = shape[-1]
    sources = [(torch.randn(*shape, generator=gen, dtype=F64) * 3.0 ** (i % 4 - 1)).to(dtype).requires_grad_()
               for i in range(N)]
    query = (torch.randn(D, generator=gen, dtype=F64) * 0.5).to(dtype).requires_grad_()
    weight = (torch.rand(D, generator=gen, dtype=F64) + 0.5).to(dtype).requires_grad_() if norm else None
    dy = torch.randn(*shape, generator=gen, dtype=F64).to(dtype)
    return sources, query, weight, dy


def run(fn, sources, query, weight, dy):
    """[output, gradients of the query, of every source and of the weight] of
    fn(query, sources, eps, weight, norm_eps)."""
    out = fn(query, sources, EPS, weight, NORM_EPS)
    inputs = [query, *sources] + ([] if weight is None else [weight])
    return [out, *torch.autograd.grad(out, inputs, dy)]


# N = 1..9 sources (`1b` mixes up to 9), d = 16..64, odd token counts, with and without the norm
CASES = [(1, (1, 16), True), (2, (7, 24), False), (4, (2, 5, 40), True), (9, (3, 3, 64), True),
         (6, (11, 17), True)]
CASE_IDS = [f"N{n}-{'x'.join(map(str, s))}-{'norm' if m else 'mix'}" for n, s, m in CASES]


@pytest.mark.parametrize("dtype, bound", [(F64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("N, shape, norm", CASES, ids=CASE_IDS)
def test_kernel_matches_reference(N, shape, norm, dtype, bound):
    """Output and the gradients of every source, the query and the norm weight equal the unfused reference
    in the same dtype (fp64 within 1e-10, fp32 within 1e-5, relative), and keep the inputs' dtypes."""
    args = make(N, shape, dtype, norm, seed=N)
    want = run(mix_then_norm, *args)
    got = run(depth_mix_triton, *args)
    for name, a, b in zip(["out", "query", *[f"source {i}" for i in range(N)], "weight"], got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel(a, b) < bound, (name, rel(a, b))


def test_half_precision_is_as_close_to_fp64_as_the_reference():
    """fp16 sources (fp32 query and weight, as the model feeds them): the kernel's error against fp64 is no
    worse than the unfused path's own, output and gradients. (fp16 standing for bf16: the interpreter
    casts fp32 to bf16 by truncation where a GPU rounds to nearest; docs/environment.md.)"""
    half = torch.float16
    sources, query, weight, dy = make(5, (9, 48), F64)
    rounded = [s.detach().to(half).requires_grad_() for s in sources]
    q32, w32 = (x.detach().float().requires_grad_() for x in (query, weight))

    def fp64(x):
        return x.detach().double().requires_grad_()

    exact = run(mix_then_norm, [fp64(s) for s in rounded], fp64(q32), fp64(w32), dy.to(half).double())
    ours = run(depth_mix_triton, rounded, q32, w32, dy.to(half))
    unfused = run(mix_then_norm, rounded, q32, w32, dy.to(half))
    for a, b, e in zip(ours, unfused, exact):
        assert a.dtype == b.dtype
        assert rel(a, e) <= max(1.5 * rel(b, e), 1e-6), (rel(a, e), rel(b, e))


def test_only_per_token_statistics_are_saved():
    """What the backward keeps is the inputs themselves (the stream holds them anyway) and per-token numbers:
    no stacked sources, no copy of the mix."""
    sources, query, weight, _ = make(3, (2, 7, 32), torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        depth_mix_triton(query, sources, EPS, weight, NORM_EPS)
    inputs = {t.data_ptr() for t in [query, weight, *sources]}
    extra = [t for t in saved if t.data_ptr() not in inputs]
    assert len(saved) == 2 + 3 + 2  # query, weight, sources, lse and rstd
    assert [tuple(t.shape) for t in extra] == [(14,), (14,)]


def test_single_source_without_query_is_the_norm_of_it():
    """The model's first sublayer has one source and no query: the fused path returns its pre-norm."""
    sources, _, weight, _ = make(1, (5, 16), F64)
    mix = FusedDepthMix("triton")
    torch.testing.assert_close(mix.normed(None, sources, EPS, weight, NORM_EPS),
                               mix_then_norm(None, sources, EPS, weight, NORM_EPS), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="exactly 1 source"):
        mix.normed(None, sources * 2, EPS, weight, NORM_EPS)


def test_mixed_dtype_sources_mix_as_the_pytorch_path_does():
    """Under bf16 autocast the embedding's source is fp32 and the sublayers' outputs bf16. The kernels take
    one dtype, so the fused mix promotes the sources as the PyTorch path's stack does and returns
    sources[0]'s dtype: output and gradients equal the reference's on the same mixed inputs (model.attnres
    .backend=triton or auto with trainer.precision=bf16 raised a ValueError before)."""
    sources, query, weight, dy = make(3, (5, 32), torch.float32)
    sources = [sources[0]] + [s.detach().bfloat16().requires_grad_() for s in sources[1:]]
    got = run(FusedDepthMix("triton").normed, sources, query, weight, dy)
    want = run(lambda *a: mix_then_norm(*a, mix=depth_attention), sources, query, weight, dy)
    assert got[0].dtype == torch.float32 and [g.dtype for g in got[2:5]] == [s.dtype for s in sources]
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5 if a.dtype == torch.float32 else rel(a, b) < 1e-2


def test_backend_selection():
    """model.attnres.backend: torch stays today's mix (eager, compiled under parallel.compile), compile is
    always compiled, auto is the fused mix whose fallback is the torch choice (what runs on CPU tensors)."""
    assert depth_mix("torch", compiled=False) is depth_attention
    assert depth_mix("torch", compiled=True) is compiled_depth_attention()
    assert depth_mix("compile", compiled=False) is compiled_depth_attention()
    auto = depth_mix("auto", compiled=True)
    assert isinstance(auto, FusedDepthMix) and auto.fallback is compiled_depth_attention()
    assert depth_mix("triton", compiled=False).backend == "triton"
    assert KimiModel(tiny_model_cfg()).depth_mix is depth_attention  # the default: as before the switch


def test_auto_on_cpu_is_the_pytorch_path_exactly():
    sources, query, weight, dy = make(3, (4, 24), torch.float32)
    got = run(depth_mix("auto", compiled=False).normed, sources, query, weight, dy)
    want = run(mix_then_norm, sources, query, weight, dy)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class _Failing:
    """Stands in for a kernel: launching it fails as an unsupported GPU would."""

    def __getitem__(self, grid):
        def launch(*_, **__):
            raise CompilationError(None, ast.parse("x = 1").body[0], "unsupported on this GPU")
        return launch


@pytest.mark.parametrize("kernel", ["mix_fwd_kernel", "mix_bwd_kernel"])
def test_kernel_failure_falls_back_under_auto_and_raises_when_forced(monkeypatch, kernel):
    """auto (made to pick Triton for CPU tensors): a kernel that cannot compile, forward or backward, sends
    the mix to the PyTorch path before any output, with one warning; forced, it is a TritonKernelError."""
    monkeypatch.setattr(dispatch, "AUTO_TRITON_ON_CPU", True)
    monkeypatch.setattr(triton_op, kernel, _Failing())
    dispatch.reset()
    try:
        args = make(2, (3, 16), torch.float32)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = run(FusedDepthMix("auto").normed, *args)
        assert sum(str(w.message).startswith("attnres depth mix:") for w in record) == 1
        assert all(torch.equal(a, b) for a, b in zip(got, run(mix_then_norm, *args)))
        dispatch.reset()
        with pytest.raises(TritonKernelError, match="model.attnres.backend=triton"):
            run(FusedDepthMix("triton").normed, *args)
    finally:
        dispatch.reset()


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    from kimi.ops.attnres.triton import common

    monkeypatch.setattr(common, "INTERPRET", False)
    sources, query, weight, _ = make(2, (3, 16), torch.float32)
    with pytest.raises(RuntimeError, match=r"^model.attnres.backend=triton needs CUDA tensors[^\n]*$"):
        depth_mix_triton(query, sources, EPS, weight, NORM_EPS)


def test_fla_backend_is_refused_in_one_line(monkeypatch):
    """fla-core's kernels run on CUDA only; an installation without its fused AttnRes is named."""
    from kimi.ops.attnres import fla

    sources, query, weight, _ = make(2, (3, 16), torch.float32)
    if fla.missing() is None:
        with pytest.raises(RuntimeError, match=r"^model.attnres.backend=fla runs on CUDA tensors only"):
            FusedDepthMix("fla").normed(query, sources, EPS, weight, NORM_EPS)
    monkeypatch.setattr(fla.importlib.util, "find_spec", lambda name: None)
    assert fla.missing() == "the fla-core package is not installed"
    with pytest.raises(ImportError, match=r"^model.attnres.backend=fla: the fla-core package is not "):
        FusedDepthMix("fla").normed(query, sources, EPS, weight, NORM_EPS)


def test_compiled_graph_holds_one_op_each_way():
    """torch.compile traces the fused mix as one custom op (no graph break under fullgraph=True), forward and
    backward, with the eager results."""
    args = make(3, (5, 16), torch.float32)
    mix = FusedDepthMix("triton")
    compiled = torch.compile(mix.normed, backend="aot_eager", fullgraph=True)
    got, want = run(compiled, *args), run(mix.normed, *args)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(got, want))


def test_bytes_report_counts_what_the_kernels_move():
    """bench/attnres.py (docs/benchmarks.md's figures): `1b`'s 33 mixes have 1 to 9 sources, and the fused
    op is priced at its inputs and outputs: per token 2 (N + 1) d bytes of bf16 rows forward, 2 (2 N + 1) d
    backward, 8 of statistics each way, and the fp32 query and weight (and their gradients) once per call;
    it keeps 8 bytes per token for the backward."""
    sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: shadows no package
    import attnres as bench

    assert bench.mixes_per_step("1b") == {1: 1, **{n: 4 for n in range(2, 10)}}
    T, D, N = 64, 32, 3
    fused = bench.paths()["fused"]
    fwd, bwd = bench.traced_bytes(fused, *bench.inputs(N, T, D, "meta"))
    assert fwd == T * (2 * (N + 1) * D + 8) + 2 * 4 * D
    assert bwd == T * (2 * (2 * N + 1) * D + 8) + 4 * 4 * D
    assert bench.saved_bytes(fused, *bench.inputs(N, T, D, "meta")) == 8 * T


def _model_step(backend: str, ac: str, ids: torch.Tensor):
    torch.manual_seed(0)
    model = KimiModel(tiny_model_cfg(attnres=dict(backend=backend), kda=dict(backend="torch"))).double()
    for p in model.attnres_queries():  # away from zero init, so the softmaxes are not uniform
        torch.nn.init.normal_(p, std=1.0)
    apply_activation_checkpointing(model, ac)
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
def test_model_step_matches_pytorch_path_with_and_without_checkpointing():
    """The tiny model (Block AttnRes: 1 to 3 sources per mix, every pre-norm folded) in fp64: loss and every
    parameter gradient with model.attnres.backend=triton equal the PyTorch path's within 1e-10, without
    activation checkpointing and under the model's own (parallel.activation_checkpointing full, selective)."""
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(1))
    loss_ref, grads_ref = _model_step("torch", "none", ids)
    for ac in ("none", "full", "selective"):
        loss, grads = _model_step("triton", ac, ids)
        assert abs(loss.item() - loss_ref.item()) < 1e-10 * abs(loss_ref.item()), ac
        for name, grad in grads.items():
            assert grads_ref[name] is not None and grad is not None, name
            assert rel(grad, grads_ref[name]) < 1e-10, (ac, name, rel(grad, grads_ref[name]))
