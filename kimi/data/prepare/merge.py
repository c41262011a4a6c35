"""The merge of a preparation in parts (kimi.data.prepare.parts): every worker's per-file token runs, read in
data.data_files' order, written into the shards, document index and manifest that the single-process
preparation writes (the same ShardWriter and held-out documents, so the same bytes). No tokenising: a copy
and a checksum pass. It refuses, in one line naming them and the command, while any worker is unfinished."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from kimi.data import pack
from kimi.data.config import DataConfig
from kimi.data.pack import (MANIFEST, SPLITS, PreparedData, data_dir_for, exclusive, finished_shards,
                            fingerprint, shard_base, shard_tokens, split_entry, write_manifest)
from kimi.data.prepare.parts import DONE, EXECUTOR_LOGS, PROGRESS, parts_dir, plan, run_stem, worker_dir
from kimi.data.shards import ShardWriter, sha256_file
from kimi.data.sources import held_out_indices
from kimi.data.tokenizer import Tokenizer
from kimi.errors import DataError


def _numbers(ranks: List[int]) -> str:
    """1,3,5-9: a list of worker numbers, runs folded."""
    out: List[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out)


def _refuse(missing: List[int], workers: int, command: str, why: str) -> DataError:
    return DataError(f"cannot merge the {workers} parts: worker(s) {_numbers(missing)} {why}; run "
                     f"`{command} data.prepare_worker=I` for each I in {_numbers(missing)} (a rerun keeps "
                     f"the files it finished), then `{command}` again to merge")


def read_progress(parts: Path, workers: int) -> List[Optional[Dict[str, Any]]]:
    """Each worker's progress record, None where it has not written one."""
    out: List[Optional[Dict[str, Any]]] = []
    for w in range(workers):
        try:
            out.append(json.loads((worker_dir(parts, w) / PROGRESS).read_text()))
        except (OSError, ValueError):
            out.append(None)
    return out


def print_progress(parts: Path, workers: int) -> None:
    """The workers' progress in total, as the [data] lines say it (tokens/s: the workers' rates summed)."""
    records = read_progress(parts, workers)
    started = [r for r in records if r]
    done = sum((worker_dir(parts, w) / DONE).is_file() for w in range(workers))
    files = sum(r["files_done"] for r in started)
    planned = sum(r["files"] for r in started)
    print(f"[data] parts: {done}/{workers} workers done, {len(started)} started; {files:,}/{planned:,} of "
          f"their files, {sum(r['documents'] for r in started):,} documents, "
          f"{sum(r['tokens'] for r in started):,} tokens, {sum(r['tokens_per_s'] for r in started):,.0f} "
          "tokens/s", flush=True)


def _runs(cfg: DataConfig, workers: int, command: str) -> List[Dict[str, Any]]:
    """Every file's run metadata in file order (with its worker and stem), each checked against its files;
    refuses while a worker is unfinished or a run is missing or damaged."""
    data_dir = data_dir_for(cfg)
    parts = parts_dir(data_dir, workers)
    missing = [w for w in range(workers) if not (worker_dir(parts, w) / DONE).is_file()]
    if missing:
        raise _refuse(missing, workers, command, f"of {workers} have not finished (no {DONE} in {parts})")
    files, _, owner = plan(cfg, workers)
    fp, runs, bad = fingerprint(cfg), [], set()
    for k, w in enumerate(owner):
        stem = run_stem(parts, w, k)
        try:
            meta = json.loads(stem.with_suffix(".json").read_text())
            ok = meta["fingerprint"] == fp and sha256_file(stem.with_suffix(".bin")) == meta["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            bad.add(w)
            continue
        runs.append({**meta, "worker": w, "stem": stem})
    if bad:
        raise _refuse(sorted(bad), workers, command, "left a missing or damaged file run (deleted, or "
                      "changed after it was written)")
    return runs


def _write(cfg: DataConfig, data_dir: Path, tok: Tokenizer, runs: List[Dict[str, Any]],
           num_documents: int) -> Dict[str, Dict[str, Any]]:
    """The shards of both splits from the runs; a killed merge's finished shards are kept (their boundaries
    are the same) and their documents skipped."""
    fp = fingerprint(cfg)
    is_val = np.zeros(num_documents, dtype=bool)
    is_val[held_out_indices(num_documents, cfg.val_fraction)] = True
    base = shard_base(cfg, fp, tok)
    done = {s: finished_shards(data_dir, s, fp, tok) for s in SPLITS}
    skip = {s: sum(int(m["num_documents"]) for m in done[s]) for s in SPLITS}
    per_shard = shard_tokens(cfg, tok)
    writers = {s: ShardWriter(data_dir, s, len(done[s]), skip[s], per_shard, base) for s in SPLITS}
    seen = {s: 0 for s in SPLITS}
    g = 0
    for run in runs:
        stem, n = run["stem"], int(run["num_tokens"])
        tokens = np.memmap(stem.with_suffix(".bin"), dtype=run["dtype"], mode="r", shape=(n,)) if n else None
        starts = np.fromfile(stem.with_suffix(".idx"), dtype=np.uint64)
        chars = np.fromfile(stem.with_suffix(".chars"), dtype=np.uint64)
        for d in range(int(run["num_documents"])):
            split = "val" if is_val[g] else "train"
            g += 1
            seen[split] += 1
            if seen[split] > skip[split]:
                writers[split].add(tokens[int(starts[d]):int(starts[d + 1])], int(chars[d]))
    return {s: split_entry(done[s] + writers[s].finish(), base, data_dir, s) for s in SPLITS}


def merge_parts(cfg: DataConfig, workers: int, command: str = "python -m kimi.data.prepare") -> PreparedData:
    """The prepared data from the ``workers`` finished parts (found as it is if merged already); the runs
    are deleted once the manifest is written. ``command``: the command without a worker number, for the
    messages."""
    data_dir = data_dir_for(cfg)
    if (data_dir / MANIFEST).is_file():
        return pack.prepare(cfg, limit=False)
    parts = parts_dir(data_dir, workers)
    print_progress(parts, workers)
    runs = _runs(cfg, workers, command)
    t0 = time.perf_counter()
    n = sum(int(r["num_documents"]) for r in runs)
    if n == 0:
        raise DataError(f"data.data_files={list(cfg.data_files)} yielded no documents")
    if not any(r["has_text"] for r in runs):
        raise DataError(f"data.data_files={list(cfg.data_files)} holds no text: every document is empty or "
                        "whitespace; point the data settings at the real corpus")
    if n == 1:  # held out by characters (kimi.data.sources.hold_out): one document, tokenised again whole
        print("[data] the corpus is one document: preparing it in one process", flush=True)
        return pack.prepare(cfg, limit=False)
    with exclusive(data_dir):
        if not (data_dir / MANIFEST).is_file():
            tok = Tokenizer(data_dir / "tokenizer.model")
            print(f"[data] merging {len(runs):,} file run(s) of {workers} workers ({n:,} documents) into "
                  f"{data_dir}", flush=True)
            write_manifest(cfg, data_dir, fingerprint(cfg), tok, _write(cfg, data_dir, tok, runs, n))
            print(f"[data] merged in {time.perf_counter() - t0:.1f}s", flush=True)
    _remove_parts(parts, workers)
    return pack.prepare(cfg, limit=False)


def _remove_parts(parts: Path, workers: int) -> None:
    """The workers' runs and their executor's log, once merged; a merge job's own datatrove log (which it
    writes after this) stays."""
    for w in range(workers):
        shutil.rmtree(worker_dir(parts, w), ignore_errors=True)
    shutil.rmtree(parts / EXECUTOR_LOGS, ignore_errors=True)
    try:
        parts.rmdir()
    except OSError:  # not empty: the merge job's log
        pass
