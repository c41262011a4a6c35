"""Kimi K3's checkpoint layout (its released snapshot), both ways: config.json and the tensors' names.

K3's config.json wraps its language model: `model_type: kimi_k3` at the top, the text model's settings in
`text_config`, which holds Kimi Linear's keys (kimi.interop.hf) plus K3's own: `hidden_act: situ` with its two
caps, `linear_attn_config.gate_lower_bound` and `.use_full_rank_gate` (KDA), `mla_use_output_gate`,
`routed_expert_hidden_size` and `latent_moe_use_norm` (the latent MoE) and `attn_res_block_size` in decoder
layers. The text tensors are Kimi Linear's names under `language_model.` plus two depth-mixing sites per layer
(`self_attention_res_{proj,norm}`, `mlp_res_{proj,norm}`) and one before the final norm (`output_attn_res_*`):
`proj` [1, d] is the pseudo-query, `norm` [d] the key-norm weight (model.attnres.key_weight). A_log is
stored zero-padded to the head dim ([128] for K3's 96 heads; the release does not say why).

What ours lacks the file still needs, so mlx-lm (which loads strictly) reads it: layer 0's attention site
(one source: any query gives weight 1; written as query 0, weight 1) and, for a model trained without key
weights, weights of 1 (the same function). Reading always gives a model with key weights. The MTP layer is
not in the release (num_nextn_predict_layers 0) and is not written.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

from kimi.interop.hf import FileEntry, NotExpressible, file_map, model_fields, release_config
from kimi.model.config import ModelConfig, mixer_pattern

PREFIX = "language_model."


@dataclasses.dataclass(frozen=True)
class Constant:
    """A file tensor that no tensor of ours is the source of: written filled with `value`, skipped on read."""
    value: float
    shape: Tuple[int, ...]


def is_k3(config: Dict[str, Any]) -> bool:
    """Whether a config.json is in K3's layout (the wrapper with text_config)."""
    return config.get("model_type") == "kimi_k3" or "text_config" in config


def _refuse(what: str, fix: str) -> None:
    raise NotExpressible(f"Kimi K3's checkpoint layout cannot express {what}: {fix}")


def k3_config(m: ModelConfig) -> Dict[str, Any]:
    """config.json in K3's layout for model config `m`, or NotExpressible naming the setting."""
    if m.residual == "attnres_full":
        _refuse("model.residual=attnres_full", "K3 has Block AttnRes (attnres_block) or none (standard)")
    if m.residual == "attnres_block" and m.attnres.block_size % 2:
        _refuse(f"model.attnres.block_size={m.attnres.block_size} (odd)",
                "its blocks are whole decoder layers: an even number of sublayers")
    if m.mlp.activation != "situ":
        _refuse(f"model.mlp.activation={m.mlp.activation}", "its FFNs are SiTU-GLU "
                "(model.mlp.activation=situ); a SwiGLU model exports in Kimi Linear's layout "
                "(layout=release)")
    if m.kda.gate_bias:
        _refuse("a bias on KDA's output gate (model.kda.gate_bias=true)", "set model.kda.gate_bias=false")
    if m.mla.qk_rope_head_dim and m.mla.rotary:
        _refuse("RoPE on MLA's shared key dims (model.mla.rotary=true)",
                "K3's MLA is NoPE: model.mla.rotary=false")
    other = sorted(set(mixer_pattern(m)) - {"K", "M"})
    if other:
        _refuse(f"token mixers {', '.join(other)} of model.layer_pattern", "only K (KDA) and M (MLA) convert")
    # Kimi Linear's keys come from the same model without K3's parts (which its config cannot hold)
    plain = dataclasses.replace(
        m, residual="standard", kda=dataclasses.replace(m.kda, gate_lower_bound=None, full_rank_gate=False),
        moe=dataclasses.replace(m.moe, latent_dim=0), mla=dataclasses.replace(m.mla, output_gate=False),
        mlp=dataclasses.replace(m.mlp, activation="swiglu"),
        attnres=dataclasses.replace(m.attnres, key_weight=False))
    text = release_config(plain)
    text["linear_attn_config"].update(use_full_rank_gate=m.kda.full_rank_gate,
                                      **({"gate_lower_bound": m.kda.gate_lower_bound}
                                         if m.kda.gate_lower_bound is not None else {}))
    text.update(hidden_act="situ", activation_situ_beta=m.mlp.situ_beta,
                activation_situ_linear_beta=m.mlp.situ_linear_beta,
                mla_use_output_gate=m.mla.output_gate, num_nextn_predict_layers=0,
                routed_expert_hidden_size=m.moe.latent_dim or None, latent_moe_use_norm=m.moe.latent_norm)
    if m.residual == "attnres_block":
        text["attn_res_block_size"] = m.attnres.block_size // 2
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
            "tie_word_embeddings": m.tie_embeddings}


def k3_model_fields(config: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields of a config.json in K3's layout (or its text_config alone)."""
    text = config.get("text_config", config)
    act = text.get("hidden_act", "silu")
    if act not in ("situ", "silu"):
        _refuse(f"hidden_act={act}", "its FFNs are SiTU-GLU (situ) or SwiGLU (silu)")
    fields = model_fields(text)
    linear = text.get("linear_attn_config") or {}
    blocks = text.get("attn_res_block_size")
    fields["kda"].update(gate_lower_bound=linear.get("gate_lower_bound"),
                         full_rank_gate=bool(linear.get("use_full_rank_gate", False)))
    fields["mla"]["output_gate"] = bool(text.get("mla_use_output_gate", False))
    fields["mlp"]["activation"] = "situ" if act == "situ" else "swiglu"
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    fields.update(tie_embeddings=bool(tied),
                  residual="attnres_block" if blocks else "standard",
                  attnres=dict(block_size=2 * (blocks or 2), key_weight=bool(blocks)))
    if act == "situ":
        # mlx-lm's K3 reads a missing gate cap as 1 and a missing up cap as none
        fields["mlp"].update(situ_beta=text.get("activation_situ_beta") or 1.0,
                             situ_linear_beta=text.get("activation_situ_linear_beta"))
    moe = fields["moe"]
    if moe["num_experts"]:
        latent = text.get("routed_expert_hidden_size") or 0
        moe.update(latent_dim=latent, latent_norm=bool(latent and text.get("latent_moe_use_norm")),
                   # K3 sets its router bias by Quantile Balancing, which needs ungrouped routing
                   balance="quantile" if moe.get("topk_groups", 1) == moe.get("groups", 1) == 1 else "sign")
    return fields


def k3_file_map(m: ModelConfig) -> List[FileEntry]:
    """Every text tensor of a K3 checkpoint of model config `m` and its source (ours, or a Constant)."""
    entries: List[Any] = []
    for name, mine, index, shape in file_map(m, "release"):
        if name.endswith(".self_attn.A_log"):
            shape = (max(m.kda.num_heads, m.kda.head_dim),)  # zero-padded, as released
        entries.append((PREFIX + name, mine, index, shape))
    if m.residual == "standard":
        return entries
    d, keyed = (1, m.d_model), m.attnres.key_weight

    def site(hf: str, ours: str | None) -> list:
        query = f"{ours}_query" if ours else Constant(0.0, d)
        weight = f"{ours}_key_weight" if ours and keyed else Constant(1.0, (m.d_model,))
        return [(f"{PREFIX}model.{hf}_proj.weight", query, None, d),
                (f"{PREFIX}model.{hf}_norm.weight", weight, None, None)]

    for i in range(m.num_layers):
        entries += site(f"layers.{i}.self_attention_res", f"blocks.{i}.mixer" if i else None)
        entries += site(f"layers.{i}.mlp_res", f"blocks.{i}.mlp")
    return entries + site("output_attn_res", "final")
