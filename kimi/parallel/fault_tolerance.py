"""Fault tolerance across replica groups with torchft (parallel.fault_tolerance=torchft; docs/parallelism.md).

HSDP's replicate dimension is cut into replica groups, each a job of its own (its own torchrun, its own world
of dp_shard x cp x tp ranks, sharded by FSDP2 as usual): torchft's Manager, one per rank, asks a lighthouse
at the start of every step which groups are alive (the quorum) and reconfigures a process group across them,
one per rank position in a group. The step then runs as one:

- the gradients, each rank's shards after its own group's reduction, are averaged over the groups in the
  quorum (one all-reduce of one flat buffer, after the accumulation), and so are QK-Clip's max logits (a
  max): every group makes the same update;
- the update happens only when the Manager's should_commit says every group got through the step; otherwise
  the step is run again with the same batches (its gradients dropped, nothing changed);
- a group that (re)joins behind the others takes the live state of a peer through torchft's HTTP checkpoint
  transport before the step: weights, optimizer state (MuonClip's momentum too), the lr schedule, the step
  and the data position. No checkpoint is read.

The quorum is synchronous (before the step's first batch is read), so a group that heals starts the step
with the right weights and data; what that costs per step is measured by bench/fault_tolerance.py.

Data: group g reads data-parallel ranks g*dp..(g+1)*dp-1 of replica_groups*dp (ParallelDims.dp_rank), so
the groups read different batches, and a missing group's batches of those steps are skipped, not re-read by
the others: the step's global batch is (groups in the quorum) / replica_groups of the full one, and the
gradient is the mean over what was read. That is said in a log line whenever the quorum changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from kimi.data import Batch
from kimi.errors import ConfigError, FinalError, RunError
from kimi.model import KimiModel
from kimi.optim.owners import like_param, local_tensor
from kimi.schema.vocabulary import RootConfig as Config

from .engine_base import EngineBase
from .interface import Engine, RunState

T = TypeVar("T")


class FaultTolerantEngine(Engine):
    """The engine parallel.engine names (`inner`), stepping across torchft's replica groups (module
    docstring): build_engine wraps it when parallel.fault_tolerance=torchft. Everything but the step is the
    inner engine's."""

    def __init__(self, inner: EngineBase, cfg: Config, mesh: Optional[DeviceMesh], device: torch.device):
        # torchft logs every quorum and commit (its Rust side by RUST_LOG, read when it is first imported, and
        # its Python loggers); this module says what matters on rank 0's console, errors still show
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.ERROR)
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.inner, self.cfg, self.batch = inner, cfg.parallel.torchft, cfg.trainer
        self.model, self.parts, self.optimizer = inner.model, inner.parts, inner.optimizer
        self.dims, self.pp_rank = inner.dims, inner.pp_rank
        self.dp_rank = inner.dims.dp_rank(mesh)
        self.run: Optional[RunState] = None
        ft = self.cfg
        lighthouse = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ConfigError("parallel.fault_tolerance=torchft needs the lighthouse's address: set "
                              "parallel.torchft.lighthouse=http://HOST:29510 or TORCHFT_LIGHTHOUSE (start "
                              "one with torchft_lighthouse --min_replicas 1)")
        timeout = timedelta(seconds=ft.timeout_s)
        group = ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo
        pg = group(timeout=timeout)
        self._store = None
        # torchrun's store: the group's ranks find their rank 0's manager there
        if "MASTER_ADDR" in os.environ:
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # one process started without torchrun
            self._store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            addr, port = "localhost", self._store.port
        self.lighthouse = lighthouse
        rank = dist.get_rank() if dist.is_initialized() else 0
        with self._lighthouse_wait(f"connecting to it (parallel.torchft.timeout_s={ft.timeout_s:g})"):
            self.manager = Manager(
                pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=ft.min_replicas,
                use_async_quorum=False, timeout=timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=timeout,
                rank=rank, world_size=self.dims.world, store_addr=addr, store_port=port,
                lighthouse_addr=lighthouse, replica_id=f"kimi_{ft.replica_group}",
                # every group initialises the same weights from the seed: nothing to copy at step 0
                init_sync=False)
        self.committed, self.participants, self._quorum_ready = True, None, False

    def join(self, run: RunState) -> None:
        """A group resuming from its own checkpoint counts its steps from there; one behind its peers takes
        their state now (the first quorum), before the run's start is logged."""
        self.run = run
        step = run.get()["step"]
        self.manager.load_state_dict({"step": step, "batches_committed": step})
        self._quorum()
        self._quorum_ready = True

    @contextlib.contextmanager
    def _lighthouse_wait(self, what: str):
        """torchft's own error for a lighthouse that does not answer within the wait (a connection error at
        the start, a TimeoutError at a quorum) as one line when the lighthouse is indeed unreachable; then
        the Manager is of no further use (it fails every later quorum at once) and a restart would wait and
        fail alike, so the group ends without torchrun restarting it (FinalError). A quorum that times out
        while the lighthouse answers (fewer than min_replicas groups) is a RunError: restarted, the group
        rejoins."""
        try:
            yield
        except (RuntimeError, TimeoutError) as e:
            if isinstance(e, RunError):
                raise
            if reachable(self.lighthouse):
                if isinstance(e, TimeoutError):
                    need = f"parallel.torchft.min_replicas={self.cfg.min_replicas} replica group(s)"
                    raise RunError(f"no quorum of {need} at the lighthouse {self.lighthouse}: gave up "
                                   f"{what}") from None
                raise
            fix = ("Start it again (launch/torchft.sh lighthouse) or fix parallel.torchft.lighthouse, then "
                   "rerun this group's command: it resumes from its newest checkpoint")
            what = f"torchft's lighthouse {self.lighthouse} does not answer: gave up {what}"
            raise FinalError(f"{what}. {fix}") from None

    # ---- the step ---------------------------------------------------------------------------------------
    def run_step(self, step: Callable[[], T]) -> T:
        """The trainer's step, run again with the same batches until the groups in the quorum commit it; each
        try starts with its quorum (the first one's was taken by join)."""
        while True:
            if not self._quorum_ready:
                self._quorum()
            self._quorum_ready = False
            before = self.run.get()
            out = step()
            if self.committed:
                return out
            self.run.set(before)
            self.run.log(f"[kimi] torchft: step {before['step'] + 1} was not committed (a replica group "
                         "failed during it): running it again with the same batches")

    def _quorum(self) -> None:
        with self._lighthouse_wait(f"waiting for a quorum (parallel.torchft.quorum_timeout_s="
                                   f"{self.cfg.quorum_timeout_s:g})"):
            self.manager.start_quorum()  # healing, if any, has loaded a peer's state when this returns
        n = self.manager.num_participants()
        if n != self.participants:
            groups, t = self.cfg.replica_groups, self.batch
            full = t.micro_batch_size * t.grad_accum_steps * self.dims.dp * groups
            step = self.run.get()["step"] + 1
            self.run.log(f"[kimi] torchft: step {step}: {n} of {groups} replica group(s) in the quorum; the "
                         f"step's global batch is {n * full // groups} of {full} sequences"
                         + ("" if n == groups else " (a missing group's batches are skipped)"))
        self.participants = n

    def step(self, max_norm: float, family_stats: bool = False) -> Dict[str, float]:
        """The inner engine's step across the groups: gradients averaged over them (and QK-Clip's logits
        maxed), then the inner step if every group commits, else nothing changes."""
        engine = self.inner
        grads = []
        for p in engine.model.parameters():
            if p.requires_grad:
                # a parameter without a gradient here must still match its peers' (which may have one)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local_tensor(p.grad))
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()  # the mean over the groups in the quorum
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        qk_clip = engine.qk_clip  # None without QK-Clip
        if qk_clip is not None:
            qk_clip.gather(replica_max=lambda x: self.manager.allreduce(x, reduce_op=ReduceOp.MAX).wait())
        self.committed = self.manager.should_commit()
        if self.committed:
            return engine.step(max_norm, family_stats=family_stats)
        engine.zero_grads()
        if qk_clip is not None:
            qk_clip.gathered = None
        return {"grad_norm": 0.0, "lr": engine.optimizer.param_groups[0]["lr"]}

    # ---- the live state a joining group takes --------------------------------------------------------------
    def _state(self) -> Dict[str, Any]:
        """Runs on torchft's quorum thread while the main thread waits for the quorum (nothing changes)."""
        return {"engine": _local(self.inner.state_dict()), **self.run.get()}

    def _load(self, state: Dict[str, Any]) -> None:
        self.inner.load_state_dict(_like(state["engine"], self.inner.state_dict()))
        # the step and data position; this group keeps its own data rank
        self.run.set({"step": int(state["step"]), "loader": state["loader"]})
        self.run.log(f"[kimi] torchft: replica group {self.cfg.replica_group} took the live state of step "
                     f"{int(state['step'])} from a peer (weights, optimizer, lr schedule, data position); no "
                     "checkpoint read")

    def close(self) -> None:
        """Stop this rank's torchft servers (the lighthouse then sees the group leave); once is enough."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        self.inner.close()

    # ---- the rest is the inner engine's -----------------------------------------------------------------
    def layout(self) -> Optional[str]:
        ft, own = self.cfg, self.inner.layout()
        line = (f"[kimi] fault tolerance: torchft, replica group {ft.replica_group} of {ft.replica_groups} "
                f"(a step commits with >= {ft.min_replicas}); data rank {self.dp_rank} of "
                f"{self.dims.data_world}")
        return line if own is None else f"{own}\n{line}"

    def forward_backward(self, batch: Batch, scale: float) -> torch.Tensor:
        return self.inner.forward_backward(batch, scale)

    def eval_loss(self, batch: Batch) -> torch.Tensor:
        return self.inner.eval_loss(batch)

    @property
    def qk_clip_stats(self) -> Dict[str, Dict[str, float]]:
        return self.inner.qk_clip_stats

    @property
    def qk_clip_head_max_logits(self) -> Dict[str, torch.Tensor]:
        return self.inner.qk_clip_head_max_logits

    def family_stats_missing(self) -> Optional[str]:
        return self.inner.family_stats_missing()

    def eval_observed(self, batch: Batch,
                      observe: Callable[[List[KimiModel]], AbstractContextManager[T]]) -> T:
        return self.inner.eval_observed(batch, observe)

    def write_run_files(self, run_dir: Path) -> None:
        self.inner.write_run_files(run_dir)

    def state_dict(self) -> Dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def model_state_dict(self) -> Dict[str, Any]:
        return self.inner.model_state_dict()

    def load_model_state_dict(self, state: Dict[str, Any]) -> None:
        self.inner.load_model_state_dict(state)


def reachable(url: str, timeout_s: float = 5.0) -> bool:
    """Whether anything accepts a TCP connection at the lighthouse's address (http://host:port)."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    try:
        with socket.create_connection((parts.hostname or "localhost", parts.port or 80), timeout=timeout_s):
            return True
    except OSError:
        return False


def _local(tree: Any) -> Any:
    """The state with each DTensor as this rank's block: the receiving rank holds the same blocks."""
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(v) for v in tree)
    return local_tensor(tree).detach() if isinstance(tree, DTensor) else tree


def _like(tree: Any, template: Any) -> Any:
    """The received blocks laid out as this rank's own state (`template`): DTensors again where it has
    them."""
    if isinstance(tree, dict) and isinstance(template, dict):
        return {k: _like(v, template.get(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and isinstance(template, (list, tuple)) and len(tree) == len(template):
        return type(tree)(_like(v, w) for v, w in zip(tree, template))
    if isinstance(template, DTensor) and isinstance(tree, torch.Tensor):
        return like_param(tree.to(template.device), template)
    return tree
