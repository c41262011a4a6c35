"""Preparing data: :func:`prepare` and its command, ``python -m kimi.data.prepare`` (``__main__.py``).
``kimi.data.prepare`` the package attribute is the function: kimi/data/__init__.py binds it after this
package is imported. Across machines: ``parts.py`` (a worker's share of the files), ``merge.py`` (the
parts into the single-process output), ``executor.py`` (datatrove runs both; optional)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from kimi.data import pack
from kimi.data.config import DataConfig
from kimi.data.pack import PreparedData

# kimi.data.blend (its validation batches are torch tensors) only for a blend: one source's preparation, a
# worker's part and the merge run without torch's start-up (seconds per worker)
if TYPE_CHECKING:
    from kimi.data.blend import PreparedBlend

__all__ = ["PreparedData", "prepare"]


def prepare(cfg: DataConfig, limit: bool = True) -> Union[PreparedData, PreparedBlend]:
    """The configured data tokenised into cached shards (kimi.data.pack), or found there; a blend
    (data.sources) prepares each source. ``limit``: refuse a corpus over data.inline_max_mb (the trainer's
    call; the prepare command lifts it)."""
    if cfg.sources:
        from kimi.data.blend import prepare_blend

        return prepare_blend(cfg, pack.prepare, limit)
    if cfg.streaming:
        from kimi.data.streaming import prepare_stream

        return prepare_stream(cfg)
    return pack.prepare(cfg, limit)
