"""The planner's traces kept on disk from one `python -m kimi.plan` to the next.

A plan's traces (the activations of a model shape per checkpointing mode and dtype, the optimizer step's
working memory) follow only the model's code, torch's and the config sections they are keyed by, and they
are about half of a large plan's time (docs/planning.md, "Speed"). Another plan of the same model, on
another number of GPUs or another sequence length, reads them back instead. An entry holds for one
fingerprint: torch's version and every source file of the kimi package, so any change of code traces anew
(and the first entry written under new code removes the old code's).

Only the command (kimi.plan.cli.plan) turns the disk on (`enabled`): a library call (a test, a bench
script) keeps its traces in memory, so a monkeypatched model never leaves one behind. The files live in
`<kimi cache>/plan/` (`$KIMI_CACHE_DIR`, else `~/.cache/kimi`); deleting the folder only costs the next plan
its traces.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

T = TypeVar("T")
PACKAGE = Path(__file__).resolve().parents[1]
_DIR: Optional[Path] = None


@contextlib.contextmanager
def enabled(directory: Path) -> Iterator[None]:
    """Inside, `cached` reads and writes entries in `directory`."""
    global _DIR
    before, _DIR = _DIR, Path(directory)
    try:
        yield
    finally:
        _DIR = before


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """torch's version and the bytes of every .py file of the kimi package (some 220 files: tens of ms)."""
    import torch  # here: the planner checks its command line before anything imports torch

    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cached(kind: str, key: str, compute: Callable[[], T], encode: Callable[[T], Any],
           decode: Callable[[Any], T]) -> T:
    """compute(), or the value an earlier command stored for (kind, key) under this code's fingerprint.
    encode makes the value JSON; decode(encode(v)) must equal v. An unreadable entry is computed again."""
    if _DIR is None:
        return compute()
    code = fingerprint()
    path = _DIR / f"{code[:16]}-{kind}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        entry = json.loads(path.read_text())
        if entry["key"] == key and entry["code"] == code:
            return decode(entry["value"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or cut short by a stopped command
    value = compute()
    try:  # a read-only cache only costs the next plan its traces
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "code": code, "value": encode(value)}))
        os.replace(tmp, path)
        for old in path.parent.glob("*.json"):  # other code's entries: the folder holds one version's
            if not old.name.startswith(code[:16]):
                old.unlink(missing_ok=True)
    except OSError:
        pass
    return value
