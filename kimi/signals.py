"""A scheduler's SIGTERM (or Ctrl-C) as a request to stop: the trainer finishes its step, saves a checkpoint
and exits, so the same command resumes; a second signal exits at once."""

from __future__ import annotations

import signal
from typing import Callable, Dict, Optional, Tuple


class StopSignals:
    def __init__(self, where: Callable[[], Tuple[int, int]]):
        """where: (this process's rank, the step done so far), for the message a signal prints."""
        self.where = where
        self.received: Optional[str] = None  # the first signal's name
        self._handlers: Dict[signal.Signals, object] = {}

    def catch(self, *signals: signal.Signals) -> None:
        for s in signals:
            self._handlers.setdefault(s, signal.signal(s, self._on_signal))

    def restore(self) -> None:
        """Put back the handlers that were there before catch."""
        while self._handlers:
            signal.signal(*self._handlers.popitem())

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # second signal: the user really wants out now
            raise KeyboardInterrupt(f"second {name}")
        self.received = name
        rank, step = self.where()
        print(f"\n[kimi] rank {rank}: {name} received: finishing step {step + 1}, saving a checkpoint, "
              "then exiting (send it again to exit at once)", flush=True)
