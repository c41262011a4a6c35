"""Kimi K3's Stable LatentMoE (model.moe.latent_dim): the router and shared experts at full width, the routed
experts on down-projected tokens, the weighted sum RMSNorm-ed and projected up. The layer equals mlx-lm's
kimi_k3 sparse MoE (an independent definition) with the same weights, with SiTU-GLU experts; the grouped
experts equal the loop; a width-0 latent is the plain layer."""

import numpy as np
import pytest
import torch

from helpers import fill_randomly, tiny_model_cfg
from kimi.interop.hf import NotExpressible, hf_config
from kimi.model.moe import MoE

pytestmark = pytest.mark.unit


def _cfg(moe=None, activation="situ", **kw):
    """tiny_model_cfg with a latent MoE of 8 SiTU-GLU experts; `moe` adds to (or changes) its MoE keys."""
    base = dict(num_experts=8, top_k=2, hidden=24, shared_experts=1, first_dense=1, latent_dim=16,
                routed_scale=2.5)
    return tiny_model_cfg(d_model=32, moe={**base, **(moe or {})}, mlp=dict(activation=activation), **kw)


def _filled(cfg):
    moe = fill_randomly(MoE(cfg), 0.4)
    moe.expert_bias.copy_(torch.linspace(-0.2, 0.3, cfg.moe.num_experts))
    return moe


def _mlx_twin(ours: MoE, cfg):
    import mlx.core as mx

    from mlx_lm.models.kimi_k3 import KimiK3SparseMoE, TextArgs

    args = TextArgs.from_dict(dict(
        hidden_size=cfg.d_model, num_experts=cfg.moe.num_experts, num_experts_per_token=cfg.moe.top_k,
        moe_intermediate_size=cfg.moe.hidden, num_shared_experts=cfg.moe.shared_experts,
        routed_expert_hidden_size=cfg.moe.latent_dim, latent_moe_use_norm=cfg.moe.latent_norm,
        num_expert_group=1, topk_group=1, routed_scaling_factor=cfg.moe.routed_scale, moe_renormalize=True,
        rms_norm_eps=cfg.norm_eps, hidden_act="situ", activation_situ_beta=cfg.mlp.situ_beta,
        activation_situ_linear_beta=cfg.mlp.situ_linear_beta))
    theirs = KimiK3SparseMoE(args)
    w = {k: v.detach().numpy() for k, v in ours.state_dict().items()}
    pairs = {"gate.weight": w["router.weight"], "e_score_correction_bias": w["expert_bias"],
             "switch_mlp.gate_proj.weight": w["experts.w_gate"],
             "switch_mlp.up_proj.weight": w["experts.w_up"],
             "switch_mlp.down_proj.weight": w["experts.w_down"],
             "routed_expert_down_proj.weight": w["latent_down.weight"],
             "routed_expert_up_proj.weight": w["latent_up.weight"],
             **{f"shared_experts.{n}_proj.weight": w[f"shared.w_{n}.weight"] for n in ("gate", "up", "down")}}
    if cfg.moe.latent_norm:
        pairs["routed_expert_norm.weight"] = w["latent_norm.weight"]
    theirs.load_weights([(k, mx.array(v)) for k, v in pairs.items()])
    return theirs


@pytest.mark.parametrize("norm", [True, False])
def test_layer_equals_mlx_lm_kimi_k3_sparse_moe(norm):
    import mlx.core as mx

    cfg = _cfg(moe=dict(latent_norm=norm))
    ours = _filled(cfg)
    x = torch.randn(3, 10, cfg.d_model, generator=torch.Generator().manual_seed(1))
    expected = torch.from_numpy(np.array(_mlx_twin(ours, cfg)(mx.array(x.numpy()))))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert ours.experts.w_gate.shape[-1] == cfg.moe.latent_dim  # the experts see latent-width tokens


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_grouped_and_loop_agree_and_gradients_reach_the_projections(impl):
    cfg = _cfg(moe=dict(impl=impl))
    ours = _filled(cfg)
    x = torch.randn(40, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ours = ours.double()
    y = ours(x)
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in ours.named_parameters()
               if n.startswith("latent_"))
    other = _filled(_cfg(moe=dict(impl="loop" if impl == "grouped" else "grouped"))).double()
    torch.testing.assert_close(y, other(x), rtol=1e-12, atol=1e-12)


def test_width_zero_is_the_plain_layer_and_kimi_linear_export_refuses_the_latent():
    plain = MoE(_cfg(moe=dict(latent_dim=0)))
    assert plain.latent_down is None and plain.experts.w_gate.shape[-1] == 32
    assert not any(n.startswith("latent_") for n, _ in plain.named_parameters())
    cfg = _cfg(activation="swiglu", residual="standard", vocab_size=64, kda=dict(gate_bias=False))
    with pytest.raises(NotExpressible, match=r"cannot express a latent MoE"):
        hf_config(cfg)
