"""Documents -> token shards per split, cached by what produced them, resumable after a kill.

``prepare`` writes, under ``<cache>/datasets/<name>-<fingerprint>/``::

    tokenizer.model            the tokenizer the tokens were made with
    train-00000.bin/.idx/.json the training split's shards (kimi.data.shards: tokens, document index,
    metadata) val-00000.bin/.idx/.json   the validation split's
    manifest.json              written last: tokenizer identity, every shard's counts and checksum

The fingerprint hashes the source identity, the split settings and the tokenizer identity, so any change
to those lands in a new directory and unchanged inputs are never tokenised twice. A directory without a
manifest is an unfinished preparation: the next ``prepare`` keeps its finished shards and tokenises from the
first document after them (``python -m kimi.data.prepare`` is the command for large corpora; the trainer
prepares only corpora up to ``data.inline_max_mb`` itself).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List

import numpy as np
import pyarrow.compute as pc

from kimi.data.config import DataConfig
from kimi.data.encode import Progress, default_num_proc, encode_documents
from kimi.data.shards import (FORMAT_VERSION, ShardedTokens, ShardWriter, document_index, open_tokens,
                              read_meta, sha256_file, shard_path, token_dtype, write_atomic)
from kimi.data.source_registry import source_for
from kimi.data.sources import cache_root, load_documents, source_identity
from kimi.data.tokenizer import Tokenizer, resolve_model_path, train_tokenizer
from kimi.errors import DataError
from kimi.folders import require_inside

if TYPE_CHECKING:  # imported where it is used: datasets takes about a second to import, and a run whose
    import datasets  # data is already prepared never needs it

# Part of a trained tokenizer's identity: bump when train_tokenizer's settings change.
TOKENIZER_RECIPE = 2
SPLITS = ("train", "val")
MANIFEST = "manifest.json"

__all__ = ["FORMAT_VERSION", "PreparedData", "fingerprint", "open_split", "open_tokens", "prepare",
           "read_meta"]


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    shards: Dict[str, List[Path]]  # split -> its shard files, in order
    meta: Dict[str, Dict[str, Any]]  # split -> its manifest entry (counts, dtype, shards)
    data_dir: Path

    @property
    def train_meta(self) -> Dict[str, Any]:
        return self.meta["train"]

    @property
    def val_meta(self) -> Dict[str, Any]:
        return self.meta["val"]


def _tokenizer_identity(cfg: DataConfig) -> Dict[str, Any]:
    tc = cfg.tokenizer
    if tc.model_path:
        path = resolve_model_path(Path(tc.model_path).expanduser())
        if path.is_dir():
            raise IsADirectoryError(f"data.tokenizer.model_path={tc.model_path!r} is a directory without a "
                                    "tokenizer.json; it must name the tokenizer file (a sentencepiece "
                                    ".model, a tiktoken BPE file or a tokenizer.json) or a directory holding "
                                    "a tokenizer.json")
        if not path.is_file():
            raise FileNotFoundError(f"data.tokenizer.model_path={tc.model_path!r} does not exist")
        return {"model_sha256": sha256_file(path)}
    return {"train_vocab_size": tc.vocab_size, "train_chars": tc.train_chars, "recipe": TOKENIZER_RECIPE}


def fingerprint(cfg: DataConfig) -> str:
    """16 hex digits naming everything the token files depend on."""
    key = {"format": FORMAT_VERSION, "source": source_identity(cfg), "tokenizer": _tokenizer_identity(cfg)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def data_dir_for(cfg: DataConfig) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", cfg.name) or "data"
    return cache_root(cfg) / "datasets" / f"{name}-{fingerprint(cfg)}"


def open_split(data: PreparedData, split: str) -> ShardedTokens:
    """A split's shards, each checked (size, checksum, ids, tokenizer), as one token array."""
    tok = data.tokenizer
    return ShardedTokens([open_tokens(p, tok.sha256, vocab_size=tok.vocab_size) for p in data.shards[split]])


# ---------------------------------------------------------------------------------------------- writing


# The documents a tokenizer is trained on, when the corpus exceeds data.tokenizer.train_chars, are drawn with
# this seed: fixed, so the tokenizer (and the cache key) does not change with trainer.seed.
TOKENIZER_SAMPLE_SEED = 20240602


def _texts(docs: datasets.Dataset):
    for batch in docs.iter(batch_size=1024):
        yield from batch["text"]


def tokenizer_texts(docs: datasets.Dataset, max_chars: int) -> Iterator[str]:
    """What the tokenizer is trained on: every document in order when the corpus fits in ``max_chars``
    characters, else documents in a seeded random order across the whole corpus (its first characters
    would be one source, one topic, one era)."""
    total = sum(int(pc.sum(pc.utf8_length(b.column("text"))).as_py() or 0)
                for b in docs.with_format("arrow").iter(batch_size=8192))
    if total <= max_chars:
        yield from _texts(docs)
        return
    for i in np.random.default_rng(TOKENIZER_SAMPLE_SEED).permutation(len(docs)):
        text = docs[int(i)]["text"]
        yield text
        max_chars -= len(text)
        if max_chars <= 0:
            return


def ensure_tokenizer(cfg: DataConfig, data_dir: Path, train_docs: datasets.Dataset) -> Tokenizer:
    """data_dir's tokenizer.model: found, copied from data.tokenizer.model_path, or trained on ``train_docs``
    (the workers of kimi.data.prepare.parts need it made once, before them)."""
    path = data_dir / "tokenizer.model"
    if path.is_file():  # a run that stopped after training it: training is deterministic, reuse it
        return Tokenizer(path)
    tc = cfg.tokenizer
    if tc.model_path:
        user = Tokenizer(Path(tc.model_path).expanduser())  # refuses a file that is no tokenizer
        return user.copy_to(path)
    return train_with_progress(tokenizer_texts(train_docs, tc.train_chars), cfg, path)


def train_with_progress(texts: Iterator[str], cfg: DataConfig, path: Path) -> Tokenizer:
    """data.tokenizer's BPE trained on `texts` into `path`, saying what it does and how long it took."""
    tc = cfg.tokenizer
    print(f"[data] training a {tc.vocab_size}-piece BPE tokenizer on up to {tc.train_chars:,} characters",
          flush=True)
    t0 = time.perf_counter()
    tok = train_tokenizer(texts, tc.vocab_size, path, max_chars=tc.train_chars)
    print(f"[data] tokenizer trained in {time.perf_counter() - t0:.1f}s", flush=True)
    return tok


def _cached_tokenizer(data_dir: Path) -> Tokenizer:
    try:
        return Tokenizer(data_dir / "tokenizer.model")
    except (DataError, FileNotFoundError):
        raise DataError(f"the prepared data in {data_dir} has a missing or corrupt tokenizer.model; delete "
                        f"{data_dir} to rebuild it") from None


def finished_shards(data_dir: Path, split: str, fp: str, tok: Tokenizer) -> List[Dict[str, Any]]:
    """The metadata of the split's shards a killed run finished (0, 1, ... while each is intact); the rest,
    and any temporary file, is deleted so the writer starts clean after them."""
    done: List[Dict[str, Any]] = []
    while (path := shard_path(data_dir, split, len(done))).with_suffix(".json").is_file():
        try:
            meta = read_meta(path)
            if meta.get("fingerprint") != fp:
                break
            open_tokens(path, tok.sha256, tok.vocab_size)
        except DataError:
            break
        done.append(meta)
    for stale in data_dir.glob(f"{split}-*"):
        number = re.match(rf"{split}-(\d+)\.", stale.name)
        if ".tmp-" in stale.name or (number and int(number.group(1)) >= len(done)):
            stale.unlink()
    return done


def _write_split(docs: datasets.Dataset, tok: Tokenizer, cfg: DataConfig, data_dir: Path, split: str,
                 base: Dict[str, Any], num_proc: int) -> Dict[str, Any]:
    done = finished_shards(data_dir, split, base["fingerprint"], tok)
    start = sum(int(m["num_documents"]) for m in done)
    if done:
        print(f"[data] {split}: {len(done)} finished shard(s) kept, {start:,} documents; continuing",
              flush=True)
    writer = ShardWriter(data_dir, split, len(done), start, shard_tokens(cfg, tok), base)
    progress = Progress(f"tokenising {split}", len(docs), start)
    eos = tok.eos_id
    for ids, chars in encode_documents(docs, tok, start, num_proc):
        for doc, n in zip(ids, chars):
            writer.add(doc + [eos], n)
        progress.add(len(ids), sum(len(d) + 1 for d in ids))
    shards = done + writer.finish()
    progress.close()
    return split_entry(shards, base, data_dir, split)


def shard_tokens(cfg: DataConfig, tok: Tokenizer) -> int:
    """Tokens in one shard (data.shard_mb): a shard closes once it holds this many."""
    return max(1, int(cfg.shard_mb * 2**20) // token_dtype(tok.vocab_size).itemsize)


def split_entry(shards: List[Dict[str, Any]], base: Dict[str, Any], data_dir: Path,
                split: str) -> Dict[str, Any]:
    """The manifest's entry of a split, from its shards' metadata in order."""
    if not shards:
        raise DataError(f"the {split} split has no documents")
    return {**base, "split": split, "dtype": shards[0]["dtype"],
            "num_tokens": sum(m["num_tokens"] for m in shards),
            "num_documents": sum(m["num_documents"] for m in shards),
            "num_chars": sum(m["num_chars"] for m in shards),
            "shards": [{"file": shard_path(data_dir, split, i).name, "num_tokens": m["num_tokens"],
                        "num_documents": m["num_documents"], "sha256": m["sha256"]}
                       for i, m in enumerate(shards)]}


def _text_mb(docs: datasets.Dataset) -> float:
    """Megabytes of text in the documents' table (UTF-8), without reading it into Python."""
    return int(pc.sum(pc.binary_length(docs.data.column("text"))).as_py() or 0) / 2**20


def prepare_command() -> str:
    """The command that prepares this run's data: the data overrides of the running Hydra command, if any."""
    args: List[str] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            args = [a for a in HydraConfig.get().overrides.task if a.lstrip("+~").startswith("data")]
    except ImportError:
        pass
    return " ".join(["python -m kimi.data.prepare", *(f"'{a}'" if " " in a else a for a in args)])


@contextlib.contextmanager
def exclusive(data_dir: Path) -> Iterator[None]:
    """One preparation of a directory at a time (two jobs sharing a cache): the second waits, then finds the
    first's manifest, or its finished shards if it was killed."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shard_base(cfg: DataConfig, fp: str, tok: Tokenizer) -> Dict[str, Any]:
    """What every shard's metadata starts with."""
    return {"format_version": FORMAT_VERSION, "fingerprint": fp, "tokenizer_sha256": tok.sha256,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
            "source": source_identity(cfg)}


def write_manifest(cfg: DataConfig, data_dir: Path, fp: str, tok: Tokenizer,
                   splits: Dict[str, Dict[str, Any]]) -> None:
    """The manifest, written last: it marks the data done."""
    manifest = {"format_version": FORMAT_VERSION, "fingerprint": fp,
                "tokenizer": {"file": "tokenizer.model", "kind": tok.kind, "sha256": tok.sha256,
                              "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id},
                "source": source_identity(cfg), "splits": splits}
    write_atomic(data_dir / MANIFEST, json.dumps(manifest, indent=1).encode())


def _tokenise(cfg: DataConfig, data_dir: Path, fp: str, limit: bool) -> PreparedData:
    t0 = time.perf_counter()
    train_docs, val_docs = load_documents(cfg)
    mb = _text_mb(train_docs)
    if limit and mb > cfg.inline_max_mb:
        raise DataError(f"data {cfg.name!r} holds {mb:,.0f} MB of text, more than the trainer tokenises "
                        f"itself (data.inline_max_mb={cfg.inline_max_mb:g}); prepare it first with "
                        f"`{prepare_command()}` (data.num_proc processes, resumable), then start training "
                        "again")
    try:  # this pass decodes every document: the UTF-8 check of JSON and Parquet text costs nothing extra
        tok = ensure_tokenizer(cfg, data_dir, train_docs)
        num_proc = default_num_proc(cfg.num_proc)
        print(f"[data] tokenising {len(train_docs):,} train / {len(val_docs):,} val documents ({mb:,.1f} "
              f"MB) on {num_proc} process(es) into {data_dir}", flush=True)
        base = shard_base(cfg, fp, tok)
        splits = {split: _write_split(docs, tok, cfg, data_dir, split, base, num_proc)
                  for split, docs in zip(SPLITS, (train_docs, val_docs))}
    except UnicodeDecodeError as e:
        raise source_for(cfg).undecodable(e) from None
    write_manifest(cfg, data_dir, fp, tok, splits)
    prepared = _prepared(data_dir)
    print(f"[data] wrote {prepared.train_meta['num_tokens']:,} train / {prepared.val_meta['num_tokens']:,} "
          f"val tokens to {data_dir} in {time.perf_counter() - t0:.1f}s", flush=True)
    return prepared


# ---------------------------------------------------------------------------------------------- reading


def _prepared(data_dir: Path) -> PreparedData:
    """The finished data in ``data_dir``, every shard checked against the manifest and opened (size,
    checksum, ids, tokenizer) before anyone trains on it."""
    path = data_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        splits = {s: manifest["splits"][s] for s in SPLITS}
        names = {s: [e["file"] for e in splits[s]["shards"]] for s in SPLITS}
        sums = {s: [e["sha256"] for e in splits[s]["shards"]] for s in SPLITS}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{path} is corrupt ({type(e).__name__}: {e}); delete {data_dir} to rebuild "
                        "it") from None
    # its shards are files of its own folder: a forged name must not read any file on the machine
    files = {s: [require_inside(data_dir, name, path, DataError) for name in names[s]] for s in SPLITS}
    tok = _cached_tokenizer(data_dir)
    if manifest.get("tokenizer", {}).get("sha256") != tok.sha256:
        raise DataError(f"the prepared data in {data_dir} was made with tokenizer "
                        f"{manifest.get('tokenizer', {}).get('sha256')}, but its tokenizer.model is "
                        f"{tok.sha256}; delete {data_dir} to rebuild it")
    for split in SPLITS:
        for file, want in zip(files[split], sums[split]):
            open_tokens(file, expected_tokenizer_sha256=tok.sha256, vocab_size=tok.vocab_size)
            document_index(file)
            if read_meta(file).get("sha256") != want:
                raise DataError(f"token file {file} is not the shard {path.name} lists; delete {data_dir} to "
                                "rebuild it")
    return PreparedData(tok, files, splits, data_dir)


def _found(data_dir: Path) -> PreparedData:
    prepared = _prepared(data_dir)
    print(f"[data] using {data_dir} ({prepared.train_meta['num_tokens']:,} train / "
          f"{prepared.val_meta['num_tokens']:,} val tokens)", flush=True)
    return prepared


def prepare(cfg: DataConfig, limit: bool = True) -> PreparedData:
    """Tokenise the configured source into cached shards (or find them already there). ``limit``: refuse a
    corpus over data.inline_max_mb (the trainer's call; the prepare command lifts it)."""
    fp = fingerprint(cfg)
    data_dir = data_dir_for(cfg)
    if (data_dir / MANIFEST).is_file():
        return _found(data_dir)
    with exclusive(data_dir):
        if (data_dir / MANIFEST).is_file():
            return _found(data_dir)
        return _tokenise(cfg, data_dir, fp, limit)


def read_tokens(data: PreparedData, split: str) -> np.ndarray:
    """A split's tokens as one in-memory array (tests and small tools; the loader reads the shards)."""
    return open_split(data, split)[:]
