"""Bounded hangs: a rank that stops (SIGSTOP, a dead node, a process stuck in C code) ends the job with a
message instead of leaving the others blocked in a collective.

Every rank runs a thread that publishes a heartbeat (a counter, its last finished step, pid and host) in
the process group's key-value store every few seconds and reads the next rank's (a ring, so the store's
load grows linearly with the ranks). It times that heartbeat with its own monotonic clock (no clock
synchronisation needed): unchanged for longer than ``trainer.collective_timeout_s``, the watched rank's
process is not running. The watcher then prints which rank stalled and the last step every rank finished,
kills the stalled process if it is on the same host (a stopped process ignores everything but SIGKILL) and
exits with code 1; torchrun then ends the other ranks. The store lives in torchrun's agent, so it answers
even when rank 0 is the one stopped.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Dict, Optional

import torch.distributed as dist

from kimi.errors import EXIT_FAILED

_KEY = "kimi/heartbeat/{}"
_RUNNING: "set[Watchdog]" = set()  # started and not stopped: stop_all() ends them before the store goes


def stop_all() -> None:
    """Stop every running watchdog. Its thread waits in the process group's store; a store torn down under
    it (destroy_process_group, interpreter exit) aborts the process ("terminate called without an active
    exception"), so destroy_distributed and exit call this even where a script never closed its Trainer."""
    for dog in list(_RUNNING):
        dog.stop()


atexit.register(stop_all)


class Watchdog:
    def __init__(self, timeout_s: float, explain: Callable[[], str] = lambda: ""):
        """explain(): a sentence added to the message (e.g. which checkpoint is intact)."""
        self.timeout_s = timeout_s
        self.interval = max(0.2, min(5.0, timeout_s / 10))
        self.explain = explain
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self.step = 0
        self._beat = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._publish()

    def progress(self, step: int) -> None:
        """The last step this rank finished (shown in the message)."""
        self.step = step

    def start(self) -> "Watchdog":
        dist.barrier()  # every rank has published once: reading a heartbeat never waits for a missing key
        self._thread = threading.Thread(target=self._run, name="kimi-watchdog", daemon=True)
        self._thread.start()
        _RUNNING.add(self)
        return self

    def stop(self) -> None:
        self._stop.set()
        _RUNNING.discard(self)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---- the thread ---------------------------------------------------------------------------------
    def _publish(self) -> None:
        self._beat += 1
        beat = {"beat": self._beat, "step": self.step, "pid": os.getpid(), "host": socket.gethostname()}
        self.store.set(_KEY.format(self.rank), json.dumps(beat))

    def _read(self, ranks) -> Dict[int, dict]:
        return {r: json.loads(self.store.get(_KEY.format(r))) for r in ranks}

    def _run(self) -> None:
        # Each rank watches the next one (a ring): two store reads per rank per interval, at any scale.
        watched = (self.rank + 1) % self.world
        last, seen_at = self._read([watched])[watched]["beat"], time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                beat = self._read([watched])[watched]["beat"]
            except Exception:  # noqa: BLE001 (the store is gone, so the job is ending anyway)
                return
            now = time.monotonic()
            if beat != last:
                last, seen_at = beat, now
            elif now - seen_at > self.timeout_s:
                self._end(watched, now - seen_at)

    def _end(self, stalled: int, silent_s: float) -> None:
        beats = self._read(range(self.world))
        b = beats[stalled]
        steps = ", ".join(f"{r}: {x['step']}" for r, x in sorted(beats.items()))
        print(f"error: rank {stalled} (pid {b['pid']} on {b['host']}) made no progress for {silent_s:.0f} s "
              f"(trainer.collective_timeout_s={self.timeout_s:g}): its process is stopped or hung. Last "
              f"finished step per rank: {steps}. Ending the job. {self.explain()}".rstrip(), file=sys.stderr,
              flush=True)
        if b["host"] == socket.gethostname():  # a stopped process ignores everything but SIGKILL
            try:
                os.kill(b["pid"], signal.SIGKILL)
            except OSError:
                pass
        os._exit(EXIT_FAILED)
