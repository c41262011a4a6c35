"""What one data-parallel rank reads: its own training micro-batches, and its share of a fixed set of
validation batches."""

from __future__ import annotations

from typing import List, Tuple

from kimi.config import TrainerConfig
from kimi.data.loader import Batch, TokenLoader
from kimi.data.pack import PreparedData, open_split


def rank_streams(data: PreparedData, t: TrainerConfig, dp_rank: int,
                 dp_world: int) -> Tuple[TokenLoader, List[Batch]]:
    """(this rank's training loader, its validation batches)."""
    tok = data.tokenizer
    train_tokens, val_tokens = open_split(data, "train"), open_split(data, "val")
    # Each rank reads its own micro-batches: one step on N ranks sees what one process would see with an N
    # times larger micro-batch (trainer.micro_batch_size is per rank, as in Megatron).
    # Positions are global (windows consumed by all ranks): a run resumes on another number of ranks, or with
    # another split of its step into micro-batches, as long as the windows per step stay the same.
    loader = TokenLoader(train_tokens, t.micro_batch_size, t.seq_len, t.seed, tok.eos_id, dp_rank=dp_rank,
                         dp_world=dp_world, global_batch=t.micro_batch_size * dp_world * t.grad_accum_steps)
    val_loader = TokenLoader(val_tokens, t.micro_batch_size, t.seq_len, t.seed, tok.eos_id, dp_rank=dp_rank,
                             dp_world=dp_world, shuffle=False)
    # A fixed set of validation windows (the first ones, in order), so evaluations are comparable; split over
    # the ranks like training batches, so N ranks evaluate what one process with N times the micro-batch
    # would.
    n_val = min(t.eval_batches, val_loader.batches_per_epoch)
    return loader, [val_loader.next_batch() for _ in range(n_val)]
