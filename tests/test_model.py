"""The whole model: shapes in every residual mode and MLA pattern, parameter and FLOP counts against
formulas written here from the spec, packed documents, and gradient flow."""

import pytest
import torch
import torch.nn.functional as F

from kimi.config import ModelConfig
from helpers import tiny_model_cfg
from kimi.model import KDA, KimiModel
from kimi.model.kda import ShortConv

F64 = torch.float64
MODES = ["standard", "attnres_full", "attnres_block"]
PATTERNS = {"all_kda": dict(mla_layers=None, mla_every=0), "all_mla": dict(mla_layers=None, mla_every=1),
            "mixed": dict(mla_layers=[1])}


def tiny_cfg(**kw) -> ModelConfig:
    return tiny_model_cfg(**{**dict(qk_rope_head_dim=8, v_head_dim=8, attnres_block_size=2), **kw})


@pytest.mark.parametrize("residual", MODES)
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_forward_shapes(residual, pattern):
    model = KimiModel(tiny_cfg(residual=residual, **PATTERNS[pattern]))
    n_mla = {"all_kda": 0, "all_mla": 3, "mixed": 1}[pattern]
    assert len(model.mla_modules()) == n_mla
    logits = model(torch.randint(0, 61, (2, 9)))
    assert logits.shape == (2, 9, 61) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model.double()(torch.randint(0, 61, (1, 5))).dtype == F64


def expected_params(c: ModelConfig, n_mla: int, tied: bool) -> tuple[int, int]:
    """(total, non-embedding) parameter counts from the architecture in the spec."""
    d, H, K = c.d_model, c.kda_num_heads, c.kda_head_dim
    kda = (3 * d * H * K + 3 * H * K * c.conv_size  # q, k, v projections and short convs
           + d * K + K * H * K + H + H * K  # gate f (low rank), A_log, dt_bias
           + d * H  # beta
           + d * K + K * H * K + H * K  # output gate (low rank, bias on the up-projection)
           + K + H * K * d)  # per-head output norm (shared weight), W_o
    Hm, qk = c.mla_num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    q = d * Hm * qk if c.q_lora_rank == 0 else d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * Hm * qk
    mla = (q + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
           + c.kv_lora_rank * Hm * (c.qk_nope_head_dim + c.v_head_dim) + Hm * c.v_head_dim * d)
    per_block = 3 * d * c.mlp_hidden + 2 * d  # MLP and the two pre-norms
    queries = 2 * c.num_layers * d if c.residual != "standard" else 0  # 2L - 1 sublayers + final
    body = n_mla * mla + (c.num_layers - n_mla) * kda + c.num_layers * per_block + queries + d  # + final norm
    emb = c.vocab_size * d
    total = body + emb + (0 if tied else emb)
    return total, total - emb


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("residual,q_lora", [("standard", 0), ("attnres_block", 12)])
def test_num_params(tied, residual, q_lora):
    cfg = tiny_cfg(tie_embeddings=tied, residual=residual, q_lora_rank=q_lora)
    model = KimiModel(cfg)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_params() == sum(unique.values())
    total, non_emb = expected_params(cfg, n_mla=1, tied=tied)
    assert (model.num_params(), model.num_params(exclude_embedding=True)) == (total, non_emb)
    assert (model.lm_head.weight is model.embed.weight) == tied


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token(tied):
    cfg = tiny_cfg(tie_embeddings=tied, num_layers=4, mla_layers=[1, 3])
    model = KimiModel(cfg)
    T = 100
    _, non_emb = expected_params(cfg, n_mla=2, tied=tied)
    matmul = non_emb + (cfg.vocab_size * cfg.d_model if tied else 0)  # the LM head always costs compute
    attn = 6 * 2 * 2 * (16 + 8 + 8) * T / 2  # 2 MLA layers, 2 heads, Dqk = 16 + 8, Dv = 8, causal half
    kda = 3 * 2 * 2 * (6 * 16**2 + 3 * 64 * 16 + 64**2)  # 2 KDA layers, 2 heads, K = 16, C = 64
    assert model.flops_per_token(T) == pytest.approx(6 * matmul + attn + kda, rel=1e-12)
    assert model.flops_per_token(2 * T) > model.flops_per_token(T) > 0


def test_short_conv_matches_conv1d():
    torch.manual_seed(4)
    conv = ShortConv(6, 4).double()
    conv.reset_parameters()
    x = torch.randn(2, 9, 6, dtype=F64)
    want = F.conv1d(x.transpose(1, 2), conv.weight, padding=3, groups=6)[..., :9].transpose(1, 2)
    y, tail = conv(x)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(tail, x[:, -3:])


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
    cu = [0, 10, 12, 25]
    ids = torch.randint(0, 61, (1, cu[-1]))
    packed = model(ids, cu_seqlens=torch.tensor(cu))
    separate = torch.cat([model(ids[:, s:e]) for s, e in zip(cu, cu[1:])], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual", MODES)
@pytest.mark.parametrize("tied", [False, True])
def test_every_parameter_gets_a_gradient(residual, tied):
    torch.manual_seed(2)
    model = KimiModel(tiny_cfg(residual=residual, tie_embeddings=tied, q_lora_rank=12))
    ids = torch.randint(0, 61, (2, 12))
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().max() > 0, name
