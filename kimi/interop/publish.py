"""An export appears complete or not at all. It is written into a fresh folder beside its target and renamed
into place once every file is there; a target holding an earlier export is replaced only when the user asks
(overwrite=true), and only after the new export is complete, so the target never mixes two exports' files
and a write that fails (a full disk) leaves the previous export as it was. Before the rename its folders are
made 0755 and its files 0644: an export is for sharing, whatever the umask made them.

Between the two renames of a replacement the target is briefly absent; the previous export is then
``.<name>.old-<pid>`` beside it (renamed back if the second rename fails). A writer killed outright leaves
its ``.<name>.partial-<pid>`` folder beside the target, never a half-written target.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from kimi.errors import ConfigError
from kimi.errors import STORAGE_ERRORS, RunError, describe


def check_target(out: Path, overwrite: bool, source: Path | None = None) -> None:
    """Refuse (one-line ConfigError) a target that is a file or lies under one, that holds files without
    overwrite, or that overwrite would wrongly delete: a folder that is no export (no config.json: a typo'd
    path, a run dir) or one holding `source` (the checkpoint being exported)."""
    under = next((p for p in out.absolute().parents if p.exists() and not p.is_dir()), None)
    if under is not None:
        raise ConfigError(f"out={out}: {under} is a file, not a folder; choose another out=")
    if not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise ConfigError(f"out={out} is a file, not a folder: give the path of a folder for the export (a "
                          "new one, or an earlier export's with overwrite=true)")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"out={out} already holds files (an earlier export?): pass overwrite=true to "
                          "replace it once the new export is complete, or choose another out=")
    if source is not None and out.resolve() in (source.resolve(), *source.resolve().parents):
        raise ConfigError(f"out={out} holds the checkpoint being exported ({source}): overwrite=true would "
                          "delete it; choose another out=")
    if not (out / "config.json").is_file():
        raise ConfigError(f"out={out} holds files but no config.json, so no earlier export: overwrite=true "
                          "replaces only an export; choose another out=")


def _os_error(e: BaseException) -> BaseException:
    """`e`, or the OSError it reports: safetensors and tokenizers (Rust) raise their own error types for a
    failed write, with the OS error only in their text ("... (os error 28)")."""
    found = None if isinstance(e, OSError) else re.search(r"os error (\d+)", str(e))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else e


@contextlib.contextmanager
def fresh_folder(out: Path, overwrite: bool, source: Path | None = None) -> Iterator[Path]:
    """A new empty folder beside `out` to write the export into; when the block ends without an error it
    becomes `out` (the earlier one, allowed by check_target, removed only then); on an error it is removed
    and `out` is left as it was. A storage error (no space, read-only) becomes one RunError line."""
    out = Path(out)
    check_target(out, overwrite, source)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    partial = parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)  # this pid's leftover from an earlier, killed writer
    partial.mkdir()
    try:
        yield partial
        _publishable(partial)
        _replace(partial, out)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        error = _os_error(e)
        if isinstance(error, OSError) and error.errno in STORAGE_ERRORS:
            kept = "the previous export is kept" if out.exists() else "no export was written"
            raise RunError(f"out={out}: {describe(error)} while writing the export; {kept} (free space, or "
                           "choose another out=)") from None
        raise


def _publishable(folder: Path) -> None:
    """Modes for sharing: 0755 folders and 0644 files, whatever the umask or the temporary folder's own mode
    (0700 where made private) would leave, so that an upload or a colleague reads every file."""
    os.chmod(folder, 0o755)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _replace(partial: Path, out: Path) -> None:
    """Rename the complete `partial` to `out`, moving an earlier `out` aside first and deleting it last."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.absolute().parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
    try:
        os.rename(partial, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        if old.is_symlink() or not old.is_dir():
            old.unlink()
        else:
            shutil.rmtree(old)
