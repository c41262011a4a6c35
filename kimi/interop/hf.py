"""Kimi Linear as Hugging Face `transformers` defines it (`KimiLinearForCausalLM`, `KimiLinearConfig`) and
as its released checkpoints lay it out: the mapping between its config and ours.

`hf_config(cfg)` gives the `KimiLinearConfig` keyword arguments of a model config, or refuses, naming the
setting, a model that `transformers`' class cannot express (Attention Residuals, a rotated MLA key, a bias
on KDA's output gate); `release_config(cfg)` the same model as the released config.json says it (which
transformers, vLLM and mlx-lm read). `model_fields(hf)` goes back, from any of those layouts, naming a
missing key instead of defaulting it.

`file_map(cfg, layout)` lists every tensor of a checkpoint file (the release's names, or the ones
save_pretrained writes) with the tensor of ours (or the expert of it) it comes from; kimi.convert reads
and writes such files one tensor at a time. Equal logits are tested against transformers and mlx-lm
(tests/interop/test_hf_interop.py, tests/interop/test_hf_release.py: ~1e-6 in fp32). transformers keeps the
MLA latent norm's eps at 1e-6 whatever rms_norm_eps says: `model_fields` sets `mla.norm_eps` to match.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from kimi.model import KimiModel
from kimi.model.config import ModelConfig, mixer_pattern
from kimi.model.sublayer import hf_entries


class NotExpressible(ValueError):
    """A model config that transformers' Kimi Linear cannot express."""


def _refuse(what: str, fix: str) -> None:
    raise NotExpressible(f"transformers' KimiLinearForCausalLM cannot express {what}: {fix}")


def hf_config(m: ModelConfig) -> Dict[str, Any]:
    """KimiLinearConfig(**hf_config(m)) describes the same model as `m` (vocab_size must be resolved)."""
    if m.residual != "standard":
        _refuse(f"model.residual={m.residual} (Attention Residuals)", "only model.residual=standard converts")
    if m.mla.qk_rope_head_dim and m.mla.rotary:
        _refuse("RoPE on MLA's shared key dims (model.mla.rotary=true)",
                "its MLA keeps them unrotated: set model.mla.rotary=false or model.mla.qk_rope_head_dim=0")
    if m.kda.gate_bias:
        _refuse("a bias on KDA's output gate (model.kda.gate_bias=true)", "set model.kda.gate_bias=false")
    if m.kda.gate_lower_bound is not None or m.kda.full_rank_gate:
        _refuse("Kimi K3's KDA (model.kda.gate_lower_bound, model.kda.full_rank_gate)",
                "its KDA has the unbounded gate and a low-rank output gate")
    if m.moe.num_experts and m.moe.latent_dim:
        _refuse("a latent MoE (model.moe.latent_dim, Kimi K3)", "its experts work at the full width")
    if m.mla.output_gate:
        _refuse("MLA's output gate (model.mla.output_gate=true, Kimi K3's gated MLA)", "its MLA has none")
    if m.mlp.activation != "swiglu":
        _refuse(f"model.mlp.activation={m.mlp.activation} (Kimi K3's SiTU-GLU)", "its MLPs are SwiGLU")
    if m.vocab_size is None:
        raise ValueError("model.vocab_size must be resolved before converting (it follows the tokenizer)")
    types = {"K": "linear_attention", "M": "full_attention"}
    other = sorted(set(mixer_pattern(m)) - set(types))
    if other:
        _refuse(f"token mixers {', '.join(other)} of model.layer_pattern", "only K (KDA) and M (MLA) convert")
    moe = bool(m.moe.num_experts)
    return dict(
        vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
        layer_types=[types[letter] for letter in mixer_pattern(m)],
        linear_num_heads=m.kda.num_heads, linear_head_dim=m.kda.head_dim, linear_conv_kernel_dim=m.conv_size,
        num_attention_heads=m.mla.num_heads, num_key_value_heads=m.mla.num_heads,
        q_lora_rank=m.mla.q_lora_rank or None, kv_lora_rank=m.mla.kv_lora_rank,
        qk_nope_head_dim=m.mla.qk_nope_head_dim, qk_rope_head_dim=m.mla.qk_rope_head_dim,
        v_head_dim=m.mla.v_head_dim,
        intermediate_size=m.mlp.hidden,
        mlp_layer_types=["sparse" if moe and i >= m.moe.first_dense else "dense"
                         for i in range(m.num_layers)],
        num_local_experts=m.moe.num_experts if moe else 1, num_experts_per_tok=m.moe.top_k,
        moe_intermediate_size=m.moe.hidden, n_shared_experts=m.moe.shared_experts,
        n_group=m.moe.groups, topk_group=m.moe.topk_groups, routed_scaling_factor=m.moe.routed_scale,
        norm_topk_prob=m.moe.norm_topk, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
        hidden_act="silu", initializer_range=m.init_std,
        # the release's special token ids belong to its tokenizer; a converter sets the ones it knows
        pad_token_id=None, bos_token_id=None, eos_token_id=None)


# transformers' KimiLinearConfig takes the first name of each pair; the released config.json and what
# save_pretrained writes use the second (its attribute_map)
_ALIASES = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
            "n_shared_experts": "num_shared_experts", "n_group": "num_expert_group",
            "norm_topk_prob": "moe_renormalize"}
# The released config.json keeps KDA's settings in linear_attn_config, under these names
_LINEAR = {"linear_num_heads": "num_heads", "linear_head_dim": "head_dim",
           "linear_conv_kernel_dim": "short_conv_kernel_size"}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "mlp_layer_types",
             *_LINEAR, "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim", "intermediate_size", "rms_norm_eps")
_REQUIRED_MOE = ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
# where a key missing from the released layout would have come from
_RELEASE_NAME = {"layer_types": "linear_attn_config.kda_layers and .full_attn_layers",
                 "mlp_layer_types": "first_k_dense_replace",
                 **{k: f"linear_attn_config.{v}" for k, v in _LINEAR.items()}, **_ALIASES}


def _transformers_names(hf: Dict[str, Any]) -> Dict[str, Any]:
    """A config dict in any of its layouts (KimiLinearConfig's keywords, its to_dict(), the released
    config.json) under KimiLinearConfig's keyword names, the per-layer lists included; nothing defaulted."""
    hf = {**{name: hf[alias] for name, alias in _ALIASES.items() if alias in hf}, **hf}
    linear = hf.get("linear_attn_config") or {}
    hf.update({k: linear[v] for k, v in _LINEAR.items() if v in linear and k not in hf})
    n = hf.get("num_hidden_layers")
    if not hf.get("layer_types") and n and {"kda_layers", "full_attn_layers"} <= set(linear):
        numbers = {"linear_attention": linear["kda_layers"], "full_attention": linear["full_attn_layers"]}
        where = {i: kind for kind, layers in numbers.items() for i in layers}  # 1-based, as released
        if sorted(where) != list(range(1, n + 1)) or sum(map(len, numbers.values())) != n:
            raise ValueError(f"linear_attn_config's kda_layers and full_attn_layers must number each of the "
                             f"{n} layers once, from 1: got {numbers}")
        hf["layer_types"] = [where[i + 1] for i in range(n)]
    if not hf.get("mlp_layer_types") and n and "first_k_dense_replace" in hf:
        if hf.get("moe_layer_freq", 1) != 1:
            _refuse(f"moe_layer_freq={hf['moe_layer_freq']}", "MoE blocks here are every block from the "
                    "first sparse one on")
        first = hf["first_k_dense_replace"] if hf.get("num_local_experts") else n
        hf["mlp_layer_types"] = ["dense" if i < first else "sparse" for i in range(n)]
    return hf


def model_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """ModelConfig fields of a Kimi Linear config dict (the inverse of hf_config), in any of its layouts:
    KimiLinearConfig's keyword arguments, its to_dict() (what save_pretrained writes) or the released
    config.json (linear_attn_config with 1-based layer numbers, first_k_dense_replace). A key none of them
    has is named (ValueError), never defaulted: a default here would build another model than the file's."""
    hf = _transformers_names(hf)
    n = hf.get("num_hidden_layers")
    sparse = [i for i, t in enumerate(hf.get("mlp_layer_types") or []) if t == "sparse"]
    missing = [k for k in (*_REQUIRED, *(_REQUIRED_MOE if sparse else ())) if hf.get(k) is None]
    if missing:
        raise ValueError("no " + ", ".join(k + (f" (or {_RELEASE_NAME[k]})" if k in _RELEASE_NAME else "")
                                           for k in missing)
                         + ": a Kimi Linear config names each (as released, or as save_pretrained writes "
                           "it); restore them from the checkpoint's source")
    if len(hf["layer_types"]) != n or len(hf["mlp_layer_types"]) != n:
        raise ValueError(f"layer_types and mlp_layer_types must have num_hidden_layers={n} entries")
    if sparse and sparse != list(range(sparse[0], n)):
        _refuse(f"MoE blocks {sparse} that are not all the blocks from the first sparse one on",
                "this framework's MoE blocks are the ones from model.moe.first_dense on")
    if hf.get("mla_use_nope") is False:
        _refuse("mla_use_nope=false (RoPE on MLA's shared key dims)", "only unrotated MLA converts")
    if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        _refuse(f"moe_router_activation_func={hf['moe_router_activation_func']}",
                "the MoE router here is sigmoid")
    types = hf["layer_types"]
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=n,
        mla_layers=[i for i, t in enumerate(types) if t == "full_attention"],
        conv_size=hf["linear_conv_kernel_dim"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        residual="standard", norm_eps=hf["rms_norm_eps"], init_std=hf.get("initializer_range", 0.02),
        kda=dict(num_heads=hf["linear_num_heads"], head_dim=hf["linear_head_dim"], gate_bias=False),
        mla=dict(num_heads=hf["num_attention_heads"], q_lora_rank=hf.get("q_lora_rank") or 0,
                 kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                 qk_rope_head_dim=hf["qk_rope_head_dim"], rotary=False, v_head_dim=hf["v_head_dim"],
                 norm_eps=1e-6),  # transformers' MLA latent (and q-LoRA) norms keep their default eps
        mlp=dict(hidden=hf["intermediate_size"]),
        moe=dict(num_experts=hf["num_local_experts"] if sparse else 0))
    if hf.get("num_key_value_heads") not in (None, hf["num_attention_heads"]):
        _refuse("grouped key/value heads in MLA", "MLA here has one key/value head per query head")
    if sparse:
        fields["moe"].update(top_k=hf["num_experts_per_tok"], hidden=hf["moe_intermediate_size"],
                             shared_experts=hf.get("n_shared_experts") or 0, first_dense=sparse[0],
                             groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1,
                             routed_scale=hf.get("routed_scaling_factor", 1.0),
                             norm_topk=bool(hf.get("norm_topk_prob", True)))
    return fields


def release_config(m: ModelConfig) -> Dict[str, Any]:
    """config.json in the released checkpoints' layout (what vLLM and mlx-lm read; transformers reads it
    too): linear_attn_config with 1-based layer numbers, first_k_dense_replace, the aliased key names."""
    kw = hf_config(m)
    types = kw.pop("layer_types")
    numbers = {t: [i + 1 for i, x in enumerate(types) if x == t]
               for t in ("linear_attention", "full_attention")}
    dense = kw.pop("mlp_layer_types").count("dense")
    out = {_ALIASES.get(k, k): v for k, v in kw.items() if k not in _LINEAR}
    out.update(linear_attn_config=dict({v: kw[k] for k, v in _LINEAR.items()},
                                       kda_layers=numbers["linear_attention"],
                                       full_attn_layers=numbers["full_attention"]),
               first_k_dense_replace=dense, moe_layer_freq=1, moe_router_activation_func="sigmoid",
               num_experts=kw["num_local_experts"] if dense < m.num_layers else 0, use_grouped_topk=True,
               # mlx-lm requires these keys (head_dim: the fallback of MLA's dims, which are all given)
               mla_use_nope=True, head_dim=m.mla.qk_nope_head_dim, rope_theta=m.rope_theta,
               model_max_length=1048576, model_type="kimi_linear", architectures=["KimiLinearForCausalLM"])
    return out


# ---- files ---------------------------------------------------------------------------------------------
# In files transformers keeps the release's names: block_sparse_moe for a MoE, one tensor per expert (w1
# gate, w3 up, w2 down), the three short convs apart, the gate's parameters directly under self_attn, mlp for
# a dense block's SwiGLU; from_pretrained converts them. Each sublayer declares its tensors' names in that
# released layout (HF_NAMES, kimi/model/sublayer.py). save_pretrained writes them back through its MoE
# rename in reverse, which also catches the dense MLP: model.layers.0.block_sparse_moe.gate_proj, a name
# other loaders (vLLM, mlx-lm) do not read. RENAMES: each Kimi Linear layout's renames of the released names
# (the layouts themselves, by name, are kimi.interop.layouts).
RENAMES = {"release": (), "save_pretrained": ((".mlp.", ".block_sparse_moe."),)}
# One entry per file tensor: (its name, our tensor's name, index into our tensor's first dim or None, the
# file tensor's shape when it differs from ours: None keeps it).
FileEntry = Tuple[str, str, Optional[int], Optional[Tuple[int, ...]]]


def in_layout(name: str, layout: str) -> str:
    """A released tensor name as `layout` writes it."""
    for old, new in RENAMES[layout]:
        name = name.replace(old, new)
    return name


def file_map(m: ModelConfig, layout: str = "release") -> List[FileEntry]:
    """Every tensor of a Kimi Linear checkpoint file for model config `m`, named as `layout` names it, and
    its source."""
    # transformers' Kimi Linear never ties its head, so files hold lm_head.weight even when tied (our tied
    # lm_head.weight is the embedding)
    out: List[FileEntry] = [("model.embed_tokens.weight", "embed.weight", None, None),
                            ("model.norm.weight", "norm.weight", None, None),
                            ("lm_head.weight", "lm_head.weight", None, None)]
    with torch.device("meta"):  # the layers' declarations, from their shapes alone
        model = KimiModel(m)
    for i in range(m.num_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        out += [(hf + "input_layernorm.weight", ours + "mixer_norm.weight", None, None),
                (hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight", None, None)]
        for kind in ("mixer", "mlp"):
            out += hf_entries(getattr(model.blocks[str(i)], kind), hf, ours + kind)
    return [(in_layout(name, layout), *rest) for name, *rest in out]
