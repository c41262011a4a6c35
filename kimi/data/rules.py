"""The data section's rules (kimi.validation runs them before any data work)."""

from __future__ import annotations

from kimi.config import DataConfig, check, check_choices, check_finite


def validate_data(d: DataConfig) -> None:
    check_choices(d, "data")
    check_finite(d, "data")
    if d.source == "hf":
        check(bool(d.path), "data.path", d.path,
              "data.source=hf needs a dataset name, e.g. data.path=roneneldan/TinyStories")
    if d.source == "files":
        check(bool(d.data_files), "data.data_files", d.data_files,
              "data.source=files needs a list of local files, e.g. 'data.data_files=[/data/a.txt]'")
    check(not d.val_split or d.source == "hf", "data.val_split", d.val_split,
          f"only data.source=hf has named splits (data.source={d.source} holds out data.val_fraction of its "
          "documents): set data.val_split=null")
    check(0.0 <= d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "must be in [0, 1)")
    check(d.num_proc is None or d.num_proc >= 1, "data.num_proc", d.num_proc, "must be >= 1 (null: every core)")
    check(d.shard_mb > 0, "data.shard_mb", d.shard_mb, "must be a positive size in MB")
    check(d.inline_max_mb >= 0, "data.inline_max_mb", d.inline_max_mb, "must be >= 0 MB")
    check(d.tokenizer.vocab_size >= 260, "data.tokenizer.vocab_size", d.tokenizer.vocab_size,
          "must be >= 260: 256 byte-fallback pieces, 3 special pieces, and the text's characters")
    check(d.tokenizer.train_chars > 0, "data.tokenizer.train_chars", d.tokenizer.train_chars,
          "must be a positive number of characters")
