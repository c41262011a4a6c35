"""The FFN activations (kimi/model/activations.py): Kimi K3's SiTU-GLU against its formula in fp64, against
mlx-lm's kimi_k3 (an independent definition, with the same weights in its MLP), its derivatives against their
closed forms, its bound, and every FFN of a MoE layer taking it (grouped equal to the loop)."""

import numpy as np
import pytest
import torch

from helpers import tiny_model_cfg
from kimi.interop.hf import NotExpressible, hf_config
from kimi.model.activations import situ, swiglu
from kimi.model.mlp import SwiGLU
from kimi.model.moe import MoE, experts_grouped, experts_loop, route

pytestmark = pytest.mark.unit

F64 = torch.float64


def _by_formula(g, u, b1, b2):
    """fp64 SiTU-GLU written out: [b1 tanh(g/b1) sigmoid(g)] [b2 tanh(u/b2)] (the up branch raw without
    b2)."""
    g, u = g.double(), u.double()
    up = u if b2 is None else b2 * torch.tanh(u / b2)
    return b1 * torch.tanh(g / b1) * (1 / (1 + torch.exp(-g))) * up


@pytest.mark.parametrize("b1,b2", [(4.0, 25.0), (1.0, None)])
def test_situ_is_its_formula_and_bounded(b1, b2):
    gen = torch.Generator().manual_seed(0)
    g, u = (torch.randn(4096, generator=gen, dtype=F64) * 20 for _ in range(2))  # far into both caps
    torch.testing.assert_close(situ(g, u, b1, b2), _by_formula(g, u, b1, b2), rtol=1e-14, atol=1e-14)
    if b2 is not None:
        assert situ(g, u, b1, b2).abs().max() <= b1 * b2
    small_g, small_u = g / 1e4, u / 1e4  # near 0: SwiGLU
    torch.testing.assert_close(situ(small_g, small_u, b1, b2), swiglu(small_g, small_u), rtol=1e-3,
                               atol=1e-12)


def test_situ_gradients_are_the_closed_forms():
    gen = torch.Generator().manual_seed(1)
    g, u = (torch.randn(512, generator=gen, dtype=F64) * 6 for _ in range(2))
    g.requires_grad_(), u.requires_grad_()
    dg, du = torch.autograd.grad(situ(g, u, 4.0, 25.0).sum(), [g, u])
    g, u = g.detach(), u.detach()
    s, up = torch.sigmoid(g), 25.0 * torch.tanh(u / 25.0)
    sech2 = lambda z: 1 / torch.cosh(z) ** 2  # noqa: E731
    torch.testing.assert_close(dg, (sech2(g / 4) * s + 4 * torch.tanh(g / 4) * s * (1 - s)) * up)
    torch.testing.assert_close(du, 4 * torch.tanh(g / 4) * s * sech2(u / 25))


def test_situ_computes_in_fp32_and_returns_the_inputs_dtype():
    g, u = (torch.randn(64, dtype=torch.bfloat16) * 30 for _ in range(2))
    out = situ(g, u)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, situ(g.float(), u.float()).bfloat16(), rtol=0, atol=0)


def test_dense_mlp_equals_mlx_lm_kimi_k3():
    import mlx.core as mx

    from mlx_lm.models.kimi_k3 import KimiK3MLP, TextArgs

    cfg = tiny_model_cfg(mlp=dict(activation="situ"))
    torch.manual_seed(0)
    ours = SwiGLU.build(cfg)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 1.0)  # large enough that both caps act
    args = TextArgs.from_dict(dict(hidden_size=cfg.d_model, intermediate_size=cfg.mlp.hidden,
                                   hidden_act="situ", activation_situ_beta=cfg.mlp.situ_beta,
                                   activation_situ_linear_beta=cfg.mlp.situ_linear_beta))
    theirs = KimiK3MLP(args)
    theirs.load_weights([(f"{n}_proj.weight", mx.array(getattr(ours, f"w_{n}").weight.detach().numpy()))
                         for n in ("gate", "up", "down")])
    x = torch.randn(8, cfg.d_model, generator=torch.Generator().manual_seed(1))
    expected = np.array(theirs(mx.array(x.numpy())))
    expected = torch.from_numpy(expected)
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    assert torch.tanh(ours.w_up(x) / 25).abs().max() > 0.5  # the up branch's cap was in play


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_moe_experts_take_situ_grouped_equal_to_loop(dtype):
    cfg = tiny_model_cfg(d_model=32, moe=dict(num_experts=8, top_k=2, hidden=16, shared_experts=1,
                                              first_dense=1), mlp=dict(activation="situ"))
    torch.manual_seed(0)
    moe = MoE(cfg).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(40, cfg.d_model, dtype=dtype, generator=torch.Generator().manual_seed(2))
    w, e, _ = route(x, moe.router.weight, moe.expert_bias, 2, 1, 1, True, 1.0)
    weights = [moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down]
    outs = [fn(x, e, w, *weights, act=moe.experts.act) for fn in (experts_grouped, experts_loop)]
    tol = 1e-12 if dtype == F64 else 1e-5
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    plain = experts_loop(x, e, w, *weights)  # SwiGLU: a different function
    assert (plain - outs[1]).abs().max() > 1e-3
    torch.testing.assert_close(moe.experts(x, e, w), outs[0], rtol=tol, atol=tol)  # the layer passes its own
    assert moe.shared.act.func is situ


def test_kimi_linear_export_refuses_situ():
    cfg = tiny_model_cfg(mlp=dict(activation="situ"), residual="standard", vocab_size=64,
                         kda=dict(gate_bias=False))
    with pytest.raises(NotExpressible,
                       match=r"cannot express model.mlp.activation=situ .*its MLPs are SwiGLU"):
        hf_config(cfg)
