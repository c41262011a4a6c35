"""Triton KDA kernels, run on CPU tensors under the Triton interpreter (conftest sets TRITON_INTERPRET=1),
against the fp64 token-by-token reference. The interpreter is slow: shapes stay small (T <= 130, H = 2)."""

import sys

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.unit

if sys.platform != "linux":  # elsewhere there is no triton to import (pyproject.toml)
    pytest.skip("triton is a dependency on Linux only", allow_module_level=True)

from test_kda_ops import make_inputs, rel, run_with_grads  # noqa: E402

import kimi.ops.kda as kda_ops  # noqa: E402
from kimi.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: E402
from kimi.ops.kda.triton import chunk_kda_triton, common, fused_recurrent_kda_triton  # noqa: E402

F64 = torch.float64
NAMES = "q k v g beta h0".split()


def naive(*args, **kwargs):
    return chunk_kda(*args, **kwargs, backend="naive")


def triton_chunk(*args, **kwargs):
    return chunk_kda(*args, **kwargs, backend="triton")


def assert_close_to_naive(inputs, dtype, bound, cu_seqlens=None, grad_bounds=None, lower_bound=None):
    """Triton chunk on `inputs` cast to dtype vs the fp64 reference on the same (rounded) values: output,
    final state and every gradient within `bound` relative error (or grad_bounds[name])."""
    rounded = [x if x is None else x.to(dtype) for x in inputs]
    # g, beta and the state stay fp32, as the layer feeds them; the reference sees the rounded values.
    rounded = [x if x is None or i < 3 else x.float() for i, x in enumerate(rounded)]
    o_ref, s_ref, grads_ref = run_with_grads(lambda *a, **kw: naive(*a, **kw, cu_seqlens=cu_seqlens),
                                             [x if x is None else x.double() for x in rounded])
    o, s, grads = run_with_grads(
        lambda *a, **kw: triton_chunk(*a, **kw, cu_seqlens=cu_seqlens, lower_bound=lower_bound), rounded)
    assert o.dtype == rounded[2].dtype and s.dtype == torch.float32
    assert rel(o.double(), o_ref) < bound
    assert rel(s.double(), s_ref) < bound
    for name, a, b in zip(NAMES, grads, grads_ref):
        assert a.dtype == rounded[NAMES.index(name)].dtype, name
        assert torch.isfinite(a).all(), name
        assert rel(a.double(), b) < (grad_bounds or {}).get(name, bound), name


# Lengths cover one token, a partial chunk, a whole chunk plus one and two chunks plus a partial one.
@pytest.mark.slow
@pytest.mark.parametrize(
    "B, T, K, V, gate_min, with_h0",
    [(2, 1, 16, 16, 5.0, True), (1, 65, 16, 24, 20.0, False), (1, 130, 32, 40, 5.0, True)],
)
def test_chunk_fp32_matches_naive_fp64(B, T, K, V, gate_min, with_h0):
    inputs = make_inputs(B, T, 2, K, V, gate_min, seed=T, initial_state=with_h0)
    assert_close_to_naive(inputs, torch.float32, 1e-5)


@pytest.mark.slow
def test_chunk_fp16_inputs():
    assert_close_to_naive(make_inputs(1, 100, 2, 32, 32, seed=3), torch.float16, 5e-3)


@pytest.mark.slow
def test_strong_decay_stays_finite():
    """Gates near -5 per token push -G past 300 in a chunk: exp(-G) alone would overflow fp32 sevenfold.

    dg is looser here: any chunkwise form gets it as an in-chunk reverse cumulative sum of terms that
    nearly cancel when everything decays this fast (on these inputs the PyTorch chunk path measures
    2.1e-5, the Triton kernels 2.0e-5, the token-by-token fp32 recurrence 2.3e-7). K = 24 also runs the
    masked tail of a key tile."""
    q, k, v, _, beta, h0 = make_inputs(1, 70, 2, 24, 16, seed=5)
    g = -5 + 0.5 * torch.rand(q.shape, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert_close_to_naive([q, k, v, g, beta, h0], torch.float32, 1e-5, grad_bounds={"g": 5e-5})


@pytest.mark.slow
def test_packed_sequences_one_launch():
    """cu_seqlens in one launch: outputs, states and gradients of four packed sequences (one empty) equal
    the reference run on each alone; a sequence after the empty one starts from its own h0."""
    lengths = [5, 70, 0, 40]
    q, k, v, g, beta, _ = make_inputs(1, sum(lengths), 2, 16, 16, seed=7)
    h0 = torch.randn(len(lengths), 2, 16, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    assert_close_to_naive([q, k, v, g, beta, h0], torch.float32, 1e-5, cu_seqlens=cu_seqlens)
    _, s = triton_chunk(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(),
                        output_final_state=True, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(s[2], h0[2].float())  # an empty sequence passes its state through


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_split_scores_grid_equals_serial(monkeypatch, lower_bound):
    """The two launch layouts of the scores kernels (common.scores_grid: a program per chunk walking its
    sub-chunks, or one per sub-chunk and key slice) compute the same sums in the same order: outputs, states
    and every gradient bitwise equal, over packed sequences with a partial chunk, both gate forms."""
    lengths = [66, 9]
    q, k, v, g, beta, _ = (x.float() for x in make_inputs(1, sum(lengths), 1, 24, 16, seed=5))
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    if lower_bound is not None:
        g = g.clamp(min=lower_bound / 4)  # a bounded gate: the diagonal blocks take the matmul form

    def chunk(*args, **kwargs):
        return triton_chunk(*args, **kwargs, cu_seqlens=cu_seqlens, lower_bound=lower_bound)

    def run(spec):
        for key, value in common.scores_grid(spec).items():  # the launches read this one dict
            monkeypatch.setitem(common.SCORES_GRID, key, value)
        return run_with_grads(chunk, [q, k, v, g, beta, None])

    serial, split = run("serial:8"), run("split:4")
    for a, b in zip([serial[0], serial[1], *serial[2]], [split[0], split[1], *split[2]]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"^KIMI_KDA_SCORES_GRID='split:3' is invalid: write serial\|split"):
        common.scores_grid("split:3")


@pytest.mark.parametrize("strong", [False, True])
def test_tokens_diagonal_matches_naive(monkeypatch, strong):
    """The tokens layout (common.scores_grid: the general gate's diagonal blocks one key token at a time,
    forward and backward) against the fp64 reference: packed sequences with a partial chunk and K = 24 (a
    masked key tail), at ordinary gates and at gates near -5 per token, where only a form that never
    exponentiates a positive number stays finite (dg's bound as in test_strong_decay_stays_finite)."""
    for key, value in common.scores_grid("tokens:4").items():
        monkeypatch.setitem(common.SCORES_GRID, key, value)
    lengths = [66, 9]
    # one head at strong gates (the heads' offsets are the ordinary case's to check): half the time
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 1 if strong else 2, 24, 16, seed=9)
    h0 = torch.cat([h0, h0.flip(0)])  # one initial state per sequence
    if strong:
        g = -5 + 0.5 * torch.rand(q.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    assert_close_to_naive([q, k, v, g, beta, h0], torch.float32, 1e-5, cu_seqlens=cu_seqlens,
                          grad_bounds={"g": 5e-5} if strong else None)


@pytest.mark.slow
def test_state_continuation():
    q, k, v, g, beta, h0 = (x.float() for x in make_inputs(1, 100, 2, 16, 16, seed=11))
    o, s = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o1, s1 = triton_chunk(*(x[:, :37] for x in (q, k, v, g, beta)), initial_state=h0, output_final_state=True)
    o2, s2 = triton_chunk(*(x[:, 37:] for x in (q, k, v, g, beta)), initial_state=s1, output_final_state=True)
    assert rel(torch.cat([o1, o2], dim=1), o) < 1e-5
    assert rel(s2, s) < 1e-5


def test_matches_fla_reference():
    """fla-core's token-by-token KDA (fp32 inside), an oracle independent of this repository."""
    fla_naive = pytest.importorskip("fla.ops.kda.naive", reason="fla-core (dev extra) not installed")
    q, k, v, g, beta, h0 = (x.float() for x in make_inputs(1, 80, 2, 32, 16, seed=13))
    o_ref, s_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = triton_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel(o, o_ref) < 1e-5
    assert rel(s, s_ref) < 1e-5


def test_recurrent_decoding_matches_naive():
    """Token-by-token decoding (state carried between calls, and updated in place) and one multi-token call
    over packed sequences, each vs the fp64 reference."""
    q, k, v, g, beta, h0 = make_inputs(2, 6, 2, 16, 32, gate_min=20.0, seed=17)
    o_ref, s_ref = naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    f32 = [x.float() for x in (q, k, v, g, beta)]
    state, state_inplace, outputs, outputs_inplace = h0.float(), h0.float().clone(), [], []
    for t in range(q.shape[1]):
        step = [x[:, t : t + 1] for x in f32]
        o_t, state = fused_recurrent_kda(*step, initial_state=state, output_final_state=True,
                                         backend="triton")
        outputs.append(o_t)
        o_t, same = fused_recurrent_kda_triton(*step, q.shape[-1] ** -0.5, state_inplace, inplace=True)
        assert same is state_inplace
        outputs_inplace.append(o_t)
    for out, final in ((outputs, state), (outputs_inplace, state_inplace)):
        assert rel(torch.cat(out, dim=1).double(), o_ref) < 1e-5
        assert rel(final.double(), s_ref) < 1e-5
    lengths = [3, 0, 9]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 2, 16, 16, seed=19)
    h0 = torch.randn(3, 2, 16, 16, dtype=F64)
    o_ref, s_ref = naive(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    o, s = fused_recurrent_kda(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(),
                               output_final_state=True, cu_seqlens=cu_seqlens, backend="triton")
    assert rel(o.double(), o_ref) < 1e-5 and rel(s.double(), s_ref) < 1e-5


@pytest.mark.slow
def test_compiles_without_graph_breaks():
    """The custom ops trace under torch.compile(fullgraph=True), packed sequences included: dynamo and AOT
    autograd see one opaque node for the forward and one for the backward (aot_eager: the tracing, without
    C++ code generation; inductor works too, but compiling C++ takes ~10 s)."""
    q, k, v, g, beta = (x.float() for x in make_inputs(1, 20, 2, 16, 16, seed=23)[:5])
    h0 = torch.randn(2, 2, 16, 16)
    cu_seqlens = torch.tensor([0, 7, 20])

    def loss(q, k, v, g, beta, h0):
        o, s = chunk_kda(F.normalize(q, dim=-1), k, v, g, beta, initial_state=h0, output_final_state=True,
                         cu_seqlens=cu_seqlens, backend="triton")
        return (o * o).sum() + s.sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    eager_in = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    compiled_in = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    eager_loss, compiled_loss = loss(*eager_in), compiled(*compiled_in)
    torch.testing.assert_close(compiled_loss, eager_loss)
    compiled_grads = torch.autograd.grad(compiled_loss, compiled_in)
    for a, b in zip(compiled_grads, torch.autograd.grad(eager_loss, eager_in)):
        torch.testing.assert_close(a, b)


def test_dispatch_by_device():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    pick = kda_ops._pick_backend
    assert pick(None, kda_ops._CHUNK_BACKENDS, "chunk", "op", cuda) is kda_ops._triton_chunk
    assert pick(None, kda_ops._RECURRENT_BACKENDS, "recurrent", "op", cuda) is kda_ops._triton_recurrent
    assert pick(None, kda_ops._CHUNK_BACKENDS, "chunk", "op", cpu) is kda_ops.chunk_kda_torch
    assert pick("triton", kda_ops._CHUNK_BACKENDS, "chunk", "op", cpu) is kda_ops._triton_chunk


def test_clear_errors(monkeypatch):
    q, k, v, g, beta, h0 = make_inputs(1, 4, 2, 16, 16)
    with pytest.raises(TypeError, match="fp64"):
        triton_chunk(q, k, v, g, beta)
    f32 = [x.float() for x in (q, k, v, g, beta)]
    with pytest.raises(RuntimeError, match="forward-only"):
        fused_recurrent_kda(*(x.requires_grad_() for x in f32), backend="triton")
    with pytest.raises(ValueError, match="rise from 0 to T"):  # checked in the op too: compiled calls skip
        chunk_kda_triton(*f32, 0.25, None, torch.tensor([0, 5, 30]))  # kimi.ops.kda's check
    with pytest.raises(ValueError, match="inplace=True needs"):
        fused_recurrent_kda_triton(*(x.detach() for x in f32), 0.25, h0, inplace=True)  # fp64 state
    monkeypatch.setattr(common, "INTERPRET", False)  # as if triton had been imported without the variable
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_chunk(*(x.detach() for x in f32))


def test_fused_l2norm_and_gate_match_pytorch():
    """The fused per-head L2 norm and gate, forward and gradients, vs the layer's PyTorch formulas in fp64.
    Gate inputs span softplus's three regimes (tiny exp(x), ordinary, x > 20 passed through)."""
    from kimi.ops.kda.triton.gate import kda_gate, l2norm

    gen = torch.Generator().manual_seed(29)
    x = torch.randn(2, 5, 3, 16, generator=gen, dtype=F64)
    f = torch.linspace(-30, 30, 480, dtype=F64)[torch.randperm(480, generator=gen)].view(2, 5, 3, 16)
    A_log, dt_bias = torch.randn(3, generator=gen, dtype=F64), torch.randn(48, generator=gen, dtype=F64)

    def reference(x, f, A_log, dt_bias):
        y = x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
        return y, -A_log.exp()[:, None] * F.softplus(f + dt_bias.view(3, 16))

    def fused(x, f, A_log, dt_bias):
        return l2norm(x), kda_gate(f, A_log, dt_bias)

    outputs = []
    for fn, dtype in ((reference, F64), (fused, torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in (x, f, A_log, dt_bias)]
        y, g = fn(*leaves)
        cotangents = torch.randn(y.shape, generator=torch.Generator().manual_seed(0), dtype=F64)
        loss = (y * cotangents.to(dtype)).sum() + (g * cotangents.to(g.dtype)).sum()
        outputs.append([y, g, *torch.autograd.grad(loss, leaves)])
    assert outputs[1][1].dtype == torch.float32
    for name, a, b in zip("y g dx df dA_log ddt_bias".split(), outputs[1], outputs[0]):
        assert rel(a.double(), b) < 1e-5, name


# Two fp32 paths through the whole model differ by their rounding, which depends on the CPU's kernels: each is
# held to the fp64 model instead. Measured worst gradient (A_log, packed) against fp64: PyTorch 2.8e-6,
# Triton 8.7e-6 on an AVX-512/AMX Xeon.
MODEL_GRAD_RTOL = 3e-5


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_model_training_step_matches_pytorch_path(packed):
    """The tiny model's loss and every parameter gradient with model.kda.backend=triton (interpreted: chunk
    kernels, fused L2 norm and gate, fp32) equal the PyTorch path's in fp64, for a plain batch and for packed
    documents (cu_seqlens from document boundaries)."""
    from helpers import tiny_model_cfg

    from kimi.model import KimiModel

    torch.manual_seed(0)
    ids = torch.randint(0, 61, (1, 40) if packed else (2, 20))
    starts = None
    if packed:  # documents starting at 0, 13, 15 of the 39 inputs
        starts = torch.zeros(1, 39, dtype=torch.bool)
        starts[0, [0, 13, 15]] = True
    results = []
    for backend, dtype in (("torch", F64), ("triton", torch.float32)):
        torch.manual_seed(1)
        model = KimiModel(tiny_model_cfg(kda=dict(backend=backend))).to(dtype)
        logits = model(ids[:, :-1], doc_starts=starts)
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss_ref, grads_ref), (loss, grads) = results
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), loss_ref, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        assert rel(grad.double(), grads_ref[name]) < MODEL_GRAD_RTOL, name


@pytest.mark.slow
@torch.no_grad()
def test_model_decoding_with_triton_matches_full_forward():
    """Generation path: prefill and one-token steps through the fused recurrent kernel (KDA cache) give the
    logits of one full forward through the chunk kernels."""
    from helpers import tiny_model_cfg

    from kimi.model import KimiModel

    torch.manual_seed(3)
    model = KimiModel(tiny_model_cfg(kda=dict(backend="triton")))
    ids = torch.randint(0, 61, (2, 9))
    full = model(ids)
    cache = model.new_cache()
    pieces = [model(ids[:, :5], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_selective_checkpointing_keeps_the_chunk_forward(monkeypatch):
    """Under activation_checkpointing=selective the Triton chunk forward runs once (its output is kept like
    a matmul's); full checkpointing runs it again in the backward."""
    from kimi.ops.kda.triton import op
    from kimi.parallel.activation_checkpointing import _checkpointed

    runs = []
    forward = op.chunk_fwd
    monkeypatch.setattr(op, "chunk_fwd", lambda *a: runs.append(1) or forward(*a))
    q, k, v, g, beta, _ = [x.float().requires_grad_() for x in make_inputs(1, 32, 1, 16, 16)[:5]] + [None]

    def kda(q, k, v, g, beta):
        return chunk_kda(q, k, v, g, beta, backend="triton")[0].square()

    kda(q, k, v, g, beta).sum().backward()  # the first call also probes the kernels
    for selective, count in ((True, 1), (False, 2)):
        runs.clear()
        _checkpointed(selective)(kda, q, k, v, g, beta).sum().backward()
        assert len(runs) == count


def test_docs_show_the_committed_compile_check():
    """docs/benchmarks.md's table of the hot kernels (registers, spills, warps resident per multiprocessor,
    per scores-kernel layout) is bench/kda.py's hot_table of the committed sm_90 and sm_80 compile checks."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.append(str(root / "bench"))  # appended: a bench script must not shadow an installed package
    import kda as bench

    results = {a: json.loads((root / f"bench/results/kda_sm{a}_compile.json").read_text()) for a in (90, 80)}
    assert bench.hot_table(results) in (root / "docs/benchmarks.md").read_text()



@pytest.mark.parametrize("dtype, g_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16)])
def test_the_chunk_ops_scratch_is_what_their_launchers_allocate(monkeypatch, dtype, g_dtype):
    """kimi.ops.SCRATCH (what the planner adds to a fake op's outputs) equals what the chunk ops allocate
    beyond their outputs, read from the allocator (the profiler's memory timeline), at 1b's head size with
    two sequences of 70 tokens: the intermediates, the states' gradients and the fp32 partial sums. The chunk
    tables (a few bytes per chunk) are left out of the formula. Kernel launches do nothing here: allocations
    only."""
    from triton.runtime.interpreter import InterpretedFunction

    from helpers import ROOT

    from kimi.ops import SCRATCH
    from kimi.ops.kda.triton import op  # noqa: F401 (defines the ops)
    from kimi.plan.measure import _profiled_rise

    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: None)
    T, H, K, V = 140, 2, 128, 128
    q, k, v = (torch.randn(1, T, H, K, dtype=dtype) for _ in range(3))
    g, beta = torch.randn(1, T, H, K, dtype=g_dtype), torch.rand(1, T, H, dtype=g_dtype)
    cu_seqlens = torch.tensor([0, 70, 140])
    ops = torch.ops.kimi
    calls = {ops.kda_chunk_fwd.default: (q, k, v, g, beta, 0.1, None, cu_seqlens),
             ops.kda_chunk_bwd.default: (q, k, v, g, beta, 0.1, None, cu_seqlens, torch.randn_like(v), None)}
    for fn, args in calls.items():
        outputs = []
        rise = _profiled_rise(lambda: outputs.append(fn(*args)))
        made = rise - sum(t.untyped_storage().nbytes() for t in outputs[0])
        scratch = SCRATCH[fn](*args)
        assert 0 <= made - scratch <= 64, (fn, made, scratch)
    if dtype == torch.bfloat16 and g_dtype == torch.float32:  # as the model runs: the bytes the docs quote
        from kimi.ops.kda.triton.chunk_bwd import chunk_bwd_scratch

        per_token = (chunk_bwd_scratch(64, 1, K, V, 1, 1, dtype, g_dtype) - K * V * 4) // 64
        planning = " ".join((ROOT / "docs" / "planning.md").read_text().split())
        assert f"{per_token:,} bytes per token and head in bf16 at head size {K}" in planning
