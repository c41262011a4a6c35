"""Batches of fixed-length windows from a flat token file, reproducible and resumable.

Window ``i`` is ``tokens[i*T : i*T + T + 1]``: T inputs and, shifted by one, T labels, so consecutive
windows share one token and no token is a label twice in one epoch. Each epoch visits the windows in
a permutation drawn from (seed, epoch) alone, and data-parallel rank r takes every dp_world-th window of it.
The whole position is therefore two integers (epoch, batch within epoch), identical on every rank because
ranks advance in lockstep: saving them restores the exact stream, and any rank's state restores every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, Union

import numpy as np
import torch

from kimi.data.sources import DataError
from kimi.ops.documents import doc_starts_after_eos


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64
    labels: torch.Tensor  # [B, T] int64: input_ids shifted left by one token
    # [B, T] bool, True where a document segment starts: each row's first token and the token after each
    # EOS (kimi.ops.documents), so packed documents (data.varlen) never attend across a boundary.
    doc_starts: torch.Tensor
    epoch: int
    step: int  # batch index within the epoch

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "Batch":
        return dataclasses.replace(self, **{name: getattr(self, name).to(device, non_blocking=non_blocking)
                                            for name in ("input_ids", "labels", "doc_starts")})


class TokenLoader:
    """Serves batches of ``batch_size`` windows of ``seq_len`` (+1) tokens forever, epoch after epoch.

    ``shuffle=False`` serves the windows in order (validation: build a fresh loader and take the first k).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, eos_id: int,
                 dp_rank: int = 0, dp_world: int = 1, shuffle: bool = True):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_world={dp_world})")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.eos_id, self.dp_rank, self.dp_world, self.shuffle = eos_id, dp_rank, dp_world, shuffle
        self.num_windows = max(0, (len(tokens) - 1) // seq_len)
        # Every rank gets the same number of windows (the tail of the permutation is dropped), and an epoch
        # is the whole batches those make: ranks stay in lockstep with no partial batch to special-case.
        self.batches_per_epoch = self.num_windows // dp_world // batch_size
        if self.batches_per_epoch == 0:
            raise DataError(
                f"{len(tokens):,} tokens make {self.num_windows} windows of seq_len+1={seq_len + 1} tokens, "
                f"fewer than one batch of {batch_size} per rank on {dp_world} data-parallel rank(s). Use "
                "more text, a smaller trainer.seq_len or trainer.micro_batch_size, or for the validation "
                "split a larger data.val_fraction")
        self.epoch = 0
        self.position = 0  # batches already served in this epoch
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """This rank's window indices for one epoch, in serving order."""
        if self.shuffle:
            # SeedSequence over (seed, epoch): independent streams per epoch, same on every machine.
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        else:
            order = np.arange(self.num_windows)
        per_rank = self.batches_per_epoch * self.batch_size
        return order[self.dp_rank::self.dp_world][:per_rank]

    def next_batch(self) -> Batch:
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        B, T = self.batch_size, self.seq_len
        starts = self._order[self.position * B:(self.position + 1) * B] * T
        windows = torch.from_numpy(self.tokens[starts[:, None] + np.arange(T + 1)].astype(np.int64))
        inputs, labels = windows[:, :-1], windows[:, 1:]
        batch = Batch(inputs.contiguous(), labels.contiguous(), doc_starts_after_eos(inputs, self.eos_id),
                      self.epoch, self.position)
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "dp_rank": self.dp_rank,
                "dp_world": self.dp_world, "num_windows": self.num_windows, "seq_len": self.seq_len,
                "batch_size": self.batch_size}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Continue exactly where the saved loader stopped (its seed included); this rank keeps its
        dp_rank.

        The data-parallel size may change if the windows per step (micro-batch x ranks) do not: rank r
        serves windows r, r + N, r + 2N, ... of the epoch's permutation, so step k covers the same windows
        on any number of ranks, and ``position`` (steps served) carries over unchanged."""
        saved_step = int(sd["batch_size"]) * int(sd["dp_world"])
        if saved_step != self.batch_size * self.dp_world:
            hint = (f"trainer.micro_batch_size={saved_step // self.dp_world}" if saved_step % self.dp_world == 0
                    else f"a data-parallel size that divides {saved_step}")
            raise DataError(
                f"the loader state was saved reading {sd['batch_size']} windows on each of {sd['dp_world']} "
                f"data-parallel rank(s), {saved_step} per step; this run reads {self.batch_size} x "
                f"{self.dp_world} = {self.batch_size * self.dp_world}. Resume with the same windows per step "
                f"({hint}), or start a fresh run")
        for key in ("seq_len", "num_windows"):
            if int(sd[key]) != getattr(self, key):
                raise DataError(f"the loader state was saved with {key}={sd[key]} but this loader has "
                                f"{key}={getattr(self, key)}: resume with the same trainer.seq_len, "
                                "trainer.micro_batch_size and data, or start a fresh run")
        self.seed, self.epoch, self.position = int(sd["seed"]), int(sd["epoch"]), int(sd["position"])
        self._order = self._epoch_order(self.epoch)
