"""A scheduler's SIGTERM (or Ctrl-C) as a request to stop: the trainer finishes its step, saves a checkpoint
and exits, so the same command resumes; a second signal exits at once (but for the two cases below).

Before there is anything to save (the imports, Hydra, validation, data preparation: minutes for a big run)
a SIGTERM ends the command at once with exit code 75 and one line (exit_while_starting): the default action
would end it as -15, which no scheduler requeues, and finishing the start first could outlast the grace time.
It ends the process from the handler (os._exit) rather than raising: an exception raised from a handler
surfaces inside whatever code runs (numpy's or torch's imports, Hydra), which may turn it into its own error
and traceback. Nothing at start-up needs unwinding: the run dir's lock is released first (release_on_exit),
and the data caches are written whole or not at all.

A second signal while a checkpoint is being written is noted, not raised: raised, it would abandon the save
the first signal asked for (inside DCP's writer, a CheckpointException traceback); the run exits with code 75
once the checkpoint is complete."""

from __future__ import annotations

import os
import signal
import sys
import weakref
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional, Tuple


def exit_while_starting() -> None:
    """Install the at-once SIGTERM handler; the first thing a command that trains does (train.py)."""
    # The handler needs kimi.cli (standard library imports only, so quick): import it first, or a signal that
    # lands while the imports below reach it finds it half made (an ImportError instead of exit 75)
    import kimi.cli  # noqa: F401

    signal.signal(signal.SIGTERM, _exit_stopped)


def _exit_stopped(signum, frame) -> None:
    from kimi.cli import finish
    from kimi.errors import EXIT_STOPPED

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one while leaving would print the line again
    # also after the run's end (its final sample, say): the checkpoint is written, and a rerun says so
    _say(f"[kimi] {signal.Signals(signum).name} with no training step under way (starting, or done): nothing "
         "to save, exiting with code 75. Run the same command again to continue")
    # the run dir as the command line names it (the launch scripts always do), for <run_dir>/exit_code
    run_dir = next((a.split("=", 1)[1] for a in reversed(sys.argv[1:])
                    if a.startswith(("hydra.run.dir=", "trainer.run_dir="))), "")
    _leave(finish(EXIT_STOPPED, run_dir))


def _say(line: str) -> None:
    """Print from a signal handler: the signal may have interrupted a print to the same stream, which
    refuses a reentrant write (RuntimeError); then the line goes to the file descriptor directly."""
    try:
        print(line, flush=True)
    except (RuntimeError, OSError, ValueError):
        os.write(1, (line + "\n").encode())


# What _leave releases first (kimi.run.rundir's run-dir lock: the kernel drops the lock itself, but its record
# would stay and the next start would say it took the lock over); weak, so that a lock dropped unreleased
# still goes by its own __del__
_release_on_exit: "weakref.WeakSet" = weakref.WeakSet()


def release_on_exit(held):
    """Have a start-up exit call held.release() (held: None, or a kimi.run.rundir.RunLock) before the process
    ends; returns held."""
    if held is not None:
        _release_on_exit.add(held)
    return held


def _leave(code: int) -> None:
    """End the process with `code` now, without unwinding the interrupted code (see the module's doc)."""
    for held in list(_release_on_exit):
        try:
            held.release()
        except Exception:  # noqa: BLE001 (the exit goes on whatever fails here)
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (RuntimeError, OSError, ValueError):
            pass
    os._exit(code)


def stopped_note(step: int, checkpoint, signal_name: Optional[str], t, stages=()) -> str:
    """The line a run prints when it stops early with a checkpoint (t: the config's trainer section): why,
    and how to go on. At trainer.stop_at_step the same command again would stop at once, so the limit has
    to move (or go). At the end of one of `stages` (the config's, kimi/run/stages.py) the next one follows."""
    from kimi.schema.stages import boundary_at, stage_label

    stop_at_step, max_steps = t.stop_at_step, t.max_steps
    at_limit = bool(stop_at_step and step >= stop_at_step)
    entered = boundary_at(stages, step) if at_limit and not signal_name else None
    if entered is not None:
        return (f"[kimi] {stage_label(stages, entered - 1)} complete at step {step}; checkpoint "
                f"{checkpoint}")
    why = signal_name or (f"trainer.stop_at_step={stop_at_step}" if at_limit else "a signal on another rank")
    how = (f"run the same command with trainer.stop_at_step raised (or dropped: on to trainer.max_steps="
           f"{max_steps}) to resume" if at_limit else "run the same command again to resume")
    return f"[kimi] stopped at step {step} ({why}); checkpoint {checkpoint}. To go on, {how}."


def stop_requested(signals: "StopSignals", saver, device, distributed: bool) -> bool:
    """Whether any rank got a signal: all must stop at the same step, or the checkpoint would hang. The
    same reduction tells whether every rank has written its part of a background save (the saver's,
    kimi.checkpoint.saver), which is then completed here (finishing is collective, so all ranks must agree it
    will not wait). Collective under torch.distributed (`distributed`)."""
    import torch
    import torch.distributed as dist

    flags = torch.tensor([float(signals.received is not None), float(saver.writing())], device=device)
    if distributed:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    stop, writing = flags.tolist()
    if not writing:
        saver.finish()
    return bool(stop)


class StopSignals:
    def __init__(self, where: Callable[[], Tuple[int, int]]):
        """where: (this process's rank, the step done so far), for the message a signal prints."""
        self.where = where
        self.received: Optional[str] = None  # the first signal's name
        self._handlers: Dict[signal.Signals, object] = {}
        self._now = False
        self._saving = False
        self.deferred = False  # a second signal came while a checkpoint was being written
        self.starting = True  # until the first training step (the trainer says when)

    def catch(self, *signals: signal.Signals) -> None:
        for s in signals:
            self._handlers.setdefault(s, signal.signal(s, self._on_signal))

    def restore(self) -> None:
        """Put back the handlers that were there before catch."""
        while self._handlers:
            signal.signal(*self._handlers.popitem())

    @contextmanager
    def at_once(self) -> Iterator[None]:
        """While inside (work a stop loses nothing of, such as data preparation, whose caches are written
        whole or not at all), a SIGTERM ends the command at once with exit code 75 instead of being kept."""
        if self.received == "SIGTERM":
            _exit_stopped(signal.SIGTERM, None)
        self._now = True
        try:
            yield
        finally:
            self._now = False

    @contextmanager
    def saving(self) -> Iterator[None]:
        """While inside (a checkpoint being written, marked complete or rotated), a second signal is noted
        with one line instead of ending the process at once."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._now and signum == signal.SIGTERM:
            _exit_stopped(signum, frame)
        rank, step = self.where()
        if self.received is not None and self._saving:
            if not self.deferred:
                _say(f"[kimi] rank {rank}: {name} again while a checkpoint is being written: not "
                     "interrupting it; the run stops as the first signal asked, with exit code 75")
            self.deferred = True
            return
        if self.received is not None and self.starting and signum == signal.SIGTERM:
            _exit_stopped(signum, frame)  # nothing trained yet, so nothing lost: exit 75, as before the start
        if self.received is not None:  # second signal: the user really wants out now
            raise KeyboardInterrupt(f"second {name}")
        self.received = name
        _say(f"\n[kimi] rank {rank}: {name} received: finishing step {step + 1}, saving a checkpoint, "
             "then exiting (send it again to exit at once)")
