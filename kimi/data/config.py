"""The data section (data.*, data.tokenizer, data.sources): its schema and the names data.source takes.

Torch-free, like every section's config (kimi/schema/__init__.py); the section's rules are
kimi/data/rules.py's, its sources kimi/data/source_registry.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kimi.schema.vocabulary import one_of

# data.source's names: the table of kimi/data/source_registry.py, which fills it (it imports this module)
DATA_SOURCES: Dict[str, Any] = {}
DATA_FORMATS = ("text", "json", "parquet")
PREPARE_EXECUTORS = ("local", "slurm")  # datatrove's executors (kimi/data/prepare/executor.py)


@dataclass
class TokenizerConfig:
    # Path to an existing sentencepiece .model; None trains a BPE on the training split.
    model_path: Optional[str] = None
    vocab_size: int = 2048
    # Characters of training text fed to the sentencepiece trainer (enough for a good BPE, fast).
    train_chars: int = 20_000_000


@dataclass
class DataSourceConfig:
    """One source of a blend (data.sources, kimi/data/blend.py): its share of the training samples and where
    its documents are; a key left null takes data.*'s value."""

    name: str = ""  # names its prepared directory and its validation loss, val_loss/<name>
    weight: float = 1.0
    source: Optional[str] = one_of(DATA_SOURCES, None)
    path: Optional[str] = None
    data_files: Optional[List[str]] = None
    format: Optional[str] = one_of(DATA_FORMATS, None)
    config: Optional[str] = None
    revision: Optional[str] = None
    text_field: Optional[str] = None
    train_split: Optional[str] = None
    val_split: Optional[str] = None
    val_fraction: Optional[float] = None


@dataclass
class DataConfig:
    name: str = "shakespeare"
    # shakespeare | hf (a hub dataset name, data.path) | files (local text/json/parquet, data.data_files)
    source: str = one_of(DATA_SOURCES, "shakespeare")
    path: Optional[str] = None  # hub dataset name for source=hf
    config: Optional[str] = None  # source=hf: the dataset's subset (load_dataset's name)
    revision: Optional[str] = None  # source=hf: a branch, tag or commit of the dataset
    data_files: Optional[List[str]] = None  # local files (or globs) for source=files
    format: Optional[str] = one_of(DATA_FORMATS, None)  # None: inferred from the file extension
    text_field: str = "text"
    train_split: str = "train"
    val_split: Optional[str] = None  # None: hold out `val_fraction` of the documents
    val_fraction: float = 0.05
    cache_dir: Optional[str] = None  # None: $KIMI_CACHE_DIR or ~/.cache/kimi
    num_proc: Optional[int] = None  # processes that tokenise (kimi.data.encode); None: every core
    shard_mb: float = 256.0  # size of one token shard (kimi.data.shards)
    # Preparing across machines (kimi/data/prepare/parts.py, docs/data.md): data.data_files split into this
    # many parts, one per worker; the command without a worker number merges them. null: one process
    prepare_workers: Optional[int] = None
    # this process's part, 0 to prepare_workers - 1; null: a SLURM array task's or torchrun rank's, if any
    prepare_worker: Optional[int] = None
    # datatrove runs the workers, then the merge (the prep extra): on this machine or as a SLURM array
    prepare_executor: Optional[str] = one_of(PREPARE_EXECUTORS, None)
    # datatrove's executor arguments, added with +: local: workers; slurm: partition, time, cpus_per_task, ...
    prepare_executor_args: Dict[str, Any] = field(default_factory=dict)
    # The trainer tokenises a corpus of up to this many MB of text itself; larger ones are prepared first with
    # `python -m kimi.data.prepare` (resumable, every core).
    inline_max_mb: float = 512.0
    varlen: bool = False  # feed document boundaries (cu_seqlens) to the model
    # Read the source as a stream while training (hf or files; kimi/data/streaming.py) instead of token shards
    streaming: bool = False
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # A blend: several sources sampled by weight (docs/data.md); null: the one source above
    sources: Optional[List[DataSourceConfig]] = None
