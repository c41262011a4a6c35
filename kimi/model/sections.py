"""The model section's per-component sections (model.kda.*, model.mla.*, model.moe.*, ...): each sublayer's
own knobs, declared beside the shared ones of kimi/model/config.py and named for the module that reads them
(kimi/model/kda.py, mla.py, mha.py, mlp.py, moe.py, attnres.py, mtp.py; model.attention: the softmax
kernels of kimi/ops/attention that MLA and MHA share).

Torch-free, like every section's config: train.py refuses a misspelt key before importing torch.

Until this layout, each of these keys was a flat key of the model section (model.kda_num_heads). ALIASES maps
every such old key to its new place; kimi/model/config.py keeps the old keys as alias fields so that old
configs, presets and run directories still load (docs/configuration.md, "Renamed keys").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from kimi.schema.vocabulary import one_of

KDA_BACKENDS = ("auto", "torch", "triton", "fla")
ATTENTION_BACKENDS = ("auto", "triton", "sdpa")
ATTNRES_BACKENDS = ("torch", "compile", "triton", "fla", "auto")
MOE_IMPLS = ("grouped", "loop")
MOE_BALANCE = ("sign", "quantile")
MLP_ACTIVATIONS = ("swiglu", "situ")


@dataclass
class KdaConfig:
    """Kimi Delta Attention (letter K of model.layer_pattern; kimi/model/kda.py)."""

    num_heads: int = 4
    head_dim: int = 64  # dk = dv; also the rank of the low-rank gate projections
    gate_bias: bool = True  # a bias on the output gate's up-projection (Kimi Linear's has none)
    # Kimi K3's KDA: the decay gate bounded below, g = L * sigmoid(exp(A_log) (f + dt_bias)) in (L, 0)
    # (null: Kimi Linear's -exp(A_log) softplus(f + dt_bias); K3: -5), and a full-rank output gate W_g x
    # [heads * head_dim, d_model] instead of the low-rank one
    gate_lower_bound: Optional[float] = None
    full_rank_gate: bool = False
    # The kernels: auto = Triton on CUDA, PyTorch on CPU; torch / triton force one (triton on CPU needs
    # TRITON_INTERPRET=1 and is slow: for tests); fla = fla-core's chunk_kda and fused_recurrent_kda (CUDA,
    # the optional fla-core package; a graph break under compile: fla marks them compiler-disabled).
    backend: str = one_of(KDA_BACKENDS, "auto")


@dataclass
class MlaConfig:
    """Multi-head latent attention (letter M; kimi/model/mla.py)."""

    num_heads: int = 4
    q_lora_rank: int = 0  # 0: full-rank query projection (Kimi Linear)
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 0  # dims of the key part shared by all heads (with its query part); 0: none
    # Rotate that shared part by position (RoPE, DeepSeek's MLA), or not: Kimi Linear keeps 64 shared key dims
    # unrotated (NoPE everywhere)
    rotary: bool = True
    norm_eps: Optional[float] = None  # latent / q-LoRA norms' eps; null: model.norm_eps (Kimi Linear: 1e-6)
    # Kimi K3's gated MLA: the heads' outputs times sigmoid(W_g x), per element, before the output projection
    # (x: the layer's normed input, W_g: [heads * v_head_dim, d_model])
    output_gate: bool = False
    v_head_dim: int = 64


@dataclass
class MhaConfig:
    """Softmax attention (letter A: the dense peer's mixer, Llama's; kimi/model/mha.py)."""

    num_heads: int = 4  # query heads
    kv_heads: int = 0  # key/value heads: 0 as many (plain multi-head), fewer: grouped-query
    head_dim: int = 0  # 0: d_model / num_heads


@dataclass
class AttentionConfig:
    """The softmax attention kernels of MLA and MHA (kimi/ops/attention)."""

    # auto = for CUDA fp16/bf16 tensors the faster of Triton flash attention and SDPA, timed once per shape;
    # SDPA otherwise; triton / sdpa force one. SDPA measures QK-Clip's max logits in a second pass (a Triton
    # Q K^T row-max kernel on CUDA), the Triton kernel in the same pass.
    backend: str = one_of(ATTENTION_BACKENDS, "auto")
    # The Triton backward's dQ: false = fp32 atomic adds in the dK/dV kernel (the last bits of dQ vary run to
    # run; about 2x faster forward+backward on an H200), true = its own kernel, bitwise reproducible
    deterministic: bool = False


@dataclass
class MlpConfig:
    """The dense feed-forward blocks (kimi/model/mlp.py) and the gated activation of every FFN
    (kimi/model/activations.py: dense, shared and routed experts)."""

    hidden: int = 768  # the inner width (of the dense blocks when model.moe.num_experts > 0)
    # swiglu, or situ (Kimi K3's SiTU-GLU: b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2) in fp32, b1 = situ_beta,
    # b2 = situ_linear_beta, null: the up branch uncapped)
    activation: str = one_of(MLP_ACTIVATIONS, "swiglu")
    situ_beta: float = 4.0
    situ_linear_beta: Optional[float] = 25.0


@dataclass
class MoeConfig:
    """Mixture of experts (kimi/model/moe.py): 0 experts keeps every block dense. Otherwise blocks from
    first_dense on route each token to top_k of num_experts experts of width hidden, plus shared_experts
    shared ones (one MLP of shared_experts * hidden)."""

    num_experts: int = 0
    top_k: int = 2
    hidden: int = 256
    shared_experts: int = 1
    # Kimi K3's latent MoE: the router and shared experts see the full width, the routed experts work on
    # tokens down-projected to this width (what expert parallelism moves), their weighted sum RMSNorm-ed
    # (latent_norm) and projected back up. 0: routed experts at d_model.
    latent_dim: int = 0
    latent_norm: bool = True
    first_dense: int = 1  # leading blocks that keep the dense MLP (Kimi Linear: 1)
    groups: int = 1  # expert groups; tokens choose among the experts of topk_groups of them
    topk_groups: int = 1
    routed_scale: float = 1.0  # routed_scaling_factor, multiplies the routed output (Kimi Linear: 2.446)
    norm_topk: bool = True  # renormalise the chosen experts' scores to sum to 1 (before the scale)
    bias_rate: float = 1e-3  # aux-loss-free balancing: bias step per optimizer step (0 = no update)
    # How the router bias balances the experts after each step: sign (DeepSeek-V3: +-bias_rate towards the
    # mean load) or quantile (Kimi K3's Quantile Balancing: each expert's bias set to the k/E quantile of the
    # step's required biases, from a histogram of qb_bins bins summed over the ranks)
    balance: str = one_of(MOE_BALANCE, "sign")
    qb_bins: int = 1000
    aux_loss_coef: float = 0.0  # weight of the sequence-wise balance loss (DeepSeek-V3: 1e-4; 0 = none)
    impl: str = one_of(MOE_IMPLS, "grouped")  # grouped GEMM, or the per-expert loop (the reference)


@dataclass
class AttnResConfig:
    """Attention Residuals (model.residual attnres_full or attnres_block; kimi/model/attnres.py)."""

    block_size: int = 4  # sublayers per AttnRes block (attnres_block only)
    # A learnable weight on each depth mix's key norm (Kimi K3's AttnRes): logits w . (gamma * RMSNorm(v)).
    # The same functions as gamma * w folded into the query, but the product trains differently; off: none.
    key_weight: bool = False
    # The depth mixes' kernels (kimi.model.attnres.depth_mix): torch = PyTorch, eager, compiled under
    # parallel.compile=true; compile = compiled always; triton = one fused Triton kernel per mix and way,
    # the pre-norm folded in (CUDA; on CPU only interpreted, TRITON_INTERPRET=1: tests); fla = fla-core's
    # fused AttnRes (CUDA); auto = triton on CUDA, torch elsewhere. The same numbers up to fp32 rounding.
    backend: str = one_of(ATTNRES_BACKENDS, "torch")


@dataclass
class MtpConfig:
    """Multi-token prediction (DeepSeek-V3; Kimi K3 pretrains with 1; kimi/model/mtp.py)."""

    # This many extra depths, depth k predicting token t+k+1, their mean loss added with loss_weight
    # (DeepSeek-V3's 0.3) in training
    layers: int = 0
    loss_weight: float = 0.3


# The flat keys these sections replaced (model.<old>) -> their place (model.<section>.<name>)
ALIASES: Dict[str, str] = {
    "kda_num_heads": "kda.num_heads", "kda_head_dim": "kda.head_dim", "kda_gate_bias": "kda.gate_bias",
    "kda_gate_lower_bound": "kda.gate_lower_bound", "kda_full_rank_gate": "kda.full_rank_gate",
    "kda_backend": "kda.backend",
    "mla_num_heads": "mla.num_heads", "q_lora_rank": "mla.q_lora_rank", "kv_lora_rank": "mla.kv_lora_rank",
    "qk_nope_head_dim": "mla.qk_nope_head_dim", "qk_rope_head_dim": "mla.qk_rope_head_dim",
    "mla_rotary": "mla.rotary", "mla_norm_eps": "mla.norm_eps", "mla_output_gate": "mla.output_gate",
    "v_head_dim": "mla.v_head_dim",
    "attn_num_heads": "mha.num_heads", "attn_kv_heads": "mha.kv_heads", "attn_head_dim": "mha.head_dim",
    "attention_backend": "attention.backend", "attention_deterministic": "attention.deterministic",
    "mlp_hidden": "mlp.hidden", "mlp_activation": "mlp.activation", "situ_beta": "mlp.situ_beta",
    "situ_linear_beta": "mlp.situ_linear_beta",
    "moe_num_experts": "moe.num_experts", "moe_top_k": "moe.top_k", "moe_hidden": "moe.hidden",
    "moe_shared_experts": "moe.shared_experts", "moe_latent_dim": "moe.latent_dim",
    "moe_latent_norm": "moe.latent_norm", "moe_first_dense": "moe.first_dense", "moe_groups": "moe.groups",
    "moe_topk_groups": "moe.topk_groups", "moe_routed_scale": "moe.routed_scale",
    "moe_norm_topk": "moe.norm_topk", "moe_bias_rate": "moe.bias_rate", "moe_balance": "moe.balance",
    "moe_qb_bins": "moe.qb_bins", "moe_aux_loss_coef": "moe.aux_loss_coef", "moe_impl": "moe.impl",
    "attnres_block_size": "attnres.block_size", "attnres_key_weight": "attnres.key_weight",
    "attnres_backend": "attnres.backend",
    "mtp_layers": "mtp.layers", "mtp_loss_weight": "mtp.loss_weight",
}
