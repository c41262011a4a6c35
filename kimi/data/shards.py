"""Token shards on disk: how one is written, checked and read, and the split as one array over its shards.

A split is a run of shards ``<split>-00000.bin``, ``<split>-00001.bin``, ... Each shard holds whole
documents, every one followed by EOS, and comes with

    <split>-NNNNN.idx    its document index: uint64 start offsets of its documents, then its length, so
                         document d starts at idx[d] without scanning for EOS
    <split>-NNNNN.json   its metadata: dtype, counts, the first document's number in the split, the
                         tokenizer's hash and the SHA-256 of the .bin and the .idx

The .bin and .idx are renamed into place before the .json is written, so a shard with metadata is complete
and a killed writer leaves only ``*.tmp-<pid>`` files, which the next run deletes. Opening a shard checks its
size, its checksum and that every id is inside the vocabulary, once per process and file version.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from kimi.errors import DataError

FORMAT_VERSION = 2
_MAX_CHUNK = 1 << 26  # tokens per pass of the id and checksum check: bounded temporaries on any shard size


def shard_path(data_dir: Path, split: str, index: int) -> Path:
    return Path(data_dir) / f"{split}-{index:05d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    # ids < vocab_size, so 2**16 pieces still fit in uint16: half the disk and memory of uint32.
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ShardWriter:
    """Appends encoded documents to a split's shards, closing a shard once it holds ``shard_tokens``.

    Shard boundaries depend only on the documents' token counts, so a run that resumes after the finished
    shards writes the same shards an uninterrupted run would."""

    def __init__(self, data_dir: Path, split: str, first_shard: int, first_document: int, shard_tokens: int,
                 meta: Dict[str, Any]):
        self.data_dir, self.split, self.shard_tokens, self.meta = Path(data_dir), split, shard_tokens, meta
        self.dtype = token_dtype(int(meta["vocab_size"]))
        self.index, self.document = first_shard, first_document
        self.written: List[Dict[str, Any]] = []
        self._open()

    def _open(self) -> None:
        self.path = shard_path(self.data_dir, self.split, self.index)
        self.tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        self.file = open(self.tmp, "wb")
        self.hash = hashlib.sha256()
        self.starts: List[int] = []
        self.tokens = self.chars = 0
        self.first_document = self.document

    def add(self, ids: Sequence[int], chars: int) -> None:
        """One document's ids, EOS included."""
        data = np.asarray(ids, dtype=self.dtype).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.starts.append(self.tokens)
        self.tokens += len(ids)
        self.chars += chars
        self.document += 1
        if self.tokens >= self.shard_tokens:
            self._close()
            self.index += 1
            self._open()

    def _close(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)
        index = np.asarray(self.starts + [self.tokens], dtype=np.uint64).tobytes()
        write_atomic(self.path.with_suffix(".idx"), index)
        meta = {**self.meta, "split": self.split, "shard": self.index, "dtype": self.dtype.name,
                "num_tokens": self.tokens, "num_documents": len(self.starts), "num_chars": self.chars,
                "first_document": self.first_document, "sha256": self.hash.hexdigest(),
                "index_sha256": hashlib.sha256(index).hexdigest()}
        # last: marks it done
        write_atomic(self.path.with_suffix(".json"), json.dumps(meta, indent=1).encode())
        self.written.append(meta)

    def finish(self) -> List[Dict[str, Any]]:
        """Close the last shard (if it holds a document) and return the metadata of the shards written."""
        if self.starts:
            self._close()
        else:
            self.file.close()
            self.tmp.unlink()
        return self.written


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


# Shards whose ids and checksum were checked in this process, by (path, inode, size, mtime, vocabulary):
# prepare() and then the trainer open each shard, and the second open need not read it again.
_CHECKED: Set[Tuple[str, int, int, int, int]] = set()


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


def _check_size(path: Path, want: int, what: str) -> None:
    if not path.is_file():
        raise DataError(f"token file {path} is missing; delete {path.parent} to rebuild it")
    size = path.stat().st_size
    if size != want:
        how = "truncated" if size < want else "longer than its metadata says"
        raise DataError(f"token file {path} is {how}: {size} bytes, but its metadata promises {what} ({want} "
                        f"bytes); delete {path.parent} to rebuild it")


def _check_contents(bin_path: Path, tokens: np.memmap, vocab_size: int, meta: Dict[str, Any]) -> None:
    """Every id below the vocabulary size (a corrupted shard, or one made by another tokenizer, would
    otherwise index past the embedding table: a CUDA assert, or silently wrong rows), and the bytes those
    the writer hashed."""
    st = bin_path.stat()
    key = (str(bin_path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, vocab_size)
    if key in _CHECKED:
        return
    h, top = hashlib.sha256(), 0
    for i in range(0, len(tokens), _MAX_CHUNK):
        chunk = np.asarray(tokens[i:i + _MAX_CHUNK])
        top = max(top, int(chunk.max()))
        h.update(chunk.tobytes())
    if top >= vocab_size:
        raise DataError(f"token file {bin_path} holds token id {top}, but its tokenizer has only "
                        f"{vocab_size} ids (a corrupted file, or one made with another tokenizer); delete "
                        f"{bin_path.parent} to rebuild it")
    if meta.get("sha256") != h.hexdigest():
        raise DataError(f"token file {bin_path} does not match its checksum (sha256 {h.hexdigest()[:16]}..., "
                        f"metadata {str(meta.get('sha256'))[:16]}...): it changed after it was written; "
                        f"delete {bin_path.parent} to rebuild it")
    _CHECKED.add(key)


def open_tokens(bin_path: Path, expected_tokenizer_sha256: Optional[str] = None,
                vocab_size: Optional[int] = None) -> np.memmap:
    """One shard as a read-only memmap, after checking it against its metadata and the tokenizer: size,
    checksum and every id below ``vocab_size`` (the metadata's vocabulary when not given)."""
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
    _check_size(bin_path, num_tokens * dtype.itemsize, f"{num_tokens} {dtype.name} tokens")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))
    _check_contents(bin_path, tokens, meta_vocab, meta)
    return tokens


def document_index(bin_path: Path) -> np.ndarray:
    """The shard's document start offsets and, last, its length (uint64), checked against its metadata."""
    bin_path = Path(bin_path)
    meta, idx_path = read_meta(bin_path), Path(bin_path).with_suffix(".idx")
    docs = int(meta.get("num_documents", -1))
    _check_size(idx_path, (docs + 1) * 8, f"{docs} document offsets and the length")
    data = idx_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != meta.get("index_sha256"):
        raise DataError(f"document index {idx_path} does not match its checksum; delete {idx_path.parent} to "
                        "rebuild it")
    return np.frombuffer(data, dtype=np.uint64)


class ShardedTokens:
    """A split's shards as one read-only token array: ``len``, integer-array indexing (any shape) and
    slices, as the loader and the tests use a flat array."""

    def __init__(self, shards: List[np.ndarray]):
        if not shards:
            raise ValueError("no shards")
        self.shards = shards
        self.dtype = shards[0].dtype
        self.ends = np.cumsum([len(s) for s in shards])
        self.starts = self.ends - [len(s) for s in shards]

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, idx: Any) -> np.ndarray:
        if isinstance(idx, slice):
            return self[np.arange(len(self))[idx]]
        idx = np.asarray(idx)
        if len(self.shards) == 1:
            return np.asarray(self.shards[0][idx])
        flat = idx.reshape(-1)
        which = np.searchsorted(self.ends, flat, side="right")
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(which):
            mask = which == s
            out[mask] = self.shards[s][flat[mask] - self.starts[s]]
        return out.reshape(idx.shape)

    def tolist(self) -> List[int]:
        return self[:].tolist()
