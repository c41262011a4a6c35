"""A blend of sources (data.sources): each prepared on its own, sampled in proportion to its weight.

Sample i of the blend (counted over every rank and step) comes from the source whose share so far lags its
weight the most: argmax_j of w_j * (i + 1) - n_j, n_j the samples source j has given (the first such source
on a tie). That is Megatron's blended dataset rule: deterministic, each source within one sample of its
share at every point, and a function of the sample number alone, so the position of the whole blend is the
number of samples consumed and the per-source counts. Each source walks its own windows epoch after epoch,
in a permutation drawn from (seed, epoch, source number), so a small source repeats while a large one has
not finished its first pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from kimi.data.config import DataConfig
from kimi.data.loader import Batch
from kimi.data.tokenizer import Tokenizer
from kimi.errors import DataError
from kimi.ops.documents import doc_starts_after_eos

# The keys of a blend entry that replace data.*'s value when set (the rest of data.* applies to all sources).
_PER_SOURCE = ("source", "path", "data_files", "format", "config", "revision", "text_field", "train_split",
               "val_split", "val_fraction")


def source_configs(cfg: DataConfig) -> List[Tuple[str, float, DataConfig]]:
    """(name, weight, the source's own DataConfig) for every entry of data.sources."""
    out = []
    for entry in cfg.sources or []:
        own = {k: getattr(entry, k) for k in _PER_SOURCE if getattr(entry, k) is not None}
        out.append((entry.name, float(entry.weight), dataclasses.replace(cfg, name=entry.name, sources=None,
                                                                         **own)))
    return out


@dataclasses.dataclass
class PreparedBlend:
    """The prepared sources of a blend, with one tokenizer (the interface of kimi.data.PreparedData that the
    trainer reads: tokenizer, train_meta, val_meta, data_dir)."""

    names: List[str]
    weights: List[float]
    parts: List[Any]  # kimi.data.pack.PreparedData, one per source

    @property
    def tokenizer(self) -> Tokenizer:
        return self.parts[0].tokenizer

    @property
    def data_dir(self) -> Path:
        return Path(self.parts[0].data_dir).parent

    def _total(self, split: str) -> Dict[str, Any]:
        return {"num_tokens": sum(p.meta[split]["num_tokens"] for p in self.parts),
                "num_documents": sum(p.meta[split]["num_documents"] for p in self.parts)}

    @property
    def train_meta(self) -> Dict[str, Any]:
        return self._total("train")

    @property
    def val_meta(self) -> Dict[str, Any]:
        return self._total("val")


def blend_tokenizer(cfg: DataConfig) -> Path:
    """The tokenizer of a blend that names none (data.tokenizer.model_path unset), trained once and cached
    under the data cache by everything it depends on: data.tokenizer's BPE on up to train_chars characters,
    each source giving its weight's share of them (the whole source when it holds less), drawn across the
    source as a single source's tokenizer draws them (kimi.data.pack.tokenizer_texts)."""
    from kimi.data.pack import TOKENIZER_RECIPE, exclusive, tokenizer_texts, train_with_progress
    from kimi.data.sources import cache_root, load_documents, source_identity

    tc, sources = cfg.tokenizer, source_configs(cfg)
    key = {"sources": [[name, weight, source_identity(own)] for name, weight, own in sources],
           "vocab_size": tc.vocab_size, "train_chars": tc.train_chars, "recipe": TOKENIZER_RECIPE}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root(cfg) / "tokenizers" / f"{cfg.name}-blend-{digest}" / "tokenizer.model"
    with exclusive(path.parent):
        if not path.is_file():
            total = sum(weight for _, weight, _ in sources)
            texts = itertools.chain.from_iterable(
                tokenizer_texts(load_documents(own)[0], int(tc.train_chars * weight / total))
                for _, weight, own in sources)
            print("[data] the blend names no tokenizer (data.tokenizer.model_path): training one on its "
                  f"sources by weight into {path}", flush=True)
            train_with_progress(texts, cfg, path)
    return path


def prepare_blend(cfg: DataConfig, prepare_one, limit: bool = True) -> PreparedBlend:
    """Every source prepared (or found prepared) with one tokenizer: the one data.tokenizer.model_path names,
    else one trained on the blend (blend_tokenizer)."""
    if not cfg.tokenizer.model_path:
        path = blend_tokenizer(cfg)
        cfg = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, model_path=str(path)))
    parts, names, weights = [], [], []
    for name, weight, own in source_configs(cfg):
        print(f"[data] blend source {name!r} (weight {weight:g})", flush=True)
        parts.append(prepare_one(own, limit))
        names.append(name)
        weights.append(weight)
    shas = {p.tokenizer.sha256 for p in parts}
    if len(shas) != 1:  # the same model_path for all; a file replaced between two sources' preparation
        raise DataError(f"the blend's sources were tokenised with {len(shas)} different tokenizers; delete "
                        f"their prepared directories under {parts[0].data_dir.parent} and prepare again")
    return PreparedBlend(names, weights, parts)


def assign(weights: Sequence[float], counts: Sequence[int], start: int, n: int) -> Tuple[np.ndarray,
                                                                                         np.ndarray]:
    """(source of each of the n samples from sample number `start` on, the counts after them), given the
    per-source counts before them."""
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    counts = np.array(counts, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for k in range(n):
        j = int(np.argmax(w * (start + k + 1) - counts))
        out[k] = j
        counts[j] += 1
    return out, counts


class BlendLoader:
    """Batches of windows from several sources by weight (the interface of kimi.data.TokenLoader).

    Micro-batch k covers blend samples k*M .. k*M + M - 1 (M = micro-batch x data-parallel ranks), of which
    rank r takes every dp_world-th from the r-th, as TokenLoader does, so a saved position resumes on another
    layout with the same windows per step."""

    def __init__(self, sources: List[Any], weights: Sequence[float], batch_size: int, seq_len: int, seed: int,
                 eos_id: int, dp_rank: int = 0, dp_world: int = 1, global_batch: Optional[int] = None):
        self.sources, self.weights = sources, [float(w) for w in weights]
        self.batch_size, self.seq_len, self.seed, self.eos_id = batch_size, seq_len, seed, eos_id
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.micro = batch_size * dp_world
        self.global_batch = global_batch or self.micro
        self.num_windows = [max(0, (len(t) - 1) // seq_len) for t in sources]
        if min(self.num_windows) == 0:
            j = self.num_windows.index(0)
            raise DataError(f"blend source {j} has {len(sources[j]):,} tokens, not one window of seq_len+1="
                            f"{seq_len + 1}; use more text or a smaller trainer.seq_len")
        self.samples = 0
        self.counts = [0] * len(sources)
        self._orders: Dict[Tuple[int, int], np.ndarray] = {}

    def _window(self, j: int, k: int) -> int:
        """Source j's k-th window (counted over its epochs)."""
        epoch, i = divmod(k, self.num_windows[j])
        if (j, epoch) not in self._orders:
            self._orders = {key: o for key, o in self._orders.items() if key[0] != j}  # one epoch per source
            self._orders[j, epoch] = np.random.default_rng([self.seed, epoch,
                                                            j]).permutation(self.num_windows[j])
        return int(self._orders[j, epoch][i])

    def next_batch(self) -> Batch:
        which, after = assign(self.weights, self.counts, self.samples, self.micro)
        seen = list(self.counts)
        rows = []
        for k, j in enumerate(which):
            if k % self.dp_world == self.dp_rank:
                w = self._window(int(j), seen[j])
                rows.append(np.asarray(self.sources[j][w * self.seq_len + np.arange(self.seq_len + 1)]))
            seen[j] += 1
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        inputs, labels = windows[:, :-1], windows[:, 1:]
        epoch = max(c // n for c, n in zip(self.counts, self.num_windows))
        batch = Batch(inputs.contiguous(), labels.contiguous(), doc_starts_after_eos(inputs, self.eos_id),
                      epoch,
                      self.samples // self.micro)
        self.samples, self.counts = self.samples + self.micro, [int(c) for c in after]
        return batch

    def state_dict(self) -> Dict[str, Any]:
        # Lists as one JSON string: the checkpoint stores plain values, not nested containers.
        blend = {"counts": self.counts, "num_windows": self.num_windows, "weights": self.weights}
        return {"samples": self.samples, "seed": self.seed, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "dp_world": self.dp_world,
                "blend": json.dumps(blend)}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if "blend" not in sd:
            raise DataError("the checkpoint's loader read one source and this run reads a blend "
                            "(data.sources); resume with the data it was trained on, or start a fresh run")
        blend = json.loads(sd["blend"])
        if int(sd["global_batch"]) != self.global_batch:
            raise DataError(f"the loader state was saved reading {sd['global_batch']} windows per step; this "
                            f"run reads {self.global_batch}. Resume with the same windows per step, or start "
                            "a fresh run")
        for key, saved, now in (("trainer.seq_len", int(sd["seq_len"]), self.seq_len),
                                ("windows per source", blend["num_windows"], self.num_windows),
                                ("data.sources weights", blend["weights"], self.weights)):
            if saved != now:
                raise DataError(f"the loader state was saved with {key} {saved}, this run has {now}: resume "
                                "with the same data.sources and trainer.seq_len, or start a fresh run")
        self.seed, self.samples = int(sd["seed"]), int(sd["samples"])
        self.counts = [int(c) for c in blend["counts"]]
        self._orders = {}


class ValBatches(list):
    """The validation batches (a list, as the trainer iterates them), and how their losses make the logged
    values: one source, their mean; a blend, each source's mean (``val_loss/<name>``) and their weighted
    mean as the blended ``val_loss``."""

    def __init__(self, batches: List[Batch], parts: Optional[List[Tuple[str, float, int, int]]] = None):
        super().__init__(batches)
        self.parts = parts or []  # (name, weight, first batch, end)
        self.by_source: Dict[str, float] = {}

    def reduce(self, losses: torch.Tensor, mean_over_ranks) -> float:
        """The validation loss from each batch's loss (a collective under torch.distributed)."""
        if not self.parts:
            return mean_over_ranks(losses.mean()).item()
        per = mean_over_ranks(torch.stack([losses[a:b].mean() for _, _, a, b in self.parts])).tolist()
        self.by_source = {f"val_loss/{name}": v for (name, _, _, _), v in zip(self.parts, per)}
        return sum(w * v for (_, w, _, _), v in zip(self.parts, per)) / sum(w for _, w, _, _ in self.parts)

    def note(self) -> str:
        """The per-source losses for the console line ('' for one source)."""
        return "".join(f"; {k[len('val_loss/'):]} {v:.4f}" for k, v in self.by_source.items())
