"""parallel.engine=deepspeed: DeepSpeed's ZeRO, stages 1-3, over the data-parallel ranks (parallel.dp_shard).

The same seam (:class:`kimi.parallel.interface.Engine`) as TorchEngine; the trainer does not know which runs.
DeepSpeed owns the model's memory layout (partitioned gradients, optimizer state and, at stage 3,
parameters), the gradient reduction, clipping and the fp32 master weights under bf16. Our optimizer is its
client (zero_client.py), so MuonClip orthogonalises every matrix exactly once per step, after
accumulation, across DeepSpeed's partitions, and QK-Clip scales the fp32 masters.

Every rank builds the whole model (seeded per parameter, so equal to one process's) before DeepSpeed
partitions it. The DeepSpeed JSON config is generated from the Hydra config (:func:`deepspeed_config`) and
written to the run dir as deepspeed.json. DeepSpeed's CPU accelerator runs on gloo, which the tests use.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from kimi.data import Batch
from kimi.errors import ConfigError
from kimi.model import KimiModel
from kimi.model.moe import set_aux_grad_scale
from kimi.model.transformer import Block
from kimi.optim import build_scheduler
from kimi.precision.registry import precision_for
from kimi.schema.vocabulary import RootConfig as Config

from .dims import ParallelDims
from .engine import keep_hyperparameters, materialize
from .engine_rules import DEEPSPEED_MISSING
from .engine_base import EngineBase
from .zero_client import ZeroClient, inner_factory


class _OurClientIsTested(logging.Filter):
    """DeepSpeed warns about any client optimizer it does not know; ours is tested with it (tests/)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


def _import_deepspeed():
    # Importing it probes the C compiler for its async-IO op; those compiler commands are logged at INFO
    # through the root logger Hydra configures, into train.log.
    logging.getLogger("compilers").setLevel(logging.WARNING)
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(DEEPSPEED_MISSING) from None
    # Its shared-memory collectives extension compiles for over a minute at the first init_distributed and
    # only speeds up CPU-only all-reduce: gloo does the work here.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.addFilter(_OurClientIsTested())
    return deepspeed


def deepspeed_config(cfg: Config, dims: ParallelDims) -> dict:
    """The DeepSpeed JSON config that runs what the Hydra config says."""
    t, ds = cfg.trainer, cfg.parallel.deepspeed
    zero = {"stage": ds.zero_stage, "reduce_bucket_size": ds.reduce_bucket_size,
            "overlap_comm": ds.overlap_comm,
            "contiguous_gradients": True}
    if ds.zero_stage < 3:
        zero["allgather_bucket_size"] = ds.allgather_bucket_size
    else:  # one sub-group: DeepSpeed steps the client once per sub-group, and MuonClip must see every matrix
        zero["sub_group_size"] = 10**15
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": t.micro_batch_size * t.grad_accum_steps * dims.dp,
        "gradient_clipping": cfg.optim.grad_clip,
        "bf16": {"enabled": precision_for(t.precision).BF16},  # the converting ones are refused (rules.py)
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # our client optimizer (ZeroClient)
        "zero_force_ds_cpu_optimizer": False,  # offload keeps our optimizer, on the CPU
        "steps_per_print": 2**31 - 1,  # the trainer prints progress
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine(EngineBase):
    def __init__(self, cfg: Config, dims: ParallelDims, mesh: DeviceMesh | None, device: torch.device,
                 model: KimiModel):
        deepspeed = _import_deepspeed()
        if not dist.is_initialized():  # one process without torchrun: DeepSpeed still wants a process group
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0,
                                    world_size=1)
        self.cfg, self.dims, self.mesh, self.device = cfg, dims, mesh, device
        self.pp_rank = None  # no pipeline
        materialize(model, device)
        client, optimizer_config = self.client_optimizer(cfg, model)
        self.ds_config = {**deepspeed_config(cfg, dims), **optimizer_config}
        self.ds, zero_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=client, model_parameters=None if client else model.parameters(),
            config=self.ds_config, dist_init_required=False)
        if cfg.parallel.deepspeed.zero_stage == 3:
            _declare_parameter_uses(deepspeed, model)
        if client is not None:
            client.bind(zero_optimizer)
        # the optimizer whose param groups DeepSpeed steps (its own, inside its ZeRO wrapper, when not ours)
        self.model, self.optimizer = model, client if client is not None else zero_optimizer.optimizer
        self.parts = [model]  # what diagnostics observe (as TorchEngine.parts)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.trainer.max_steps)

    def client_optimizer(self, cfg: Config, model: KimiModel) -> tuple[ZeroClient | None, dict]:
        """The optimizer DeepSpeed wraps (ours, over its partitions), and DeepSpeed config entries for it.
        A subclass may return (None, {"optimizer": ...}) for one of DeepSpeed's own (bench/zero.py)."""
        return ZeroClient(model, cfg.optim.lr, inner_factory(cfg.optim, model)), {}

    # ---- one step -----------------------------------------------------------------------------------
    def _loss(self, batch: Batch) -> torch.Tensor:
        return self.ds(batch.input_ids, doc_starts=self.doc_starts(batch), labels=batch.labels)

    def forward_backward(self, batch: Batch, scale: float) -> torch.Tensor:
        """As TorchEngine's: DeepSpeed divides the loss by its gradient_accumulation_steps, which is
        trainer.grad_accum_steps, so `scale` is that already."""
        gas = self.ds.gradient_accumulation_steps()
        if abs(scale * gas - 1.0) > 1e-9:
            raise ValueError(f"DeepSpeed scales gradients by 1/{gas}; the trainer asked for {scale}")
        self.ds.train()
        batch = batch.to(self.device, non_blocking=True)
        set_aux_grad_scale(self.model, scale)
        loss = self._loss(batch)
        self.ds.backward(loss)
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()  # counts the micro-batch; the boundary's step() is `step` below
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        self.ds.eval()
        return self._loss(batch.to(self.device, non_blocking=True))

    def step(self, max_norm: float, family_stats: bool = False) -> dict:
        """Reduce, clip (DeepSpeed's gradient_clipping is optim.grad_clip), update through the client
        optimizer (and QK-Clip), advance the lr schedule. Returns the gradient norm before clipping and lr.
        No per-family statistics (`family_stats`): DeepSpeed clips and steps its flat partitions in one
        call, with no point between to read them (the trainer's diagnostics say so once)."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.ds.step()
        grad_norm = self.ds.get_global_grad_norm()
        return {"grad_norm": float(grad_norm), "lr": lr, **self.after_update()}

    @property
    def qk_clip(self):
        """ZeroClient's QK-Clip hook; DeepSpeed's own optimizers have none."""
        return self.optimizer.qk_clip if isinstance(self.optimizer, ZeroClient) else None

    # ---- diagnostics and the run dir ----------------------------------------------------------------
    def family_stats_missing(self) -> str | None:
        return "parallel.engine=deepspeed (DeepSpeed clips and steps its partitions in one call)"

    def eval_observed(self, batch: Batch, observe):
        with observe(self.parts) as seen:
            self.eval_loss(batch)
        return seen

    def layout(self) -> str | None:
        if not self.dims.enabled:
            return None
        ds = self.cfg.parallel.deepspeed
        offload = ", optimizer state offloaded to CPU" if ds.offload_optimizer else ""
        return (f"[kimi] parallel: DeepSpeed ZeRO-{ds.zero_stage} over dp_shard={self.dims.dp_shard} "
                f"processes{offload}; its config in {self.cfg.trainer.run_dir}/deepspeed.json")

    def write_run_files(self, run_dir: Path) -> None:
        """deepspeed.json: what DeepSpeed was given."""
        (Path(run_dir) / "deepspeed.json").write_text(json.dumps(self.ds_config, indent=2) + "\n")

    # ---- checkpoint state: the torch engine's layout (whole tensors under single-device names) ------------
    def _state_names(self) -> dict[str, str]:
        """Every key of the model's state dict -> the parameter it is (tied weights: two keys, one name) or
        itself (a buffer)."""
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        return {k: name_of.get(id(v), k) for k, v in self.model.state_dict(keep_vars=True).items()}

    def model_state_dict(self) -> dict:
        """Whole fp32 weights (DeepSpeed's masters) and buffers by name, on every rank; the optimizer's
        state is neither read nor created (trainer.init_from starts a fresh one). Collective."""
        return self._model_state(self.optimizer.full_masters())

    def _model_state(self, masters: dict) -> dict:
        buffers = dict(self.model.named_buffers())
        return {k: masters[n] if n in masters else buffers[n].detach().clone()
                for k, n in self._state_names().items()}

    def state_dict(self) -> dict:
        """Model, optimizer and lr-schedule state as TorchEngine.state_dict lays them out, so a checkpoint
        moves between the engines and layouts. Collective."""
        masters, optim = self.optimizer.full_state()
        return {"model": self._model_state(masters), "optim": optim, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """As TorchEngine.load_state_dict: weights, moments and the schedule's position from `state`,
        hyper-parameters from this run's config."""
        with keep_hyperparameters(self.optimizer, self.scheduler, state["scheduler"]):
            self._load(state["model"], state["optim"])

    def load_model_state_dict(self, state: dict) -> None:
        self._load(state, None)

    @torch.no_grad()
    def _load(self, model_state: dict, optim: dict | None) -> None:
        names = self._state_names()
        params = {n: model_state[k] for k, n in names.items() if k in model_state}
        masters = {n: t for n, t in params.items() if n in self.optimizer.masters}
        self.optimizer.load_full_state(masters, optim)
        buffers = dict(self.model.named_buffers())
        for n, t in params.items():
            if n in buffers:
                buffers[n].copy_(t)
        # the model's own (working-precision) weights follow the masters, as after a step
        for n, p in self.model.named_parameters():
            if n not in masters:
                continue
            if hasattr(p, "ds_tensor"):  # ZeRO-3: this rank's partition of the parameter
                piece = self.optimizer.gather.fragment(n, masters[n])
                p.ds_tensor.narrow(0, 0, piece.numel()).copy_(piece)
            else:
                p.copy_(masters[n])


def _declare_parameter_uses(deepspeed, model: KimiModel) -> None:
    """ZeRO-3 gathers a module's parameters around its forward and its backward, found through the tensors
    it takes and returns. A block takes and returns the residual stream (an object), so the AttnRes queries
    it holds are declared the whole model's, which gathers them for both passes (d_model values each);
    a sublayer that declares ZERO3_LEAF (a MoE layer reads its router's weight without calling the router)
    is gathered as one unit."""
    for module in model.modules():
        if isinstance(module, Block):
            for p in module.parameters(recurse=False):
                deepspeed.zero.register_external_parameter(model, p)
    leaves = {type(m) for _, m in model.sublayers() if m.ZERO3_LEAF}
    if leaves:
        deepspeed.utils.set_z3_leaf_modules(model, list(leaves))
