"""What one data-parallel rank reads: its own training micro-batches, and its share of a fixed set of
validation batches (for a blend, of each source's); and the opening words of the validation split, which every
rank reads alike (the end-of-run sample's default prompt)."""

from __future__ import annotations

from typing import Tuple, Union

import numpy as np

from kimi.data.blend import BlendLoader, PreparedBlend, ValBatches
from kimi.data.loader import TokenLoader
from kimi.data.pack import PreparedData, open_split
from kimi.data.streaming import StreamingData, held_out, stream_ranks
from kimi.schema.run import TrainerConfig

OPENING_CHARS = 40  # the default sample prompt: at most this many characters of the first validation document


def _val_batches(data: PreparedData, t: TrainerConfig, eos_id: int, dp_rank: int, dp_world: int) -> list:
    # A fixed set of validation windows (the first ones, in order), so evaluations are comparable:
    # eval_batches steps' worth (micro-batch x ranks x accumulation steps each), split over the ranks like
    # training
    # batches, so every layout of the same step evaluates the same windows.
    val_loader = TokenLoader(open_split(data, "val"), t.micro_batch_size, t.seq_len, t.seed, eos_id,
                             dp_rank=dp_rank, dp_world=dp_world, shuffle=False)
    n = min(t.eval_batches * t.grad_accum_steps, val_loader.batches_per_epoch)
    return [val_loader.next_batch() for _ in range(n)]


def rank_streams(data: Union[PreparedData, PreparedBlend, StreamingData], t: TrainerConfig, dp_rank: int,
                 dp_world: int) -> Tuple[Union[TokenLoader, BlendLoader], ValBatches]:
    """(this rank's training loader, its validation batches)."""
    if isinstance(data, StreamingData):
        loader, batches = stream_ranks(data, t, dp_rank, dp_world)
        return loader, ValBatches(batches)
    eos = data.tokenizer.eos_id
    # Each rank reads its own micro-batches: one step on N ranks sees what one process would see with an N
    # times larger micro-batch (trainer.micro_batch_size is per rank, as in Megatron). Positions are global
    # (windows consumed by all ranks): a run resumes on another number of ranks, or with another split of its
    # step into micro-batches, as long as the windows per step stay the same.
    layout = dict(dp_rank=dp_rank, dp_world=dp_world,
                  global_batch=t.micro_batch_size * dp_world * t.grad_accum_steps)
    if isinstance(data, PreparedBlend):
        loader = BlendLoader([open_split(p, "train") for p in data.parts], data.weights, t.micro_batch_size,
                             t.seq_len, t.seed, eos, **layout)
        batches, parts = [], []
        for name, weight, part in zip(data.names, data.weights, data.parts):
            own = _val_batches(part, t, eos, dp_rank, dp_world)
            parts.append((name, weight, len(batches), len(batches) + len(own)))
            batches += own
        return loader, ValBatches(batches, parts)
    loader = TokenLoader(open_split(data, "train"), t.micro_batch_size, t.seq_len, t.seed, eos, **layout)
    return loader, ValBatches(_val_batches(data, t, eos, dp_rank, dp_world))


def val_opening(data: Union[PreparedData, PreparedBlend, StreamingData],
                max_chars: int = OPENING_CHARS) -> str:
    """The first words of the run's first validation document that has any (a blend's: its first
    source's), at most max_chars characters, cut after a whole word (a single longer word is cut at
    max_chars): the end-of-run sample's prompt when trainer.sample_prompt is null, so it continues text like
    the run's own."""
    tok = data.tokenizer
    if isinstance(data, StreamingData):
        tokens, _ = held_out(data.cfg, tok, 0, 0)  # the first document of the validation stream
    else:
        tokens = open_split(data.parts[0] if isinstance(data, PreparedBlend) else data, "val")
    # 4 tokens per character are enough for any text: a byte-level piece is at least a byte, and a
    # character at most 4 bytes
    ids = [int(i) for i in tokens[np.arange(min(4 * max_chars + 1, len(tokens)))]]
    docs: list = [[]]  # the documents these tokens hold, the last one perhaps cut
    for i in ids:
        if i == tok.eos_id:
            docs.append([])
        else:
            docs[-1].append(i)
    text = next((t for t in map(tok.decode, docs) if t.strip()), "")
    return opening_words(text, max_chars) or "\n"  # "\n": a split of blank documents only


def opening_words(text: str, max_chars: int = OPENING_CHARS) -> str:
    """text's first whole words (its whitespace kept as it is) within max_chars characters."""
    text = text.lstrip()
    if len(text) <= max_chars:
        return text.rstrip()
    cut = text[:max_chars + 1]  # a word ending at max_chars is whole when the next character is a space
    end = max((cut.rfind(c) for c in " \t\n"), default=-1)
    return cut[:end].rstrip() if end > 0 and cut[:end].strip() else text[:max_chars]
