"""What one data-parallel rank reads: its own training micro-batches, and its share of a fixed set of
validation batches (for a blend, of each source's)."""

from __future__ import annotations

from typing import Tuple, Union

from kimi.config import TrainerConfig
from kimi.data.blend import BlendLoader, PreparedBlend, ValBatches
from kimi.data.loader import TokenLoader
from kimi.data.pack import PreparedData, open_split
from kimi.data.streaming import StreamingData, stream_ranks


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
