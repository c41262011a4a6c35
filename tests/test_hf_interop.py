"""kimi.interop.hf against transformers' Kimi Linear (an independent definition of the architecture): the
48B-A3B preset has exactly the parameters KimiLinearForCausalLM has for the same config, built on the
meta device; configs map both ways; what transformers cannot express is refused by name."""

import dataclasses

import pytest
import torch

from helpers import tiny_model_cfg
from kimi.config import ModelConfig
from kimi.interop.hf import NotExpressible, hf_config, model_fields
from kimi.summary import compose_config, summarize

hf_model = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear",
                               reason="transformers (dev extra) not installed")
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig  # noqa: E402


def test_48b_a3b_counts_equal_transformers():
    s = summarize(compose_config(["model=kimi_linear_48b_a3b"]))
    with torch.device("meta"):
        theirs = hf_model.KimiLinearForCausalLM(KimiLinearConfig(**hf_config(s.cfg.model)))
    total = sum(p.numel() for p in theirs.parameters())
    experts = [e for e in theirs.modules() if isinstance(e, hf_model.KimiLinearExperts)]
    per_expert = [e.gate_up_proj[0].numel() + e.down_proj[0].numel() for e in experts]
    inactive = sum((e.gate_up_proj.shape[0] - s.cfg.model.moe_top_k) * n for e, n in zip(experts, per_expert))
    assert (s.total, s.active) == (total, total - inactive)
    assert 49.0e9 < s.total < 49.2e9 and 3.4e9 < s.active < 3.5e9


def test_configs_map_both_ways():
    m = ModelConfig(**{**dataclasses.asdict(compose_config(["model=kimi_linear_48b_a3b"]).model)})
    back = model_fields(KimiLinearConfig(**hf_config(m)).to_dict())
    for key, value in back.items():
        assert getattr(m, key) == value, key
    small = tiny_model_cfg(residual="standard", kda_gate_bias=False, q_lora_rank=8, qk_rope_head_dim=8,
                           mla_rotary=False, moe_num_experts=4, moe_top_k=2, moe_groups=2, moe_topk_groups=1)
    again = model_fields(KimiLinearConfig(**hf_config(small)).to_dict())
    assert all(getattr(small, k) == v for k, v in again.items() if k != "mla_layers")
    assert again["mla_layers"] == [1]


REFUSED = [(dict(residual="attnres_block"), "model.residual"),
           (dict(residual="standard", kda_gate_bias=True), "model.kda_gate_bias"),
           (dict(residual="standard", kda_gate_bias=False, qk_rope_head_dim=8, mla_rotary=True),
            "model.mla_rotary")]


@pytest.mark.parametrize("overrides,key", REFUSED)
def test_what_transformers_cannot_express_is_refused_by_name(overrides, key):
    with pytest.raises(NotExpressible, match=key):
        hf_config(tiny_model_cfg(**overrides))
