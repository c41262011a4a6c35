"""Structured configuration: the schema (dataclasses registered in Hydra's ConfigStore), the vocabulary its
rules are written in, and the rules that span sections.

The root schema is stored as ``base_config``; ``conf/config.yaml`` lists it first in its defaults, so every
YAML preset and command-line override is merged into typed nodes and a misspelt key fails with Hydra's
"Key 'x' not in 'TrainerConfig'" before any work. Values that type-check but cannot work are caught by the one
validation pass, :func:`kimi.run.validation.validate`, which ``Trainer.__init__`` calls first (before any
data is downloaded or tokenised). Each section's own rules live with the code that owns it
(kimi/model/rules.py, kimi/data/rules.py, kimi/optim/rules.py, kimi/parallel/rules.py, kimi/run/validation.py
for the run's trainer and logging sections); the rules here read several sections (context, expert and
pipeline parallelism against the model and the batch, the vocabulary against the tokenizer). Each failure is
a one-line :class:`ConfigError` that names the key(s) and how to fix it.

This module is pure data: it imports neither torch nor the rest of kimi (it is imported first) but for the
error types (kimi/errors.py). The registries (data sources, optimizers, engines, precisions) fill its tables
of names when they are imported.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf

from kimi.errors import ConfigError  # noqa: F401 (kimi.config.ConfigError, as ever)

# ---- keys that take one of a fixed set of values ---------------------------------------------------------
# The installed OmegaConf (2.3) rejects typing.Literal in structured configs ("Unexpected type annotation:
# Literal[...]"), and an Enum annotation would hand the code Enum members instead of plain strings and make
# a bad value a composition-time ValidationError instead of a ConfigError listing the choices. So these keys
# stay `str`, each declared with one_of(TUPLE, default): the field's metadata holds its one tuple of allowed
# values, and validate() derives the check (and its message) from it for every such field.
RESIDUAL_MODES = ("standard", "attnres_full", "attnres_block")
KDA_BACKENDS = ("auto", "torch", "triton", "fla")
ATTENTION_BACKENDS = ("auto", "triton", "sdpa")
ATTNRES_BACKENDS = ("torch", "compile", "triton", "fla", "auto")
# data.source's names: the table of kimi/data/source_registry.py, which fills it (it imports this module)
DATA_SOURCES: Dict[str, Any] = {}
DATA_FORMATS = ("text", "json", "parquet")
PREPARE_EXECUTORS = ("local", "slurm")  # datatrove's executors (kimi/data/prepare/executor.py)
# optim.name's names: the table of kimi/optim/registry.py, which fills it (it imports this module)
OPTIMIZERS: Dict[str, Any] = {}
# parallel.engine's names: the table of kimi/parallel/engine_rules.py, which fills it (it imports this module)
ENGINES: Dict[str, Any] = {}
SCHEDULES = ("cosine", "wsd", "constant")
NS_DTYPES = ("auto", "fp32", "bf16")
ADJUST_LR_FNS = ("match_rms_adamw", "original")
# trainer.precision's names: the table of kimi/precision/registry.py, which fills it
PRECISIONS: Dict[str, Any] = {}
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's recipe names
QAT_MODES = ("mxfp4_experts",)
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("offline", "online", "disabled")
AC_MODES = ("none", "full", "selective")
FAULT_TOLERANCE = ("none", "torchft")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank; the others run pp_virtual_stages each
MOE_IMPLS = ("grouped", "loop")
MOE_BALANCE = ("sign", "quantile")
MLP_ACTIVATIONS = ("swiglu", "situ")


def registered(entry: Any, package: str) -> type:
    """A registry table's entry (DATA_SOURCES, OPTIMIZERS): the class itself, or "module:Class" of a module
    in `package`, imported when first asked for (a registry's built-ins import the registry for its base
    class, so the table names them rather than importing them)."""
    if isinstance(entry, str):
        import importlib

        module, _, cls = entry.partition(":")
        entry = getattr(importlib.import_module(f".{module}", package), cls)
    return entry


def one_of(choices: Tuple[str, ...], default: Optional[str]) -> Any:
    """A string field taking one of `choices` (or null, when the default is null); validate() checks it."""
    return field(default=default, metadata={"choices": choices, "nullable": default is None})


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


@dataclass
class TokenizerConfig:
    # Path to an existing sentencepiece .model; None trains a BPE on the training split.
    model_path: Optional[str] = None
    vocab_size: int = 2048
    # Characters of training text fed to the sentencepiece trainer (enough for a good BPE, fast).
    train_chars: int = 20_000_000


@dataclass
class DataSourceConfig:
    """One source of a blend (data.sources, kimi/data/blend.py): its share of the training samples and where
    its documents are; a key left null takes data.*'s value."""

    name: str = ""  # names its prepared directory and its validation loss, val_loss/<name>
    weight: float = 1.0
    source: Optional[str] = one_of(DATA_SOURCES, None)
    path: Optional[str] = None
    data_files: Optional[List[str]] = None
    format: Optional[str] = one_of(DATA_FORMATS, None)
    config: Optional[str] = None
    revision: Optional[str] = None
    text_field: Optional[str] = None
    train_split: Optional[str] = None
    val_split: Optional[str] = None
    val_fraction: Optional[float] = None


@dataclass
class DataConfig:
    name: str = "shakespeare"
    # shakespeare | hf (a hub dataset name, data.path) | files (local text/json/parquet, data.data_files)
    source: str = one_of(DATA_SOURCES, "shakespeare")
    path: Optional[str] = None  # hub dataset name for source=hf
    config: Optional[str] = None  # source=hf: the dataset's subset (load_dataset's name)
    revision: Optional[str] = None  # source=hf: a branch, tag or commit of the dataset
    data_files: Optional[List[str]] = None  # local files (or globs) for source=files
    format: Optional[str] = one_of(DATA_FORMATS, None)  # None: inferred from the file extension
    text_field: str = "text"
    train_split: str = "train"
    val_split: Optional[str] = None  # None: hold out `val_fraction` of the documents
    val_fraction: float = 0.05
    cache_dir: Optional[str] = None  # None: $KIMI_CACHE_DIR or ~/.cache/kimi
    num_proc: Optional[int] = None  # processes that tokenise (kimi.data.encode); None: every core
    shard_mb: float = 256.0  # size of one token shard (kimi.data.shards)
    # Preparing across machines (kimi/data/prepare/parts.py, docs/data.md): data.data_files split into this
    # many parts, one per worker; the command without a worker number merges them. null: one process
    prepare_workers: Optional[int] = None
    # this process's part, 0 to prepare_workers - 1; null: a SLURM array task's or torchrun rank's, if any
    prepare_worker: Optional[int] = None
    # datatrove runs the workers, then the merge (the prep extra): on this machine or as a SLURM array
    prepare_executor: Optional[str] = one_of(PREPARE_EXECUTORS, None)
    # datatrove's executor arguments, added with +: local: workers; slurm: partition, time, cpus_per_task, ...
    prepare_executor_args: Dict[str, Any] = field(default_factory=dict)
    # The trainer tokenises a corpus of up to this many MB of text itself; larger ones are prepared first with
    # `python -m kimi.data.prepare` (resumable, every core).
    inline_max_mb: float = 512.0
    varlen: bool = False  # feed document boundaries (cu_seqlens) to the model
    # Read the source as a stream while training (hf or files; kimi/data/streaming.py) instead of token shards
    streaming: bool = False
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # A blend: several sources sampled by weight (docs/data.md); null: the one source above
    sources: Optional[List[DataSourceConfig]] = None


@dataclass
class OptimConfig:
    name: str = one_of(OPTIMIZERS, "muonclip")
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    schedule: str = one_of(SCHEDULES, "cosine")  # all after linear warmup
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine and wsd)
    decay_fraction: float = 0.2  # wsd: fraction of max_steps spent decaying
    # MuonClip only (kimi/optim/muonclip.py); lr, weight_decay, betas and eps above serve its AdamW family.
    momentum: float = 0.95  # Muon momentum
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_dtype: str = one_of(NS_DTYPES, "auto")  # Newton-Schulz matmuls: auto = bf16 on CUDA, fp32 elsewhere
    # Muon's lr scale: match_rms_adamw (0.2 sqrt(max(A,B))) | original (sqrt(max(1,A/B)))
    adjust_lr_fn: str = one_of(ADJUST_LR_FNS, "match_rms_adamw")
    # fnmatch patterns over parameter names that force a family; null keeps the default (embed, lm_head)
    adamw_patterns: Optional[List[str]] = None
    muon_patterns: List[str] = field(default_factory=list)
    # Orthogonalise MLA's fused projections per logical matrix (true) or each weight whole (false: what
    # torch.optim.Muon and Moonlight do); one of the ablations (conf/experiment)
    muon_split_fused: bool = True
    # Kimi K3's per-head Muon: each head's block of the query, key and value projections (KDA q/k/v, MLA's
    # query and W_ukv: keys and values of a head apart) orthogonalised alone, its update scaled by its own
    # shape; the other matrices whole, or per logical matrix with muon_split_fused
    muon_per_head: bool = False
    # QK-Clip threshold on each MLA head's max scaled logit (K2: 100); 0 disables QK-Clip
    qk_clip_tau: float = 100.0


@dataclass
class ProfileConfig:
    """trainer.profile (kimi/run/profiling.py): a torch.profiler trace of a few training steps."""

    steps: Optional[List[int]] = None  # [first, last] training steps to record (1-based); null: off
    ranks: List[int] = field(default_factory=lambda: [0])  # the global ranks that record
    memory: bool = True  # on CUDA also the allocator's memory snapshot of those steps
    top: int = 25  # rows of the ops table (ops_rank<r>.txt)


@dataclass
class TrainerConfig:
    seed: int = 1234
    max_steps: int = 600
    micro_batch_size: int = 16
    seq_len: int = 128
    grad_accum_steps: int = 1
    # bf16: autocast; weights and optimizer stay fp32. fp8 / mxfp8: bf16 autocast, and the large block
    # projections through torchao's fp8 / MXFP8 matmuls (the precision section, kimi/precision)
    precision: str = one_of(PRECISIONS, "fp32")
    device: str = one_of(DEVICES, "auto")
    eval_every: int = 100  # 0 disables periodic validation (a final one still runs)
    # Diagnostics of every building block (AttnRes weights, MLA logits, KDA decay, MoE load, Muon/AdamW
    # updates; kimi/diagnostics) every this many steps and at the last; null: at the evaluation steps
    # (eval_every) and the last; 0: never.
    diag_every: Optional[int] = None
    eval_batches: int = 8
    # lm-eval tasks also scored at each evaluation, logged as eval/<task>/<metric> (docs/eval.md; the eval
    # extra)
    eval_tasks: List[str] = field(default_factory=list)
    eval_tasks_limit: int = 100  # examples of each task scored at an evaluation; 0: all
    log_every: int = 10
    checkpoint_every: int = 200  # 0: only the final checkpoint
    keep_checkpoints: int = 2  # complete checkpoints kept on disk (oldest removed first)
    # Write periodic checkpoints in the background (DCP async_save): training pauses only while the state is
    # copied to CPU memory (one more copy of it in host memory while the write runs). The final checkpoint,
    # and one at a stop, are waited for.
    async_checkpoint: bool = False
    run_dir: str = "runs/default"  # set to Hydra's output dir by conf/config.yaml
    resume: bool = True  # pick up the newest intact checkpoint in run_dir/checkpoints
    # A new run (nothing to resume) starts from these weights: a checkpoint dir, or a run dir's newest one;
    # weights only, step 0, fresh optimizer. Empty: run_dir/init when it exists (kimi.convert from-hf).
    init_from: str = ""
    # With resume=false in a run dir that already holds checkpoints: true moves the old run aside (into
    # run_dir/previous/<time>/, never deleted); false refuses to start.
    overwrite: bool = False
    # Seconds a rank may make no progress (or a collective may wait) before the job is ended with a message
    # naming the stalled rank; also the process group's timeout. Raise it for very slow checkpoint storage.
    collective_timeout_s: float = 600.0
    # Stop (with a checkpoint) after this step although the schedule runs to max_steps: for jobs sliced by
    # a time limit, each slice run with a higher stop_at_step (or the last without it) resuming where the
    # previous one stopped; the same command again trains nothing. 0: off.
    stop_at_step: int = 0
    peak_flops: Optional[float] = None  # per-device FLOP/s for MFU; None: table (CUDA) or measured (CPU)
    sample_tokens: int = 200  # tokens sampled at the end of training (0: none)
    # the text the end-of-run sample continues; null: the first words of the first validation document
    sample_prompt: Optional[str] = None
    # torch intra-op threads on CPU; null: the usable cores less the one-minute load (at least 1), or
    # $OMP_NUM_THREADS where set; 0: torch's default
    threads: Optional[int] = None
    # Before anything is built, a model whose weights, gradients and optimizer state (estimated from the
    # config, split over the ranks) cannot fit the device's memory is refused (kimi/model/footprint.py);
    # true skips that check.
    skip_size_check: bool = False
    profile: ProfileConfig = field(default_factory=ProfileConfig)


@dataclass
class WandbConfig:
    # offline: no network (`wandb sync` later). null: $WANDB_MODE, else offline
    # (kimi.run.wandb_run.wandb_mode)
    mode: Optional[str] = one_of(WANDB_MODES, None)
    project: Optional[str] = None  # null: $WANDB_PROJECT, else kimi
    entity: Optional[str] = None
    name: Optional[str] = None
    group: Optional[str] = None  # runs shown together (an ablation's experiment)
    tags: List[str] = field(default_factory=list)  # e.g. an ablation's arm and seed
    # each complete checkpoint directory as a version of the model artifact checkpoint-<run id> (offline too:
    # wandb copies it to its staging directory at once, and `wandb sync` uploads it); off by default, as each
    # version is a whole copy of the checkpoint
    log_checkpoints: bool = False


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    metrics_file: str = "metrics.jsonl"
    # write loss_curve.png in the run dir after each validation and at the end, and diagnostics/*.png
    plot: bool = True
    # also write TensorBoard event files to <run_dir>/tensorboard/ (the tensorboard extra; docs/dashboards.md)
    tensorboard: bool = False
    # CUDA: synchronize the device after each timed part of a step, so time/* measures the GPU's work, not
    # only the host's (costs the overlap between the parts); a CPU's times are exact without it
    step_time_sync: bool = False


@dataclass
class DeepSpeedConfig:
    """parallel.engine=deepspeed (kimi/parallel/deepspeed_engine.py): ZeRO over the dp_shard ranks; the
    DeepSpeed JSON config is generated from these and the rest of the config (run_dir/deepspeed.json)."""

    zero_stage: int = 2  # 1: optimizer state partitioned; 2: + gradients; 3: + parameters
    reduce_bucket_size: int = 500_000_000  # elements per gradient reduction bucket
    allgather_bucket_size: int = 500_000_000  # elements per parameter all-gather bucket (stages 1-2)
    overlap_comm: bool = False  # overlap gradient reduction with the backward
    offload_optimizer: bool = False  # keep optimizer state and fp32 masters in CPU memory (ZeRO-Offload)


@dataclass
class TorchftConfig:
    """parallel.fault_tolerance=torchft (kimi/parallel/fault_tolerance.py): each replica group is a job of its
    own; gradients are averaged over the groups in the step's quorum, a group that (re)joins takes a peer's
    live state."""

    replica_group: int = 0  # this job's group, 0..replica_groups-1: which share of the data it reads
    replica_groups: int = 2  # groups the run is planned with: the global batch when all are in the quorum
    # e.g. http://host:29510; null: the TORCHFT_LIGHTHOUSE environment variable
    lighthouse: Optional[str] = None
    min_replicas: int = 1  # groups a step needs to commit its update (the others wait for more)
    timeout_s: float = 60.0  # a collective or a state transfer between groups
    quorum_timeout_s: float = 60.0  # waiting for the quorum at the start of a step


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    # expert parallelism: the routed experts of every MoE layer split over this many of the dp_shard ranks
    # (kimi/parallel/expert_parallel.py); the experts' weights are FSDP-sharded over the rest
    ep: int = 1
    # context parallelism: every sequence split into this many consecutive shards, one per rank
    # (kimi/parallel/context_parallel.py); trainer.seq_len must divide by it
    cp: int = 1
    activation_checkpointing: str = one_of(AC_MODES, "none")  # see kimi/parallel/activation_checkpointing.py
    compile: bool = False  # torch.compile each token mixer and MLP
    reshard_after_forward: bool = True  # FSDP2: False keeps weights gathered until the backward (ZeRO-2-like)
    sequence_parallel: bool = False  # with tp > 1: activations between sublayers split along the sequence
    pp_schedule: str = one_of(PP_SCHEDULES, "1f1b")
    pp_virtual_stages: int = 2  # stages per rank for interleaved_1f1b and zero_bubble
    pp_microbatches: int = 0  # micro-batches per step through the pipeline; 0: as many as stages
    pp_split: Optional[List[int]] = None  # first block of stages 1..pp-1; null: balanced by FLOPs
    # torch: FSDP2/TP/PP from torch.distributed; deepspeed: DeepSpeed's ZeRO 1-3 over dp_shard ranks
    engine: str = one_of(ENGINES, "torch")
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    # none, or torchft: replica groups (each its own torchrun job) that train on when one is lost
    fault_tolerance: str = one_of(FAULT_TOLERANCE, "none")
    torchft: TorchftConfig = field(default_factory=TorchftConfig)


@dataclass
class Fp8Config:
    recipe: str = one_of(FP8_RECIPES, "tensorwise")  # torchao's Float8LinearConfig.from_recipe_name
    # tensorwise under FSDP2 (dp_shard * cp > 1): FSDP gathers the converted weights as fp8 (1 byte per
    # element) instead of bf16 (2), each cast from its fp32 shard with the whole weight's amax
    fsdp_all_gather: bool = False


@dataclass
class PrecisionConfig:
    """Low-precision training (trainer.precision=fp8|mxfp8, precision.qat; kimi/precision,
    docs/precision.md)."""

    fp8: Fp8Config = field(default_factory=Fp8Config)
    # null: the fp8 / MXFP8 matmuls emulated on CPU, native on CUDA (a GPU without them, below sm_89 for fp8
    # or sm_100 for MXFP8, is refused unless true); true: emulated everywhere; false: native only
    emulate: Optional[bool] = None
    # blocks at each end of the model whose projections stay bf16 (the first and last layers)
    keep_end_blocks: int = 1
    # projections with fewer input or output features stay bf16 (their cast costs more than it saves)
    min_features: int = 64
    # mxfp4_experts: the routed experts' weights fake-quantised to MXFP4 in the forward (QAT), exportable
    qat: Optional[str] = one_of(QAT_MODES, None)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)


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


def stages_per_rank(p: ParallelConfig) -> int:
    """Pipeline stages each pipeline rank runs: parallel.pp_virtual_stages for the interleaved schedules."""
    return 1 if p.pp == 1 or p.pp_schedule in SINGLE_STAGE_SCHEDULES else p.pp_virtual_stages


def pipeline_stages(p: ParallelConfig) -> int:
    """Pipeline stages in all (1 without pipeline parallelism); each needs at least one block."""
    return p.pp * stages_per_rank(p)


def pipeline_microbatches(cfg: Config) -> int:
    """Micro-batches per step through the pipeline (1 without one): parallel.pp_microbatches, 0 meaning pp."""
    p = cfg.parallel
    return 1 if p.pp == 1 else (p.pp_microbatches or p.pp)


# ---- the rules' vocabulary
# ---------------------------------------------------------------------------------------------
def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    """A value of one key: `key=value is invalid: allowed`."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def require(ok: bool, message: str) -> None:
    """A rule over several keys, with its own message (naming the keys and the fix)."""
    if not ok:
        raise ConfigError(message)


def check_choices(node: Any, prefix: str) -> None:
    """Every one_of() field of the dataclass `node` (and of the dataclasses nested in it) holds an allowed
    value; its allowed values come from the field's metadata, so no such key is left unchecked."""
    for f in fields(node):
        key, value = f"{prefix}.{f.name}", getattr(node, f.name)
        choices = f.metadata.get("choices")
        if choices is not None:
            nullable = f.metadata["nullable"]
            check(value in choices or (nullable and value is None), key, value,
                  f"choose one of {'|'.join(choices)}" + (" or null" if nullable else ""))
        elif is_dataclass(value):
            check_choices(value, key)


def check_finite(node: Any, prefix: str) -> None:
    """Every float of the dataclass `node` (and of those nested in it) is finite: OmegaConf accepts nan and
    inf for a float key, and inf passes every `> 0` rule below."""
    for f in fields(node):
        key, value = f"{prefix}.{f.name}", getattr(node, f.name)
        if isinstance(value, float):
            check(math.isfinite(value), key, value, "must be a finite number")
        elif is_dataclass(value):
            check_finite(value, key)


def check_positive(node: Any, prefix: str, keys: Tuple[str, ...]) -> None:
    for key in keys:
        check(getattr(node, key) > 0, f"{prefix}.{key}", getattr(node, key), "must be a positive integer")


# ---- across sections -------------------------------------------------------------------------------------
def check_sequence_parallel(cfg: Config) -> None:
    """Sequence parallelism splits every sequence over the tp (and cp) ranks."""
    p, t = cfg.parallel, cfg.trainer
    if p.tp > 1 and p.sequence_parallel:
        ranks = f"parallel.tp={p.tp} ranks" if p.cp == 1 else f"parallel.cp*tp={p.cp}*{p.tp} ranks"
        require(t.seq_len % (p.tp * p.cp) == 0,
                f"trainer.seq_len={t.seq_len} does not split over {ranks} for sequence parallelism: make it "
                f"a multiple of {p.tp * p.cp}")


def check_context_parallel(cfg: Config) -> None:
    """parallel.cp splits every row into equal shards; what does not work across them yet is named."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    if p.cp == 1:
        return
    require(t.seq_len % p.cp == 0,
            f"trainer.seq_len={t.seq_len} does not split into parallel.cp={p.cp} equal shards: make it a "
            f"multiple of {p.cp}")
    require(t.seq_len // p.cp >= m.conv_size - 1,
            f"trainer.seq_len={t.seq_len} over parallel.cp={p.cp} gives shards of {t.seq_len // p.cp} "
            f"tokens, shorter than the short convolutions' halo (model.conv_size - 1 = {m.conv_size - 1}): "
            "use a longer sequence or a smaller cp")
    unsupported = [f"parallel.{k}={getattr(p, k)}" for k in ("ep",) if getattr(p, k) > 1]
    unsupported += ["parallel.compile=true"] if p.compile else []
    unsupported += [f"model.moe_aux_loss_coef={m.moe_aux_loss_coef} (its balance statistics are per whole "
                    "sequence; the aux-loss-free bias update works)"] if m.moe_aux_loss_coef else []
    require(not unsupported,
            f"parallel.cp={p.cp} does not work with {', '.join(unsupported)} yet: reset those, or use "
            "parallel.cp=1")


def check_expert_parallel(cfg: Config) -> None:
    """parallel.ep takes its ranks from dp_shard and splits every MoE layer's experts evenly."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return
    require(m.moe_num_experts > 0, f"parallel.ep={p.ep} needs a mixture-of-experts model "
                                    "(model.moe_num_experts > 0, e.g. model=moe_tiny): expert parallelism "
                                    "splits the routed experts; set parallel.ep=1")
    require(p.dp_shard % p.ep == 0,
            f"parallel.ep={p.ep} does not divide parallel.dp_shard={p.dp_shard}: the expert-parallel ranks "
            "are taken from the dp_shard ranks; make dp_shard a multiple of ep")
    require(m.moe_num_experts % p.ep == 0,
            f"model.moe_num_experts={m.moe_num_experts} is not divisible by parallel.ep={p.ep}: each "
            "expert-parallel rank holds the same number of experts; choose an ep that divides it")


def check_stage_split(p: ParallelConfig, layers: int, split: Optional[List[int]]) -> None:
    """Every pipeline stage needs a block; parallel.pp_split names where stages 1.. start."""
    stages = pipeline_stages(p)
    if stages == p.pp:
        require(stages <= layers, f"parallel.pp={stages} is more stages than model.num_layers={layers}; "
                                  "every stage needs a block: lower parallel.pp")
    else:
        require(stages <= layers,
                f"parallel.pp={p.pp} x parallel.pp_virtual_stages={p.pp_virtual_stages} = {stages} stages "
                f"({p.pp_schedule}) is more than model.num_layers={layers}; every stage needs a block: "
                "lower parallel.pp_virtual_stages or parallel.pp")
    if split:
        split = [int(i) for i in split]
        bounds = [0, *split, layers]
        require(len(split) == stages - 1 and all(a < b for a, b in zip(bounds, bounds[1:])),
                f"parallel.pp_split={split} is invalid: give {stages - 1} rising block indices in "
                f"(0, {layers}) where stages 1..{stages - 1} start")


def check_pipeline(cfg: Config) -> None:
    """Stages against blocks, pp_split, and the micro-batches a step sends through the pipeline."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    if p.pp == 1:
        require(not p.pp_split,
                f"parallel.pp_split={list(p.pp_split or [])} is invalid: it sets pipeline stage boundaries "
                "and parallel.pp=1 has one stage; set parallel.pp_split=null")
        return
    check_stage_split(p, m.num_layers, p.pp_split)
    n = pipeline_microbatches(cfg)
    require(n >= p.pp or p.pp_schedule == "gpipe",
            f"parallel.pp_microbatches={p.pp_microbatches} is too few for the {p.pp_schedule} schedule over "
            f"{p.pp} ranks: use at least {p.pp} (or 0 for that many)")
    if p.pp_schedule not in SINGLE_STAGE_SCHEDULES:
        # torch's interleaved schedules run max(1, n // pp) rounds of equally many micro-batches
        rounds = max(1, n // p.pp)
        require(n % rounds == 0,
                f"parallel.pp_microbatches={n} is invalid for parallel.pp_schedule={p.pp_schedule} over "
                f"parallel.pp={p.pp} ranks: torch runs it in {rounds} rounds of equally many micro-batches; "
                f"use a multiple of {p.pp}")
    require(t.micro_batch_size % n == 0,
            f"trainer.micro_batch_size={t.micro_batch_size} does not split into "
            f"parallel.pp_microbatches={n} micro-batches: make it a multiple of {n}")
    require(t.grad_accum_steps == 1,
            "trainer.grad_accum_steps > 1 with parallel.pp > 1: raise parallel.pp_microbatches and "
            "trainer.micro_batch_size instead (the pipeline accumulates over micro-batches)")


def check_vocab(cfg: Config) -> None:
    """A set model.vocab_size must hold the tokenizer's ids; a trained tokenizer has exactly
    data.tokenizer.vocab_size (a given data.tokenizer.model_path is only known after loading it)."""
    m, tok = cfg.model, cfg.data.tokenizer
    if m.vocab_size is not None and tok.model_path is None:
        require(m.vocab_size >= tok.vocab_size,
                f"model.vocab_size={m.vocab_size} is invalid: the tokenizer trained with "
                f"data.tokenizer.vocab_size={tok.vocab_size} has that many tokens; set model.vocab_size >= "
                f"{tok.vocab_size}, or null to follow the tokenizer")


def _schema_keys(schema: type, prefix: str = "") -> List[str]:
    """Every dotted key of the dataclass `schema`, its sections included (model, data.tokenizer, ...)."""
    keys = []
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        keys.append(key)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys += _schema_keys(type(default), f"{key}.")
    return keys


def _closest_key(key: str, schema: type) -> str:
    """`: did you mean <key>?` for the known key whose last part is closest (in the same section first, then
    in any), else where the keys are listed. Whole dotted keys would match on their shared section alone."""
    section, _, leaf = key.rpartition(".")
    siblings = difflib.get_close_matches(leaf, [f.name for f in fields(schema)], n=1)
    if siblings:
        return f": did you mean {section + '.' if section else ''}{siblings[0]}?"
    by_leaf: Dict[str, str] = {}
    for known in _schema_keys(Config):
        by_leaf.setdefault(known.rpartition(".")[2], known)
    anywhere = difflib.get_close_matches(leaf, list(by_leaf), n=1)
    if anywhere:
        return f": did you mean {by_leaf[anywhere[0]]}?"
    if schema is Config:
        return f" (the sections are {', '.join(f.name for f in fields(Config))})"
    return f" (the keys of {section} are the fields of {schema.__name__} in kimi/config.py)"


def unknown_key(key: str) -> str:
    """The message for a dotted key the schema lacks, with the closest known key."""
    schema, parts = Config, key.split(".")
    for part in parts[:-1]:
        f = {f.name: f for f in fields(schema)}.get(part)
        default = f.default_factory() if f is not None and callable(f.default_factory) else None
        if not is_dataclass(default):
            break
        schema = type(default)
    return f"{key} is not a config key{_closest_key(key, schema)}"


def _check_known_keys(given: Dict[str, Any], schema: type, prefix: str = "") -> None:
    """Refuse a key the schema lacks. Hydra's `+key=value` adds keys even to a structured config, and
    OmegaConf.to_object then drops them without a word: `+trainer.max_stepz=3` would train 600 steps."""
    names = {f.name: f for f in fields(schema)}
    for name, value in given.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise ConfigError(f"{key} is not a config key{_closest_key(key, schema)}")
        default = names[name].default_factory() if callable(names[name].default_factory) else None
        if is_dataclass(default) and isinstance(value, dict):
            _check_known_keys(value, type(default), f"{key}.")


def resolve_vocab(m: ModelConfig, tokenizer_vocab: int) -> None:
    """Set model.vocab_size from the tokenizer when it is null (padded to model.pad_vocab_multiple); refuse
    one too small for the tokenizer."""
    if m.vocab_size is None:
        mult = m.pad_vocab_multiple
        m.vocab_size = (tokenizer_vocab + mult - 1) // mult * mult
    elif m.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is invalid: the tokenizer has {tokenizer_vocab} "
                          "tokens; set model.vocab_size >= that, or null to follow the tokenizer")


def to_config(cfg: Union[Config, DictConfig, Dict[str, Any]]) -> Config:
    """A typed :class:`Config` from a Hydra DictConfig, a plain dict, or a Config (returned as is).
    A key the schema lacks is a ConfigError naming it (and the closest key, if one is close)."""
    if isinstance(cfg, Config):
        return cfg
    # unresolved: interpolations such as ${hydra:runtime.output_dir} only resolve inside a Hydra job
    given = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    _check_known_keys(given, Config)
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    return OmegaConf.to_object(merged)


def config_dict(cfg: Config) -> Dict[str, Any]:
    """The resolved config as plain containers (for checkpoints, wandb and comparisons)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
