"""The engine seam as a type: all that the trainer, run log, diagnostics and checkpoints ask of an engine.

An engine owns everything about a step that depends on how the model is distributed; callers outside
kimi/parallel/ use only what :class:`Engine` declares, so they never learn which engine runs (TorchEngine,
engine.py; DeepSpeedEngine, deepspeed_engine.py). An engine missing a method cannot be built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, TypeVar

if TYPE_CHECKING:
    import torch

    from kimi.data import Batch
    from kimi.model import KimiModel

    from .dims import ParallelDims

T = TypeVar("T")


@dataclass
class RunState:
    """What of the run an engine may read and replace (Engine.join): the trainer's step and data position,
    as {"step": int, "loader": the loader's state_dict}, and the run's console."""

    get: Callable[[], Dict[str, Any]]
    set: Callable[[Dict[str, Any]], None]
    log: Callable[[str], None]


class Engine(ABC):
    model: KimiModel  # what this rank holds of the model (its pipeline stages' union)
    parts: List[KimiModel]  # the model parts this rank runs, one per pipeline stage it holds
    # the optimizer whose param groups are stepped (and the lr schedule moves); MuonClip, or DeepSpeed's
    # client over it, answers routing_table() (kimi.optim.RoutedOptimizer)
    optimizer: torch.optim.Optimizer
    dims: ParallelDims
    pp_rank: Optional[int]  # this rank's pipeline rank; None without pipeline parallelism

    # ---- one step -------------------------------------------------------------------------------------
    @abstractmethod
    def forward_backward(self, batch: Batch, scale: float) -> torch.Tensor:
        """Forward and backward of one batch, gradients scaled by `scale` (1 / accumulation steps) and added
        to those of earlier batches of the step; the batch's mean loss (detached)."""

    @abstractmethod
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        """The batch's mean loss, without gradients."""

    @abstractmethod
    def step(self, max_norm: float, family_stats: bool = False) -> Dict[str, float]:
        """Clip the step's gradients to `max_norm` (0: no clipping), update, QK-Clip, advance the lr schedule;
        the gradient norm before clipping and the lr used (with `family_stats`, each optimizer family's
        statistics too, where family_stats_missing() is None). A norm that is not finite should leave the
        weights as they were: the trainer then stops the run (kimi/run/divergence.py) without another
        checkpoint."""

    @property
    @abstractmethod
    def qk_clip_stats(self) -> Dict[str, Dict[str, float]]:
        """{layer: {"max_logit", "clipped_frac"}} of the last step (empty without QK-Clip)."""

    @property
    @abstractmethod
    def qk_clip_head_max_logits(self) -> Dict[str, torch.Tensor]:
        """{layer: max logit per head} of the last step, over every rank holding the layer (empty without
        QK-Clip)."""

    # ---- what diagnostics and the run dir need ----------------------------------------------------------
    @abstractmethod
    def family_stats_missing(self) -> Optional[str]:
        """Why step(family_stats=True) cannot measure each optimizer family (None: it can)."""

    @abstractmethod
    def eval_observed(self, batch: Batch,
                      observe: Callable[[List[KimiModel]], AbstractContextManager[T]]) -> T:
        """Evaluate `batch` with `observe(parts)` entered around exactly that forward; what it yields."""

    @abstractmethod
    def layout(self) -> Optional[str]:
        """The start banner's line about how the model is distributed (None: one process, nothing to say)."""

    @abstractmethod
    def write_run_files(self, run_dir: Path) -> None:
        """Keep in the run dir what the engine was launched with beyond the config (rank 0 calls it)."""

    # ---- checkpoint state: single-device names, so a checkpoint moves between engines and layouts ---------
    @abstractmethod
    def state_dict(self) -> Dict[str, Any]:
        """{"model", "optim", "scheduler"}. Collective."""

    @abstractmethod
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Weights, optimizer moments and the schedule's position from `state`; hyper-parameters stay this
        run's config."""

    @abstractmethod
    def model_state_dict(self) -> Dict[str, Any]:
        """The weights alone, laid out as in state_dict (trainer.init_from loads into it). Collective."""

    @abstractmethod
    def load_model_state_dict(self, state: Dict[str, Any]) -> None:
        """The weights from `state`; the optimizer and schedule stay as they are."""

    # ---- a step that other jobs must agree on (torchft's replica groups; the others do nothing) ---------
    def join(self, run: RunState) -> None:
        """The run's state is loaded (resumed or fresh): an engine that shares the live state with peers
        takes theirs here when it is behind."""

    def run_step(self, step: Callable[[], T]) -> T:
        """One optimizer step, `step()` (the trainer's: batches, forward_backward, step); an engine whose
        step other jobs must agree on runs it again with the same batches until they do."""
        return step()

    def close(self) -> None:
        """Release what the engine holds beyond the process group (servers, threads); once is enough."""
