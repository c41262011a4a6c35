"""Batches of fixed-length windows from a split's tokens, reproducible and resumable on any layout.

Window ``i`` is ``tokens[i*T : i*T + T + 1]``: T inputs and, shifted by one, T labels, so consecutive
windows share one token and no token is a label twice in one epoch. Each epoch visits the windows in
a permutation drawn from (seed, epoch) alone; micro-batch k of an epoch is its windows k*M .. k*M + M - 1
(M = micro-batch x data-parallel ranks), of which rank r takes every dp_world-th from the r-th. The whole
position is therefore two integers, (epoch, windows consumed by all ranks), identical on every rank and
independent of how the ranks split a step: saving them restores the exact stream, on the same or another
number of ranks, and any rank's state restores every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, Optional, Union

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

    ``global_batch``: windows per optimizer step over all ranks (micro-batch x ranks x accumulation; default
    one micro-batch on every rank). An epoch is the whole steps the windows make, so a step never straddles
    two epochs, and the position is global: ``samples``, the windows every rank together has consumed in this
    epoch. ``shuffle=False`` serves the windows in order (validation: build a fresh loader and take the
    first k).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, eos_id: int,
                 dp_rank: int = 0, dp_world: int = 1, shuffle: bool = True,
                 global_batch: Optional[int] = None):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_world={dp_world})")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.eos_id, self.dp_rank, self.dp_world, self.shuffle = eos_id, dp_rank, dp_world, shuffle
        self.micro = batch_size * dp_world  # windows per micro-batch over all ranks
        self.global_batch = global_batch or self.micro
        if self.global_batch % self.micro:
            raise ValueError(f"global_batch={self.global_batch} is not a multiple of {batch_size} x "
                             f"{dp_world}")
        self.num_windows = max(0, (len(tokens) - 1) // seq_len)
        self._set_epoch_unit(self.global_batch)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"{len(tokens):,} tokens make {self.num_windows} windows of seq_len+1={seq_len + 1} tokens, "
                f"fewer than one step's {self.global_batch} ({batch_size} per micro-batch on {dp_world} "
                "data-parallel rank(s)). Use more text, a smaller trainer.seq_len or "
                "trainer.micro_batch_size, or for the validation split a larger data.val_fraction")
        self.epoch = 0
        self.samples = 0  # windows all ranks have consumed in this epoch
        self._order = self._epoch_order(0)

    def _set_epoch_unit(self, unit: int) -> None:
        # Every rank gets the same number of windows (the tail of the permutation is dropped), and an epoch
        # is whole steps: ranks stay in lockstep with no partial batch to special-case.
        self.epoch_unit = unit
        self.epoch_windows = self.num_windows // unit * unit
        self.batches_per_epoch = self.epoch_windows // self.micro

    @property
    def position(self) -> int:
        """Micro-batches served in this epoch."""
        return self.samples // self.micro

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's window indices over all ranks, in serving order."""
        if self.shuffle:
            # SeedSequence over (seed, epoch): independent streams per epoch, same on every machine.
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        else:
            order = np.arange(self.num_windows)
        return order[:self.epoch_windows]

    def next_batch(self) -> Batch:
        if self.samples == self.epoch_windows:
            self.epoch, self.samples = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        T = self.seq_len
        # this micro-batch's windows over all ranks; rank r takes every dp_world-th, from the r-th
        mine = self._order[self.samples:self.samples + self.micro][self.dp_rank::self.dp_world]
        starts = mine * T
        windows = torch.from_numpy(self.tokens[starts[:, None] + np.arange(T + 1)].astype(np.int64))
        inputs, labels = windows[:, :-1], windows[:, 1:]
        batch = Batch(inputs.contiguous(), labels.contiguous(), doc_starts_after_eos(inputs, self.eos_id),
                      self.epoch, self.position)
        self.samples += self.micro
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "samples": self.samples, "seed": self.seed,
                "epoch_unit": self.epoch_unit,
                "global_batch": self.global_batch, "num_windows": self.num_windows, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "dp_world": self.dp_world, "position": self.position}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Continue exactly where the saved loader stopped (its seed included); this rank keeps its
        dp_rank.

        The position is global (windows consumed by all ranks), so the data-parallel size, the micro-batch
        and the accumulation steps may change as long as the windows per optimizer step do not: step k then
        covers the same windows on any layout. A state saved before positions were global (micro-batches
        served) continues with that run's epoch length."""
        if not sd:  # the placeholder's keys are all missing: a streamed run's checkpoint (one "stream" key)
            raise DataError("the checkpoint's loader read a stream (data.streaming=true) and this run reads "
                            "prepared shards; resume with data.streaming=true, or start a fresh run")
        if "blend" in sd or ("samples" in sd and "epoch_unit" not in sd):
            raise DataError("the checkpoint's loader read a blend (data.sources) and this run reads one "
                            "source; resume with the data it was trained on, or start a fresh run")
        saved_micro, accum = int(sd["batch_size"]) * int(sd["dp_world"]), self.global_batch // self.micro
        if "samples" not in sd:  # saved before positions were global: micro-batches served, same accumulation
            sd = {**sd, "samples": int(sd["position"]) * saved_micro, "epoch_unit": saved_micro,
                  "global_batch": saved_micro * accum}
        saved_step = int(sd["global_batch"])
        if saved_step != self.global_batch:
            per, rest = divmod(saved_step, self.dp_world * accum)
            hint = (f"trainer.micro_batch_size={per}" if not rest else
                    f"micro-batch x data-parallel ranks x trainer.grad_accum_steps = {saved_step}")
            raise DataError(
                f"the loader state was saved reading {saved_step} windows per step ({sd['batch_size']} per "
                f"micro-batch on each of {sd['dp_world']} data-parallel rank(s)); this run reads "
                f"{self.batch_size} x {self.dp_world} x {accum} accumulation step(s) = {self.global_batch}. "
                f"Resume with the same windows per step ({hint}), or start a fresh run")
        for key in ("seq_len", "num_windows"):
            if int(sd[key]) != getattr(self, key):
                raise DataError(f"the loader state was saved with {key}={sd[key]} but this loader has "
                                f"{key}={getattr(self, key)}: resume with the same trainer.seq_len, "
                                "trainer.micro_batch_size and data, or start a fresh run")
        if int(sd["epoch_unit"]) % self.micro:
            raise DataError(f"the loader state's epochs are {sd['epoch_unit']}-window multiples, which this "
                            f"run's micro-batches of {self.batch_size} x {self.dp_world} windows do not "
                            f"divide: resume with {sd['batch_size']} windows per micro-batch on "
                            f"{sd['dp_world']} rank(s)")
        self._set_epoch_unit(int(sd["epoch_unit"]))
        self.seed, self.epoch, self.samples = int(sd["seed"]), int(sd["epoch"]), int(sd["samples"])
        self._order = self._epoch_order(self.epoch)
