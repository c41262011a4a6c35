"""Kimi Linear as Hugging Face `transformers` defines it (`KimiLinearForCausalLM`, `KimiLinearConfig`): the
mapping between its config and ours.

`hf_config(cfg)` gives the `KimiLinearConfig` keyword arguments of a model config, or refuses, naming the
setting, a model that `transformers`' class cannot express (Attention Residuals, a rotated MLA key, a bias
on KDA's output gate). `model_fields(hf)` goes back: the
`model.*` values of a `transformers` config (its `to_dict()`, or a config.json it wrote).

`file_map(cfg)` lists every tensor of a transformers checkpoint file with the tensor of ours (or the
expert of it) it comes from; kimi.convert reads and writes such files one tensor at a time. Equal logits
are tested (tests/test_hf_interop.py: 1.2e-6 relative in fp32). transformers keeps the MLA latent norm's
eps at 1e-6 whatever rms_norm_eps says: `model_fields` sets `mla_norm_eps` to match.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from kimi.config import ModelConfig, mixer_pattern
from kimi.model import KimiModel
from kimi.model.sublayer import hf_entries


class NotExpressible(ValueError):
    """A model config that transformers' Kimi Linear cannot express."""


def _refuse(what: str, fix: str) -> None:
    raise NotExpressible(f"transformers' KimiLinearForCausalLM cannot express {what}: {fix}")


def hf_config(m: ModelConfig) -> Dict[str, Any]:
    """KimiLinearConfig(**hf_config(m)) describes the same model as `m` (vocab_size must be resolved)."""
    if m.residual != "standard":
        _refuse(f"model.residual={m.residual} (Attention Residuals)", "only model.residual=standard converts")
    if m.qk_rope_head_dim and m.mla_rotary:
        _refuse("RoPE on MLA's shared key dims (model.mla_rotary=true)",
                "its MLA keeps them unrotated: set model.mla_rotary=false or model.qk_rope_head_dim=0")
    if m.kda_gate_bias:
        _refuse("a bias on KDA's output gate (model.kda_gate_bias=true)", "set model.kda_gate_bias=false")
    if m.vocab_size is None:
        raise ValueError("model.vocab_size must be resolved before converting (it follows the tokenizer)")
    types = {"K": "linear_attention", "M": "full_attention"}
    other = sorted(set(mixer_pattern(m)) - set(types))
    if other:
        _refuse(f"token mixers {', '.join(other)} of model.layer_pattern", "only K (KDA) and M (MLA) convert")
    moe = bool(m.moe_num_experts)
    return dict(
        vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
        layer_types=[types[letter] for letter in mixer_pattern(m)],
        linear_num_heads=m.kda_num_heads, linear_head_dim=m.kda_head_dim, linear_conv_kernel_dim=m.conv_size,
        num_attention_heads=m.mla_num_heads, num_key_value_heads=m.mla_num_heads,
        q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        intermediate_size=m.mlp_hidden,
        mlp_layer_types=["sparse" if moe and i >= m.moe_first_dense else "dense"
                         for i in range(m.num_layers)],
        num_local_experts=m.moe_num_experts if moe else 1, num_experts_per_tok=m.moe_top_k,
        moe_intermediate_size=m.moe_hidden, n_shared_experts=m.moe_shared_experts,
        n_group=m.moe_groups, topk_group=m.moe_topk_groups, routed_scaling_factor=m.moe_routed_scale,
        norm_topk_prob=m.moe_norm_topk, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
        hidden_act="silu", initializer_range=m.init_std,
        # the release's special token ids belong to its tokenizer; a converter sets the ones it knows
        pad_token_id=None, bos_token_id=None, eos_token_id=None)


# transformers' KimiLinearConfig takes the first name of each pair and writes the second (its attribute_map)
_ALIASES = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
            "n_shared_experts": "num_shared_experts", "n_group": "num_expert_group",
            "norm_topk_prob": "moe_renormalize"}


def model_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields of a transformers Kimi Linear config dict (the inverse of hf_config), under either
    of its names for a key (KimiLinearConfig's keyword arguments, or what its to_dict() writes)."""
    hf = {**{name: hf[alias] for name, alias in _ALIASES.items() if alias in hf}, **hf}
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or []
    mlp_types = hf.get("mlp_layer_types") or []
    sparse = [i for i, t in enumerate(mlp_types) if t == "sparse"]
    if sparse and sparse != list(range(sparse[0], n)):
        _refuse(f"MoE blocks {sparse} that are not all the blocks from the first sparse one on",
                "this framework's MoE blocks are the ones from model.moe_first_dense on")
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=n,
        mla_layers=[i for i, t in enumerate(types) if t == "full_attention"],
        kda_num_heads=hf["linear_num_heads"], kda_head_dim=hf["linear_head_dim"],
        conv_size=hf["linear_conv_kernel_dim"], kda_gate_bias=False,
        mla_num_heads=hf["num_attention_heads"], q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"], mla_rotary=False, v_head_dim=hf["v_head_dim"],
        mlp_hidden=hf["intermediate_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        residual="standard", norm_eps=hf["rms_norm_eps"], init_std=hf.get("initializer_range", 0.02),
        mla_norm_eps=1e-6,  # transformers' MLA latent (and q-LoRA) norms keep their default eps
        moe_num_experts=hf["num_local_experts"] if sparse else 0)
    if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
        _refuse("grouped key/value heads in MLA", "MLA here has one key/value head per query head")
    if sparse:
        fields.update(moe_top_k=hf["num_experts_per_tok"], moe_hidden=hf["moe_intermediate_size"],
                      moe_shared_experts=hf.get("n_shared_experts") or 0, moe_first_dense=sparse[0],
                      moe_groups=hf.get("n_group") or 1, moe_topk_groups=hf.get("topk_group") or 1,
                      moe_routed_scale=hf.get("routed_scaling_factor", 1.0),
                      moe_norm_topk=bool(hf.get("norm_topk_prob", True)))
    return fields


# ---- files ---------------------------------------------------------------------------------------------
# In files (the released checkpoints, and what save_pretrained writes) transformers keeps the original
# names: block_sparse_moe for every feed-forward, one tensor per expert (w1 gate, w3 up, w2 down), the three
# short convs apart, the gate's parameters directly under self_attn. from_pretrained converts them. Each
# sublayer declares its tensors' names (HF_NAMES, kimi/model/sublayer.py).
# One entry per file tensor: (its name, our tensor's name, index into our tensor's first dim or None, the
# file tensor's shape when it differs from ours: None keeps it).
FileEntry = Tuple[str, str, Optional[int], Optional[Tuple[int, ...]]]


def file_map(m: ModelConfig) -> List[FileEntry]:
    """Every tensor of a transformers Kimi Linear checkpoint file for model config `m`, and its source."""
    out: List[FileEntry] = [("model.embed_tokens.weight", "embed.weight", None, None),
                            ("model.norm.weight", "norm.weight", None, None)]
    if not m.tie_embeddings:
        out.append(("lm_head.weight", "lm_head.weight", None, None))
    with torch.device("meta"):  # the layers' declarations, from their shapes alone
        model = KimiModel(m)
    for i in range(m.num_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        out += [(hf + "input_layernorm.weight", ours + "mixer_norm.weight", None, None),
                (hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight", None, None)]
        for kind in ("mixer", "mlp"):
            out += hf_entries(getattr(model.blocks[str(i)], kind), hf, ours + kind)
    return out
