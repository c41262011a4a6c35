"""The model section's rules: the values a model needs to build, the layer pattern's letters, what tensor
parallelism splits (each sublayer declares it: TP_DIVIDES) and the KDA kernels' limits. kimi.run.validation
runs them in the one validation pass; kimi.summary too."""

from __future__ import annotations

import importlib.util
import os

import torch

from kimi.model.config import ModelConfig, check_sizes, mixer_pattern
from kimi.ops.kda.chunk import TRITON_MAX_HEAD_DIM
from kimi.schema.vocabulary import RootConfig as Config
from kimi.schema.vocabulary import check, check_choices, check_finite, check_positive, require, value_at

from .registry import mixer_classes, mlp_class, mlp_kinds


def validate_model(m: ModelConfig) -> None:
    """The model section's own rules (all a model needs to build, also outside the trainer)."""
    check_sizes(m)
    check_choices(m, "model")
    check_finite(m, "model")
    check_positive(m, "model", ("d_model", "num_layers", "kda.num_heads", "kda.head_dim", "mla.num_heads",
                                 "mla.kv_lora_rank", "mla.qk_nope_head_dim", "mla.v_head_dim", "mlp.hidden",
                                 "attnres.block_size", "pad_vocab_multiple"))
    check(m.conv_size >= 1, "model.conv_size", m.conv_size, "must be >= 1 (4 in Kimi Linear)")
    check(m.moe.latent_dim >= 0, "model.moe.latent_dim", m.moe.latent_dim,
          "must be >= 0 (0: routed experts at d_model; Kimi K3: half of it)")
    if "A" in mixer_pattern(m):
        check(m.mha.num_heads >= 1, "model.mha.num_heads", m.mha.num_heads, "must be >= 1")
        kv = m.mha.kv_heads or m.mha.num_heads
        check(m.mha.num_heads % kv == 0, "model.mha.kv_heads", m.mha.kv_heads,
              f"must divide model.mha.num_heads={m.mha.num_heads} (each key/value head serves a group)")
        check(m.mha.head_dim > 0 or m.d_model % m.mha.num_heads == 0, "model.mha.head_dim",
              m.mha.head_dim, f"0 takes d_model / model.mha.num_heads, but {m.d_model} does not divide by "
              f"{m.mha.num_heads}: set it")
    check(m.mtp.layers >= 0, "model.mtp.layers", m.mtp.layers,
          "must be >= 0 (0: no multi-token prediction; K3: 1)")
    check(m.mtp.loss_weight >= 0, "model.mtp.loss_weight", m.mtp.loss_weight,
          "must be >= 0 (DeepSeek-V3: 0.3)")
    check(m.kda.gate_lower_bound is None or m.kda.gate_lower_bound < 0, "model.kda.gate_lower_bound",
          m.kda.gate_lower_bound, "must be negative (Kimi K3: -5), or null for Kimi Linear's unbounded gate")
    check(m.loss_chunk >= -1, "model.loss_chunk", m.loss_chunk,
          "must be -1 (plain loss), 0 (chunk sized by model.loss_chunk_mib) or a number of tokens per chunk")
    check(m.loss_chunk_mib >= 1, "model.loss_chunk_mib", m.loss_chunk_mib,
          "must be >= 1 (MiB of fp32 logits per loss chunk; 64 holds 512 tokens at a 32k vocabulary)")
    check(m.mla.q_lora_rank >= 0, "model.mla.q_lora_rank", m.mla.q_lora_rank,
          "must be >= 0 (0 = no query compression)")
    check(m.mla.qk_rope_head_dim >= 0 and m.mla.qk_rope_head_dim % 2 == 0, "model.mla.qk_rope_head_dim",
          m.mla.qk_rope_head_dim, "must be an even number >= 0 (0 = NoPE)")
    check(m.mla_every >= 0, "model.mla_every", m.mla_every, "must be >= 0 (0 = no MLA, 4 = 3:1 KDA:MLA)")
    if m.layer_pattern is not None:
        pattern = m.layer_pattern
        check(pattern.isalpha() and pattern.isupper(), "model.layer_pattern", pattern,
              "give one capital letter per block, e.g. KKKM (K = KDA, M = MLA)")
        check(m.num_layers % len(pattern) == 0, "model.layer_pattern", pattern,
              f"its length {len(pattern)} must divide model.num_layers={m.num_layers} (a shorter pattern "
              "repeats)")
        check(m.mla_layers is None, "model.mla_layers", m.mla_layers,
              "set either model.layer_pattern or model.mla_layers, not both: set model.mla_layers=null")
    if m.mla_layers is not None:
        layers = [int(i) for i in m.mla_layers]
        bad = [i for i in layers if not 0 <= i < m.num_layers]
        check(not bad, "model.mla_layers", layers,
              f"indices must be 0-based block indices in [0, {m.num_layers - 1}] (bad: {bad})")
        repeated = sorted({i for i in layers if layers.count(i) > 1})
        check(not repeated, "model.mla_layers", layers,
              f"give each block index at most once (repeated: {repeated})")
    if m.vocab_size is not None:
        check(m.vocab_size > 0, "model.vocab_size", m.vocab_size,
              "must be positive, or null to use the tokenizer's")
    # a large std saturates the gates and softmaxes at step 0 and leaves (almost) no gradient to train on
    check(0 < m.init_std <= 1, "model.init_std", m.init_std, "must be in (0, 1] (0.02 is usual)")
    check(0 < m.norm_eps < 1, "model.norm_eps", m.norm_eps, "must be in (0, 1) (1e-5 or 1e-6 is usual)")
    if m.mla.norm_eps is not None:
        check(0 < m.mla.norm_eps < 1, "model.mla.norm_eps", m.mla.norm_eps,
               "must be in (0, 1), or null to use model.norm_eps")
    # RoPE turns pair i by theta**(-2i/d) radians a token: with theta <= 1 no pair turns slower than one
    # radian a token, so distant positions look alike
    check(m.rope_theta > 1, "model.rope_theta", m.rope_theta, "must be > 1 (10000 is usual)")
    if m.moe.num_experts:
        _validate_moe(m)
    mixer_classes(m)  # every letter of the pattern names a registered token mixer


def _validate_moe(m: ModelConfig) -> None:
    E = m.moe.num_experts
    check(E >= 2, "model.moe.num_experts", E, "must be 0 (dense) or >= 2")
    check_positive(m, "model", ("moe.top_k", "moe.hidden", "moe.groups", "moe.topk_groups"))
    check(m.moe.shared_experts >= 0, "model.moe.shared_experts", m.moe.shared_experts, "must be >= 0")
    check(0 <= m.moe.first_dense <= m.num_layers, "model.moe.first_dense", m.moe.first_dense,
          f"must be in [0, model.num_layers = {m.num_layers}]")
    check(E % m.moe.groups == 0 and E // m.moe.groups >= 2, "model.moe.groups", m.moe.groups,
          f"must divide model.moe.num_experts = {E} into groups of at least 2 experts (a group's score is "
          "the sum of its two best experts')")
    check(m.moe.topk_groups <= m.moe.groups, "model.moe.topk_groups", m.moe.topk_groups,
          f"must be <= model.moe.groups = {m.moe.groups}")
    reachable = m.moe.topk_groups * (E // m.moe.groups)
    check(m.moe.top_k <= reachable, "model.moe.top_k", m.moe.top_k,
          f"must be <= the experts of the chosen groups ({m.moe.topk_groups} x {E // m.moe.groups} = "
          f"{reachable})")
    check(m.moe.routed_scale > 0, "model.moe.routed_scale", m.moe.routed_scale, "must be > 0 (1 = none)")
    check(m.moe.bias_rate >= 0, "model.moe.bias_rate", m.moe.bias_rate,
          "must be >= 0 (0 = no bias update; DeepSeek-V3 used 1e-3)")
    check(m.moe.aux_loss_coef >= 0, "model.moe.aux_loss_coef", m.moe.aux_loss_coef,
          "must be >= 0 (0 = no auxiliary loss; DeepSeek-V3 used 1e-4)")
    if m.moe.balance == "quantile":
        check(m.moe.groups == 1, "model.moe.groups", m.moe.groups,
              "must be 1 with model.moe.balance=quantile: its cutoff is each token's (k+1)-th best expert "
              "of all")
        check(m.moe.top_k < E, "model.moe.top_k", m.moe.top_k,
              f"must be < model.moe.num_experts = {E} with model.moe.balance=quantile (it reads the "
              "(k+1)-th)")
        check(m.moe.qb_bins >= 2, "model.moe.qb_bins", m.moe.qb_bins, "must be >= 2 (Kimi K3: 1000)")


def check_tensor_parallel(m: ModelConfig, tp: int) -> None:
    """What tensor parallelism splits must divide by parallel.tp: each sublayer's declared sizes (its heads
    or width, TP_DIVIDES) and the vocabulary (the embedding's rows, the LM head's outputs)."""
    if tp == 1:
        return
    classes = [*mixer_classes(m), *(mlp_class(kind) for kind in mlp_kinds(m))]
    keys = list(dict.fromkeys(key for cls in classes for key in cls.TP_DIVIDES))
    for key in keys + (["vocab_size"] if m.vocab_size is not None else []):
        value = value_at(m, key)
        require(value % tp == 0,
                f"model.{key}={value} is not divisible by parallel.tp={tp}: tensor parallelism splits it "
                "over the tp ranks; choose a parallel.tp that divides it")
    if m.vocab_size is None:  # the tokenizer's vocabulary, padded up to a multiple of pad_vocab_multiple
        mult = m.pad_vocab_multiple
        require(mult % tp == 0,
                f"model.pad_vocab_multiple={mult} is not divisible by parallel.tp={tp}: with "
                "model.vocab_size=null the vocabulary is padded to a multiple of it and tensor parallelism "
                f"splits it over the tp ranks; make it a multiple of {tp} (or set model.vocab_size)")


def check_kernels(cfg: Config) -> None:
    """The Triton KDA kernels (model.kda.backend=triton, or auto on CUDA) take key head dims up to a limit;
    fla-core's (model.kda.backend=fla) need CUDA and the package. So do the fused depth mixes
    (model.attnres.backend triton, fla; the Triton one also runs interpreted, for tests)."""
    m, limit = cfg.model, TRITON_MAX_HEAD_DIM
    check_attnres_kernels(cfg)
    if m.kda.backend == "fla":
        cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
        require(cuda, f"model.kda.backend=fla is invalid with trainer.device={cfg.trainer.device} on this "
                      "machine: fla-core's KDA kernels run on CUDA only; set model.kda.backend=auto")
        require(importlib.util.find_spec("fla") is not None,
                "model.kda.backend=fla needs the fla-core package, which is not installed: pip install "
                "fla-core, or set model.kda.backend=auto")
    on = {"triton": "model.kda.backend=triton", "auto": "model.kda.backend=auto and trainer.device=cuda"}
    if m.kda.backend == "triton" or (m.kda.backend == "auto" and cfg.trainer.device == "cuda"):
        require(m.kda.head_dim <= limit,
                f"model.kda.head_dim={m.kda.head_dim} is invalid with {on[m.kda.backend]}: the Triton KDA "
                f"kernels take head dims up to {limit}; lower model.kda.head_dim or set "
                "model.kda.backend=torch")


def check_attnres_kernels(cfg: Config) -> None:
    backend, device = cfg.model.attnres.backend, cfg.trainer.device
    if backend not in ("triton", "fla"):
        return
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    interpreted = backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    tests = " (on CPU interpreted, with TRITON_INTERPRET=1, for tests)" if backend == "triton" else ""
    require(cuda or interpreted,
            f"model.attnres.backend={backend} is invalid with trainer.device={device} on this machine: the "
            f"fused depth-mix kernel runs on CUDA only{tests}; set model.attnres.backend=auto")
    if backend == "fla":
        from kimi.ops.attnres.fla import missing

        reason = missing()
        require(reason is None, f"model.attnres.backend=fla needs fla-core's fused AttnRes, but {reason}: "
                "install a fla-core that has it, or set model.attnres.backend=auto")


def check_mtp(cfg: Config) -> None:
    """Multi-token prediction runs on one process and under FSDP/HSDP data parallelism; what it does not
    support yet is named (each would need the shifted labels or its block handled across ranks)."""
    if not cfg.model.mtp.layers:
        return
    p = cfg.parallel
    unsupported = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(p, k) > 1]
    unsupported += [f"parallel.engine={p.engine}"] if p.engine != "torch" else []
    require(not unsupported, f"model.mtp.layers={cfg.model.mtp.layers} does not run with "
            f"{', '.join(unsupported)} yet: train multi-token prediction with data parallelism "
            "(parallel.dp_shard / dp_replicate) alone, or set model.mtp.layers=0")
