"""data.streaming: training reads the source as it goes (``datasets.load_dataset(..., streaming=True)``),
never tokenised into shards first.

Each data-parallel rank reads its own part of the stream (``split_dataset_by_node``: whole files when their
number is a multiple of the ranks, else every dp_world-th document), tokenises each document, appends EOS as
the prepared path does, and cuts windows of seq_len + 1 tokens (consecutive windows share one token) in
order: no shuffling, since a shuffle buffer is not part of the stream's state and could not resume exactly.
The position is the stream's own ``state_dict()`` plus the tokens read but not yet served, per rank, so a
resume continues with exactly the tokens an uninterrupted run would read, on the same number of ranks.

Validation is the first documents of the source's stream (data.val_split's when set), as many as make
eval_batches steps of windows; without a val_split training skips every document whose text is one of
them. Both are read unsplit, so every evaluation sees the same windows.
"""

from __future__ import annotations

import hashlib
import json
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set

import numpy as np
import torch

from kimi.data import sources
from kimi.data.config import DataConfig
from kimi.data.loader import Batch, TokenLoader
from kimi.data.shards import sha256_file
from kimi.data.source_registry import source_for
from kimi.data.tokenizer import Tokenizer, resolve_model_path, train_tokenizer
from kimi.errors import DataError, one_line
from kimi.ops.documents import doc_starts_after_eos
from kimi.schema.run import TrainerConfig


@dataclass
class StreamingData:
    """A streamed source (the interface of kimi.data.PreparedData that the trainer reads: tokenizer,
    train_meta, val_meta, data_dir); data_dir holds only the tokenizer."""

    cfg: DataConfig
    tokenizer: Tokenizer
    data_dir: Path
    train_meta = {"num_tokens": "streamed"}
    val_meta = {"num_tokens": "streamed"}


def _where(cfg: DataConfig) -> str:
    return source_for(cfg).where()


def open_stream(cfg: DataConfig, split: str):
    """The source's ``split`` as a datasets IterableDataset of rows (DataSource.stream: data.source=hf: path,
    subset, revision; files: data_files in their format)."""
    return source_for(cfg).stream(split)


def _texts(cfg: DataConfig, rows) -> Iterator[str]:
    field = source_for(cfg).text_field()
    rows = iter(rows)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 (a stream reads its files only now, datasets wraps the failure)
            raise DataError(f"cannot stream {_where(cfg)}: {one_line(e)}; check the source or set "
                            "data.streaming=false") from e
        text = row.get(field)
        if not isinstance(text, str):
            raise DataError(f"{_where(cfg)}: a streamed row's {field!r} is {type(text).__name__}, not text "
                            f"(columns: {', '.join(row)}); set data.text_field to the text column")
        yield text


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def prepare_stream(cfg: DataConfig) -> StreamingData:
    """The tokenizer of a streamed run: data.tokenizer.model_path's, else one trained once on the first
    data.tokenizer.train_chars characters of the training stream and cached by what it depends on."""
    tc = cfg.tokenizer
    key = {"stream": sources.source_identity(cfg),
           "tokenizer": sha256_file(resolve_model_path(Path(tc.model_path).expanduser())) if tc.model_path
           else
           [tc.vocab_size, tc.train_chars]}
    fp = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    data_dir = sources.cache_root(cfg) / "datasets" / f"{cfg.name}-stream-{fp}"
    path = data_dir / "tokenizer.model"
    if path.is_file():
        return StreamingData(cfg, Tokenizer(path), data_dir)
    if tc.model_path:
        return StreamingData(cfg, Tokenizer(Path(tc.model_path).expanduser()).copy_to(path), data_dir)
    print(f"[data] training a {tc.vocab_size}-piece BPE tokenizer on the stream's first {tc.train_chars:,} "
          "characters", flush=True)
    t0 = time.perf_counter()
    tok = train_tokenizer(_texts(cfg, open_stream(cfg, cfg.train_split)), tc.vocab_size, path,
                          max_chars=tc.train_chars)
    print(f"[data] tokenizer trained in {time.perf_counter() - t0:.1f}s", flush=True)
    return StreamingData(cfg, tok, data_dir)


class StreamLoader:
    """This rank's micro-batches of ``batch_size`` windows from the stream, epoch after epoch (each epoch the
    same documents in the same order); documents whose digest is in ``skip`` are held out."""

    def __init__(self, cfg: DataConfig, tok: Tokenizer, batch_size: int, seq_len: int, dp_rank: int = 0,
                 dp_world: int = 1, skip: Optional[Set[bytes]] = None):
        self.cfg, self.tok, self.batch_size, self.seq_len = cfg, tok, batch_size, seq_len
        self.dp_rank, self.dp_world, self.skip = dp_rank, dp_world, skip or set()
        self.epoch, self.position, self.buffer = 0, 0, np.zeros(0, np.int64)
        self._start(None)

    def _start(self, state: Optional[Dict[str, Any]]) -> None:
        from datasets.distributed import split_dataset_by_node

        if getattr(self, "_closer", None):
            self._closer()  # the previous epoch's reader, now, not at exit (when pyarrow is half torn down)
        ds = open_stream(self.cfg, self.cfg.train_split)
        if self.dp_world > 1:
            ds = split_dataset_by_node(ds, rank=self.dp_rank, world_size=self.dp_world)
        if state is not None:
            ds.load_state_dict(state)
        # whether this epoch has given a document yet (a resumed one has)
        self.ds, self._docs, self._read_any = ds, _texts(self.cfg, ds), state is not None
        self._closer = weakref.finalize(self, self._docs.close)

    def _read(self, need: int) -> None:
        """Documents into the buffer until it holds ``need`` tokens; a new epoch where the stream ends."""
        parts: List[np.ndarray] = [self.buffer]
        have = len(self.buffer)
        while have < need:
            text = next(self._docs, None)
            if text is None:
                if not self._read_any:
                    raise DataError(f"{_where(self.cfg)}: data-parallel rank {self.dp_rank}'s part of the "
                                    "stream has no document to train on (none, or all held out for "
                                    "validation); use more data, fewer ranks, a data.val_split or a lower "
                                    "trainer.eval_batches")
                self.epoch, self.position = self.epoch + 1, 0
                self._start(None)
                continue
            if _digest(text) in self.skip:
                continue
            ids = np.asarray(self.tok.encode(text) + [self.tok.eos_id], np.int64)
            parts.append(ids)
            have, self._read_any = have + len(ids), True
        self.buffer = np.concatenate(parts)

    def next_batch(self) -> Batch:
        T = self.seq_len
        self._read(self.batch_size * T + 1)
        starts = np.arange(self.batch_size) * T
        windows = torch.from_numpy(self.buffer[starts[:, None] + np.arange(T + 1)])
        self.buffer = self.buffer[self.batch_size * T:]  # the last label starts the next window
        inputs, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        batch = Batch(inputs, labels, doc_starts_after_eos(inputs, self.tok.eos_id), self.epoch,
                      self.position)
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def _own_state(self) -> Dict[str, Any]:
        return {"dataset": self.ds.state_dict(), "buffer": self.buffer.tolist(), "epoch": self.epoch,
                "position": self.position}

    def state_dict(self) -> Dict[str, Any]:
        """Every rank's position, as one JSON string (the checkpoint keeps one copy of what is not a tensor,
        so every rank's is gathered into it)."""
        import torch.distributed as dist

        mine = (self.dp_rank, self._own_state())
        every = [mine]
        if self.dp_world > 1 and dist.is_available() and dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        ranks = {str(rank): state for rank, state in every}
        return {"stream": json.dumps({"dp_world": self.dp_world, "seq_len": self.seq_len,
                                      "batch_size": self.batch_size, "ranks": ranks})}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if "stream" not in sd:
            raise DataError("the checkpoint's loader read prepared token shards and this run streams "
                            "(data.streaming=true); resume with data.streaming=false, or start a fresh run")
        saved = json.loads(sd["stream"])
        if int(saved["dp_world"]) != self.dp_world:
            raise DataError(f"the stream's position was saved on {saved['dp_world']} data-parallel rank(s) "
                            f"and this run has {self.dp_world}: split_dataset_by_node gives each rank its "
                            f"part of the stream by the number of ranks; resume on {saved['dp_world']} "
                            "rank(s)")
        for key in ("seq_len", "batch_size"):
            if int(saved[key]) != getattr(self, key):
                raise DataError(f"the stream's position was saved with {key}={saved[key]} and this run has "
                                f"{getattr(self, key)}: resume with the same trainer.seq_len and "
                                "trainer.micro_batch_size")
        own = saved["ranks"][str(self.dp_rank)]
        self.epoch, self.position = int(own["epoch"]), int(own["position"])
        self.buffer = np.asarray(own["buffer"], np.int64)
        self._start(own["dataset"])


def held_out(cfg: DataConfig, tok: Tokenizer, windows: int, seq_len: int) -> tuple:
    """(the validation tokens, the digests of their documents): the first documents of the validation stream
    (data.val_split's, else the training split's) holding ``windows`` windows."""
    split = cfg.val_split or cfg.train_split
    need, parts, digests, have = windows * seq_len + 1, [], set(), 0
    for text in _texts(cfg, open_stream(cfg, split)):
        ids = tok.encode(text) + [tok.eos_id]
        parts.append(ids)
        digests.add(_digest(text))
        have += len(ids)
        if have >= need:
            break
    else:
        raise DataError(f"{_where(cfg)}[{split}] has {have:,} tokens, fewer than the {need:,} of the "
                        "validation windows (trainer.eval_batches steps); lower trainer.eval_batches or use "
                        "more data")
    return np.concatenate([np.asarray(p, np.int64) for p in parts]), digests


def stream_ranks(data: StreamingData, t: TrainerConfig, dp_rank: int, dp_world: int):
    """(this rank's StreamLoader, its validation batches): the validation windows are split over the ranks
    as the prepared path's are, every evaluation the same."""
    global_batch = t.micro_batch_size * dp_world * t.grad_accum_steps
    tokens, digests = held_out(data.cfg, data.tokenizer, t.eval_batches * global_batch, t.seq_len)
    val = TokenLoader(tokens, t.micro_batch_size, t.seq_len, t.seed, data.tokenizer.eos_id, dp_rank=dp_rank,
                      dp_world=dp_world, shuffle=False)
    batches = [val.next_batch() for _ in range(min(t.eval_batches * t.grad_accum_steps,
                                                   val.batches_per_epoch))]
    loader = StreamLoader(data.cfg, data.tokenizer, t.micro_batch_size, t.seq_len, dp_rank, dp_world,
                          skip=set() if data.cfg.val_split else digests)
    return loader, batches
