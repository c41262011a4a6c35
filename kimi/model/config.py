"""The model section (model.*): its schema, the size bounds that refuse a typo before anything is built,
the per-block helpers read from it (which mixer, which blocks are MoE) and the vocabulary size against the
tokenizer's.

Torch-free, like every section's config (kimi/schema/__init__.py): kimi/config.py assembles the root config
from it, and train.py refuses a misspelt key or an absurd size before importing torch. The section's other
rules are kimi/model/rules.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from kimi.errors import ConfigError
from kimi.schema.vocabulary import RootConfig, check, one_of, require

RESIDUAL_MODES = ("standard", "attnres_full", "attnres_block")
KDA_BACKENDS = ("auto", "torch", "triton", "fla")
ATTENTION_BACKENDS = ("auto", "triton", "sdpa")
ATTNRES_BACKENDS = ("torch", "compile", "triton", "fla", "auto")
MOE_IMPLS = ("grouped", "loop")
MOE_BALANCE = ("sign", "quantile")
MLP_ACTIVATIONS = ("swiglu", "situ")


@dataclass
class ModelConfig:
    name: str = "tiny"
    # None: take the tokenizer's vocabulary size (rounded up to `pad_vocab_multiple`).
    vocab_size: Optional[int] = None
    pad_vocab_multiple: int = 64
    d_model: int = 256
    num_layers: int = 4  # transformer blocks; each is a token mixer (KDA or MLA) and an MLP
    # Each block's token mixer as a letter of kimi/model/registry.py (K = KDA, M = MLA), e.g. "KKKM"; a
    # shorter pattern repeats (its length must divide num_layers). null: from mla_every / mla_layers.
    layer_pattern: Optional[str] = None
    # Every `mla_every`-th block (1-based) uses MLA, the rest KDA: 4 gives Kimi Linear's 3:1.
    # 0 means no MLA at all, 1 means MLA everywhere. `mla_layers` (0-based) overrides it.
    mla_every: int = 4
    mla_layers: Optional[List[int]] = None
    # KDA
    kda_num_heads: int = 4
    kda_head_dim: int = 64  # dk = dv; also the rank of the low-rank gate projections
    conv_size: int = 4
    kda_gate_bias: bool = True  # a bias on the output gate's up-projection (Kimi Linear's has none)
    # Kimi K3's KDA: the decay gate bounded below, g = L * sigmoid(exp(A_log) (f + dt_bias)) in (L, 0)
    # (null: Kimi Linear's -exp(A_log) softplus(f + dt_bias); K3: -5), and a full-rank output gate W_g x
    # [heads * head_dim, d_model] instead of the low-rank one
    kda_gate_lower_bound: Optional[float] = None
    kda_full_rank_gate: bool = False
    # KDA kernels: auto = Triton on CUDA, PyTorch on CPU; torch / triton force one (triton on CPU needs
    # TRITON_INTERPRET=1 and is slow: for tests); fla = fla-core's chunk_kda and fused_recurrent_kda (CUDA,
    # the optional fla-core package; a graph break under compile: fla marks them compiler-disabled).
    kda_backend: str = one_of(KDA_BACKENDS, "auto")
    # MLA
    mla_num_heads: int = 4
    q_lora_rank: int = 0  # 0: full-rank query projection (Kimi Linear)
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 0  # dims of the key part shared by all heads (with its query part); 0: none
    # Rotate that shared part by position (RoPE, DeepSeek's MLA), or not: Kimi Linear keeps 64 shared key dims
    # unrotated (NoPE everywhere)
    mla_rotary: bool = True
    mla_norm_eps: Optional[float] = None  # MLA latent / q-LoRA norms' eps; null: norm_eps (Kimi Linear: 1e-6)
    # Kimi K3's gated MLA: the heads' outputs times sigmoid(W_g x), per element, before the output projection
    # (x: the layer's normed input, W_g: [heads * v_head_dim, d_model])
    mla_output_gate: bool = False
    v_head_dim: int = 64
    rope_theta: float = 10000.0  # RoPE's base (MLA's rotated key dims, softmax attention)
    # Softmax attention kernels (MLA and A): auto = for CUDA fp16/bf16 tensors the faster of Triton flash
    # attention and SDPA, timed once per shape; SDPA otherwise; triton / sdpa force one (kimi/ops/attention).
    # SDPA measures QK-Clip's max logits in a second pass (a Triton Q K^T row-max kernel on CUDA), the Triton
    # kernel in the same pass.
    attention_backend: str = one_of(ATTENTION_BACKENDS, "auto")
    # The Triton backward's dQ: false = fp32 atomic adds in the dK/dV kernel (the last bits of dQ vary run to
    # run; about 2x faster forward+backward on an H200), true = its own kernel, bitwise reproducible
    attention_deterministic: bool = False
    # Softmax attention (letter A in model.layer_pattern: the dense peer's mixer, Llama's): query heads,
    # key/value heads (0: as many, plain multi-head; fewer: grouped-query) and head dim (0: d_model / heads)
    attn_num_heads: int = 4
    attn_kv_heads: int = 0
    attn_head_dim: int = 0
    # MLP
    mlp_hidden: int = 768  # SwiGLU inner width (of the dense blocks when moe_num_experts > 0)
    # The gated activation of every FFN (dense, shared and routed experts; kimi/model/activations.py): swiglu,
    # or situ (Kimi K3's SiTU-GLU: b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2) in fp32, b1 = situ_beta, b2 =
    # situ_linear_beta, null: the up branch uncapped)
    mlp_activation: str = one_of(MLP_ACTIVATIONS, "swiglu")
    situ_beta: float = 4.0
    situ_linear_beta: Optional[float] = 25.0
    # Mixture of experts (kimi/model/moe.py): 0 experts keeps every block dense. Otherwise blocks from
    # moe_first_dense on route each token to moe_top_k of moe_num_experts SwiGLU experts of width moe_hidden,
    # plus moe_shared_experts shared ones (one SwiGLU of moe_shared_experts * moe_hidden).
    moe_num_experts: int = 0
    moe_top_k: int = 2
    moe_hidden: int = 256
    moe_shared_experts: int = 1
    # Kimi K3's latent MoE: the router and shared experts see the full width, the routed experts work on
    # tokens down-projected to this width (what expert parallelism moves), their weighted sum RMSNorm-ed
    # (moe_latent_norm) and projected back up. 0: routed experts at d_model.
    moe_latent_dim: int = 0
    moe_latent_norm: bool = True
    moe_first_dense: int = 1  # leading blocks that keep the dense MLP (Kimi Linear: 1)
    moe_groups: int = 1  # expert groups; tokens choose among the experts of moe_topk_groups of them
    moe_topk_groups: int = 1
    moe_routed_scale: float = 1.0  # routed_scaling_factor, multiplies the routed output (Kimi Linear: 2.446)
    moe_norm_topk: bool = True  # renormalise the chosen experts' scores to sum to 1 (before the scale)
    moe_bias_rate: float = 1e-3  # aux-loss-free balancing: bias step per optimizer step (0 = no update)
    # How the router bias balances the experts after each step: sign (DeepSeek-V3: +-moe_bias_rate towards
    # the mean load) or quantile (Kimi K3's Quantile Balancing: each expert's bias set to the k/E quantile of
    # the step's required biases, from a histogram of moe_qb_bins bins summed over the ranks)
    moe_balance: str = one_of(MOE_BALANCE, "sign")
    moe_qb_bins: int = 1000
    moe_aux_loss_coef: float = 0.0  # weight of the sequence-wise balance loss (DeepSeek-V3: 1e-4; 0 = none)
    moe_impl: str = one_of(MOE_IMPLS, "grouped")  # grouped GEMM, or the per-expert loop (the reference)
    tie_embeddings: bool = False
    # Residuals: standard pre-norm, or Attention Residuals over every layer / over blocks of layers.
    residual: str = one_of(RESIDUAL_MODES, "attnres_block")
    attnres_block_size: int = 4  # sublayers per AttnRes block (attnres_block only)
    # A learnable weight on each depth mix's key norm (Kimi K3's AttnRes): logits w . (gamma * RMSNorm(v)).
    # The same functions as gamma * w folded into the query, but the product trains differently; off: none.
    attnres_key_weight: bool = False
    # The depth mixes' kernels (kimi.model.attnres.depth_mix): torch = PyTorch, eager, compiled under
    # parallel.compile=true; compile = compiled always; triton = one fused Triton kernel per mix and way,
    # the pre-norm folded in (CUDA; on CPU only interpreted, TRITON_INTERPRET=1: tests); fla = fla-core's
    # fused AttnRes (CUDA); auto = triton on CUDA, torch elsewhere. The same numbers up to fp32 rounding.
    attnres_backend: str = one_of(ATTNRES_BACKENDS, "torch")
    # Multi-token prediction (DeepSeek-V3; Kimi K3 pretrains with 1): this many extra depths, depth k
    # predicting token t+k+1 (kimi/model/mtp.py), their mean loss added with this weight (DeepSeek-V3's 0.3)
    # in training
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # The training loss from the final hidden states, this many tokens at a time (kimi/ops/linear_ce.py), so
    # the sequence's logits never exist whole: 0 takes as many as loss_chunk_mib holds, -1 the plain way
    # (every logit, then the cross-entropy). Vocabulary-parallel heads (tensor parallelism) and pipeline
    # schedules always take the plain way.
    loss_chunk: int = 0
    # MiB of fp32 logits one loss chunk may hold when loss_chunk is 0: the chunk is the largest power of two
    # of tokens within it (kimi.ops.linear_ce.chunk_tokens; 64: 512 tokens at a 32k vocabulary). Its peak,
    # about 1.5 times this, does not grow with the sequence; a smaller budget makes more passes over the
    # head's fp32 weight gradient (one per chunk).
    loss_chunk_mib: int = 64


# ---- sizes -------------------------------------------------------------------------------------------------
# Upper bounds of the model's sizes, far past any real model, so that a typo (d_model=1048576, a million
# layers) is one line instead of an allocator's traceback or minutes of building: key -> (bound, what the
# largest released model, Kimi K3 (conf/model/kimi_k3.yaml), or the widest preset has); each leaves 8x or
# more. Here, not with the model's other rules (kimi/model/rules.py, whose validate_model runs them first),
# because this module does not import torch: train.py refuses such a typo before the seconds of importing it.
SIZE_BOUNDS = {
    "d_model": (65536, "Kimi K3 has 7168"),
    "num_layers": (1024, "Kimi K3 has 93"),
    "vocab_size": (2**21, "Kimi K3 has 163840"),
    "kda_num_heads": (1024, "Kimi K3 has 96"),
    "mla_num_heads": (1024, "Kimi K3 has 96"),
    "attn_num_heads": (1024, "Kimi K3's attention has 96"),
    "attn_kv_heads": (1024, "Kimi K3's attention has 96"),
    "kda_head_dim": (1024, "Kimi K3 has 128"),
    "qk_nope_head_dim": (1024, "Kimi K3 has 128"),
    "qk_rope_head_dim": (1024, "Kimi K3 has 64"),
    "v_head_dim": (1024, "Kimi K3 has 128"),
    "attn_head_dim": (1024, "Kimi K3's attention has 128"),
    "q_lora_rank": (65536, "Kimi K3 has 1536"),
    "kv_lora_rank": (65536, "Kimi K3 has 512"),
    "moe_latent_dim": (65536, "Kimi K3 has 3584"),
    "mlp_hidden": (2**21, "Kimi K3 has 33792, the dense 48b_dense preset 247808"),
    "moe_hidden": (2**21, "Kimi K3 has 3072"),
    "moe_num_experts": (8192, "Kimi K3 has 896"),
    "moe_shared_experts": (8192, "Kimi K3 has 2"),
    "mtp_layers": (64, "Kimi K3 has 1"),
    "pad_vocab_multiple": (2**21, "64 is usual; Kimi K3's whole vocabulary is 163840"),
}


def check_sizes(m: Any) -> None:
    """Every size of model section `m` (a ModelConfig, or its DictConfig) at most its bound (SIZE_BOUNDS)."""
    for key, (bound, largest) in SIZE_BOUNDS.items():
        value = getattr(m, key)
        check(value is None or value <= bound, f"model.{key}", value,
              f"must be <= {bound}, far past any real model ({largest}): is it a typo?")


def moe_layer_indices(m: ModelConfig) -> List[int]:
    """0-based indices of the blocks whose MLP is a mixture of experts."""
    return list(range(m.moe_first_dense, m.num_layers)) if m.moe_num_experts else []


def mixer_pattern(m: ModelConfig) -> str:
    """One letter per block naming its token mixer (kimi/model/registry.py): model.layer_pattern repeated to
    model.num_layers, or K (KDA) and M (MLA) from model.mla_layers / model.mla_every."""
    if m.layer_pattern:
        return m.layer_pattern * max(1, m.num_layers // len(m.layer_pattern))
    if m.mla_layers is not None:
        mla = {int(i) for i in m.mla_layers}
    else:
        mla = {i for i in range(m.num_layers) if m.mla_every > 0 and (i + 1) % m.mla_every == 0}
    return "".join("M" if i in mla else "K" for i in range(m.num_layers))


def mla_layer_indices(m: ModelConfig) -> List[int]:
    """0-based indices of the blocks whose token mixer is MLA."""
    return [i for i, letter in enumerate(mixer_pattern(m)) if letter == "M"]


# ---- the vocabulary against the tokenizer ------------------------------------------------------------------
def check_vocab(cfg: RootConfig) -> None:
    """A set model.vocab_size must hold the tokenizer's ids; a trained tokenizer has exactly
    data.tokenizer.vocab_size (a given data.tokenizer.model_path is only known after loading it)."""
    m, tok = cfg.model, cfg.data.tokenizer
    if m.vocab_size is not None and tok.model_path is None:
        require(m.vocab_size >= tok.vocab_size,
                f"model.vocab_size={m.vocab_size} is invalid: the tokenizer trained with "
                f"data.tokenizer.vocab_size={tok.vocab_size} has that many tokens; set model.vocab_size >= "
                f"{tok.vocab_size}, or null to follow the tokenizer")


def resolve_vocab(m: ModelConfig, tokenizer_vocab: int) -> None:
    """Set model.vocab_size from the tokenizer when it is null (padded to model.pad_vocab_multiple); refuse
    one too small for the tokenizer."""
    if m.vocab_size is None:
        mult = m.pad_vocab_multiple
        m.vocab_size = (tokenizer_vocab + mult - 1) // mult * mult
    elif m.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is invalid: the tokenizer has {tokenizer_vocab} "
                          "tokens; set model.vocab_size >= that, or null to follow the tokenizer")
