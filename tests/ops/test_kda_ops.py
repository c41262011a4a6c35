"""KDA ops: the chunkwise form and the decode path against the token-by-token reference (and fla-core)."""

import pytest
import torch
import torch.nn.functional as F

from kimi.ops.kda import chunk_kda, fused_recurrent_kda
from kimi.ops.kda.chunk import chunk_kda_torch
from kimi.ops.kda.recurrent import kda_step

pytestmark = pytest.mark.unit

F64 = torch.float64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error; 0 when both are exactly zero (the gate gradient with a zero state and T = 1)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def make_inputs(B, T, H, K, V, gate_min=5.0, dtype=F64, seed=0, initial_state=True):
    """Inputs as the layer feeds them: unit-norm q and k, beta in (0, 1), gates in [gate_min, 0]."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    # Mostly mild gates with a tail reaching gate_min, as softplus of a projection gives.
    g = -(F.softplus(randn(B, T, H, K) * 2) * gate_min / 4).clamp(max=gate_min)
    beta = torch.sigmoid(randn(B, T, H))
    h0 = randn(B, H, K, V) if initial_state else None
    return [x if x is None else x.to(dtype) for x in (q, k, v, g, beta, h0)]


def run_with_grads(fn, inputs, seed=1):
    """Outputs, final state and gradients wrt every input of a fixed random linear function of them."""
    inputs = [x if x is None else x.detach().clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, h0 = inputs
    o, state = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    gen = torch.Generator().manual_seed(seed)
    # Cotangents drawn in fp64 so fp32 and fp64 runs see the same ones.
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype)).sum()
    loss = loss + (state * torch.randn(state.shape, generator=gen, dtype=F64).to(state.dtype)).sum()
    leaves = [x for x in inputs if x is not None]
    return o, state, torch.autograd.grad(loss, leaves)


def assert_matches_naive_fp64(fn, inputs):
    """Outputs, final state and every gradient of fn within 1e-10 of the token-by-token reference."""
    o_ref, s_ref, grads_ref = run_with_grads(lambda *a, **kw: chunk_kda(*a, **kw, backend="naive"), inputs)
    o, s, grads = run_with_grads(fn, inputs)
    assert o.dtype == F64 and s.dtype == F64
    assert rel(o, o_ref) < 1e-10
    assert rel(s, s_ref) < 1e-10
    for name, a, b in zip("q k v g beta h0".split(), grads, grads_ref):
        assert rel(a, b) < 1e-10, name


@pytest.mark.parametrize(
    "T, K, V, gate_min, with_h0",
    [(1, 16, 16, 5.0, False), (63, 16, 32, 5.0, True), (64, 32, 16, 5.0, True), (65, 16, 16, 20.0, True),
     (130, 32, 24, 5.0, True), (130, 16, 16, 20.0, False)],
)
def test_chunk_matches_naive_fp64(T, K, V, gate_min, with_h0):
    inputs = make_inputs(2, T, 2, K, V, gate_min, initial_state=with_h0, seed=T)
    assert_matches_naive_fp64(lambda *a, **kw: chunk_kda(*a, **kw, backend="chunk"), inputs)


# With gates down to -20 an exponential factored on the wrong side of its anchor overflows fp32.
@pytest.mark.parametrize("gate_min", [5.0, 20.0])
def test_chunk_fp32_matches_naive_fp64(gate_min):
    inputs = make_inputs(2, 130, 2, 32, 32, gate_min=gate_min)
    o_ref, s_ref, grads_ref = run_with_grads(lambda *a, **kw: chunk_kda(*a, **kw, backend="naive"), inputs)
    o, s, grads = run_with_grads(chunk_kda, [x.float() for x in inputs])
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel(o.double(), o_ref) < 1e-5
    assert rel(s.double(), s_ref) < 1e-5
    for name, a, b in zip("q k v g beta h0".split(), grads, grads_ref):
        assert rel(a.double(), b) < 1e-5, name


@pytest.mark.parametrize("T", [15, 16, 17, 33, 48, 65])
def test_chunk_exact_across_sub_chunk_boundaries(T):
    """Lengths just before, at and past sub-chunk (16) and chunk (64) ends, where the zero-padded tail meets
    the anchors, under strong decay."""
    assert_matches_naive_fp64(chunk_kda, make_inputs(1, T, 2, 16, 8, gate_min=20.0, seed=T))


@pytest.mark.parametrize("chunk_size", [4, 16, 24, 32])
def test_chunk_sizes_nest_sub_chunks(chunk_size):
    """Other chunk lengths anchor at fewer levels (32: 16 and 4; 16, 24: 4; 4: none) and stay exact."""

    def fn(q, k, v, g, beta, initial_state, output_final_state):
        return chunk_kda_torch(q, k, v, g, beta, q.shape[-1] ** -0.5, initial_state, chunk_size=chunk_size)

    assert_matches_naive_fp64(fn, make_inputs(1, 70, 2, 16, 8, gate_min=20.0, seed=chunk_size))


def test_zero_token_leaves_state_unchanged():
    """Why zero-padding the last chunk is exact: k = 0, g = 0, beta = 0 neither decays nor writes."""
    B, H, K, V = 2, 3, 8, 5
    state = torch.randn(B, H, K, V, dtype=F64)
    q = torch.randn(B, H, K, dtype=F64)
    zeros = torch.zeros(B, H, K, dtype=F64)
    _, after = kda_step(q, zeros, torch.randn(B, H, V, dtype=F64), zeros, torch.zeros(B, H, dtype=F64), state)
    assert torch.equal(after, state)


@pytest.mark.parametrize("backend", ["chunk", "naive"])
def test_packed_sequences_equal_separate_runs(backend):
    lengths = [5, 70, 0, 129]
    q, k, v, g, beta, _ = make_inputs(1, sum(lengths), 2, 16, 8)
    h0 = torch.randn(len(lengths), 2, 16, 8, dtype=F64)
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens,
                     backend=backend)
    assert s.shape == (len(lengths), 2, 16, 8)
    for i, (start, end) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())):
        part = [x[:, start:end] for x in (q, k, v, g, beta)]
        o_i, s_i = chunk_kda(*part, initial_state=h0[i : i + 1], output_final_state=True, backend=backend)
        torch.testing.assert_close(o[:, start:end], o_i, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s[i : i + 1], s_i, rtol=1e-12, atol=1e-12)
    # Packing must not leak state across a boundary: the sequence after an empty one starts from its own h0.
    assert not torch.allclose(s[2], s[3])


def test_state_continuation():
    q, k, v, g, beta, h0 = make_inputs(2, 150, 2, 16, 24)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o1, s1 = chunk_kda(*(x[:, :70] for x in (q, k, v, g, beta)), initial_state=h0, output_final_state=True)
    o2, s2 = chunk_kda(*(x[:, 70:] for x in (q, k, v, g, beta)), initial_state=s1, output_final_state=True)
    assert rel(torch.cat([o1, o2], dim=1), o) < 1e-12
    assert rel(s2, s) < 1e-12


def test_decoding_token_by_token_equals_chunk():
    q, k, v, g, beta, h0 = make_inputs(2, 67, 2, 16, 16, gate_min=20.0)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    state, outputs = h0, []
    for t in range(q.shape[1]):
        step = (x[:, t : t + 1] for x in (q, k, v, g, beta))
        o_t, state = fused_recurrent_kda(*step, initial_state=state, output_final_state=True)
        outputs.append(o_t)
    assert rel(torch.cat(outputs, dim=1), o_ref) < 1e-12
    assert rel(state, s_ref) < 1e-12


def test_dtypes_and_optional_state():
    q, k, v, g, beta, _ = make_inputs(1, 20, 2, 8, 8, dtype=torch.bfloat16, initial_state=False)
    o, s = chunk_kda(q, k, v, g, beta)
    assert o.dtype == torch.bfloat16 and o.shape == v.shape and s is None
    _, s = fused_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert s.dtype == torch.float32 and s.shape == (1, 2, 8, 8)


def test_matches_fla_reference():
    """fla-core's token-by-token KDA (fp32 inside, same layout, scale K^-0.5, no normalisation of q, k)."""
    fla_naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, g, beta, h0 = make_inputs(2, 130, 2, 32, 16, gate_min=5.0)
    fp32 = [x.float() for x in (q, k, v, g, beta)]
    o_ref, s_ref = fla_naive.naive_recurrent_kda(*fp32, initial_state=h0.float(), output_final_state=True)
    for backend in ("chunk", "naive"):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend)
        assert rel(o, o_ref.double()) < 1e-5
        assert rel(s, s_ref.double()) < 1e-5
    scale = 0.3  # an explicit scale is passed through the same way
    o_ref, _ = fla_naive.naive_recurrent_kda(*fp32, scale=scale)
    assert rel(chunk_kda(q, k, v, g, beta, scale=scale)[0], o_ref.double()) < 1e-5


# Each entry breaks one argument of a valid call; the error must name what is wrong.
BAD_ARGUMENTS = {
    "k must": lambda a: dict(k=a["k"][..., :-1]),
    "g must": lambda a: dict(g=a["g"][:, :-1]),
    "v must": lambda a: dict(v=a["v"][:, :, :1]),
    "beta must": lambda a: dict(beta=a["beta"][..., None]),
    "q must": lambda a: dict(q=a["q"][0]),
    "initial_state must": lambda a: dict(initial_state=a["initial_state"][:, :, :-1]),
    "needs B == 1": lambda a: dict(cu_seqlens=torch.tensor([0, 5])),
    "rise from 0 to T": lambda a: {**{n: x[:1] for n, x in a.items()}, "cu_seqlens": torch.tensor([0, 4])},
    r"unknown backend 'fast'; allowed": lambda a: dict(backend="fast"),
}


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda])
@pytest.mark.parametrize("message", list(BAD_ARGUMENTS))
def test_bad_arguments_raise(op, message):
    q, k, v, g, beta, h0 = make_inputs(2, 5, 2, 4, 3)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    op(**args)  # valid as given
    with pytest.raises(ValueError, match=message):
        op(**{**args, **BAD_ARGUMENTS[message](args)})


def test_fla_backend_passes_our_arguments_to_fla_core(monkeypatch):
    """backend="fla" (model.kda.backend=fla) hands fla-core's kernels our layout, scale, state, int64 document
    offsets and, under a safe gate, safe_gate=True with the bound. fla's kernels need a GPU, so its own
    token-by-token reference stands in for them here (make gpu-check compares the real ones)."""
    fla_naive = pytest.importorskip("fla.ops.kda.naive")
    import kimi.ops.kda.fla as fla_backend

    calls = []

    def fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
             **kw):
        calls.append(dict(kw, cu=None if cu_seqlens is None else cu_seqlens.dtype, scale=scale,
                          final=output_final_state))
        bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        outs, states = [], []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            h0 = None if initial_state is None else initial_state[i:i + 1]
            o, s = fla_naive.naive_recurrent_kda(*(x[:, a:b] for x in (q, k, v, g, beta)), scale=scale,
                                                 initial_state=h0, output_final_state=True)
            outs.append(o)
            states.append(s)
        return torch.cat(outs, 1), torch.cat(states)

    monkeypatch.setattr(fla_backend, "_kernels", lambda: (fake, fake))
    q, k, v, g, beta, h0 = (x.float() for x in make_inputs(1, 40, 2, 16, 8, gate_min=4.0))
    g, h0 = g.clamp(min=-5.0), torch.cat([h0, -h0])  # a state per document
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    want = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                     backend="chunk")
    for op in (chunk_kda, fused_recurrent_kda):
        got = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="fla")
        for a, b in zip(got, want):
            assert rel(a.double(), b.double()) < 1e-5
    assert [c["cu"] for c in calls] == [torch.int64] * 2 and calls[0]["scale"] == 16**-0.5
    assert "safe_gate" not in calls[0]
    chunk_kda(q, k, v, g, beta, backend="fla", lower_bound=-5.0)
    assert calls[-1]["safe_gate"] is True and calls[-1]["lower_bound"] == -5.0
    chunk_kda(q, k, v, g, beta, backend="fla", lower_bound=-6.0)  # beyond the bounded form's reach
    assert "safe_gate" not in calls[-1]

    # the layer: model.kda.backend=fla sends its KDA there (its safe gate too), the same output as torch
    from kimi.config import ModelConfig
    from kimi.model.kda import KDA

    x = torch.randn(1, 70, 32, generator=torch.Generator().manual_seed(2))
    outs = []
    for backend in ("torch", "fla"):
        torch.manual_seed(0)
        layer = KDA(ModelConfig(d_model=32, kda=dict(num_heads=2, head_dim=16, gate_lower_bound=-5.0,
                                                     backend=backend)))
        layer.init_weights(0.3, 0.3)
        with torch.no_grad():
            outs.append(layer(x))
    assert calls[-1]["safe_gate"] is True and len(calls) == 5
    assert rel(outs[1].double(), outs[0].double()) < 1e-5  # fp32: two summation orders

