"""The data section's rules (kimi.run.validation runs them before any data work)."""

from __future__ import annotations

import math
import re
from typing import List

from kimi.data.config import DataConfig
from kimi.data.source_registry import names_where, source_for
from kimi.schema.vocabulary import check, check_choices, check_finite


def _check_source(d: DataConfig, key: str) -> None:
    """Where one source's documents come from (data.*, or a blend entry merged over data.*: key names it);
    data.source is known (check_choices ran)."""
    source = source_for(d)
    source.check(key)
    check(not d.val_split or source.NAMED_SPLITS, f"{key}.val_split", d.val_split,
          f"only data.source={' or '.join(names_where('NAMED_SPLITS'))} has named splits "
          f"(data.source={d.source} holds out data.val_fraction of its documents): set data.val_split=null")
    check(0.0 <= d.val_fraction < 1.0, f"{key}.val_fraction", d.val_fraction, "must be in [0, 1)")


def _check_blend(d: DataConfig) -> None:
    from kimi.data.blend import source_configs

    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        check_choices(s, key)
        check(bool(re.fullmatch(r"[A-Za-z0-9._-]+", s.name or "")), f"{key}.name", s.name,
              "every blend source needs a name of letters, digits, '.', '_' or '-' (it names its directory)")
        check(s.weight > 0 and math.isfinite(s.weight), f"{key}.weight", s.weight,
              "must be a positive number")
    names = [s.name for s in d.sources]
    check(len(names) == len(set(names)), "data.sources", names, "every source needs a name of its own")
    for i, (_, _, own) in enumerate(source_configs(d)):
        _check_source(own, f"data.sources[{i}]")


def _check_workers(d: DataConfig) -> None:
    """Preparing in parts (kimi/data/prepare/parts.py) splits data.data_files by file."""
    n = d.prepare_workers
    check(n is None or n >= 1, "data.prepare_workers", n, "must be >= 1 (null: one process)")
    check(d.prepare_worker is None or (n is not None and 0 <= d.prepare_worker < n), "data.prepare_worker",
          d.prepare_worker, f"must be a worker's number, 0 to data.prepare_workers - 1 "
          f"(data.prepare_workers={n})")
    if (n or 1) > 1 or d.prepare_executor:
        check(source_for(d).BY_FILE and not d.sources and not d.streaming, "data.prepare_workers", n,
              f"a preparation in parts splits the files of data.source={' or '.join(names_where('BY_FILE'))} "
              "(data.data_files), one source, not streamed; prepare other sources in one process "
              "(data.prepare_workers=null)")


def validate_data(d: DataConfig) -> None:
    check_choices(d, "data")
    check_finite(d, "data")
    check(not (d.streaming and d.sources), "data.streaming", d.streaming,
          "a blend (data.sources) is read from prepared shards, not streamed: set data.streaming=false")
    check(not d.streaming or source_for(d).STREAMS, "data.streaming", d.streaming,
          f"only data.source={' or '.join(names_where('STREAMS'))} can be streamed, not {d.source}: set "
          "data.streaming=false")
    if d.sources:
        _check_blend(d)
    else:
        _check_source(d, "data")
    check(d.num_proc is None or d.num_proc >= 1, "data.num_proc", d.num_proc,
          "must be >= 1 (null: every core)")
    _check_workers(d)
    check(d.shard_mb > 0, "data.shard_mb", d.shard_mb, "must be a positive size in MB")
    check(d.inline_max_mb >= 0, "data.inline_max_mb", d.inline_max_mb, "must be >= 0 MB")
    check(d.tokenizer.vocab_size >= 260, "data.tokenizer.vocab_size", d.tokenizer.vocab_size,
          "must be >= 260: 256 byte-fallback pieces, 3 special pieces, and the text's characters")
    check(d.tokenizer.train_chars > 0, "data.tokenizer.train_chars", d.tokenizer.train_chars,
          "must be a positive number of characters")


def data_warnings(d: DataConfig) -> List[str]:
    """Settings that work but are likely not what was meant (kimi.run.validation prints them, one line
    each)."""
    if d.num_proc is None:
        return []
    from kimi.data.encode import default_num_proc  # (it imports datasets: only for a num_proc to judge)

    cores = default_num_proc(None)  # every core this process may use: its affinity, which taskset narrows
    if d.num_proc > cores:
        return [f"data.num_proc={d.num_proc} is more than the {cores} cores this process may use: the "
                f"tokenising processes share them (no faster, more memory); set data.num_proc={cores} or "
                "null (every core)"]
    return []
