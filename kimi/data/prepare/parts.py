"""Preparing data.data_files in parts: N workers, each tokenising its share of the files, and one merge
(kimi.data.prepare.merge) that writes the shards, document index and manifest byte for byte as the
single-process preparation (kimi.data.pack) writes them.

A worker cannot write shards: a shard closes once it holds data.shard_mb of tokens (so its boundaries depend
on every document before it), and which documents are held out for validation depends on how many documents
the whole corpus has (kimi.data.sources.held_out_indices). So a worker writes one token run per file, under
``<data_dir>/parts-<N>/worker-<i>/``::

    file-<k>.bin    the file's documents' ids, each followed by EOS (the shards' dtype); k: its number in
    file-<k>.idx    data.data_files' order; uint64 document starts, then the length
    file-<k>.chars  uint64 characters of each document
    file-<k>.json   counts and checksum, written last: the file is done
    progress.json   files, documents, tokens and tokens/s so far (after each file)
    done.json       written last: the worker is done

and the merge, which needs every part, reads the runs in file order and does the rest without tokenising.

A file is the unit of work. The files are dealt out largest first, each to the worker with the fewest bytes
so far (ties: the lower number): deterministic, since the sizes are part of the data's fingerprint, and the
same on every machine. A worker killed and run again keeps its finished files and redoes the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import pyarrow.compute as pc

from kimi.data.config import DataConfig
from kimi.data.encode import default_num_proc, encode_documents
from kimi.data.files import file_format, resolve_files
from kimi.data.pack import MANIFEST, data_dir_for, ensure_tokenizer, exclusive, fingerprint
from kimi.data.shards import token_dtype, write_atomic
from kimi.data.source_registry import source_for
from kimi.data.sources import file_documents, load_documents
from kimi.data.tokenizer import Tokenizer
from kimi.errors import ConfigError, DataError

DONE, PROGRESS = "done.json", "progress.json"
EXECUTOR_LOGS = "datatrove"  # parts-<N>/datatrove: the workers' executor's logs and completion markers
RUN_FILES = (".bin", ".idx", ".chars", ".json")


def parts_dir(data_dir: Path, workers: int) -> Path:
    return data_dir / f"parts-{workers}"


def worker_dir(parts: Path, worker: int) -> Path:
    return parts / f"worker-{worker:05d}"


def run_stem(parts: Path, worker: int, k: int) -> Path:
    return worker_dir(parts, worker) / f"file-{k:06d}"


def assign(sizes: List[int], workers: int) -> List[int]:
    """The worker of each file: largest first, to the worker with the fewest bytes so far."""
    load, owner = [0] * workers, [0] * len(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        w = min(range(workers), key=lambda w: (load[w], w))
        owner[k], load[w] = w, load[w] + sizes[k]
    return owner


def plan(cfg: DataConfig, workers: int) -> Tuple[List[str], str, List[int]]:
    """(every file in data.data_files' order, their format, the worker of each)."""
    files = resolve_files(cfg)
    return files, file_format(cfg, files), assign([os.stat(f).st_size for f in files], workers)


def launcher_worker(env: Mapping[str, str]) -> Optional[Tuple[int, int, str]]:
    """(worker, workers, where from) that a launcher gives this process: a SLURM array task, or a torchrun
    rank; None outside both."""
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        first = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
        return (int(env["SLURM_ARRAY_TASK_ID"]) - first, int(env["SLURM_ARRAY_TASK_COUNT"]),
                "SLURM_ARRAY_TASK_ID")
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), "RANK"
    return None


def this_worker(cfg: DataConfig, env: Mapping[str, str]) -> Optional[int]:
    """The part this process prepares: data.prepare_worker, else the launcher's task or rank; None: none
    (the command merges). The launcher's count must be data.prepare_workers: the merge needs that number,
    and a SLURM array of different preparations must not split each of them."""
    if cfg.prepare_worker is not None or (cfg.prepare_workers or 1) <= 1:
        return cfg.prepare_worker
    given = launcher_worker(env)
    if given is None:
        return None
    worker, count, name = given
    if count != cfg.prepare_workers:
        raise ConfigError(f"data.prepare_workers={cfg.prepare_workers}, but the launcher started {count} "
                          f"workers ({name}={env[name]}): set data.prepare_workers={count}, or give each "
                          "worker its number with data.prepare_worker")
    return worker


def _worker_tokenizer(cfg: DataConfig, data_dir: Path, command: str) -> Tokenizer:
    path = data_dir / "tokenizer.model"
    if path.is_file():
        return Tokenizer(path)
    if cfg.tokenizer.model_path:  # every worker may copy it: the copy is renamed into place
        return Tokenizer(Path(cfg.tokenizer.model_path).expanduser()).copy_to(path)
    raise DataError(f"no tokenizer in {data_dir} yet: it is trained once, on the whole corpus, before the "
                    f"workers; run `{command}` (without a worker number) first, or set "
                    "data.tokenizer.model_path")


def make_tokenizer(cfg: DataConfig) -> bool:
    """The data's tokenizer made once, before the workers (it is trained on the whole corpus's training
    split, as the single-process preparation trains it); True when this call made it."""
    data_dir = data_dir_for(cfg)
    if (data_dir / "tokenizer.model").is_file():
        return False
    if cfg.tokenizer.model_path:
        data_dir.mkdir(parents=True, exist_ok=True)
        _worker_tokenizer(cfg, data_dir, "")
        return True
    with exclusive(data_dir):  # two coordinators at once: one trains, the other finds it
        if (data_dir / "tokenizer.model").is_file():
            return False
        train_docs, _ = load_documents(cfg)
        try:
            ensure_tokenizer(cfg, data_dir, train_docs)
        except UnicodeDecodeError as e:
            raise source_for(cfg).undecodable(e) from None
    return True


def _finished_run(stem: Path, fp: str, tok: Tokenizer) -> Optional[Dict[str, Any]]:
    """The metadata of a file's run that a killed worker finished (sizes as promised), else None, and its
    leftovers deleted."""
    try:
        meta = json.loads(stem.with_suffix(".json").read_text())
        n, docs = int(meta["num_tokens"]), int(meta["num_documents"])
        itemsize = token_dtype(tok.vocab_size).itemsize
        if (meta.get("fingerprint") == fp and meta.get("tokenizer_sha256") == tok.sha256
                and stem.with_suffix(".bin").stat().st_size == n * itemsize
                and stem.with_suffix(".idx").stat().st_size == (docs + 1) * 8
                and stem.with_suffix(".chars").stat().st_size == docs * 8):
            return meta
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for suffix in RUN_FILES:
        stem.with_suffix(suffix).unlink(missing_ok=True)
    return None


def _write_run(stem: Path, path: str, fmt: str, cfg: DataConfig, tok: Tokenizer, fp: str,
               num_proc: int) -> Dict[str, Any]:
    """Tokenise one file into its run (the .json last)."""
    try:
        docs = file_documents(cfg, [path], fmt, path)
        dtype, eos = token_dtype(tok.vocab_size), tok.eos_id
        starts, chars, h = [0], [], hashlib.sha256()
        tmp = stem.with_name(f"{stem.name}.bin.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            for ids, lengths in encode_documents(docs, tok, 0, num_proc):
                for doc, n in zip(ids, lengths):
                    data = np.asarray(doc + [eos], dtype=dtype).tobytes()
                    f.write(data)
                    h.update(data)
                    starts.append(starts[-1] + len(doc) + 1)
                    chars.append(n)
        # the single-process preparation refuses a corpus with no text at all: the merge asks every file
        has_text = any(pc.any(pc.match_substring_regex(b["text"], r"\S")).as_py()
                       for b in docs.with_format("arrow").iter(batch_size=1024))
    except UnicodeDecodeError as e:
        raise source_for(cfg).undecodable(e) from None
    os.replace(tmp, stem.with_suffix(".bin"))
    write_atomic(stem.with_suffix(".idx"), np.asarray(starts, dtype=np.uint64).tobytes())
    write_atomic(stem.with_suffix(".chars"), np.asarray(chars, dtype=np.uint64).tobytes())
    meta = {"file": path, "fingerprint": fp, "tokenizer_sha256": tok.sha256, "dtype": dtype.name,
            "num_documents": len(chars), "num_tokens": starts[-1], "num_chars": int(sum(chars)),
            "has_text": bool(has_text), "sha256": h.hexdigest()}
    write_atomic(stem.with_suffix(".json"), json.dumps(meta, indent=1).encode())
    return meta


def prepare_part(cfg: DataConfig, worker: int, workers: int, num_proc: Optional[int] = None,
                 command: str = "python -m kimi.data.prepare") -> Dict[str, Any]:
    """Worker ``worker`` of ``workers``: tokenise its files into runs (kimi.data.prepare.merge joins them).
    ``num_proc``: its processes (default data.num_proc, else every core this process may use); ``command``:
    the merge command (without a worker number), for the messages. Returns its progress record."""
    data_dir = data_dir_for(cfg)
    label = f"worker {worker}/{workers}"
    if (data_dir / MANIFEST).is_file():
        print(f"[data] {label}: {data_dir} is prepared already, nothing to do", flush=True)
        return {}
    fp = fingerprint(cfg)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok = _worker_tokenizer(cfg, data_dir, command)
    files, fmt, owner = plan(cfg, workers)
    mine = [k for k in range(len(files)) if owner[k] == worker]
    parts = parts_dir(data_dir, workers)
    out = worker_dir(parts, worker)
    out.mkdir(parents=True, exist_ok=True)
    (out / DONE).unlink(missing_ok=True)
    for stale in out.glob("*.tmp-*"):  # a killed run's unfinished files
        stale.unlink()
    num_proc = num_proc or default_num_proc(cfg.num_proc)
    t0 = time.perf_counter()
    record = {"worker": worker, "workers": workers, "files": len(mine), "files_done": 0, "documents": 0,
              "tokens": 0, "tokens_now": 0, "seconds": 0.0, "tokens_per_s": 0.0}
    print(f"[data] {label}: {len(mine)} of {len(files)} file(s) on {num_proc} process(es) into {out}",
          flush=True)
    for k in mine:
        stem = run_stem(parts, worker, k)
        meta = _finished_run(stem, fp, tok)
        if meta is None:
            meta = _write_run(stem, files[k], fmt, cfg, tok, fp, num_proc)
            record["tokens_now"] += meta["num_tokens"]
        record["files_done"] += 1
        record["documents"] += meta["num_documents"]
        record["tokens"] += meta["num_tokens"]
        record["seconds"] = round(time.perf_counter() - t0, 3)
        record["tokens_per_s"] = round(record["tokens_now"] / max(record["seconds"], 1e-9), 1)
        write_atomic(out / PROGRESS, json.dumps(record).encode())
        print(f"[data] {label}: file {record['files_done']}/{len(mine)} {Path(files[k]).name}: "
              f"{record['documents']:,} documents, {record['tokens']:,} tokens, "
              f"{record['tokens_per_s']:,.0f} tokens/s", flush=True)
    write_atomic(out / PROGRESS, json.dumps(record).encode())
    write_atomic(out / DONE, json.dumps(record).encode())  # last: the worker is done
    print(f"[data] {label} done: {len(mine)} file(s), {record['tokens']:,} tokens in "
          f"{record['seconds']:.1f}s; merge when all {workers} are done: `{command}`", flush=True)
    return record
