"""Preparing in parts against one process (docs/data.md, "Preparing across machines"): wall-clock tokens/s of
`python -m kimi.data.prepare` on one corpus as one process (data.num_proc=1 and =every core) and as
--workers workers through datatrove's local executor (one process each, as many at once as cores), merge
included, and their CPU seconds (the command and its processes; tokens per CPU second holds on a machine
shared with other work, as bench/data.py's), and a check that all of them wrote the same bytes.

The corpus: --files JSON-lines files of Shakespeare's works (bench/data.py's tokenizer.json recipe, --vocab
pieces), each file the works once with its own prefix per document. The files' arrow cache is made first
and not timed (the same for every run).

    python bench/prepare_workers.py [--files 8] [--workers 4] [--vocab 32000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def write_corpus(root: Path, files: int) -> int:
    from kimi.config import DataConfig
    from kimi.data.sources import shakespeare_texts

    works = list(shakespeare_texts(DataConfig()).values())
    root.mkdir(parents=True)
    written = 0
    for part in range(files):
        with open(root / f"part{part:03d}.jsonl", "w") as f:
            for i, text in enumerate(works):
                line = json.dumps({"text": f"[{part}.{i}]\n{text}"}) + "\n"
                f.write(line)
                written += len(line.encode())
    return written


def _child_cpu() -> float:
    """CPU seconds of the finished child processes (and theirs): the command and its workers."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _digest(data_dir: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(data_dir.iterdir()):
        if p.name != ".lock":
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def timed(name: str, overrides: list, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "kimi.data.prepare", *overrides, f"data.cache_dir={cache}"]
    cpu0, load0, t0 = _child_cpu(), os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _child_cpu() - cpu0
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    data_dir = next((cache / "datasets").iterdir())
    manifest = json.loads((data_dir / "manifest.json").read_text())
    tokens = sum(manifest["splits"][s]["num_tokens"] for s in ("train", "val"))
    merged = re.search(r"merged in ([\d.]+)s", proc.stdout)
    row = {"run": name, "command": " ".join(["python -m kimi.data.prepare", *overrides[1:]]),
           "tokens": tokens, "seconds": round(wall, 1), "tokens_per_s": round(tokens / wall),
           "cpu_seconds": round(cpu, 1), "tokens_per_cpu_s": round(tokens / cpu),
           "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
           "bytes": _digest(data_dir), "merge_seconds": float(merged.group(1)) if merged else None}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from data import train_tokenizer_json  # bench/data.py

    from kimi.config import DataConfig
    from kimi.data.sources import shakespeare_texts

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        size = write_corpus(work / "corpus", args.files)
        tok = train_tokenizer_json(list(shakespeare_texts(DataConfig()).values()), args.vocab, work / "tok")
        import datasets  # the arrow cache of each file, made once, untimed

        for f in sorted((work / "corpus").iterdir()):
            datasets.load_dataset("json", data_files=[str(f)], split="train")
        base = ["data=files", f"data.data_files=[{work / 'corpus'}/*.jsonl]", "data.val_fraction=0.01",
                f"data.tokenizer.model_path={tok / 'tokenizer.json'}"]
        cores = len(os.sched_getaffinity(0))
        parts = [f"data.prepare_workers={args.workers}", "data.prepare_executor=local"]
        rows = [timed("1 process, data.num_proc=1", [*base, "data.num_proc=1"], work / "c1"),
                timed(f"1 process, data.num_proc={cores}", [*base, f"data.num_proc={cores}"], work / "c2"),
                timed(f"{args.workers} workers, datatrove local", [*base, *parts], work / "c3")]
    same = len({r.pop("bytes") for r in rows}) == 1
    result = {"machine": f"{platform.machine()}, {cores} cores", "python": platform.python_version(),
              "corpus_bytes": size, "files": args.files, "same_bytes": same, "runs": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if not same:
        raise SystemExit("the runs wrote different bytes")


if __name__ == "__main__":
    main()
