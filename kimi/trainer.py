"""The training loop: batches through the engine, with accumulation, evaluation, checkpoints and metrics.

``Trainer(cfg).fit()`` is all ``train.py`` does. The order of work in ``__init__`` is deliberate: validate
the whole config first (no data is downloaded for a run whose config cannot work), then data, the model on
the meta device, the newest intact checkpoint in ``<run_dir>/checkpoints`` (checked against this config),
the engine (parallelism, this rank's shards, optimizer) and its state. A run with nothing left to train
builds no engine, and its ``fit`` starts no metrics, wandb or sample. ``fit`` keeps the config it trains
with, the optimizer's routing table and rank 0's console output in the run dir (kimi/run/runlog.py).
Everything that depends on how the model is distributed lives in the engine (kimi/parallel/interface.py);
where a run starts from is kimi/run/resume.py's, its saves kimi/checkpoint/saver.py's, its stop signals
kimi/run/signals.py's.
"""

from __future__ import annotations

import functools
import math
import os
import signal
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from kimi.checkpoint.saver import Saver
from kimi.config import Config, config_dict, resolve_vocab, to_config
from kimi.data import prepare
from kimi.data.rank_batches import rank_streams
from kimi.diagnostics import Diagnostics
from kimi.eval.in_training import TaskScores
from kimi.model import KimiModel
from kimi.model.decode import decode_blocker, final_sample
from kimi.optim.memory import check_training_fits
from kimi.parallel import (ParallelDims, build_engine, checkpoint_group, init_distributed, main_rank_first,
                           mean_over_ranks, resolve_device)
from kimi.parallel.interface import RunState
from kimi.parallel.watchdog import Watchdog
from kimi.precision.registry import precision_for
from kimi.run import cpu, rundir
from kimi.run.divergence import check_finite
from kimi.run.metrics import MetricsLogger, qk_clip_record
from kimi.run.peaks import PeakFlops
from kimi.run.progress import ProgressWindow, banner, cpu_size_note
from kimi.run.profiling import StepProfiler
from kimi.run.resume import checkpoint_to_resume, load_weights, resume, resume_note, weights_to_start_from
from kimi.run.runlog import RunLog, data_identity, nothing_to_train, save_config, write_routing
from kimi.run.signals import StopSignals, release_on_exit, stop_requested, stopped_note
from kimi.run.step_time import StepClock
from kimi.run.validation import validate
from kimi.schema.run import tokens_per_step


class Trainer:
    def __init__(self, cfg: Union[Config, DictConfig, Dict[str, Any]]):
        self.cfg = cfg = to_config(cfg)
        validate(cfg)
        check_training_fits(cfg, resolve_device(cfg.trainer.device))  # one line, not an allocator's traceback
        # A scheduler's SIGTERM while the run starts (data, model, resume) is kept, not fatal: the run stops
        # with a checkpoint after its first step. Ctrl-C still interrupts the start at once.
        self.step, self.rank = 0, int(os.environ.get("RANK", "0"))
        self.clock = StepClock(cfg.logging.step_time_sync)  # where each step's time goes
        self.signals = StopSignals(lambda: (self.rank, self.step))
        self.signals.catch(signal.SIGTERM)
        try:
            self._open()
        finally:  # fit installs its own handlers: a Trainer that is never fit leaves none behind
            self.signals.restore()

    def _open(self) -> None:
        cfg = self.cfg
        self.dims = dims = ParallelDims.from_config(cfg.parallel)
        t = cfg.trainer
        self.run_dir, self.ckpt_dir = Path(t.run_dir), Path(t.run_dir) / "checkpoints"
        self.device = resolve_device(t.device)
        if dims.enabled:
            init_distributed(self.device, t.collective_timeout_s)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.mesh = dims.build_mesh(self.device.type) if dims.enabled else None
        self.rank = dist.get_rank() if dims.enabled else 0
        self.dp_rank = dims.dp_rank(self.mesh)  # ranks of one tensor-parallel group read the same data
        self.is_main = self.rank == 0
        note = functools.partial(resume_note, self.ckpt_dir)  # what a hang's last message says
        self.watchdog = Watchdog(t.collective_timeout_s, note).start() if dims.enabled else None
        self.lock, self.metrics, self.engine = None, None, None
        self.runlog = RunLog(enabled=self.is_main)  # rank 0's stdout, also in <run_dir>/train.log
        try:
            with self.runlog.tee():
                self.lock = release_on_exit(rundir.open_run_dir(self.run_dir, t.resume, t.overwrite,
                                                                self.is_main, dims.enabled, self.log))
                self.runlog.open(self.run_dir)
                self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        cfg, t, dims = self.cfg, self.cfg.trainer, self.dims
        self.threads = cpu.set_threads(t.threads, self.device)  # for the banner: how many, and why
        torch.manual_seed(t.seed)

        # Rank 0 tokenises and packs; the others then find the finished cache instead of racing to write it.
        with self.signals.at_once():
            self.data = main_rank_first(lambda: prepare(cfg.data), dims.enabled)
        tok = self.data.tokenizer
        resolve_vocab(cfg.model, tok.vocab_size)
        self.loader, self.val_batches = rank_streams(self.data, t, self.dp_rank, dims.data_world)
        self.task_scores = TaskScores(t, tok, decode_blocker(cfg.parallel), self.log)

        # Every rank builds the model on the meta device (no memory); the engine applies parallelism, then
        # allocates and initialises only this rank's shards.
        with torch.device("meta"):
            model = KimiModel(cfg.model)
        self.flops_per_token = model.flops_per_token(t.seq_len)  # whole-model figures, before any split
        self.num_params = (model.num_params(), model.num_params(exclude_embedding=True))
        self.run_id = rundir.new_run_id()  # a resumed run keeps the checkpoint's run id
        group = checkpoint_group(t.collective_timeout_s) if t.async_checkpoint and dims.enabled else None
        self.saver = Saver(self.ckpt_dir, t.keep_checkpoints, t.async_checkpoint, group, self.log)
        self._last_val: Optional[float] = None
        start = checkpoint_to_resume(cfg, self.ckpt_dir, tok.sha256, self.log)
        self.step = int(start[1]["step"]) if start else self.step
        weights = None if start else weights_to_start_from(cfg, self.run_dir, tok.sha256, self.log)
        self.idle = self.step >= t.max_steps or bool(t.stop_at_step and self.step >= t.stop_at_step)
        if self.idle:  # nothing to train: no weights allocated or loaded; fit says so
            return
        self.engine = build_engine(cfg, dims, self.mesh, self.device, model)
        self.model, self.optimizer = self.engine.model, self.engine.optimizer
        self.diagnostics = Diagnostics(cfg, self.run_dir, self.engine, self.mesh, dims, self.is_main,
                                       self.log)
        if start:
            self.step, run_id = resume(cfg, self.engine, self.loader, *start, self.log)
            self.run_id = run_id or self.run_id
        elif weights:
            load_weights(self.engine, weights, self.log)
        # torchft: a late replica group takes its peers' state here
        self.engine.join(RunState(lambda: {"step": self.step, "loader": self.loader.state_dict()},
                                  self._take_state, self.log))

    def log(self, message: str) -> None:
        """Console output, from rank 0 only."""
        if self.is_main:
            print(message, flush=True)

    def close(self) -> None:
        """Restore the signal handlers, stop the watchdog and unlock the run dir."""
        self.signals.restore()
        if self.engine is not None:
            self.engine.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.lock is not None:
            self.lock.release()

    def _take_state(self, state: Dict[str, Any]) -> None:
        """A peer's step and data position (Engine.join); this rank keeps its own data rank."""
        self.loader.load_state_dict(state["loader"])
        self.step = state["step"]

    # ---- the loop ------------------------------------------------------------------------------------
    def train_step(self, family_stats: bool = False) -> Dict[str, float]:
        """One optimizer step, as the engine runs it (Engine.run_step: torchft's again until it commits);
        family_stats: also each optimizer family's gradient norm and update RMS (a diagnostics step)."""
        return self.engine.run_step(lambda: self._step(family_stats))

    def _step(self, family_stats: bool) -> Dict[str, float]:
        t = self.cfg.trainer
        total = torch.zeros((), device=self.device)
        for _ in range(t.grad_accum_steps):
            with self.clock("data"):
                batch = self.loader.next_batch()
            with self.clock("forward_backward"):
                total += self.engine.forward_backward(batch, scale=1.0 / t.grad_accum_steps)
        with self.clock("forward_backward"):  # one loss on every rank (all stop alike on NaN), read once
            loss = mean_over_ranks(total / t.grad_accum_steps).item()  # (again, it would wait for the update)
        check_finite("loss", loss, self.step, self.ckpt_dir, t.precision)
        with self.clock("optimizer"):
            out = self.engine.step(self.cfg.optim.grad_clip, family_stats=family_stats)
        # a global norm, the same on every rank; the torch engine has skipped the update for it
        check_finite("the gradient norm", out["grad_norm"], self.step, self.ckpt_dir, t.precision)
        self.step += 1
        return {"loss": loss, **out}

    @torch.no_grad()
    def evaluate(self) -> float:
        losses = torch.stack([self.engine.eval_loss(b) for b in self.val_batches])
        return self.val_batches.reduce(losses, mean_over_ranks)  # a blend's per-source losses in .by_source

    def save_checkpoint(self, wait: bool = True) -> Path:
        """Checkpoint this step. With trainer.async_checkpoint and wait=False, return once the state is staged
        and let it be written while training goes on (finish_checkpoint completes it)."""
        return self.saver.save(self.step, self.engine, self.loader, config_dict(self.cfg),
                               data_identity(self.run_dir, self.data, self.is_main), self.run_id, wait)

    def finish_checkpoint(self) -> Optional[Path]:
        """Wait for the checkpoint in flight (if any), then mark it complete and rotate; collective."""
        return self.saver.finish()

    def fit(self) -> Dict[str, Any]:
        with self.runlog.tee():  # rank 0's console output, also in <run_dir>/train.log
            if self.idle:  # no metrics, wandb, plot or sample: the run dir stays as it was
                self.close()
                return nothing_to_train(self.step, self.cfg.trainer, self.log)
            return self._fit()

    def _fit(self) -> Dict[str, Any]:
        t, cfg = self.cfg.trainer, self.cfg
        self.signals.catch(signal.SIGTERM, signal.SIGINT)
        self.profiler = StepProfiler.from_config(cfg, self.rank, self.device, self.run_dir, self.log)
        try:
            self._start()
            result = self._loop()
        finally:
            self.profiler.close()
            self.saver.abandon()  # a save still in flight here will not complete: the run failed
            if self.metrics is not None:
                self.metrics.close(stopping=self.signals.received is not None)
            self.close()
        if cfg.logging.plot and self.metrics.history:
            if png := self.metrics.plot(self.run_dir / "loss_curve.png"):
                self.log(f"[kimi] loss curve: {png}")
        if result["finished"] and (text := final_sample(self.model, self.data, t, self.task_scores.blocked,
                                                        self.step, self.log)) is not None:
            result["sample"] = text
        return result

    def _start(self) -> None:
        """What a start that trains writes first: the routing table (the first rank of each pipeline stage),
        the banner, the config it trains with, and metrics.jsonl's start (and wandb's)."""
        cfg = self.cfg
        routing = write_routing(self.run_dir, self.engine, self.mesh, cfg.optim.name)
        self.log(banner(cfg, self.dims, self.num_params, self.flops_per_token, self.data, self.device,
                        routing, self.engine.layout(), self.threads))
        if self.is_main:
            save_config(self.run_dir, config_dict(cfg), self.step)
            self.engine.write_run_files(self.run_dir)
        self.metrics = MetricsLogger(self.run_dir, cfg.logging, config_dict(cfg), resume_step=self.step,
                                     enabled=self.is_main, run_id=self.run_id, saver=self.saver,
                                     tokens_per_step=tokens_per_step(cfg.trainer, self.dims.dp))

    def _loop(self) -> Dict[str, Any]:
        t = self.cfg.trainer
        # MFU over all devices, against the rate of the compute dtype (a CPU's bf16 can be far slower)
        peak = PeakFlops(self.device, t.peak_flops, self.dims.world,
                         dtype=precision_for(t.precision).compute_dtype())
        notes = (peak.describe(), ProgressWindow.header(t.log_every),
                 cpu_size_note(self.device, self.num_params[0]), self.diagnostics.note())
        self.log("\n".join(note for note in notes if note))
        if self.step == 0 and t.eval_every:  # the starting point of the validation curve
            self._validate_and_report({"step": 0})
        window = ProgressWindow(peak, self.metrics.tokens_per_step, self.flops_per_token, self.step,
                                t.max_steps, self.device, self.clock)
        last_saved, self.signals.starting = None, False  # a second signal now interrupts training
        while self.step < t.max_steps:
            diagnose = self.diagnostics.due(self.step + 1)
            with self.profiler.around(self.step + 1):
                out = self.train_step(family_stats=diagnose)
            if self.watchdog is not None:
                self.watchdog.progress(self.step)
            window.add(out["loss"])
            text, record = window.due(self.step, out, t.log_every)
            if text:
                self.log(text)
            if record:
                record.update(qk_clip_record(self.engine.qk_clip_stats))
            if (t.eval_every and self.step % t.eval_every == 0) or self.step == t.max_steps:
                with window.paused("eval"):  # throughput is about training only
                    record = self._validate_and_report({**record, "step": self.step}, log=False)
            images, tables = {}, {}
            if diagnose:
                with window.paused("diagnostics"):
                    found, images, tables = self.diagnostics.run(self.step, self.val_batches[0], out)
                # QK-Clip's summary keys, in both, are the diagnostics' there: the same numbers, but gathered
                # from every pipeline stage (the log step's come from rank 0's stage)
                record = {"step": self.step, **record, **found}
            if record:
                with window.paused("logging"):  # the PNG, wandb's and TensorBoard's writes are not training
                    self.metrics.log({**record, **window.pauses()}, images, tables)
            stop = (stop_requested(self.signals, self.saver, self.device, self.dims.enabled)
                    or bool(t.stop_at_step and self.step >= t.stop_at_step))
            last = self.step == t.max_steps or stop
            if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or last:
                with window.paused("checkpoint"), self.signals.saving():  # a second signal waits for it
                    last_saved = self.save_checkpoint(wait=last)
            if stop:
                self.log(stopped_note(self.step, last_saved, self.signals.received, t, self.cfg.stages))
                return {"finished": False, "step": self.step, "val_loss": self._last_val}
        return {"finished": True, "step": self.step, "val_loss": self._last_val}

    def _validate_and_report(self, record: Dict[str, Any], log: bool = True) -> Dict[str, Any]:
        self._last_val = val = self.evaluate()
        ppl = math.exp(min(val, 50.0))
        self.log(f"[kimi] step {self.step}: validation loss {val:.4f}, perplexity "
                 f"{ppl:.2f}{self.val_batches.note()}")
        record = {**record, "val_loss": val, "val_ppl": ppl, **self.val_batches.by_source,
                  **self.task_scores(self.model, self.step)}
        if log:
            self.metrics.log(record)
        return record
