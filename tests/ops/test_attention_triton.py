"""Triton flash attention (interpreted on CPU) against naive fp64 softmax attention: O, LSE, max logits and
the gradients of q, k, v (through O and LSE); the dispatching attention() against the SDPA path; an MLA layer
on either backend; torch.compile without graph breaks."""

import pytest
import torch

from kimi.config import ModelConfig
from kimi.model.mla import MLA, apply_rope
from kimi.ops.attention import attention
from kimi.ops.attention.reference import naive_attention
from kimi.ops.attention.triton import common, flash_attention

pytestmark = pytest.mark.unit


def reference(q, k, v, causal, scale, cu_seqlens):
    """Explicit scores -> (o, lse [B, H, Tq], max_logits [B, H]); rows with no allowed key give NaN/-inf."""
    o, max_logits, lse = naive_attention(q, k, v, causal, scale, cu_seqlens, return_lse=True)
    return o, lse, max_logits


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def inputs(B, Tq, Tk, H, Hkv, D, Dv, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, H, D, generator=gen)
    k = torch.randn(B, Tk, Hkv, D, generator=gen)
    v = torch.randn(B, Tk, Hkv, Dv, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


CASES = {  # name: (B, Tq, Tk, H, Hkv, Dqk, Dv, causal, cu_seqlens)
    "causal_64": (2, 40, 40, 2, 2, 64, 64, True, None),
    "mla_192_128_mqa": (1, 80, 80, 2, 1, 192, 128, True, None),
    "gqa_not_causal": (2, 30, 40, 4, 2, 24, 16, False, None),
    "decode_tail_gqa": (2, 7, 40, 4, 2, 24, 16, True, None),
    # a zero-length document (20, 20) and a tail past the last offset, which is one more document
    "packed": (1, 50, 50, 2, 1, 24, 16, True, [0, 5, 20, 20, 21, 45]),
    "packed_192_128": (1, 64, 64, 2, 2, 192, 128, True, [0, 17, 40, 64]),
    "packed_not_causal_64": (1, 48, 48, 2, 1, 64, 64, False, [0, 13, 30, 48]),
    # documents longer than the tiles: blocks inside one document take the unmasked path
    "packed_long_docs": (1, 96, 96, 2, 1, 64, 32, True, [0, 70, 96]),
    "packed_long_docs_not_causal": (1, 96, 96, 2, 2, 24, 16, False, [0, 3, 70, 96]),
}


# dQ from atomic adds in the dK/dV kernel (common.DQ_ATOMIC) instead of its own kernel, on a subset
ATOMIC_DQ_CASES = ["mla_192_128_mqa", "gqa_not_causal", "decode_tail_gqa", "packed_long_docs"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,atomic_dq", [(name, False) for name in CASES] + [(name, True) for name in ATOMIC_DQ_CASES]
)
def test_matches_fp64_reference(name, atomic_dq, monkeypatch):
    monkeypatch.setattr(common, "DQ_ATOMIC", atomic_dq)
    B, Tq, Tk, H, Hkv, D, Dv, causal, cu = CASES[name]
    q, k, v = inputs(B, Tq, Tk, H, Hkv, D, Dv, seed=len(name))
    cu_seqlens = None if cu is None else torch.tensor(cu)
    scale = 0.7 * D**-0.5
    o, lse, max_logits = flash_attention(q, k, v, causal, scale, cu_seqlens, return_max_logits=True)
    assert o.shape == (B, Tq, H, Dv) and lse.shape == (B, H, Tq) and max_logits.shape == (B, H)
    assert lse.dtype == max_logits.dtype == torch.float32

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref, max_ref = reference(q64, k64, v64, causal, scale, cu_seqlens)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(lse, lse_ref) < 1e-5
    assert ((max_logits.double() - max_ref).abs() / max_ref.abs()).max() < 1e-5

    gen = torch.Generator().manual_seed(1)
    do, dlse = torch.randn(o.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    grads = torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), (q, k, v))
    loss_ref = (o_ref * do.double()).sum() + (lse_ref * dlse.double()).sum()
    grads_ref = torch.autograd.grad(loss_ref, (q64, k64, v64))
    for name_, g, g_ref in zip("qkv", grads, grads_ref):
        assert rel_err(g, g_ref) < 1e-5, f"d{name_}"


@pytest.mark.parametrize("atomic_dq", [False, True])
def test_rows_without_keys_are_zero_not_nan(atomic_dq, monkeypatch):
    """Causal with Tq > Tk: queries 0..6 sit before the first key. They give O = 0, LSE = -inf, no gradient;
    the other rows equal attention over the keys they may see."""
    monkeypatch.setattr(common, "DQ_ATOMIC", atomic_dq)
    q, k, v = inputs(2, 12, 5, 2, 1, 24, 16, seed=3)
    o, lse, max_logits = flash_attention(q, k, v, True, 0.3, None, return_max_logits=True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(4))
    dq, dk, dv = torch.autograd.grad((o * do).sum(), (q, k, v))
    for t in (o, max_logits, dq, dk, dv):
        assert not t.isnan().any()
    assert (o[:, :7] == 0).all() and (dq[:, :7] == 0).all() and (lse[:, :, :7] == float("-inf")).all()

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q[:, 7:], k, v))
    o_ref, lse_ref, max_ref = reference(q64, k64, v64, True, 0.3, None)
    assert rel_err(o[:, 7:], o_ref) < 1e-5 and rel_err(lse[:, :, 7:], lse_ref) < 1e-5
    torch.testing.assert_close(max_logits, max_ref.float())
    grads_ref = torch.autograd.grad((o_ref * do[:, 7:].double()).sum(), (q64, k64, v64))
    for g, g_ref in zip((dq[:, 7:], dk, dv), grads_ref):
        assert rel_err(g, g_ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_storage(dtype):
    """fp16/bf16 tensors in and out (the interpreter computes in fp32): errors at the storage precision."""
    q, k, v = inputs(1, 40, 40, 2, 1, 24, 16, dtype=dtype, seed=5)
    cu_seqlens = torch.tensor([0, 19, 40])
    o, lse, _ = flash_attention(q, k, v, True, 0.25, cu_seqlens)
    assert o.dtype == dtype
    grads = torch.autograd.grad(o.float().square().sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref, _ = reference(q64, k64, v64, True, 0.25, cu_seqlens)
    grads_ref = torch.autograd.grad(o_ref.square().sum(), (q64, k64, v64))
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    assert rel_err(o, o_ref) < tol and rel_err(lse, lse_ref) < 1e-5
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == dtype and rel_err(g, g_ref) < 2 * tol


DISPATCH_CASES = {  # name: (B, Tq, Tk, H, Hkv, Dqk, Dv, causal, cu_seqlens)
    "causal": (2, 10, 10, 2, 2, 16, 16, True, None),
    "not_causal": (2, 7, 10, 2, 2, 16, 16, False, None),
    "gqa_dv": (2, 10, 10, 4, 2, 16, 8, True, None),
    "decode_tail": (2, 3, 10, 4, 1, 16, 24, True, None),
    "packed": (1, 13, 13, 2, 1, 8, 12, True, [0, 4, 5, 13]),
}


@pytest.mark.parametrize("name", list(DISPATCH_CASES))
def test_triton_backend_equals_sdpa_backend(name):
    B, Tq, Tk, H, Hkv, D, Dv, causal, cu = DISPATCH_CASES[name]
    q, k, v = inputs(B, Tq, Tk, H, Hkv, D, Dv, seed=len(name))
    kw = dict(causal=causal, scale=0.3, cu_seqlens=None if cu is None else torch.tensor(cu))
    o, m = attention(q, k, v, return_max_logits=True, backend="triton", **kw)
    o_sdpa, m_sdpa = attention(q, k, v, return_max_logits=True, backend="sdpa", **kw)
    torch.testing.assert_close(o, o_sdpa, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, m_sdpa, rtol=1e-6, atol=1e-6)
    plain = attention(q, k, v, backend="triton", **kw)
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, o, rtol=0, atol=0)
    torch.testing.assert_close(attention(q, k, v, **kw), o_sdpa, rtol=0, atol=0)  # CPU default: SDPA


def test_backend_errors(monkeypatch):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="unknown backend"):
        attention(q, q, q, backend="flash")
    with pytest.raises(TypeError, match="fp16/bf16/fp32"):
        attention(q.double(), q.double(), q.double(), backend="triton")
    monkeypatch.setattr(common, "INTERPRET", False)  # as if triton had been imported without the interpreter
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        attention(q, q, q, backend="triton")


@pytest.mark.parametrize("packed", [False, True])
def test_mla_layer_on_triton_backend(packed):
    """An MLA layer (RoPE 8 + NoPE 16 query/key dims, 8 value dims) gives the same output, parameter
    gradients and recorded max logits on both backends."""
    mla = dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=8)
    cfg = ModelConfig(d_model=32, mla=mla, rope_theta=100.0)
    torch.manual_seed(7)
    layer = MLA(cfg)
    layer.init_weights(0.2, 0.2)
    layer.track_max_logits = True
    x = torch.randn(1 if packed else 2, 24, 32)
    cu_seqlens = torch.tensor([0, 9, 24]) if packed else None

    def run():
        layer.zero_grad()
        out = layer(x, cu_seqlens=cu_seqlens)
        out.square().sum().backward()
        return out.detach(), layer.consume_max_logits(), [p.grad.clone() for p in layer.parameters()]

    want = run()
    layer.attention_options["backend"] = "triton"  # model.attention.backend=triton
    got = run()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for g, g_want in zip(got[2], want[2]):
        torch.testing.assert_close(g, g_want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_torch_compile_fullgraph():
    """The custom op traces as one node: fullgraph=True fails on any graph break. (aot_eager keeps the test
    fast; the inductor backend also works here, ~20 s of C++ compilation.)"""
    q, k, v = inputs(1, 24, 24, 2, 1, 24, 16, seed=8)
    cu_seqlens = torch.tensor([0, 10, 24])

    def loss(q, k, v):
        o, m = attention(q, k, v, cu_seqlens=cu_seqlens, return_max_logits=True, backend="triton")
        return o.square().sum(), m

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    (value, m), (value_eager, m_eager) = compiled(q, k, v), loss(q, k, v)
    grads = torch.autograd.grad(value, (q, k, v))
    grads_eager = torch.autograd.grad(value_eager, (q, k, v))
    torch.testing.assert_close(value, value_eager, rtol=0, atol=0)
    torch.testing.assert_close(m, m_eager, rtol=0, atol=0)
    for g, g_eager in zip(grads, grads_eager):
        torch.testing.assert_close(g, g_eager, rtol=0, atol=0)


MAX_PASS_CASES = ["mla_192_128_mqa", "gqa_not_causal", "decode_tail_gqa", "packed", "packed_long_docs"]


@pytest.mark.parametrize("name", MAX_PASS_CASES)
def test_max_logit_pass_matches_reference(name):
    """The forward kernel reduced to Q K^T and a row max (the SDPA path's max-logit pass on a GPU) gives the
    fp64 maxima, and bit for bit what the full forward kernel records."""
    from kimi.ops.attention.triton import max_logits

    B, Tq, Tk, H, Hkv, D, Dv, causal, cu = CASES[name]
    q, k, v = (x.detach() for x in inputs(B, Tq, Tk, H, Hkv, D, Dv, seed=len(name)))
    cu_seqlens = None if cu is None else torch.tensor(cu)
    got = max_logits(q, k, causal, 0.4, cu_seqlens)
    _, _, want = reference(q.double(), k.double(), v.double(), causal, 0.4, cu_seqlens)
    assert got.shape == (B, H) and got.dtype == torch.float32
    assert ((got.double() - want).abs() / want.abs()).max() < 1e-5
    _, _, full = flash_attention(q, k, v, causal, 0.4, cu_seqlens, return_max_logits=True)
    torch.testing.assert_close(got, full, rtol=0, atol=0)


def test_sdpa_path_measures_max_logits_with_the_kernel(monkeypatch):
    """Where auto picks Triton (a GPU; here the interpreter), backend="sdpa" takes its max logits from the
    row-max kernel, not the PyTorch pass over the scores; both give the same maxima."""
    import kimi.ops.attention.triton as triton_attention
    from kimi.ops import dispatch

    calls = []
    kernel = triton_attention.max_logits
    monkeypatch.setattr(triton_attention, "max_logits", lambda *a: calls.append(1) or kernel(*a))
    q, k, v = (x.detach() for x in inputs(1, 40, 40, 4, 2, 24, 16, dtype=torch.bfloat16, seed=9))
    cu_seqlens = torch.tensor([0, 17, 40])
    o_cpu, m_cpu = attention(q, k, v, cu_seqlens=cu_seqlens, return_max_logits=True, backend="sdpa")
    assert calls == []
    monkeypatch.setattr(dispatch, "AUTO_TRITON_ON_CPU", True)
    o, m = attention(q, k, v, cu_seqlens=cu_seqlens, return_max_logits=True, backend="sdpa")
    assert calls == [1]
    torch.testing.assert_close(o, o_cpu, rtol=0, atol=0)
    torch.testing.assert_close(m, m_cpu, rtol=1e-6, atol=1e-6)


def test_deterministic_switch_chooses_the_dq_kernel(monkeypatch):
    """model.attention.deterministic reaches the Triton backward: true builds dQ in its own kernel, false (the
    default) with atomics; attention(deterministic=None) follows common.DQ_ATOMIC. The gradients agree."""
    from kimi.ops.attention.triton import op

    modes = []
    backward = op.attention_backward
    monkeypatch.setattr(op, "attention_backward", lambda *a: modes.append(a[-1]) or backward(*a))
    mla = dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=8)
    grads = {}
    for deterministic in (True, False):
        torch.manual_seed(3)
        attn = dict(backend="triton", deterministic=deterministic)
        layer = MLA(ModelConfig(d_model=32, mla=mla, attention=attn))
        layer.init_weights(0.2, 0.2)
        layer(torch.randn(2, 24, 32)).square().sum().backward()
        grads[deterministic] = [p.grad for p in layer.parameters()]
        assert modes[-1] is (not deterministic)  # the backward's atomic flag (a first call probes it before)
    for g_det, g_atomic in zip(grads[True], grads[False]):
        torch.testing.assert_close(g_atomic, g_det, rtol=1e-5, atol=1e-6)
    q, k, v = inputs(1, 16, 16, 2, 1, 16, 16, seed=2)
    monkeypatch.setattr(common, "DQ_ATOMIC", False)
    attention(q, k, v, backend="triton").sum().backward()
    assert modes[-1] is False


def test_selective_checkpointing_keeps_the_kernels_output(monkeypatch):
    """Under activation_checkpointing=selective the Triton attention forward runs once: its outputs are
    kept like SDPA's and the matmuls', not recomputed in the backward (full recomputes it)."""
    from kimi.ops.attention.triton import op
    from kimi.parallel.activation_checkpointing import _checkpointed

    runs = []
    forward = op.attention_forward
    monkeypatch.setattr(op, "attention_forward", lambda *a: runs.append(1) or forward(*a))
    q, k, v = inputs(1, 24, 24, 2, 1, 16, 16, seed=4)
    attention(q, k, v, backend="triton").sum().backward()  # the first call also probes the kernels
    for selective, count in ((True, 1), (False, 2)):
        runs.clear()
        out = _checkpointed(selective)(lambda q, k, v: attention(q, k, v, backend="triton").square(), q, k, v)
        out.sum().backward()
        assert len(runs) == count


def test_selective_checkpointing_around_the_first_call():
    """The kernels' first call probes them (kimi.ops.dispatch.Guard.probe). Inside a selectively
    checkpointed region the probe runs outside the region's dispatch mode: were its outputs kept with the
    step's, the recompute would take the probe's 16 positions for the kernel's 24 (torch's CheckpointError;
    with equal shapes, silently wrong gradients). Output and gradients equal an uncheckpointed run's."""
    from kimi.ops import dispatch
    from kimi.parallel.activation_checkpointing import _checkpointed

    q, k, v = inputs(1, 24, 24, 2, 1, 16, 16, seed=6)
    fn = lambda q, k, v: attention(q, k, v, backend="triton").square()  # noqa: E731
    dispatch.reset()
    out = _checkpointed(True)(fn, q, k, v)
    got = (out.detach(), *torch.autograd.grad(out.sum(), (q, k, v)))
    out = fn(q, k, v)
    want = (out.detach(), *torch.autograd.grad(out.sum(), (q, k, v)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def latent_inputs(B=2, block=16, n=3, H=2, nope=16, rope=8, Dv=8, R=12, seed=5):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, block, H, nope + rope, generator=gen)
    c, r = torch.randn(B, n * block, R, generator=gen), torch.randn(B, n * block, rope, generator=gen)
    w = 0.3 * torch.randn(H * (nope + Dv), R, generator=gen)
    return [x.requires_grad_() for x in (q, c, r, w)]


def test_latent_attention_matches_fp64():
    """Attention over a prefix of MLA latents up-projected one block at a time (context parallelism's last
    ranks) equals fp64 attention over the whole prefix's keys and values: output, max logits, and the
    gradients of the queries, the latents, the rotary key part and the up-projection."""
    from kimi.ops.attention.latent import _up, latent_attention

    q, c, r, w = latent_inputs()
    o, m = latent_attention(q, c, r, w, nope=16, block=16, return_max_logits=True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(6))
    grads = torch.autograd.grad((o * do).sum(), (q, c, r, w))
    q64, c64, r64, w64 = (x.detach().double().requires_grad_() for x in (q, c, r, w))
    k, v = _up(c64, r64, w64, 2, 16, torch.float64)
    o_ref, m_ref = naive_attention(q64, k, v, causal=True)  # the queries are the prefix's last block
    grads_ref = torch.autograd.grad((o_ref * do.double()).sum(), (q64, c64, r64, w64))
    assert rel_err(o, o_ref) < 1e-5
    torch.testing.assert_close(m.double(), m_ref.double(), rtol=1e-6, atol=1e-6)
    for name, g, g_ref in zip("qcrw", grads, grads_ref):
        assert rel_err(g, g_ref) < 1e-5, name
    with pytest.raises(ValueError, match="queries of one block"):
        latent_attention(q, c[:, :40], r[:, :40], w, nope=16, block=16)

    def loss(q, c, r, w):  # one custom autograd function: torch.compile traces it whole, bit for bit
        out, m = latent_attention(q, c, r, w, nope=16, block=16, return_max_logits=True)
        return (out * do).sum(), m

    (value, m_compiled) = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, c, r, w)
    assert torch.equal(m_compiled, m)
    for g, g_eager in zip(torch.autograd.grad(value, (q, c, r, w)), grads):
        assert torch.equal(g, g_eager)


def test_mla_under_context_parallelism_attends_latent_blocks(monkeypatch):
    """The last of 3 context-parallel ranks: with the Triton backend MLA attends its prefix's latents block
    by block and gives what attention over the whole prefix's keys and values gives (output, max logits,
    parameter gradients), without any tensor of the prefix's keys or values."""
    import kimi.model.mla as mla_module

    mla = dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=8,
               output_gate=True)
    cfg = ModelConfig(d_model=32, mla=mla, attention=dict(backend="triton"))
    torch.manual_seed(3)
    layer = MLA(cfg)
    layer.init_weights(0.2, 0.2)
    layer.track_max_logits = True
    T = 16
    x = torch.randn(2, 3 * T, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # the earlier ranks' latents, as the all-gather would bring them
        c_kv, k_rope = layer.wkv_a(x[:, :2 * T]).split([16, 8], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), torch.arange(2 * T), cfg.rope_theta).squeeze(2)
        earlier = torch.cat([layer.kv_norm(c_kv), k_rope], dim=-1)

    class LastRank:  # the parts of kimi.parallel.context_parallel.SequenceShard that MLA reads
        rows, length = 2, T

        def positions(self, device):
            return torch.arange(2 * T, 3 * T, device=device)

        def prefix(self, latent):
            return torch.cat([earlier, latent], dim=1)

    def run():
        layer.zero_grad()
        out = layer(x[:, 2 * T:], context=LastRank())
        out.square().sum().backward()
        return out.detach(), layer.consume_max_logits(), [p.grad.clone() for p in layer.parameters()]

    blocks = []
    latent = mla_module.latent_attention
    monkeypatch.setattr(mla_module, "latent_attention", lambda *a, **k: blocks.append(1) or latent(*a, **k))
    got = run()
    assert blocks == [1]
    monkeypatch.setattr(mla_module, "runs_triton", lambda q, backend: False)  # the whole prefix at once
    want = run()
    assert blocks == [1]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for g, g_want in zip(got[2], want[2]):
        torch.testing.assert_close(g, g_want, rtol=1e-4, atol=1e-5)
