"""The run's own sections: trainer.* (with trainer.profile) and logging.* (with logging.wandb), and the
names trainer.precision, trainer.device and logging.wandb.mode take.

Their owners, the trainer and kimi/run/ (profiling, metrics, wandb_run, validation), sit above kimi.config
and read the whole config; but the floors below it read these sections too (the data loader's batches
take trainer.micro_batch_size and seq_len, the parallel and precision rules the same), so the sections lie
here, on the config's ground floor, rather than beside their owners.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kimi.schema.vocabulary import one_of

# trainer.precision's names: the table of kimi/precision/registry.py, which fills it
PRECISIONS: Dict[str, Any] = {}
DEVICES = ("auto", "cpu", "cuda")
WANDB_MODES = ("offline", "online", "disabled")


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


def tokens_per_step(t: TrainerConfig, data_parallel: int) -> int:
    """Training tokens one optimizer step takes (trainer section `t`, over `data_parallel` ranks)."""
    return t.micro_batch_size * t.seq_len * t.grad_accum_steps * data_parallel
