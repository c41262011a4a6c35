"""The whole model: shapes in every residual mode and MLA pattern, parameter and FLOP counts against
formulas written here from the spec, packed documents, and gradient flow."""

import pytest
import torch
import torch.nn.functional as F

from kimi.config import ModelConfig
from helpers import tiny_model_cfg
from kimi.model import KDA, KimiModel
from kimi.model.kda import ShortConv

pytestmark = pytest.mark.unit

F64 = torch.float64
MODES = ["standard", "attnres_full", "attnres_block"]
PATTERNS = {"all_kda": dict(mla_layers=None, mla_every=0), "all_mla": dict(mla_layers=None, mla_every=1),
            "mixed": dict(mla_layers=[1])}


def tiny_cfg(mla=None, **kw) -> ModelConfig:
    """tiny_model_cfg with 8 rotated key dims and AttnRes blocks of 2; `mla` adds to its MLA keys."""
    return tiny_model_cfg(**{"attnres": dict(block_size=2), **kw,
                             "mla": {"qk_rope_head_dim": 8, "v_head_dim": 8, **(mla or {})}})


@pytest.mark.parametrize("residual", MODES)
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_forward_shapes(residual, pattern):
    model = KimiModel(tiny_cfg(residual=residual, **PATTERNS[pattern]))
    n_mla = {"all_kda": 0, "all_mla": 3, "mixed": 1}[pattern]
    assert len(model.qk_clip_modules()) == n_mla
    logits = model(torch.randint(0, 61, (2, 9)))
    assert logits.shape == (2, 9, 61) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model.double()(torch.randint(0, 61, (1, 5))).dtype == F64


def expected_params(c: ModelConfig, n_mla: int, tied: bool) -> tuple[int, int]:
    """(total, non-embedding) parameter counts from the architecture in the spec."""
    d, H, K = c.d_model, c.kda.num_heads, c.kda.head_dim
    kda = (3 * d * H * K + 3 * H * K * c.conv_size  # q, k, v projections and short convs
           + d * K + K * H * K + H + H * K  # gate f (low rank), A_log, dt_bias
           + d * H  # beta
           + d * K + K * H * K + H * K  # output gate (low rank, bias on the up-projection)
           + K + H * K * d)  # per-head output norm (shared weight), W_o
    a = c.mla
    Hm, qk = a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
    q = d * Hm * qk if a.q_lora_rank == 0 else d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * Hm * qk
    mla = (q + d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
           + a.kv_lora_rank * Hm * (a.qk_nope_head_dim + a.v_head_dim) + Hm * a.v_head_dim * d)
    per_block = 3 * d * c.mlp.hidden + 2 * d  # MLP and the two pre-norms
    queries = 2 * c.num_layers * d if c.residual != "standard" else 0  # 2L - 1 sublayers + final
    body = n_mla * mla + (c.num_layers - n_mla) * kda + c.num_layers * per_block + queries + d  # + final norm
    emb = c.vocab_size * d
    total = body + emb + (0 if tied else emb)
    return total, total - emb


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("residual,q_lora", [("standard", 0), ("attnres_block", 12)])
def test_num_params(tied, residual, q_lora):
    cfg = tiny_cfg(tie_embeddings=tied, residual=residual, mla=dict(q_lora_rank=q_lora))
    model = KimiModel(cfg)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_params() == sum(unique.values())
    total, non_emb = expected_params(cfg, n_mla=1, tied=tied)
    assert (model.num_params(), model.num_params(exclude_embedding=True)) == (total, non_emb)
    assert (model.lm_head.weight is model.embed.weight) == tied


def _counted_flops(fn) -> int:
    """FLOPs torch.utils.flop_counter.FlopCounterMode counts while fn() runs: matrix multiplies (mm, addmm,
    bmm) and triangular solves (kimi/ops/flops.py); elementwise work, reductions, softmax and the embedding
    gather are not counted."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _dense_attention(q, k, v, causal=True, cu_seqlens=None, return_max_logits=False, **_backend_options):
    """The reference attention (explicit q k^T and p v matmuls), which torch's own bmm formula counts: a count
    independent of ours for the CPU SDPA kernel (kimi/ops/flops.py, tests/ops/test_flop_count.py)."""
    from kimi.ops.attention.reference import naive_attention

    out, max_logits = naive_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens)
    return (out, max_logits) if return_max_logits else out


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_matches_flop_counter(tied, monkeypatch):
    """model.flops_per_token(T) against the matmul FLOPs FlopCounterMode counts in a real forward + backward
    (PyTorch KDA chunk backend), term by term: dense 6N, MLA attention, KDA chunkwise."""
    import kimi.model.maxlogits
    from torch import nn

    from kimi.ops.kda import chunk_kda

    monkeypatch.setattr(kimi.model.maxlogits, "attention", _dense_attention)
    B, T = 2, 128  # two 64-token KDA chunks per row
    # standard residual: AttnRes' depth mixing (query . keys) is a matmul the formula leaves out on purpose
    cfg = tiny_cfg(num_layers=4, mla_layers=[1, 3], residual="standard", kda=dict(backend="torch"),
                   tie_embeddings=tied)
    model = KimiModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    total = _counted_flops(lambda: model(ids).square().mean().backward())
    n_mla, n_kda, tokens = 2, 2, B * T

    # Counted alone, with every input requiring a gradient as in the model: one KDA layer's chunkwise kernel
    # and one MLA layer's attention (Dqk = 16 + 8 rope, Dv = 8: the formula must not confuse the two).
    H, K = cfg.kda.num_heads, cfg.kda.head_dim
    q, k, v, g = (torch.randn(B, T, H, K, requires_grad=True) for _ in range(4))
    beta = torch.rand(B, T, H, requires_grad=True)
    kda = _counted_flops(lambda: chunk_kda(q, k, v, -F.softplus(g), beta.sigmoid(), backend="chunk")[0].sum()
                         .backward())
    Hm, Dqk, Dv = cfg.mla.num_heads, cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    qa, ka, va = (torch.randn(B, T, Hm, D, requires_grad=True) for D in (Dqk, Dqk, Dv))
    attn = _counted_flops(lambda: _dense_attention(qa, ka, va).sum().backward())
    # Every linear: 2 FLOPs per weight and token forward, 4 backward (input and weight gradients). A tied LM
    # head is still a matmul; the embedding lookup is a gather (not counted, and not in the formula).
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert total == 6 * linear * tokens + n_kda * kda + n_mla * attn  # the counted FLOPs, fully accounted for

    per_token = model.flops_per_token(T)
    # Attention, the formula's only T-dependent term: the dense reference computes the whole T x T score
    # matrix and masks it, the formula counts the causal half (what a flash kernel skipping masked tiles
    # runs), so exactly twice the formula.
    attn_formula = model.flops_per_token(2 * T) - per_token  # per token, at T
    assert n_mla * attn == pytest.approx(2 * attn_formula * tokens, rel=1e-12)
    # Dense: 6 N with N every non-embedding parameter (plus the LM head when tied). The matmuls use the
    # linear weights only; norms, conv kernels, A_log, dt_bias and the gate bias are the formula's
    # documented overcount: 3.1% of this 32-wide toy (0.003% at d_model 2304).
    n_dense = model.num_params(exclude_embedding=True) + (cfg.vocab_size * cfg.d_model if tied else 0)
    assert 6 * linear <= 6 * n_dense <= 1.05 * 6 * linear
    # KDA chunkwise: the formula's per-token 3 H (6 K^2 + 5 C K + C^2 / 3) counts the chunk
    # algorithm's triangles (kimi.ops.kda.chunk.chunk_flops_per_token); the PyTorch chunk form differs from
    # it: it multiplies full C x C and anchored sub-chunk blocks where triangles suffice, and solves for W
    # and U directly (more), while the first chunk's zero state and the last chunk's unused final state skip
    # backward matmuls (less). Measured at K = 16, C = 64, T = 128: 27,584 counted (23,488 of them
    # matmuls, 4,096 triangular solves) vs 24,064 formula FLOPs per token and head (+15%); 20% bounds it.
    kda_formula = per_token - 6 * n_dense - attn_formula
    assert n_kda * kda == pytest.approx(kda_formula * tokens, rel=0.2)
    # The whole model, attention halved to the causal convention: 1.7% over the formula here (the KDA gap on
    # its ~25% share, less the dense overcount); 6% bounds it.
    assert total - n_mla * attn / 2 == pytest.approx(per_token * tokens, rel=0.06)
    # Tying the embeddings changes the parameter count, not the matmuls: same count, same formula.
    twin = KimiModel(tiny_cfg(num_layers=4, mla_layers=[1, 3], residual="standard", kda=dict(backend="torch"),
                              tie_embeddings=not tied))
    assert _counted_flops(lambda: twin(ids).square().mean().backward()) == total
    assert twin.flops_per_token(T) == per_token


def test_short_conv_matches_conv1d():
    torch.manual_seed(4)
    conv = ShortConv(6, 4).double()
    conv.reset_parameters()
    x = torch.randn(2, 9, 6, dtype=F64)
    want = F.conv1d(x.transpose(1, 2), conv.weight, padding=3, groups=6)[..., :9].transpose(1, 2)
    y, tail = conv(x)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(tail, x[:, -3:])


def test_bf16_autocast_feeds_the_kda_kernels_bf16(monkeypatch):
    """Under trainer.precision=bf16 (autocast, fp32 weights) q, k, v reach chunk_kda in bf16 and the gates in
    fp32: the short convolutions' fp32 weights must not promote them (they did, so bf16 training ran the
    fp32 kernels)."""
    import kimi.model.kda as layer

    seen = []
    real = layer.chunk_kda
    monkeypatch.setattr(layer, "chunk_kda", lambda q, k, v, g, beta, *a, **kw: seen.append(
        [x.dtype for x in (q, k, v, g, beta)]) or real(q, k, v, g, beta, *a, **kw))
    kda = KDA(tiny_model_cfg())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kda(torch.randn(2, 8, tiny_model_cfg().d_model))
    assert seen == [[torch.bfloat16] * 3 + [torch.float32] * 2]


def test_kda_packed_equals_separate():
    """Documents packed with cu_seqlens (one shorter than the conv kernel) match separate runs: neither
    the recurrent state nor the short convs carry anything across a boundary."""
    torch.manual_seed(0)
    layer = KDA(tiny_cfg()).double()
    layer.init_weights(0.3, 0.3)
    cu = [0, 7, 9, 26]
    x = torch.randn(1, cu[-1], 32, dtype=F64)
    packed = layer(x, cu_seqlens=torch.tensor(cu))
    separate = torch.cat([layer(x[:, s:e]) for s, e in zip(cu, cu[1:])], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(packed, layer(x), rtol=1e-6, atol=1e-6)  # packing does change the result


@pytest.mark.parametrize("residual", MODES)
def test_model_packed_equals_separate(residual):
    torch.manual_seed(1)
    model = KimiModel(tiny_cfg(residual=residual)).double()
    cu = [0, 10, 12, 25, 30, 40]  # a document crosses the row boundary at 20: rows restart documents too
    ids = torch.randint(0, 61, (2, 20))
    starts = torch.zeros(2, 20, dtype=torch.bool)
    starts.view(-1)[cu[:-1]] = True
    starts[:, 0] = True
    packed = model(ids, doc_starts=starts)
    assert packed.shape == (1, 40, 61)
    bounds = sorted(set(cu) | {20})
    flat = ids.reshape(1, -1)
    separate = torch.cat([model(flat[:, s:e]) for s, e in zip(bounds, bounds[1:])], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual", MODES)
@pytest.mark.parametrize("tied", [False, True])
def test_every_parameter_gets_a_gradient(residual, tied):
    torch.manual_seed(2)
    model = KimiModel(tiny_cfg(residual=residual, tie_embeddings=tied, mla=dict(q_lora_rank=12)))
    ids = torch.randint(0, 61, (2, 12))
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().max() > 0, name


@pytest.mark.parametrize("tied", [False, True])
def test_meta_build_materialised_equals_a_direct_build(tied):
    """Per-parameter seeded init: a model built on the meta device and materialised, or only a part of it
    (a pipeline stage), holds the values a direct build holds under the same torch seed."""
    from kimi.parallel.engine import materialize

    cfg = tiny_cfg(tie_embeddings=tied)
    torch.manual_seed(3)
    direct = dict(KimiModel(cfg).named_parameters())
    for blocks, first, last in ((range(3), True, True), (range(1, 3), False, True),
                                (range(0, 1), True, False)):
        torch.manual_seed(3)
        with torch.device("meta"):
            part = KimiModel(cfg).part(blocks, first, last)
        materialize(part, torch.device("cpu"))
        if first and last:
            assert (part.lm_head.weight is part.embed.weight) == tied
        names = dict(part.named_parameters())
        assert names and all(not p.is_meta for p in names.values())
        for name, p in names.items():
            want = direct["embed.weight" if tied and name == "lm_head.weight" else name]
            assert torch.equal(p, want), name
    torch.manual_seed(4)
    assert not torch.equal(KimiModel(cfg).embed.weight, direct["embed.weight"])  # the seed matters
