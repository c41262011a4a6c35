"""Folders are trust boundaries: a file name read from a file (a Hugging Face index's weight_map, a
prepared-data manifest, a checkpoint's metadata and marker) names a file inside the folder that file lies in.

Joining such a name to its folder as it is would read anywhere: ``../`` climbs out, an absolute name replaces
the folder, and a symbolic link (or a link among the folder's parents' entries) points elsewhere. So the name
is resolved (links followed, ``..`` applied) and must land strictly inside the resolved folder. One predicate
for every reader, each raising its own error type (the exit code its command documents).
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """The kimi cache (prepared data, the CPU's measured peak, the planner's traces): $KIMI_CACHE_DIR, else
    ~/.cache/kimi."""
    return Path(os.environ.get("KIMI_CACHE_DIR") or "~/.cache/kimi").expanduser()


def inside(folder: str | os.PathLike, name) -> Path | None:
    """``folder / name`` when `name` (a str) resolves to a path strictly inside `folder`, else None (also
    for a name that is not a string, is empty, or is the folder itself)."""
    if not isinstance(name, str) or not name or "\0" in name:
        return None
    folder = Path(folder)
    try:
        root, target = folder.resolve(), (folder / name).resolve()
    except (OSError, RuntimeError):  # a loop of links
        return None
    return folder / name if root in target.parents else None


def outside(name, source: str | os.PathLike | None, folder: str | os.PathLike) -> str:
    """The one-line refusal of entry `name` read from file `source` (None: a fixed name, such as
    model.safetensors, that is a link leading out)."""
    if source is None:
        return (f"{Path(folder) / str(name)} leads out of {folder} (a link to a file elsewhere): refusing to "
                "read it; copy the file itself into the folder")
    return (f"{source} names {name!r}, which is not a file inside {folder} (a '..' or absolute path, or a "
            "link leading out): refusing to read it; use a folder that holds its own files, from a source "
            "you trust")


def require_inside(folder: str | os.PathLike, name, source: str | os.PathLike | None,
                   error: type[Exception] = ValueError) -> Path:
    """``folder / name``, or `error` with the one-line refusal (outside) when it leaves `folder`."""
    path = inside(folder, name)
    if path is None:
        raise error(outside(name, source, folder))
    return path
