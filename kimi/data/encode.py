"""Documents -> token ids, on several processes, in document order, with a progress line.

Worker processes each load the tokenizer from its file once and encode batches of documents the parent
reads from the dataset; ``imap`` hands the results back in order, so the output is the same for any number
of processes and the parent can write shards as they come.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from typing import TYPE_CHECKING, Iterator, List, Optional, Tuple

if TYPE_CHECKING:  # imported where it is used: datasets takes about a second to import, and a run whose
    import datasets  # data is already prepared never needs it

# A task is up to this many documents or characters: large enough that its pickling is small next to its
# encoding, small enough that the progress line moves and the parent's memory stays bounded (a few imap tasks
# in flight per worker) when documents are books.
BATCH_DOCS = 512
BATCH_CHARS = 4 << 20

_WORKER_TOKENIZER = None


def _init_worker(path: str) -> None:
    global _WORKER_TOKENIZER
    # Each worker is one of num_proc processes: the tokenizers library's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from kimi.data.tokenizer import Tokenizer

    _WORKER_TOKENIZER = Tokenizer(path)


def _encode_in_worker(texts: List[str]) -> List[List[int]]:
    return _WORKER_TOKENIZER.encode_batch(texts)


def default_num_proc(num_proc: Optional[int]) -> int:
    """data.num_proc, or every core this process may use."""
    if num_proc:
        return num_proc
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _batches(docs: datasets.Dataset, start: int) -> Iterator[List[str]]:
    batch: List[str] = []
    chars = 0
    for i in range(start, len(docs), 64):
        for text in docs[i:i + 64]["text"]:
            batch.append(text)
            chars += len(text)
            if len(batch) == BATCH_DOCS or chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


class Progress:
    """One line on stdout, rewritten in place on a terminal and every 10 s otherwise: documents, tokens,
    tokens/s and the time left (from the share of documents done)."""

    def __init__(self, what: str, total_docs: int, done_docs: int):
        self.what, self.total, self.done, self.tokens = what, total_docs, done_docs, 0
        self.t0 = self.last = time.perf_counter()
        self.start_docs = done_docs
        self.tty = sys.stdout.isatty()

    def add(self, docs: int, tokens: int) -> None:
        self.done += docs
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last >= (0.5 if self.tty else 10.0):
            self.last = now
            self._print(end="\r" if self.tty else "\n")

    def _print(self, end: str) -> None:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        rate = (self.done - self.start_docs) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta_s = f"{eta / 60:.0f}m{eta % 60:02.0f}s" if eta == eta else "?"
        print(f"[data] {self.what}: {self.done:,}/{self.total:,} documents, {self.tokens:,} tokens, "
              f"{self.tokens / elapsed:,.0f} tokens/s, ETA {eta_s}   ", end=end, flush=True)

    def close(self) -> None:
        self._print(end="\n")


def encode_documents(docs: datasets.Dataset, tokenizer, start: int, num_proc: int) -> Iterator[
        Tuple[List[List[int]], List[int]]]:
    """(ids, characters) of the documents from number ``start`` on, one batch at a time, in order."""
    batches = _batches(docs, start)
    if num_proc <= 1 or len(docs) - start <= BATCH_DOCS:
        for texts in batches:
            yield tokenizer.encode_batch(texts), [len(t) for t in texts]
        return
    lengths: List[List[int]] = []

    def feed() -> Iterator[List[str]]:
        for texts in batches:
            lengths.append([len(t) for t in texts])
            yield texts

    # fork: the workers need no import of their own (spawn would re-import torch and datasets in each).
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with ctx.Pool(num_proc, initializer=_init_worker, initargs=(str(tokenizer.path),)) as pool:
        for ids in pool.imap(_encode_in_worker, feed(), chunksize=1):
            yield ids, lengths.pop(0)
