"""A checkpoint written while training goes on (``trainer.async_checkpoint``).

Starting one blocks only while DCP's ``async_save`` stages the state: a copy into CPU memory, so the next
step may change the weights and optimizer state. DCP then plans and writes from a thread of its own; its
collectives run over a separate gloo group (kimi.parallel.dims.checkpoint_group), because two threads must
not issue collectives on one group. When the write ends, the same thread checksums this rank's share of
the files.

Nothing marks the directory complete until :meth:`BackgroundSave.finish`, a collective call from the
training thread: it gathers the shares, writes the manifest and COMPLETE marker, and only then rotates
older checkpoints away. A process that dies at any point before that leaves a directory without a marker,
which resume skips, and every older checkpoint in place.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .store import (_fresh_dir, _manifest_share, _mark_complete, _rotate_after, _saving, latest_complete,
                    step_dir)


class BackgroundSave:
    def __init__(self, root: Path, step: int, state: Dict[str, Any], marker: Dict[str, Any], keep: int,
                 group):
        self.root, self.step, self.keep, self.marker = Path(root), step, keep, marker
        self.path = step_dir(root, step)
        self.kept = latest_complete(root)
        self.write_s = 0.0
        self._written = threading.Event()
        self._share: Optional[Dict[str, Any]] = None
        self._error: Optional[BaseException] = None
        t0 = time.time()
        _fresh_dir(self.path)
        with _saving(self.path, self.kept):
            response = dcp.async_save(state, checkpoint_id=str(self.path), process_group=group)
        self.staged_s = time.time() - t0
        future = getattr(response, "upload_completion", response)  # a future, or one inside a response
        future.add_done_callback(lambda f: self._on_written(f, t0))

    def _on_written(self, future, t0: float) -> None:
        try:
            future.result()
            self._share = _manifest_share(self.path)
        except BaseException as e:  # kept for finish(), which raises it on the training thread
            self._error = e
        finally:
            self.write_s = time.time() - t0
            self._written.set()

    def done(self) -> bool:
        """Whether this rank's files are written and checksummed (finish() will not wait)."""
        return self._written.is_set()

    def finish(self) -> Path:
        """Wait for the write, then (collectively) write the manifest and marker and rotate. A rank's failed
        write fails every rank, with the partial directory removed and the older checkpoints kept."""
        self._written.wait()
        reports: List[Any] = [(self._share, None if self._error is None else repr(self._error))]
        if dist.is_initialized() and dist.get_world_size() > 1:
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, (self._share, None if self._error is None else repr(self._error)))
        failed = [(rank, why) for rank, (_, why) in enumerate(reports) if why is not None]
        if failed:
            with _saving(self.path, self.kept):
                if self._error is not None:
                    raise self._error
                rank, why = failed[0]
                raise RuntimeError(f"rank {rank} failed to write checkpoint {self.path}: {why}")
        files = {name: v for share, _ in reports for name, v in share.items()}
        _mark_complete(self.path, {**self.marker, "seconds": round(self.write_s, 3),
                                   "staged_seconds": round(self.staged_s, 3), "background": True}, files)
        _rotate_after(self.root, self.step, self.keep, self.marker.get("run_id", ""))
        return self.path
