"""The torch engine: one object owns everything about a step that depends on how the model is distributed.

The trainer's loop only asks an engine (interface.Engine) to run a micro-batch forward and backward
(``forward_backward``), to evaluate one (``eval_loss``), to finish the step (``step``: gradient clipping, the
optimizer, QK-Clip, the lr schedule) and for its checkpoint state; gradient accumulation, the NaN check,
metrics and logging stay in the trainer. ``TorchEngine`` is the torch-native stack (FSDP2 / HSDP, tensor,
sequence and pipeline parallelism from torch.distributed), selected by ``parallel.engine=torch``;
``DeepSpeedEngine`` (deepspeed_engine.py, ``parallel.engine=deepspeed``) implements the same interface over
DeepSpeed's ZeRO. A new parallel dimension changes ``parallelize`` and the engines, not the trainer.

The model arrives built on the meta device: the engine applies parallelism to it, then materialises only
this rank's shards on the device and initialises them (``materialize``), so no rank ever holds the whole
model, and every layout starts from the weights of one process (per-parameter seeded initialisation).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import loss_parallel

from kimi.data import Batch
from kimi.errors import ConfigError
from kimi.model import KimiModel
from kimi.model.moe import set_aux_grad_scale
from kimi.optim import build_optimizer, build_qk_clip, build_scheduler
from kimi.precision import apply_low_precision, float8_gather
from kimi.precision.registry import precision_for
from kimi.schema.pipeline import pipeline_microbatches
from kimi.schema.vocabulary import RootConfig as Config

from .cuda_graphs import StepGraph
from .dims import ParallelDims
from .family_stats import FamilyStats
from .engine_base import EngineBase
from .parallelize import parallelize
from .pipeline import TiedEnds, build_schedule
from .tensor_parallel import clip_grad_norm_


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (a loss-parallel loss) as the plain tensor every rank holds."""
    return x.full_tensor() if isinstance(x, DTensor) else x


@torch.no_grad()
def materialize(model: KimiModel, device: torch.device) -> None:
    """Allocate this rank's shards of a meta-device model on `device` and initialise them: each parameter's
    full value is drawn from a generator seeded by its name (KimiModel.init_rules), and each rank keeps
    the block it holds, so every layout gets one process's weights whatever it shards."""
    model.to_empty(device=device)
    if model.cfg.tie_embeddings and model.embed is not None and model.lm_head is not None:
        model.lm_head.weight = model.embed.weight  # to_empty gives plain tensors new Parameters: tie again
    rules = model.init_rules()
    for name, p in model.named_parameters():
        full = torch.empty(p.shape, dtype=p.dtype, device=device)
        model.init_parameter(name, full, rules)
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            p.to_local().copy_(full[tuple(slice(o, o + s) for o, s in zip(offset, shape))])
        else:
            p.copy_(full)
    model.init_buffers()


class TorchEngine(EngineBase):
    def __init__(self, cfg: Config, dims: ParallelDims, mesh: DeviceMesh | None, device: torch.device,
                 model: KimiModel):
        p, t = cfg.parallel, cfg.trainer
        self.cfg, self.dims, self.mesh, self.device = cfg, dims, mesh, device
        if p.cuda_graphs != "none" and device.type != "cuda":  # trainer.device=auto without CUDA
            raise ConfigError(f"parallel.cuda_graphs={p.cuda_graphs} needs a CUDA GPU and this run's device "
                              f"is {device.type}: set parallel.cuda_graphs=none")
        # regions: a step's micro-batches are one generation of the recorded graphs (_begin_graph_step)
        self.graph_regions = self.graph_step_begins = p.cuda_graphs == "regions"
        self.expert_mesh = dims.build_expert_mesh(device.type)
        # before any parallelism, as torchao asks
        self.low_precision = apply_low_precision(model, cfg, device, fsdp=dims.fsdp)
        bf16 = precision_for(t.precision).BF16  # fp8 and mxfp8 run the rest of the model as bf16 does
        parts = parallelize(model, p, dims, mesh, bf16=bf16, seq_len=t.seq_len, expert_mesh=self.expert_mesh)
        for part in parts:  # before joining them: to_empty gives plain parameters new objects
            materialize(part, device)
        self.float8_gather = float8_gather(cfg, dims.fsdp)  # None unless precision.fp8.fsdp_all_gather
        if self.float8_gather:
            self.float8_gather.attach(parts, device)
        # the model parts this rank runs (its pipeline stages), whose forwards diagnostics observe
        self.parts = parts
        self.model = KimiModel.union(parts)
        self.schedule = self.pp_rank = None
        self.cp_rank = mesh["cp"].get_local_rank() if dims.cp > 1 else 0
        if dims.pp > 1:
            self.pp_rank = mesh["pp"].get_local_rank()  # 0 feeds the tokens, pp - 1 computes the loss
            self.schedule = build_schedule(parts, mesh["pp"], device, p.pp_schedule,
                                           pipeline_microbatches(cfg))
        self.tied_ends = TiedEnds(mesh) if dims.pp > 1 and cfg.model.tie_embeddings else None
        group = dims.stage_group(mesh)
        self.optimizer = build_optimizer(self.model, cfg.optim, process_group=group)
        self.qk_clip = build_qk_clip(self.model, cfg.optim, group=group,
                                     head_group=mesh["tp"].get_group() if dims.tp > 1 else None)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.max_steps)
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        # parallel.cuda_graphs=step: each micro-batch's forward and backward replayed from one graph
        self.step_graph = StepGraph(self.model, self._forward_backward) if p.cuda_graphs == "step" else None

    # ---- one step -----------------------------------------------------------------------------------
    def loss_context(self):
        """torch's loss_parallel() when the LM head's logits are sharded over the vocabulary, else nothing."""
        return loss_parallel() if self.dims.loss_parallel else nullcontext()

    def _shard(self, batch: Batch) -> Batch:
        """The batch on this rank's device, cut to its context-parallel shard of every row: the cp ranks
        read the same rows, rank r keeps the r-th of cp consecutive column ranges (tokens, labels and
        document starts alike). Each shard's loss is the mean over its tokens; all shards hold as many, so
        the gradient average over the cp ranks (FSDP's, see dims.py) is the whole rows' mean."""
        batch = batch.to(self.device, non_blocking=True)
        if self.dims.cp == 1:
            return batch
        n = batch.input_ids.shape[1] // self.dims.cp
        cols = slice(self.cp_rank * n, (self.cp_rank + 1) * n)
        return dataclasses.replace(batch, **{k: getattr(batch, k)[:, cols] for k in ("input_ids", "labels",
                                                                                      "doc_starts")})

    def _loss(self, batch: Batch) -> torch.Tensor:
        with self.autocast, self.loss_context():
            return self.model(batch.input_ids, doc_starts=self.doc_starts(batch), labels=batch.labels)

    def _pipeline(self, batch: Batch, train: bool) -> torch.Tensor:
        """One pass of the schedule (forward and backward, or forward only) over the batch's micro-batches;
        their mean loss, on every stage. The schedule scales gradients by 1 / micro-batches itself."""
        first, last = self.pp_rank == 0, self.pp_rank == self.dims.pp - 1
        args = (batch.input_ids,) if first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": batch.labels, "losses": losses} if last else {}
        if self.doc_starts(batch) is not None:  # every stage needs them, split by rows like the tokens
            kwargs["doc_starts"] = batch.doc_starts
        with self.autocast, self.loss_context():
            (self.schedule.step if train else self.schedule.eval)(*args, **kwargs)
        loss = _plain(torch.stack(losses).mean().detach()) if last else torch.zeros((), device=self.device)
        return funcol.all_reduce(loss, "sum", group=self.mesh["pp"]).wait()

    def forward_backward(self, batch: Batch, scale: float) -> torch.Tensor:
        """Forward and backward of one batch, gradients scaled by `scale` (1 / accumulation steps) and
        added to those of earlier batches of the step; returns the batch's mean loss (detached)."""
        self.model.train()
        self._begin_graph_step()
        batch = self._shard(batch)
        # MoE auxiliary losses enter the backward beside the loss, scaled like it (the pipeline schedule
        # divides all gradients by its micro-batches afterwards, theirs included)
        set_aux_grad_scale(self.model, scale)
        if self.schedule is not None:
            if scale != 1.0:
                raise ValueError("the pipeline accumulates over its micro-batches: no gradient accumulation")
            return self._pipeline(batch, train=True)
        if self.step_graph is not None:
            return _plain(self.step_graph(batch, scale))
        return _plain(self._forward_backward(batch, scale).detach())

    def _forward_backward(self, batch: Batch, scale: float) -> torch.Tensor:
        loss = self._loss(batch)
        with self.loss_context():
            (loss * scale).backward()
        return loss

    def _begin_graph_step(self, evaluating: bool = False) -> None:
        """Under parallel.cuda_graphs, tell inductor's cudagraph trees where a step begins: the outputs of
        earlier replays may be overwritten from here on. Once per optimizer step, not per micro-batch: what a
        micro-batch's graphs leave for the step's end (the max logits QK-Clip reads) must outlive the next
        micro-batch's replays. Each evaluation batch is a step of its own."""
        if self.graph_step_begins or (evaluating and self.graph_regions):
            torch.compiler.cudagraph_mark_step_begin()
            self.graph_step_begins = evaluating  # the training step after an evaluation begins anew

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        self._begin_graph_step(evaluating=True)
        batch = self._shard(batch)
        return self._pipeline(batch, train=False) if self.schedule is not None else _plain(self._loss(batch))

    def step(self, max_norm: float, family_stats: bool = False) -> dict:
        """Finish the step's gradients, clip them to `max_norm` (0: no clipping), update, QK-Clip, advance
        the lr schedule. Returns the gradient norm before clipping and the lr used; with `family_stats`
        (the trainer's diagnostics steps) also each optimizer family's gradient norm before clipping and
        update RMS (family_stats.py: it copies the parameters, so only when asked)."""
        if self.tied_ends:  # the end stages' copies of tied embeddings take the whole gradient
            self.tied_ends.sum_grads(self.model)
        max_norm = max_norm if max_norm > 0 else float("inf")
        pp_group = self.mesh["pp"] if self.dims.pp > 1 else None
        uncounted = self.tied_ends.duplicate(self.model) if self.tied_ends else None
        families = FamilyStats(self.optimizer, pp_group, uncounted) if family_stats else None
        if self.dims.world > 1:
            # plain and DTensor gradients on different meshes, stages' norms summed: torch's cannot do either,
            # and its foreach calls on DTensors cost seconds of sharding propagation at the first step
            grad_norm = clip_grad_norm_(self.model.parameters(), max_norm, pp_group, uncounted)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        # the step's one read before the update (after it, a read would wait for the update to finish)
        grad_norm = _plain(grad_norm).item()
        self.graph_step_begins = self.graph_regions
        if not math.isfinite(grad_norm):  # no update: the trainer stops on the norm returned
            self.zero_grads()
            return {"grad_norm": grad_norm, "lr": lr}
        self.optimizer.step()
        stats = families.finish() if families is not None else {}  # the optimizer's update, before QK-Clip's
        if self.qk_clip is not None:  # after any optimizer's update (K2)
            self.qk_clip()
        self._weights_changed()
        self.zero_grads()
        return {"grad_norm": grad_norm, "lr": lr, **self.after_update(), **stats}

    def zero_grads(self) -> None:
        """The gradients ready for the next step: freed, or, under a step graph (which adds into them where
        it found them), zeroed in place."""
        self.optimizer.zero_grad(set_to_none=self.step_graph is None)

    # ---- diagnostics and the run dir ----------------------------------------------------------------
    def family_stats_missing(self) -> str | None:
        return None

    def eval_observed(self, batch: Batch, observe):
        if self.schedule is not None:
            # Switching from training to evaluation, torch's pipeline schedule first runs every stage once to
            # infer shapes (later stages on uninitialised tensors): an evaluation before the observed one
            # takes that run.
            self.eval_loss(batch)
        with observe(self.parts) as seen:
            self.eval_loss(batch)
        return seen

    def layout(self) -> str | None:
        d, seq_len = self.dims, self.cfg.trainer.seq_len
        if not d.enabled:
            return None
        experts = f"; MoE experts split over ep={d.ep} of the dp_shard ranks" if d.ep > 1 else ""
        context = (f"; each sequence split into cp={d.cp} shards of {seq_len // d.cp} tokens" if d.cp > 1
                   else "")
        return (f"[kimi] parallel: pp={d.pp} x dp_replicate={d.dp_replicate} x dp_shard={d.dp_shard} x "
                f"cp={d.cp} x tp={d.tp} over {d.world} processes{experts}{context}")

    def write_run_files(self, run_dir) -> None:
        """Nothing: the config says all there is."""

    def _weights_changed(self) -> None:
        """The float8 gather's scales follow the weights (collective)."""
        if self.float8_gather:
            self.float8_gather.refresh_scales(self.model)

    def _plain(self, state: dict) -> dict:
        """A state dict as checkpoints hold it: plain fp32 tensors, also under the float8 gather."""
        return self.float8_gather.plain(state) if self.float8_gather else state

    # ---- checkpoint state ---------------------------------------------------------------------------
    def _optim_aliases(self) -> dict[str, str]:
        """Optimizer-state names that differ from a whole model's: a tied LM head held without its embedding
        (the last pipeline stage's copy of the tied matrix) keeps its state under the embedding's name, as
        one process does, so a checkpoint moves between layouts."""
        m = self.model
        if m.cfg.tie_embeddings and m.embed is None and m.lm_head is not None:
            return {"lm_head.weight": "embed.weight"}
        return {}

    def state_dict(self) -> dict:
        """Model, optimizer and lr-schedule state, each tensor laid out like its parameter (DTensors for
        sharded ones), under the single-device names: torch.distributed.checkpoint saves it and reloads it
        into another layout. Collective."""
        model_sd, optim_sd = map(self._plain, get_state_dict(self.model, self.optimizer))
        return {"model": model_sd, "optim": _rename(optim_sd, self._optim_aliases()),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Weights, optimizer moments and the schedule's position come from `state`; hyper-parameters (lr,
        weight decay, betas, ...) and the schedule's shape stay this run's config, so a resumed run can
        change them (the trainer lists what changed)."""
        back = {v: k for k, v in self._optim_aliases().items()}
        with keep_hyperparameters(self.optimizer, self.scheduler, state["scheduler"]):
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=_rename(state["optim"], back))
        self._weights_changed()

    def model_state_dict(self) -> dict:
        """The weights alone, laid out as in ``state_dict`` (trainer.init_from loads into it). Collective."""
        return self._plain(get_model_state_dict(self.model))

    def load_model_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state)
        self._weights_changed()


@contextmanager
def keep_hyperparameters(optimizer, scheduler, scheduler_state: dict):
    """Around loading optimizer state: the lr schedule's position comes from ``scheduler_state``, while the
    hyper-parameters and the schedule's shape stay this run's config, and lr is set to where that schedule
    is at the loaded position."""
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    yield
    scheduler.load_state_dict(scheduler_state)
    for group, h in zip(optimizer.param_groups, hyper):
        group.update(h)
    scheduler.base_lrs = [h["initial_lr"] for h in hyper]
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)


def _rename(optim_sd: dict, names: dict[str, str]) -> dict:
    if not names:
        return optim_sd
    return {"state": {names.get(k, k): v for k, v in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [names.get(p, p) for p in g["params"]]}
                             for g in optim_sd["param_groups"]]}
