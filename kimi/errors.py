"""The errors a user can cause, and the exit codes every command ends with: the ground floor (it imports
nothing of kimi, so every package raises these without importing upwards).

  0   EXIT_OK        finished
  1   EXIT_FAILED    a failure (loss became NaN, no space left, a stalled rank, ...); a bug still prints its
                     traceback
  2   EXIT_BAD_INPUT bad config, data, arguments or run directory: the message says what to change
  75  EXIT_STOPPED   stopped early with a checkpoint (SIGTERM, trainer.stop_at_step): rerun to continue
                     (75 is EX_TEMPFAIL of sysexits.h: "try again later")

How a command turns these into one line and its code, also under torchrun: kimi.cli.
"""

from __future__ import annotations

import errno

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 75
# errno -> what a user should read
STORAGE_ERRORS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                  errno.EROFS: "not writable (read-only file system)",
                  errno.EACCES: "not writable (permission denied)",
                  errno.EPERM: "not writable (not permitted)"}


class ConfigError(ValueError):
    """A configuration value that cannot work; the one-line message names the key(s) and how to fix it."""


class DataError(ValueError):
    """Data that cannot be used as configured; the message says what to change."""


class RunError(RuntimeError):
    """A failure whose message says everything (printed as one line, exit code 1)."""


class FinalError(RunError):
    """A RunError that a restart would only repeat (the torchft lighthouse gone): under torchrun its ranks
    exit 0, so that torchrun does not restart them, and <run_dir>/exit_code holds 1 (kimi.cli.finish)."""


def exit_code_for(e: BaseException) -> int | None:
    """The exit code for an error worth one line, or None for a bug (which keeps its traceback)."""
    if isinstance(e, (ConfigError, DataError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                      PermissionError)):
        return EXIT_BAD_INPUT
    if isinstance(e, (RunError, FloatingPointError)):
        return EXIT_FAILED
    if isinstance(e, OSError) and e.errno in STORAGE_ERRORS:
        return EXIT_FAILED
    return None


def describe(e: BaseException) -> str:
    """The error as one line; OS errors say in plain words what ran out or was refused."""
    if isinstance(e, OSError) and e.errno in STORAGE_ERRORS and not isinstance(e, FileNotFoundError):
        return f"{STORAGE_ERRORS[e.errno]}: {e.filename}" if e.filename else STORAGE_ERRORS[e.errno]
    return " ".join(str(e).split())


def one_line(e: BaseException) -> str:
    """``e``'s message on one line, its type's name when it has none (a DataError is one line, so the CLI
    can print it as is)."""
    return " ".join(str(e).split()) or type(e).__name__
