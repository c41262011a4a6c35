"""Documents -> one flat token file per split, cached by what produced it.

``prepare`` writes, under ``<cache>/datasets/<name>-<fingerprint>/``::

    tokenizer.model            the sentencepiece model the tokens were made with
    train.bin  val.bin         every document's ids followed by EOS, concatenated (uint16 or uint32)
    train.json val.json        metadata: tokenizer hash, vocabulary, dtype, counts, source

The fingerprint hashes the source identity, the split settings and the tokenizer identity, so any change
to those lands in a new directory and unchanged inputs are never tokenised twice. Every file is written to
a temporary name and renamed into place, metadata last: a killed run leaves no half file that looks done,
and ranks racing on the same directory write identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import datasets
import numpy as np

from kimi.config import DataConfig
from kimi.data.checks import undecodable_text_error
from kimi.data.errors import DataError
from kimi.data.sources import cache_root, load_documents, source_identity
from kimi.data.tokenizer import Tokenizer, train_tokenizer

FORMAT_VERSION = 1
# Part of a trained tokenizer's identity: bump when train_tokenizer's settings change.
TOKENIZER_RECIPE = 1
SPLITS = ("train", "val")


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train_path: Path
    val_path: Path
    train_meta: Dict[str, Any]
    val_meta: Dict[str, Any]
    data_dir: Path


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer_identity(cfg: DataConfig) -> Dict[str, Any]:
    tc = cfg.tokenizer
    if tc.model_path:
        path = Path(tc.model_path).expanduser()
        if path.is_dir():
            raise IsADirectoryError(f"data.tokenizer.model_path={tc.model_path!r} is a directory; it must name the "
                                    "tokenizer file (a sentencepiece .model or a tiktoken BPE file) inside it")
        if not path.is_file():
            raise FileNotFoundError(f"data.tokenizer.model_path={tc.model_path!r} does not exist")
        return {"model_sha256": _sha256_file(path)}
    return {"train_vocab_size": tc.vocab_size, "train_chars": tc.train_chars, "recipe": TOKENIZER_RECIPE}


def fingerprint(cfg: DataConfig) -> str:
    """16 hex digits naming everything the token files depend on."""
    key = {"format": FORMAT_VERSION, "source": source_identity(cfg), "tokenizer": _tokenizer_identity(cfg)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_meta(bin_path: Path) -> Dict[str, Any]:
    meta_path = Path(bin_path).with_suffix(".json")
    if not meta_path.is_file():
        raise DataError(f"token file {bin_path} has no metadata {meta_path.name} (an interrupted "
                        f"preparation?); delete {Path(bin_path).parent} and run again")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"token metadata {meta_path} is corrupt ({e}); delete {meta_path.parent} to rebuild "
                        "it") from None
    if not isinstance(meta, dict):
        raise DataError(f"token metadata {meta_path} is corrupt (not a JSON object); delete "
                        f"{meta_path.parent} to rebuild it")
    return meta


# Token files whose ids were checked in this process, by (path, inode, size, mtime, vocabulary): prepare()
# and then the trainer open each file, and the second open need not read it again.
_IDS_CHECKED: Set[Tuple[str, int, int, int, int]] = set()
_MAX_CHUNK = 1 << 26  # tokens per np.max call: bounded temporaries on any file size


def _token_layout(bin_path: Path, meta: Dict[str, Any]) -> Tuple[np.dtype, int, int]:
    """(dtype, num_tokens, vocab_size) from the metadata, refusing missing or impossible values."""
    try:
        dtype, num_tokens, vocab = np.dtype(meta["dtype"]), int(meta["num_tokens"]), int(meta["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"token metadata {bin_path.with_suffix('.json')} is corrupt ({type(e).__name__}: "
                        f"{e}); delete {bin_path.parent} to rebuild it") from None
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)) or num_tokens < 1 or vocab < 1:
        raise DataError(f"token metadata {bin_path.with_suffix('.json')} is corrupt (dtype {dtype}, "
                        f"{num_tokens} tokens, vocabulary {vocab}); delete {bin_path.parent} to rebuild it")
    return dtype, num_tokens, vocab


def _check_size(bin_path: Path, dtype: np.dtype, num_tokens: int) -> None:
    if not bin_path.is_file():
        raise DataError(f"token file {bin_path} is missing; delete {bin_path.parent} to rebuild it")
    size, want = bin_path.stat().st_size, num_tokens * dtype.itemsize
    if size != want:
        what = "truncated" if size < want else "longer than its metadata says"
        raise DataError(f"token file {bin_path} is {what}: {size} bytes, but its metadata promises "
                        f"{num_tokens} {dtype.name} tokens ({want} bytes); delete {bin_path.parent} to "
                        "rebuild it")


def _check_ids(bin_path: Path, tokens: np.memmap, vocab_size: int) -> None:
    """Every id below the vocabulary size: a corrupted file, or one made by another tokenizer, would
    otherwise index past the embedding table (a CUDA assert, or silently wrong rows)."""
    st = bin_path.stat()
    key = (str(bin_path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, vocab_size)
    if key in _IDS_CHECKED:
        return
    top = max(int(tokens[i:i + _MAX_CHUNK].max()) for i in range(0, len(tokens), _MAX_CHUNK))
    if top >= vocab_size:
        raise DataError(f"token file {bin_path} holds token id {top}, but its tokenizer has only "
                        f"{vocab_size} ids (a corrupted file, or one made with another tokenizer); delete "
                        f"{bin_path.parent} to rebuild it")
    _IDS_CHECKED.add(key)


def open_tokens(bin_path: Path, expected_tokenizer_sha256: Optional[str] = None,
                vocab_size: Optional[int] = None) -> np.memmap:
    """The token file as a read-only memmap, after checking it against its metadata and the tokenizer.

    Every id must be below ``vocab_size`` (the metadata's vocabulary when not given): one pass over the
    file, once per process and file version.
    """
    bin_path = Path(bin_path)
    meta = read_meta(bin_path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"token file {bin_path} has format version {meta.get('format_version')}, this code "
                        f"reads {FORMAT_VERSION}; delete {bin_path.parent} to prepare it again")
    if expected_tokenizer_sha256 is not None and meta.get("tokenizer_sha256") != expected_tokenizer_sha256:
        raise DataError(f"token file {bin_path} was made with tokenizer {meta.get('tokenizer_sha256')}, but "
                        f"this run uses {expected_tokenizer_sha256}; delete {bin_path.parent} or point "
                        "data.tokenizer.model_path at the original")
    dtype, num_tokens, meta_vocab = _token_layout(bin_path, meta)
    if vocab_size is not None and meta_vocab != vocab_size:
        raise DataError(f"token metadata {bin_path.with_suffix('.json')} says vocabulary {meta_vocab}, but "
                        f"the tokenizer has {vocab_size} pieces; delete {bin_path.parent} to rebuild it")
    _check_size(bin_path, dtype, num_tokens)
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))
    _check_ids(bin_path, tokens, meta_vocab)
    return tokens


def _texts(docs: datasets.Dataset) -> Iterator[str]:
    for batch in docs.iter(batch_size=1024):
        yield from batch["text"]


def _encode(batch: Dict[str, List[str]], tokenizer: Tokenizer) -> Dict[str, list]:
    ids = tokenizer.encode_batch(batch["text"])
    return {"ids": [x + [tokenizer.eos_id] for x in ids], "tokens": [len(x) + 1 for x in ids],
            "chars": [len(t) for t in batch["text"]]}


def _write_split(docs: datasets.Dataset, tok: Tokenizer, cfg: DataConfig, out: Path, work: Path,
                 meta: Dict[str, Any]) -> None:
    encoded = docs.map(
        _encode, batched=True, num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        fn_kwargs={"tokenizer": tok}, remove_columns=docs.column_names,
        features=datasets.Features({"ids": datasets.List(datasets.Value("int32")),
                                    "tokens": datasets.Value("int64"), "chars": datasets.Value("int64")}),
        # Our own files are the cache: datasets' map output goes to a scratch dir that prepare() deletes.
        cache_file_name=str(work / f"{out.stem}-map.arrow"),
        new_fingerprint=f"{meta['fingerprint']}-{out.stem}",
        desc=f"tokenising {out.stem}",
    )
    # ids < vocab_size, so 2**16 pieces still fit in uint16: half the disk and memory of uint32.
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    counts = encoded.select_columns(["tokens", "chars"]).with_format("numpy")[:]
    num_tokens, num_chars = int(counts["tokens"].sum()), int(counts["chars"].sum())
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tokens = np.memmap(tmp, dtype=dtype, mode="w+", shape=(num_tokens,))
    pos = 0
    for batch in encoded.with_format("arrow").iter(batch_size=8192):
        flat = batch["ids"].combine_chunks().flatten().to_numpy()
        tokens[pos:pos + len(flat)] = flat
        pos += len(flat)
    tokens.flush()
    del tokens
    os.replace(tmp, out)
    meta = {**meta, "split": out.stem, "dtype": dtype.name, "num_tokens": num_tokens,
            "num_documents": len(encoded), "num_chars": num_chars}
    _write_atomic(out.with_suffix(".json"), json.dumps(meta, indent=1).encode())  # last: marks the split done


def _tokenizer(cfg: DataConfig, data_dir: Path, train_docs: datasets.Dataset) -> Tokenizer:
    path = data_dir / "tokenizer.model"
    if path.is_file():  # a run that stopped after training it: training is deterministic, reuse it
        return Tokenizer(path)
    tc = cfg.tokenizer
    if tc.model_path:
        user = Tokenizer(Path(tc.model_path).expanduser())  # refuses a file that is no tokenizer
        return user.copy_to(path)
    print(f"[data] training a {tc.vocab_size}-piece BPE tokenizer on up to {tc.train_chars:,} characters",
          flush=True)
    t0 = time.perf_counter()
    tok = train_tokenizer(_texts(train_docs), tc.vocab_size, path, max_chars=tc.train_chars)
    print(f"[data] tokenizer trained in {time.perf_counter() - t0:.1f}s", flush=True)
    return tok


def _cached_tokenizer(data_dir: Path) -> Tokenizer:
    try:
        return Tokenizer(data_dir / "tokenizer.model")
    except (DataError, FileNotFoundError):
        raise DataError(f"the prepared data in {data_dir} has a missing or corrupt tokenizer.model; delete "
                        f"{data_dir} to rebuild it") from None


def _prepared(data_dir: Path, tok: Tokenizer) -> PreparedData:
    paths = [data_dir / f"{s}.bin" for s in SPLITS]
    for p in paths:  # validates sizes, format, tokenizer hash and ids before anyone trains on the files
        open_tokens(p, expected_tokenizer_sha256=tok.sha256, vocab_size=tok.vocab_size)
    return PreparedData(tok, paths[0], paths[1], read_meta(paths[0]), read_meta(paths[1]), data_dir)


def _tokenise(cfg: DataConfig, data_dir: Path, fp: str, train_docs: datasets.Dataset,
              val_docs: datasets.Dataset) -> Tokenizer:
    tok = _tokenizer(cfg, data_dir, train_docs)
    print(f"[data] tokenising {len(train_docs):,} train / {len(val_docs):,} val documents", flush=True)
    base = {"format_version": FORMAT_VERSION, "fingerprint": fp, "tokenizer_sha256": tok.sha256,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
            "source": source_identity(cfg)}
    work = data_dir / f"tmp-{os.getpid()}"
    work.mkdir(exist_ok=True)
    try:
        for split, docs in zip(SPLITS, (train_docs, val_docs)):
            _write_split(docs, tok, cfg, data_dir / f"{split}.bin", work, base)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tok


def prepare(cfg: DataConfig) -> PreparedData:
    """Tokenise the configured source into cached token files (or find them already there)."""
    fp = fingerprint(cfg)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", cfg.name) or "data"
    data_dir = cache_root(cfg) / "datasets" / f"{name}-{fp}"
    if all((data_dir / f"{s}.json").is_file() for s in SPLITS):
        prepared = _prepared(data_dir, _cached_tokenizer(data_dir))
        print(f"[data] using {data_dir} ({prepared.train_meta['num_tokens']:,} train / "
              f"{prepared.val_meta['num_tokens']:,} val tokens)", flush=True)
        return prepared

    t0 = time.perf_counter()
    train_docs, val_docs = load_documents(cfg)
    data_dir.mkdir(parents=True, exist_ok=True)
    try:  # this pass decodes every document: the UTF-8 check of JSON and Parquet text costs nothing extra
        tok = _tokenise(cfg, data_dir, fp, train_docs, val_docs)
    except UnicodeDecodeError as e:
        raise undecodable_text_error(cfg, e) from None
    prepared = _prepared(data_dir, tok)
    print(f"[data] wrote {prepared.train_meta['num_tokens']:,} train / {prepared.val_meta['num_tokens']:,} "
          f"val tokens to {data_dir} in {time.perf_counter() - t0:.1f}s", flush=True)
    return prepared
