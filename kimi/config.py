"""Structured configuration: dataclasses registered in Hydra's ConfigStore.

The root schema is stored as ``base_config``; ``conf/config.yaml`` lists it first in its defaults, so every
YAML preset and command-line override is merged into typed nodes and a misspelt key fails with Hydra's
"Key 'x' not in 'TrainerConfig'" before any work. Values that type-check but cannot work (a block size of
zero, an MLA layer index past the last layer) are caught by :func:`validate`, which names the key and what
is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


RESIDUAL_MODES = ("standard", "attnres_full", "attnres_block")
SCHEDULES = ("cosine", "wsd", "constant")
PRECISIONS = ("fp32", "bf16")
WANDB_MODES = ("offline", "online", "disabled")
DATA_SOURCES = ("shakespeare", "hf", "files")
OPTIMIZERS = ("adamw", "muonclip")
NS_DTYPES = ("fp32", "bf16")
ADJUST_LR_FNS = ("match_rms_adamw", "original")
KDA_BACKENDS = ("auto", "torch", "triton")


@dataclass
class ModelConfig:
    name: str = "tiny"
    # None: take the tokenizer's vocabulary size (rounded up to `pad_vocab_multiple`).
    vocab_size: Optional[int] = None
    pad_vocab_multiple: int = 64
    d_model: int = 256
    num_layers: int = 4  # transformer blocks; each is a token mixer (KDA or MLA) and an MLP
    # Every `mla_every`-th block (1-based) uses MLA, the rest KDA: 4 gives Kimi Linear's 3:1.
    # 0 means no MLA at all, 1 means MLA everywhere. `mla_layers` (0-based) overrides it.
    mla_every: int = 4
    mla_layers: Optional[List[int]] = None
    # KDA
    kda_num_heads: int = 4
    kda_head_dim: int = 64  # dk = dv; also the rank of the low-rank gate projections
    conv_size: int = 4
    # KDA kernels: auto = Triton on CUDA, PyTorch on CPU; torch / triton force one (triton on CPU needs
    # TRITON_INTERPRET=1 and is slow: for tests).
    kda_backend: str = "auto"
    # MLA
    mla_num_heads: int = 4
    q_lora_rank: int = 0  # 0: full-rank query projection (Kimi Linear)
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 0  # 0: NoPE (Kimi Linear default)
    v_head_dim: int = 64
    rope_theta: float = 10000.0
    # MLP
    mlp_hidden: int = 768  # SwiGLU inner width
    tie_embeddings: bool = False
    # Residuals: standard pre-norm, or Attention Residuals over every layer / over blocks of layers.
    residual: str = "attnres_block"
    attnres_block_size: int = 4  # sublayers per AttnRes block (attnres_block only)
    norm_eps: float = 1e-5
    init_std: float = 0.02


@dataclass
class TokenizerConfig:
    # Path to an existing sentencepiece .model; None trains a BPE on the training split.
    model_path: Optional[str] = None
    vocab_size: int = 2048
    # Characters of training text fed to the sentencepiece trainer (enough for a good BPE, fast).
    train_chars: int = 20_000_000


@dataclass
class DataConfig:
    name: str = "shakespeare"
    source: str = "shakespeare"  # shakespeare | hf (a hub dataset name) | files (local text/json/parquet)
    path: Optional[str] = None  # hub dataset name for source=hf
    data_files: Optional[List[str]] = None  # local files (or globs) for source=files
    format: Optional[str] = None  # text | json | parquet; None infers from the file extension
    text_field: str = "text"
    train_split: str = "train"
    val_split: Optional[str] = None  # None: hold out `val_fraction` of the documents
    val_fraction: float = 0.05
    cache_dir: Optional[str] = None  # None: $KIMI_CACHE_DIR or ~/.cache/kimi
    num_proc: int = 1  # processes for datasets.map during tokenisation
    varlen: bool = False  # feed document boundaries (cu_seqlens) to the model
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


@dataclass
class OptimConfig:
    name: str = "muonclip"  # muonclip | adamw
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    schedule: str = "cosine"  # cosine | wsd | constant (all after linear warmup)
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine and wsd)
    decay_fraction: float = 0.2  # wsd: fraction of max_steps spent decaying
    # MuonClip only (kimi/optim/muonclip.py); lr, weight_decay, betas and eps above serve its AdamW family.
    momentum: float = 0.95  # Muon momentum
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_dtype: str = "fp32"  # fp32 | bf16: dtype of the Newton-Schulz matmuls (bf16 on GPU)
    # Muon's lr scale: match_rms_adamw (0.2 sqrt(max(A,B))) | original (sqrt(max(1,A/B)))
    adjust_lr_fn: str = "match_rms_adamw"
    # fnmatch patterns over parameter names that force a family; null keeps the default (embed, lm_head)
    adamw_patterns: Optional[List[str]] = None
    muon_patterns: List[str] = field(default_factory=list)
    # QK-Clip threshold on each MLA head's max scaled logit (K2: 100); 0 disables QK-Clip
    qk_clip_tau: float = 100.0


@dataclass
class TrainerConfig:
    seed: int = 1234
    max_steps: int = 600
    micro_batch_size: int = 16
    seq_len: int = 128
    grad_accum_steps: int = 1
    precision: str = "fp32"  # fp32 | bf16 (autocast; weights and optimizer stay fp32)
    device: str = "auto"  # auto | cpu | cuda
    eval_every: int = 100  # 0 disables periodic validation (a final one still runs)
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 200  # 0: only the final checkpoint
    keep_checkpoints: int = 2  # complete checkpoints kept on disk (oldest removed first)
    run_dir: str = "runs/default"  # set to Hydra's output dir by conf/config.yaml
    resume: bool = True  # pick up the latest complete checkpoint in run_dir/checkpoints
    # Stop (with a checkpoint) after this step although the schedule runs to max_steps: for jobs sliced by
    # a time limit, resumed by rerunning the same command. 0: off.
    stop_at_step: int = 0
    peak_flops: Optional[float] = None  # per-device FLOP/s for MFU; None: table (CUDA) or measured (CPU)
    sample_tokens: int = 200  # tokens sampled at the end of training (0: none)
    sample_prompt: str = "ROMEO:"
    threads: int = 0  # torch intra-op threads on CPU; 0 leaves torch's default


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "kimi"
    entity: Optional[str] = None
    name: Optional[str] = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    metrics_file: str = "metrics.jsonl"
    plot: bool = True  # write loss_curve.png in the run dir at the end


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    activation_checkpointing: str = "none"  # none | full | selective (see kimi/parallel/checkpointing.py)
    compile: bool = False  # torch.compile each token mixer and MLP
    reshard_after_forward: bool = True  # FSDP2: False keeps weights gathered until the backward (ZeRO-2-like)
    sequence_parallel: bool = False  # with tp > 1: activations between sublayers split along the sequence
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    pp_virtual_stages: int = 2  # stages per rank for interleaved_1f1b and zero_bubble
    pp_microbatches: int = 0  # micro-batches per step through the pipeline; 0: as many as stages
    pp_split: Optional[List[int]] = None  # first block of stages 1..pp-1; null: balanced by FLOPs


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and what is allowed."""


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def mla_layer_indices(m: ModelConfig) -> List[int]:
    """0-based indices of the blocks whose token mixer is MLA."""
    if m.mla_layers is not None:
        return sorted(int(i) for i in m.mla_layers)
    if m.mla_every <= 0:
        return []
    return [i for i in range(m.num_layers) if (i + 1) % m.mla_every == 0]


def validate_model(m: ModelConfig) -> None:
    for key in ("d_model", "num_layers", "kda_num_heads", "kda_head_dim", "mla_num_heads", "kv_lora_rank",
                "qk_nope_head_dim", "v_head_dim", "mlp_hidden", "attnres_block_size", "pad_vocab_multiple"):
        _check(getattr(m, key) > 0, f"model.{key}", getattr(m, key), "must be a positive integer")
    _check(m.conv_size >= 1, "model.conv_size", m.conv_size, "must be >= 1 (4 in Kimi Linear)")
    _check(m.kda_backend in KDA_BACKENDS, "model.kda_backend", m.kda_backend,
           f"choose one of {'|'.join(KDA_BACKENDS)}")
    _check(m.q_lora_rank >= 0, "model.q_lora_rank", m.q_lora_rank, "must be >= 0 (0 = no query compression)")
    _check(m.qk_rope_head_dim >= 0 and m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim",
           m.qk_rope_head_dim, "must be an even number >= 0 (0 = NoPE)")
    _check(m.mla_every >= 0, "model.mla_every", m.mla_every, "must be >= 0 (0 = no MLA, 4 = 3:1 KDA:MLA)")
    if m.mla_layers is not None:
        bad = [i for i in m.mla_layers if not 0 <= int(i) < m.num_layers]
        _check(not bad, "model.mla_layers", list(m.mla_layers),
               f"indices must be 0-based block indices in [0, {m.num_layers - 1}] (bad: {bad})")
    _check(m.residual in RESIDUAL_MODES, "model.residual", m.residual, f"choose one of {'|'.join(RESIDUAL_MODES)}")
    if m.vocab_size is not None:
        _check(m.vocab_size > 0, "model.vocab_size", m.vocab_size, "must be positive, or null to use the tokenizer's")
    _check(m.init_std > 0, "model.init_std", m.init_std, "must be > 0")
    _check(m.norm_eps > 0, "model.norm_eps", m.norm_eps, "must be > 0")


def validate(cfg: Config) -> None:
    """Fail before any work on values that cannot work; every message names its key."""
    validate_model(cfg.model)
    d, o, t, lg, p = cfg.data, cfg.optim, cfg.trainer, cfg.logging, cfg.parallel
    _check(d.source in DATA_SOURCES, "data.source", d.source, f"choose one of {'|'.join(DATA_SOURCES)}")
    if d.source == "hf":
        _check(bool(d.path), "data.path", d.path, "data.source=hf needs a dataset name, e.g. data.path=roneneldan/TinyStories")
    if d.source == "files":
        _check(bool(d.data_files), "data.data_files", d.data_files,
               "data.source=files needs a list of local files, e.g. 'data.data_files=[/data/a.txt]'")
    _check(d.format in (None, "text", "json", "parquet"), "data.format", d.format, "choose text|json|parquet or null")
    _check(0.0 <= d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "must be in [0, 1)")
    _check(d.num_proc >= 1, "data.num_proc", d.num_proc, "must be >= 1")
    _check(d.tokenizer.vocab_size >= 260, "data.tokenizer.vocab_size", d.tokenizer.vocab_size,
           "must be >= 260: 256 byte-fallback pieces, 3 special pieces, and the text's characters")
    _check(o.name in OPTIMIZERS, "optim.name", o.name, f"choose one of {'|'.join(OPTIMIZERS)}")
    _check(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    _check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", list(o.betas),
           "must be two numbers in [0, 1)")
    _check(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0 (0 disables clipping)")
    _check(o.schedule in SCHEDULES, "optim.schedule", o.schedule, f"choose one of {'|'.join(SCHEDULES)}")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    _check(0 < o.decay_fraction <= 1, "optim.decay_fraction", o.decay_fraction, "must be in (0, 1]")
    _check(0 <= o.momentum < 1, "optim.momentum", o.momentum, "must be in [0, 1) (0.95 in Muon)")
    _check(o.ns_steps >= 1, "optim.ns_steps", o.ns_steps, "must be >= 1 (5 in Muon)")
    _check(o.ns_dtype in NS_DTYPES, "optim.ns_dtype", o.ns_dtype, f"choose one of {'|'.join(NS_DTYPES)}")
    _check(o.adjust_lr_fn in ADJUST_LR_FNS, "optim.adjust_lr_fn", o.adjust_lr_fn,
           f"choose one of {'|'.join(ADJUST_LR_FNS)}")
    _check(o.qk_clip_tau >= 0, "optim.qk_clip_tau", o.qk_clip_tau, "must be >= 0 (100 in K2; 0 disables QK-Clip)")
    for key in ("max_steps", "micro_batch_size", "seq_len", "grad_accum_steps", "eval_batches", "log_every"):
        _check(getattr(t, key) > 0, f"trainer.{key}", getattr(t, key), "must be a positive integer")
    for key in ("eval_every", "checkpoint_every", "sample_tokens", "threads", "stop_at_step"):
        _check(getattr(t, key) >= 0, f"trainer.{key}", getattr(t, key), "must be >= 0 (0 disables)")
    _check(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", t.keep_checkpoints, "must be >= 1")
    _check(t.precision in PRECISIONS, "trainer.precision", t.precision, f"choose one of {'|'.join(PRECISIONS)}")
    _check(t.device in ("auto", "cpu", "cuda"), "trainer.device", t.device, "choose auto|cpu|cuda")
    _check(lg.wandb.mode in WANDB_MODES, "logging.wandb.mode", lg.wandb.mode, f"choose one of {'|'.join(WANDB_MODES)}")
    for key in ("dp_replicate", "dp_shard", "tp", "pp"):
        _check(getattr(p, key) >= 1, f"parallel.{key}", getattr(p, key), "must be >= 1")
