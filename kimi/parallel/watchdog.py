"""Bounded hangs: a rank that stops (SIGSTOP, a dead node, a process stuck in C code) ends the job with a
message instead of leaving the others blocked in a collective.

Every rank runs a thread that publishes a heartbeat (a counter, its last finished step, pid and host) in
the process group's key-value store every few seconds and reads everyone else's. Each rank times the others
with its own monotonic clock (no clock synchronisation needed): a heartbeat unchanged for longer than
``trainer.collective_timeout_s`` means that rank's process is not running. The live ranks then end the job:
the lowest one prints which rank stalled and the last step every rank finished, ranks on the stalled one's
host kill it (a stopped process ignores everything but SIGKILL), and all exit with code 1, which torchrun
passes on. The store lives in torchrun's agent, so it answers even when rank 0 is the one stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Dict, Optional

import torch.distributed as dist

from kimi.cli import EXIT_FAILED

_KEY = "kimi/heartbeat/{}"


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
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---- the thread ---------------------------------------------------------------------------------
    def _publish(self) -> None:
        self._beat += 1
        beat = {"beat": self._beat, "step": self.step, "pid": os.getpid(), "host": socket.gethostname()}
        self.store.set(_KEY.format(self.rank), json.dumps(beat))

    def _read(self) -> Dict[int, dict]:
        return {r: json.loads(self.store.get(_KEY.format(r))) for r in range(self.world)}

    def _run(self) -> None:
        seen = {r: (b["beat"], time.monotonic()) for r, b in self._read().items()}
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                beats = self._read()
            except Exception:  # noqa: BLE001: the store is gone, so the job is ending anyway
                return
            now = time.monotonic()
            for r, b in beats.items():
                if b["beat"] != seen[r][0]:
                    seen[r] = (b["beat"], now)
            stalled = [r for r in range(self.world) if now - seen[r][1] > self.timeout_s]
            if stalled and self.rank not in stalled:
                self._end(stalled, beats, now - min(seen[r][1] for r in stalled))

    def _end(self, stalled: list, beats: Dict[int, dict], silent_s: float) -> None:
        live = [r for r in range(self.world) if r not in stalled]
        if self.rank == live[0]:
            who = ", ".join(f"rank {r} (pid {beats[r]['pid']} on {beats[r]['host']})" for r in stalled)
            steps = ", ".join(f"{r}: {b['step']}" for r, b in sorted(beats.items()))
            print(f"error: {who} made no progress for {silent_s:.0f} s (trainer.collective_timeout_s="
                  f"{self.timeout_s:g}): its process is stopped or hung. Last finished step per rank: {steps}. "
                  f"Ending the job. {self.explain()}".rstrip(), file=sys.stderr, flush=True)
        host = socket.gethostname()
        for r in stalled:
            if beats[r]["host"] == host:
                try:
                    os.kill(beats[r]["pid"], signal.SIGKILL)
                except OSError:
                    pass
        os._exit(EXIT_FAILED)
