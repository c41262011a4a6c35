"""What a complete checkpoint holds: the size and CRC-32 of every file, recorded in its COMPLETE marker.

Loading checks the manifest first, so flipped bytes, a truncated or missing file, or a marker with nothing
behind it are found before anything is read into the model (DCP itself would load silently changed
tensor bytes). CRC-32 (zlib) checks a few GB/s on one core, and each rank checksums the files it wrote
itself (still in the page cache) and, on load, a share of the files.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from kimi.folders import inside

Manifest = Dict[str, Tuple[int, int]]  # file name -> (size in bytes, crc32)
_BLOCK = 16 << 20


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            value = zlib.crc32(block, value)
    return value


def describe(path: Path, names: List[str]) -> Manifest:
    return {name: (path.joinpath(name).stat().st_size, crc32(path / name)) for name in names}


def read_marker(marker: Path) -> Tuple[Optional[dict], str]:
    """(the marker's JSON, "") or (None, why it cannot be used)."""
    try:
        data = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"its {marker.name} marker is unreadable ({type(e).__name__})"
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or not data["files"]:
        return None, (f"its {marker.name} marker lists no files (not written by this version of kimi, or "
                      "planted)")
    return data, ""


def check_files(path: Path, files: Dict[str, list], names: List[str]) -> List[str]:
    """Problems with the files `names` of checkpoint `path` against the manifest `files` (empty: intact)."""
    problems = []
    for name in names:
        size, crc = files[name]
        f = path / name
        if inside(path, name) is None:  # kimi.folders: '../', '/' or a link would check any file
            problems.append(f"its marker lists {name!r}, which is not a file inside it (forged)")
        elif not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{name} has {f.stat().st_size} bytes, {size} were written")
        elif crc32(f) != crc:
            problems.append(f"{name} does not match its checksum (bytes changed since it was written)")
    return problems


def unlisted(path: Path, files: Dict[str, list], ignore: Tuple[str, ...]) -> List[str]:
    """Files in the checkpoint the manifest does not know (a planted .metadata would be one)."""
    return sorted(p.name for p in path.iterdir() if p.name not in files and p.name not in ignore)


def to_json(manifest: Manifest) -> Dict[str, list]:
    return {name: list(v) for name, v in sorted(manifest.items())}
