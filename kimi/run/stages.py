"""A run of several stages in one command (the config's ``stages``, docs/stages.md): each stage is a normal
training segment (a Trainer) whose config is the run's with the stage's overrides, trainer.max_steps the total
over all stages (one lr curve) and trainer.stop_at_step the stage's last step. A stage ends with its
checkpoint; the next one resumes from it through the usual resume path (kimi/run/resume.py), which knows a
boundary from the checkpoint's step and the stages and says so instead of listing the changed settings as a
user's change. The same command again starts at the stage its newest checkpoint belongs to.

What a boundary does to the data (kimi/run/resume.py, stream_changes): a stage that reads the same data
in the same windows per step as the one before continues its stream where it was; any other starts a stream
of its own, from the first window of a permutation drawn from (trainer.seed, the stage's index), so each
stage's batches are a function of (stage, step within the stage) and the run's history before it.

The process group lives as long as the command (kimi.train.train destroys it at the end); each Trainer builds
its own DeviceMesh over it, so a stage may change parallel.cp, and with it dp_shard, on the same ranks.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
from omegaconf import OmegaConf

from kimi import checkpoint
from kimi.config import Config, ConfigError, _schema_keys, unknown_key
from kimi.data.files import check_files_named
from kimi.errors import DataError
from kimi.schema.run import tokens_per_step
from kimi.schema.stages import flat_overrides, stage_ends, stage_label

Log = Callable[[str], None]

# Keys a stage cannot change, and why: one model, one optimizer and lr curve, one run directory and wandb run.
FIXED = {
    "model": "the weights carry over from stage to stage",
    "optim": "the optimizer state carries over and the lr schedule is one curve over all stages (a stage's "
             "decay: true puts WSD's decay start at its first step)",
    "stages": "stages do not nest",
    "trainer.max_steps": "it is the total of the stages' steps",
    "trainer.stop_at_step": "each stage stops at its last step; set it for the run to stop early",
    "trainer.run_dir": "one run directory holds every stage",
    "trainer.resume": "set it for the run",
    "trainer.overwrite": "set it for the run",
    "trainer.init_from": "set it for the run",
    "trainer.seed": "set it for the run; a stage that starts a stream of its own derives its order from it",
    "logging.wandb": "one wandb run records every stage",
    "logging.metrics_file": "one metrics.jsonl records every stage",
    "data.tokenizer": "tokens must mean the same in every stage (the first stage's tokenizer is used)",
    "data.streaming": "stages read prepared data",
    "parallel.engine": "set it for the run",
    "parallel.fault_tolerance": "set it for the run",
}
DEGREES = ("dp_replicate", "cp", "tp", "pp")


def stage_configs(cfg: Config, world: int) -> List[Config]:
    """Each stage's config: the run's with the stage's overrides, parallel.dp_shard the ranks the other
    degrees leave (unless the stage sets it), the stages' steps resolved, trainer.max_steps their total and
    trainer.stop_at_step the stage's end (or the run's own, when it comes first)."""
    stages, merged = cfg.stages, []
    names = [s.name for s in stages]
    if cfg.data.streaming:  # a boundary reseeds or continues the loader's position, which a stream has not
        raise ConfigError("data.streaming=true does not work with stages yet: prepare the data "
                          "(python -m kimi.data.prepare) and set data.streaming=false")
    for i, stage in enumerate(stages):
        label = f"stage {i + 1}/{len(stages)} ({stage.name or '?'})"
        if not stage.name or names.count(stage.name) > 1:
            raise ConfigError(f"stages[{i}].name={stage.name!r} is invalid: give every stage a name of its "
                              "own")
        if (stage.steps > 0) == (stage.tokens > 0) or stage.steps < 0 or stage.tokens < 0:
            raise ConfigError(f"{label}: give exactly one of steps and tokens, as a positive number "
                              f"(steps={stage.steps}, tokens={stage.tokens})")
        merged.append(_with_overrides(cfg, stage, label, world))
    steps = [s.steps or -(-s.tokens // _tokens_per_step(c)) for s, c in zip(stages, merged)]
    # both filled in as trained: steps, and the tokens they take (metrics' token counts add them up)
    resolved = [replace(s, steps=n, tokens=n * _tokens_per_step(c)) for s, n, c in zip(stages, steps, merged)]
    ends, total = stage_ends(resolved), sum(steps)
    decay = [i for i, s in enumerate(stages) if s.decay]
    if decay and (len(decay) > 1 or cfg.optim.schedule != "wsd" or decay[0] == 0):
        raise ConfigError(f"stages: decay=true is set on {[stages[i].name for i in decay]}; it puts WSD's "
                          "decay start at one stage's first step: set it on one stage after the first, with "
                          f"optim.schedule=wsd (now {cfg.optim.schedule})")
    out = []
    for i, c in enumerate(merged):
        stop = ends[i] if i < len(ends) - 1 else 0  # the last stage runs to max_steps like any run
        if cfg.trainer.stop_at_step and (not stop or cfg.trainer.stop_at_step < stop):
            stop = cfg.trainer.stop_at_step
        trainer = replace(c.trainer, max_steps=total, stop_at_step=stop)
        optim = c.optim
        if decay:  # the decay's steps exactly: round(fraction * total) gives them back
            optim = replace(optim, decay_fraction=(total - ends[decay[0] - 1]) / total)
        out.append(replace(c, trainer=trainer, optim=optim, stages=resolved))
    return out


def _with_overrides(cfg: Config, stage, label: str, world: int) -> Config:
    known = set(_schema_keys(Config))
    node = OmegaConf.structured(replace(cfg, stages=[]))
    pairs = flat_overrides(dict(stage.overrides))
    for key, value in pairs:
        fixed = next((k for k in FIXED if key == k or key.startswith(k + ".")), None)
        if fixed:
            raise ConfigError(f"{label}: {key} cannot change between stages ({FIXED[fixed]}); set it for the "
                              "whole run, outside stages")
        if key not in known:
            raise ConfigError(f"{label}: {unknown_key(key)}")
        try:
            OmegaConf.update(node, key, value, merge=True)  # a list (data.sources) typed, and replaced
        except Exception as e:  # noqa: BLE001 (OmegaConf's type errors are several lines)
            raise ConfigError(f"{label}: {key}={value!r} is invalid: {str(e).splitlines()[0]}") from None
    merged: Config = OmegaConf.to_object(node)
    p = merged.parallel
    if "parallel.dp_shard" not in dict(pairs):  # the ranks the stage's other degrees leave
        others = int(np.prod([getattr(p, d) for d in DEGREES]))
        if world % others == 0:
            merged.parallel.dp_shard = world // others
    return merged


def _tokens_per_step(c: Config) -> int:
    return tokens_per_step(c.trainer, c.parallel.dp_replicate * c.parallel.dp_shard)


def validate_stages(configs: List[Config], world: int, first: int = 0, stop: int = 0) -> None:
    """validate() every stage this command will run (from `first`, up to the one trainer.stop_at_step =
    `stop` ends in) before any trains; a failure names its stage. Their warnings are left to each stage's
    own start."""
    from kimi.run.validation import validate

    stages = configs[0].stages
    for i in range(first, len(configs)):
        if stop and stage_ends(stages)[i] - stages[i].steps >= stop:
            break  # this command stops before the stage: it is checked when a later command reaches it
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                validate(configs[i], world)
            check_files_named(configs[i].data)  # a later stage's data: missing is found now, not at its start
        except (FileNotFoundError, DataError) as e:
            raise DataError(f"{stage_label(stages, i)}: {e}") from None
        except ConfigError as e:
            fix = (f"; or stop the run before this stage with trainer.stop_at_step="
                   f"{stage_ends(stages)[i] - stages[i].steps}" if "process(es) were launched" in str(e)
                   else "")
            raise ConfigError(f"{stage_label(stages, i)}: {e}{fix}") from None


def _first_stage(configs: List[Config]) -> int:
    """The stage the run's newest complete checkpoint continues in (0 without one, or without resume)."""
    t = configs[0].trainer
    latest = checkpoint.latest_complete(Path(t.run_dir) / "checkpoints") if t.resume else None
    step = latest.step if latest is not None else 0
    ends = stage_ends(configs[0].stages)
    return next((i for i, end in enumerate(ends) if step < end), len(ends) - 1)


def _share_tokenizer(configs: List[Config], first: int, log: Log) -> None:
    """Stages that read other data than the first one take its tokenizer (the file it was prepared with),
    unless data.tokenizer.model_path names one for all: a stage's token ids must mean what they meant."""
    base = configs[0].data
    if base.tokenizer.model_path or all(c.data == base for c in configs[first:]):
        return
    from kimi.data import prepare
    from kimi.parallel import init_distributed, main_rank_first, resolve_device

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        init_distributed(resolve_device(configs[0].trainer.device), configs[0].trainer.collective_timeout_s)
    path = main_rank_first(lambda: prepare(base).tokenizer.path, distributed)
    log(f"[kimi] stages: every stage's data is tokenised with the first stage's tokenizer, {path}")
    for c in configs:
        if c.data != base:
            c.data.tokenizer.model_path = str(path)


def long_document_share(data, seq_len: int, limit: int = 1 << 26) -> float:
    """The share of training tokens that come from documents of at least seq_len tokens (EOS included), over
    the first `limit` tokens of each source (a blend: by its weights)."""
    from kimi.data.blend import PreparedBlend
    from kimi.data.pack import open_split

    if isinstance(data, PreparedBlend):
        shares = [long_document_share(p, seq_len, limit) for p in data.parts]
        return float(np.dot(shares, data.weights) / np.sum(data.weights))
    tokens, eos = open_split(data, "train"), data.tokenizer.eos_id
    n = min(len(tokens), limit)
    ends = [-1]
    for lo in range(0, n, 1 << 22):  # a chunk at a time: the shards are memory-mapped
        chunk = tokens[np.arange(lo, min(n, lo + (1 << 22)))]
        ends.extend((np.flatnonzero(chunk == eos) + lo).tolist())
    if ends[-1] != n - 1:
        ends.append(n - 1)  # the last document, cut at the limit or unterminated
    lengths = np.diff(ends)
    return float(lengths[lengths >= seq_len].sum() / max(1, n))


def stage_note(data, dims, configs: List[Config], i: int) -> str:
    """The line a stage starts with: its steps, sequence, batch and layout (`dims`, kimi.parallel's
    ParallelDims), and the share of its tokens (`data`: the prepared data) from documents as long as its
    sequence."""
    c = configs[i]
    stages, t = c.stages, c.trainer
    end = stage_ends(stages)[i]
    share = long_document_share(data, t.seq_len)
    packing = ("packed with document masks (data.varlen)" if c.data.varlen
               else "packed without document masks (data.varlen=false: they attend across boundaries)")
    return (f"[kimi] {stage_label(stages, i)}: steps {end - stages[i].steps + 1}-{end} of "
            f"{t.max_steps}, seq_len {t.seq_len}, {_tokens_per_step(c):,} tokens/step, dp {dims.dp} cp "
            f"{dims.cp} tp {dims.tp} pp {dims.pp}; {share:.1%} of its training tokens come from documents "
            f">= {t.seq_len} tokens, the rest {packing}")


def any_rank(received: bool, device) -> bool:
    """Whether any rank has `received` true (a stop signal in the stage: one that came with its last step
    stops the run at the boundary); collective under torch.distributed."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(received)], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def run_stages(cfg: Config, trainer_class: type, log: Optional[Log] = None) -> Dict[str, Any]:
    """Train every stage of `cfg` in order, each with a `trainer_class` (kimi.trainer.Trainer, which stands a
    floor above this package), from the stage its run dir's newest checkpoint belongs to; the last stage's
    fit result (finished only when the last stage is)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    is_main = int(os.environ.get("RANK", "0")) == 0
    log = log or (lambda m: print(m, flush=True) if is_main else None)
    configs = stage_configs(cfg, world)
    i = _first_stage(configs)
    validate_stages(configs, world, i, cfg.trainer.stop_at_step)
    _share_tokenizer(configs, i, log)
    ends = stage_ends(configs[0].stages)
    result: Dict[str, Any] = {"finished": False, "step": 0, "val_loss": None}
    while i < len(configs):
        trainer = trainer_class(configs[i])
        start = ends[i] - configs[i].stages[i].steps
        if trainer.step < start or (trainer.step >= ends[i] and i < len(configs) - 1):
            # an older (or newer) checkpoint than the newest complete one was intact: its own stage trains
            trainer.close()
            i = next(k for k, end in enumerate(ends) if trainer.step < end or k == len(ends) - 1)
            del trainer
            continue
        if not trainer.idle:
            with trainer.runlog.tee():  # in train.log too
                trainer.log(stage_note(trainer.data, trainer.dims, configs, i))
        result = trainer.fit()
        signalled = any_rank(trainer.signals.received is not None, trainer.device)
        del trainer
        gc.collect()  # the stage's model, optimizer and mesh go before the next stage builds its own
        user_stop = bool(cfg.trainer.stop_at_step and result["step"] >= cfg.trainer.stop_at_step)
        if user_stop and result["step"] == ends[i] and i < len(configs) - 1 and not signalled:
            log(f"[kimi] stopped at step {result['step']} (trainer.stop_at_step={cfg.trainer.stop_at_step}); "
                "to go on, run the same command with trainer.stop_at_step raised or dropped")
        if result["step"] < ends[i] or i == len(configs) - 1 or signalled or user_stop:
            return result  # stopped inside the stage (a signal, trainer.stop_at_step), or the run is done
        # the next stages continue this run (trainer.resume=false, overwrite=true meant the run's start)
        for c in configs[i + 1:]:
            c.trainer = replace(c.trainer, resume=True, overwrite=False)
        i += 1
    return result
