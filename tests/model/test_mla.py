"""MLA against a naive per-head softmax attention built from its own weights; attention() and its max
logits against the explicit-score reference and brute force."""

import itertools

import pytest
import torch

from kimi.config import ModelConfig
from kimi.model.mla import MLA
from kimi.ops.attention import attention
from kimi.ops.attention.reference import naive_attention

pytestmark = pytest.mark.unit

F64 = torch.float64


def mla_cfg(**mla) -> ModelConfig:
    """A 2-head NoPE MLA with a full-rank query; `mla`: model.mla.* keys to change."""
    base = dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=8)
    return ModelConfig(d_model=32, rope_theta=100.0, mla={**base, **mla})


def make_mla(**mla) -> MLA:
    layer = MLA(mla_cfg(**mla)).double()
    layer.init_weights(0.2, 0.2)
    with torch.no_grad():  # norms away from 1, so a missing weight multiply would show
        for p in layer.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return layer


def rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, theta):
    """RoPE as complex multiplication: channel pair (i, i + R/2) is the complex number x_i + j x_{i+R/2}."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:])
    z = z * torch.polar(torch.ones(half, dtype=F64), pos * theta ** (-torch.arange(half, dtype=F64) / half))
    return torch.cat([z.real, z.imag], -1)


def naive_mla(layer: MLA, x: torch.Tensor):
    """Loops over batch, heads and query positions; returns (output, per-head max logit over the batch)."""
    c = layer.nope + layer.rope
    B, T, _ = x.shape
    if hasattr(layer, "wq_a"):
        q_all = rms(x @ layer.wq_a.weight.T, layer.q_norm.weight, layer.q_norm.eps) @ layer.wq_b.weight.T
    else:
        q_all = x @ layer.wq.weight.T
    kv_a = x @ layer.wkv_a.weight.T
    latent = rms(kv_a[..., : layer.kv_lora_rank], layer.kv_norm.weight, layer.kv_norm.eps)
    kv_all = latent @ layer.wkv_b.weight.T
    H = q_all.shape[-1] // c
    out = torch.zeros(B, T, H * layer.v_dim, dtype=F64)
    max_logit = torch.full((H,), -torch.inf, dtype=F64)
    for b, h in itertools.product(range(B), range(H)):
        q = q_all[b, :, h * c : (h + 1) * c]
        kv = kv_all[b, :, h * (layer.nope + layer.v_dim) : (h + 1) * (layer.nope + layer.v_dim)]
        k_rope = kv_a[b, :, layer.kv_lora_rank :]
        if layer.rope and layer.rotary:  # unrotated (Kimi Linear): the shared dims enter as they are
            pos = torch.arange(T, dtype=F64)[:, None]
            q = torch.cat([q[:, : layer.nope], rotate(q[:, layer.nope :], pos, layer.rope_theta)], -1)
            k_rope = rotate(k_rope, pos, layer.rope_theta)
        k = torch.cat([kv[:, : layer.nope], k_rope], -1)
        v = kv[:, layer.nope :]
        for t in range(T):
            s = (k[: t + 1] @ q[t]) / c**0.5
            max_logit[h] = torch.maximum(max_logit[h], s.max())
            out[b, t, h * layer.v_dim : (h + 1) * layer.v_dim] = torch.softmax(s, 0) @ v[: t + 1]
    return out @ layer.wo.weight.T, max_logit


@pytest.mark.parametrize("rope,q_lora,rotary", [(0, 0, True), (8, 0, True), (0, 12, True), (8, 12, True),
                                                (8, 0, False), (8, 12, False)])
def test_mla_matches_naive(rope, q_lora, rotary):
    torch.manual_seed(rope + q_lora)
    layer = make_mla(qk_rope_head_dim=rope, q_lora_rank=q_lora, rotary=rotary)
    layer.track_max_logits = True
    x = torch.randn(2, 11, 32, dtype=F64)
    want, want_max = naive_mla(layer, x)
    torch.testing.assert_close(layer(x), want, rtol=1e-10, atol=1e-10)
    assert layer.max_logits.dtype == torch.float32 and layer.max_logits.shape == (2,)
    torch.testing.assert_close(layer.max_logits, want_max.float())


def test_qk_clip_row_layout():
    """The documented rows: scaling head 0's query rows or head 1's k_nope rows scales only that head."""
    torch.manual_seed(3)
    layer = make_mla()
    layer.track_max_logits = True
    x = torch.randn(1, 9, 32, dtype=F64)
    layer(x)
    before = layer.consume_max_logits()  # max_logits is a running max until consumed
    qk, kv = layer.nope + layer.rope, layer.nope + layer.v_dim
    with torch.no_grad():
        layer.q_proj.weight[0:qk] *= 0.5
        layer.wkv_b.weight[kv : kv + layer.nope] *= 3.0
    layer(x)
    torch.testing.assert_close(layer.max_logits, before * torch.tensor([0.5, 3.0]))


def brute_max_logits(q, k, scale, allowed):
    """max over (b, h) of q_i . k_j * scale over allowed(i, j), one pair at a time."""
    B, Tq, H, _ = q.shape
    rep = H // k.shape[2]
    out = torch.full((B, H), -torch.inf, dtype=F64)
    for b, h, i, j in itertools.product(range(B), range(H), range(Tq), range(k.shape[1])):
        if allowed(i, j):
            out[b, h] = max(out[b, h], float(q[b, i, h] @ k[b, j, h // rep]) * scale)
    return out.float()


CASES = {  # name: (B, Tq, Tk, H, Hkv, Dqk, Dv, causal, cu_seqlens)
    "causal": (2, 10, 10, 2, 2, 16, 16, True, None),
    "not_causal": (2, 7, 10, 2, 2, 16, 16, False, None),
    "gqa_dv": (2, 10, 10, 4, 2, 16, 8, True, None),
    "decode_tail": (2, 3, 10, 4, 1, 16, 24, True, None),
    "packed": (1, 13, 13, 2, 1, 8, 12, True, [0, 4, 5, 13]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attention_matches_reference(name):
    B, Tq, Tk, H, Hkv, D, Dv, causal, cu = CASES[name]
    torch.manual_seed(len(name))
    q, k = torch.randn(B, Tq, H, D, dtype=F64), torch.randn(B, Tk, Hkv, D, dtype=F64)
    v = torch.randn(B, Tk, Hkv, Dv, dtype=F64)
    cu_seqlens = None if cu is None else torch.tensor(cu)
    o, m = attention(q, k, v, causal=causal, scale=0.3, cu_seqlens=cu_seqlens, return_max_logits=True)
    o_ref, m_ref = naive_attention(q, k, v, causal=causal, scale=0.3, cu_seqlens=cu_seqlens)
    assert o.shape == (B, Tq, H, Dv)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attention(q, k, v, causal=causal, scale=0.3, cu_seqlens=cu_seqlens), o)

    def doc(t):
        return sum(t >= s for s in cu[1:]) if cu else 0

    def allowed(i, j):  # query i sits at key position Tk - Tq + i
        pos = Tk - Tq + i
        return (j <= pos or not causal) and doc(pos) == doc(j)

    want = brute_max_logits(q, k, 0.3, allowed)
    torch.testing.assert_close(m, want)
    torch.testing.assert_close(m_ref, want)


def test_packed_attention_equals_separate_documents():
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 12, 2, 8, dtype=F64) for _ in range(3))
    cu = [0, 5, 12]
    packed = attention(q, k, v, cu_seqlens=torch.tensor(cu))
    for s, e in zip(cu, cu[1:]):
        torch.testing.assert_close(packed[:, s:e], attention(q[:, s:e], k[:, s:e], v[:, s:e]))
