"""Kimi K3's gated MLA (model.mla.output_gate): our MLA with the gate equals mlx-lm's kimi_k3 MLA attention
(an independent definition, NoPE with q-LoRA as K3 has it) with the same weights, the gate is off by default,
its weight splits by heads under tensor parallelism, and QK-Clip still reads the attention's logits."""

import numpy as np
import pytest
import torch

from helpers import fill_randomly, tiny_model_cfg
from kimi.interop.hf import NotExpressible, hf_config
from kimi.model.mla import MLA

pytestmark = pytest.mark.unit


def _cfg(gate: bool = False, **kw):
    """A K3-like MLA: q-LoRA, 8 unrotated shared key dims; `gate`: model.mla.output_gate."""
    mla = dict(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16, rotary=False, norm_eps=1e-6, output_gate=gate)
    return tiny_model_cfg(d_model=32, mla=mla, **kw)


def _filled(cfg):
    return fill_randomly(MLA(cfg), 0.3)


def _mlx_twin(ours: MLA, cfg):
    import mlx.core as mx

    from mlx_lm.models.kimi_k3 import KimiK3MLAAttention, TextArgs

    args = TextArgs.from_dict(dict(hidden_size=cfg.d_model, num_attention_heads=cfg.mla.num_heads,
                                   q_lora_rank=cfg.mla.q_lora_rank, kv_lora_rank=cfg.mla.kv_lora_rank,
                                   qk_nope_head_dim=cfg.mla.qk_nope_head_dim,
                                   qk_rope_head_dim=cfg.mla.qk_rope_head_dim, v_head_dim=cfg.mla.v_head_dim,
                                   mla_use_nope=True, mla_use_output_gate=cfg.mla.output_gate))
    theirs = KimiK3MLAAttention(args)
    w = {k: v.detach().numpy() for k, v in ours.state_dict().items()}
    H, nope = cfg.mla.num_heads, cfg.mla.qk_nope_head_dim
    kv_b = w["wkv_b.weight"].reshape(H, nope + cfg.mla.v_head_dim, -1)  # mlx-lm's sanitize splits it per head
    pairs = [("q_a_proj.weight", w["wq_a.weight"]), ("q_a_layernorm.weight", w["q_norm.weight"]),
             ("q_b_proj.weight", w["wq_b.weight"]), ("kv_a_proj_with_mqa.weight", w["wkv_a.weight"]),
             ("kv_a_layernorm.weight", w["kv_norm.weight"]), ("o_proj.weight", w["wo.weight"]),
             ("embed_q.weight", np.ascontiguousarray(kv_b[:, :nope].swapaxes(-1, -2))),
             ("unembed_out.weight", np.ascontiguousarray(kv_b[:, nope:]))]
    if cfg.mla.output_gate:
        pairs.append(("g_proj.weight", w["wg.weight"]))
    theirs.load_weights([(k, mx.array(v)) for k, v in pairs])
    return theirs


@pytest.mark.parametrize("gate", [True, False])
def test_equals_mlx_lm_kimi_k3_mla(gate):
    import mlx.core as mx

    cfg = _cfg(gate=gate)
    ours = _filled(cfg)
    assert (ours.wg is not None) == gate
    x = torch.randn(2, 12, cfg.d_model, generator=torch.Generator().manual_seed(1))
    causal = mx.array(np.tril(np.ones((12, 12), dtype=bool)))
    expected = torch.from_numpy(np.array(_mlx_twin(ours, cfg)(mx.array(x.numpy()), mask=causal)))
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_the_gate_acts_per_element_from_the_layer_input():
    cfg = _cfg(gate=True)
    ours = _filled(cfg)
    x = torch.randn(1, 6, cfg.d_model, generator=torch.Generator().manual_seed(2))
    gated = ours(x)
    with torch.no_grad():
        ours.wg.weight.zero_()  # sigmoid(0) = 1/2 on every element
    half = ours(x)
    ours.wg = None
    torch.testing.assert_close(half, 0.5 * ours(x))
    assert (gated - half).abs().max() > 1e-3


def test_tensor_parallel_splits_the_gate_by_heads_and_qk_clip_is_unchanged():
    gated, plain = MLA(_cfg(gate=True)), MLA(_cfg())
    plan = gated.tp_plan()
    assert "wg" in plan.colwise and plan.split_dim("wg.weight") == 0
    spec, plain_spec = gated.qk_clip_spec("m"), plain.qk_clip_spec("m")
    assert ((spec.layer, spec.num_heads, spec.rows)
            == (plain_spec.layer, plain_spec.num_heads, plain_spec.rows))
    assert ("wg.weight" in gated.init_rules(0.02, 0.01)
            and gated.HF_NAMES["wg.weight"] == "self_attn.g_proj.weight")


def test_kimi_linear_export_refuses_the_gate():
    cfg = _cfg(gate=True, residual="standard", vocab_size=64, kda=dict(gate_bias=False))
    with pytest.raises(NotExpressible, match=r"cannot express MLA's output gate .*its MLA has none"):
        hf_config(cfg)
