"""The one validation pass: every rule of every section and across sections, before any work.

``validate(cfg)`` is what ``Trainer.__init__`` calls first (before any data is downloaded or tokenised) and
kimi.summary before it sizes a layout. Each section's rules live with the code that owns the section
(kimi/model/rules.py, kimi/data/rules.py, kimi/optim/rules.py, kimi/parallel/rules.py,
kimi/precision/rules.py); the trainer and logging sections, the run's own, are here; the rules across
sections are kimi/parallel/rules.py's (parallelism against the model and the batch) and
kimi/model/config.py's (the vocabulary against the tokenizer). Each failure is a
one-line ConfigError naming its key(s) and the fix. A setting that works but is likely not what was meant is
a warning instead: one stdout line each (rank 0), from ``warnings_of``, and the run goes on.
"""

from __future__ import annotations

import importlib.util
import os
from typing import List, Optional

from kimi.config import Config
from kimi.data.rules import data_warnings, validate_data
from kimi.eval.harness import check_names
from kimi.model.config import check_vocab
from kimi.model.rules import check_kernels, check_mtp, check_tensor_parallel, validate_model
from kimi.optim.rules import validate_optim
from kimi.parallel.rules import (check_context_parallel, check_cuda_graphs, check_expert_parallel,
                                 check_pipeline, check_sequence_parallel)
from kimi.parallel.rules import check_engine, check_fault_tolerance, check_layout, validate_parallel
from kimi.precision.rules import validate_precision
from kimi.schema.run import LoggingConfig, TrainerConfig
from kimi.schema.vocabulary import check, check_choices, check_finite, check_positive, require

TENSORBOARD_MISSING = ("logging.tensorboard=true needs the tensorboard package, which is not installed: "
                       "pip install -e '.[tensorboard]' (the project's tensorboard extra), or set "
                       "logging.tensorboard=false")


def validate(cfg: Config, world: Optional[int] = None, model_checked: bool = False) -> None:
    """Fail before any work on a config that cannot work; every message is one line naming its key(s).

    world: the number of processes (default: torchrun's WORLD_SIZE, 1 without torchrun). model_checked: the
    model section's own rules passed already (the planner validates thousands of layouts of one model)."""
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    if not model_checked:
        validate_model(cfg.model)
    validate_data(cfg.data)
    validate_optim(cfg.optim)
    validate_trainer(cfg.trainer)
    validate_logging(cfg.logging)
    validate_parallel(cfg.parallel)
    check_layout(cfg.parallel, world)
    check_tensor_parallel(cfg.model, cfg.parallel.tp)
    check_sequence_parallel(cfg)
    check_expert_parallel(cfg)
    check_context_parallel(cfg)
    check_cuda_graphs(cfg)
    check_engine(cfg.parallel)
    validate_precision(cfg)
    check_fault_tolerance(cfg)
    check_pipeline(cfg)
    check_vocab(cfg)
    check_kernels(cfg)
    check_mtp(cfg)
    # across model and trainer: a short convolution wider than the sequence sees only its zero padding past
    # it, and made steps about 20x slower
    require(cfg.model.conv_size <= cfg.trainer.seq_len,
            f"model.conv_size={cfg.model.conv_size} is longer than trainer.seq_len={cfg.trainer.seq_len}: "
            "use a conv_size of at most the sequence length (4 in Kimi Linear) or a longer sequence")
    if int(os.environ.get("RANK", "0")) == 0:
        for line in warnings_of(cfg):
            print(f"[kimi] warning: {line}", flush=True)


def warnings_of(cfg: Config) -> List[str]:
    """What validate warns about (a valid config): each a line naming its key(s) and the fix."""
    o, t = cfg.optim, cfg.trainer
    found = []
    if o.warmup_steps > t.max_steps:  # the linear warmup (kimi/optim/schedules.py) is cut off part way
        peak = t.max_steps / o.warmup_steps
        found.append(f"optim.warmup_steps={o.warmup_steps} is more than trainer.max_steps={t.max_steps}: the "
                     f"learning rate never reaches optim.lr (at most {peak:.0%} of it) and never decays; "
                     f"lower optim.warmup_steps (to {max(1, t.max_steps // 10)}, say)")
    return found + data_warnings(cfg.data)


def validate_trainer(t: TrainerConfig) -> None:
    check_choices(t, "trainer")
    check_finite(t, "trainer")
    # torch.manual_seed takes 64-bit unsigned seeds; numpy's SeedSequence (the data order) no negative ones
    check(0 <= t.seed < 2**64, "trainer.seed", t.seed, "must be an integer in [0, 2**64)")
    check_positive(t, "trainer", ("max_steps", "micro_batch_size", "seq_len", "grad_accum_steps",
                                   "eval_batches", "log_every"))
    for key in ("eval_every", "checkpoint_every", "sample_tokens", "stop_at_step"):
        check(getattr(t, key) >= 0, f"trainer.{key}", getattr(t, key), "must be >= 0 (0 disables)")
    check(t.threads is None or t.threads >= 0, "trainer.threads", t.threads,
          "must be >= 0 (0: torch's default), or null to fit the free cores")
    check(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", t.keep_checkpoints, "must be >= 1")
    check(t.diag_every is None or t.diag_every >= 0, "trainer.diag_every", t.diag_every,
          "must be >= 0 (0 disables diagnostics), or null for the evaluation steps")
    # the end-of-training sample continues this text; an empty one would fail after the whole run
    check(t.sample_tokens == 0 or t.sample_prompt != "", "trainer.sample_prompt", t.sample_prompt,
          "must be non-empty when trainer.sample_tokens > 0 (set trainer.sample_tokens=0 for no sample)")
    check(t.collective_timeout_s > 0, "trainer.collective_timeout_s", t.collective_timeout_s,
          "must be > 0 seconds (default 600)")
    if t.peak_flops is not None:  # MFU divides by it
        check(t.peak_flops > 0, "trainer.peak_flops", t.peak_flops,
              "must be > 0 FLOP/s, or null for the table")
    steps = t.profile.steps
    if steps is not None:
        check(len(steps) == 2 and 1 <= steps[0] <= steps[1] <= t.max_steps, "trainer.profile.steps",
              list(steps), f"must be [first, last] training steps with 1 <= first <= last <= "
              f"trainer.max_steps ({t.max_steps}), e.g. [5,6]; null: no profile")
    check(t.profile.top >= 1, "trainer.profile.top", t.profile.top, "must be >= 1 rows")
    check(t.eval_tasks_limit >= 0, "trainer.eval_tasks_limit", t.eval_tasks_limit,
          "must be >= 0 (0: every example)")
    check_names(t.eval_tasks)


def validate_logging(lg: LoggingConfig) -> None:
    from kimi.run.wandb_run import wandb_mode

    check_choices(lg, "logging")
    wandb_mode(lg.wandb)  # $WANDB_MODE, where the config leaves the mode to it
    require(not lg.tensorboard or importlib.util.find_spec("tensorboard") is not None, TENSORBOARD_MISSING)
