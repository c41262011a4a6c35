"""Which model folders may run their own Python code. transformers imports a folder's modeling code (the
files config.json's ``auto_map`` names, and what they import) when asked to with trust_remote_code; kimi asks
only when the user passes trust_remote_code=true. Reading the weights (from-hf, load_hf) never imports them.

An export kimi writes with its own code (kimi.interop.remote) records its ``auto_map`` and the sha256 of each
of its Python files in ``kimi_code.json``. A folder holding that record whose code differs from it (a file
edited, added or removed, auto_map changed) has been changed since: it runs only when trust_modified_code=true
is given as well. A folder with auto_map and no record of ours (another tool's export) needs
trust_remote_code=true alone. The record tells our own export apart from a changed one; it is no signature.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kimi.errors import ConfigError

RECORD = "kimi_code.json"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_files(directory: Path) -> dict[str, str]:
    """name -> sha256 of every Python file in `directory` (transformers imports modules beside the modeling
    file only)."""
    return {p.name: _sha256(p) for p in sorted(Path(directory).glob("*.py")) if p.is_file()}


def write_record(directory: Path, auto_map: dict) -> str:
    """Record the Python files now in `directory` and `auto_map` as ours; returns the record's file name."""
    record = {"written_by": "python -m kimi.convert to-hf", "auto_map": auto_map,
              "sha256": code_files(directory)}
    (Path(directory) / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return RECORD


def code_changes(directory: Path, config: dict) -> list[str] | None:
    """What differs from the record of ours in `directory` (empty: the code we wrote), or None when it holds
    no record."""
    path = Path(directory) / RECORD
    if not path.exists() and not path.is_symlink():
        return None
    try:
        record = json.loads(path.read_text())
        sums, auto_map = record["sha256"], record["auto_map"]
        if not isinstance(sums, dict):
            raise TypeError("sha256 is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{RECORD} is unreadable ({type(e).__name__})"]
    now = code_files(directory)
    changes = [f"{name} edited" for name in sorted(set(now) & set(sums)) if now[name] != sums[name]]
    changes += [f"{name} added" for name in sorted(set(now) - set(sums))]
    changes += [f"{name} removed" for name in sorted(set(sums) - set(now))]
    if config.get("auto_map") != auto_map:
        changes.append("config.json's auto_map changed")
    return changes


def _modules(auto_map) -> list[str]:
    """The modules an auto_map names ("modeling_kimi.KimiForCausalLM", or [slow, fast] for tokenizers)."""
    values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else [value])]
    return sorted({str(v).rsplit(".", 1)[0] + ".py" for v in flat if v})


def allow_code(directory: Path, config: dict, trust_remote_code: bool,
               trust_modified_code: bool = False) -> bool:
    """Whether loading `directory` (whose config.json is `config`) in transformers runs code from it (its
    config.json has an auto_map), once the user's keys allow that; a one-line ConfigError saying how to
    allow it otherwise."""
    auto_map = config.get("auto_map")
    if not auto_map:
        return False
    if not trust_remote_code:
        files = ", ".join(_modules(auto_map)) or "auto_map"
        raise ConfigError(f"{directory} holds its own Python code ({files} in config.json's auto_map), "
                          "which loading it would run: pass trust_remote_code=true to run it, for a folder "
                          "you trust (one kimi.convert to-hf wrote, say)")
    changes = code_changes(Path(directory), config)
    if changes and not trust_modified_code:
        raise ConfigError(f"{directory}: its Python code is not what kimi.convert to-hf wrote "
                          f"({'; '.join(changes[:3])}{'; ...' if len(changes) > 3 else ''}): export the run "
                          "again, or pass trust_modified_code=true as well to run it as it is")
    return True
