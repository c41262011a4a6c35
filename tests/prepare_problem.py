"""The preparation problem of tests/data/test_prepare_workers.py, shared with tests/parallel/test_slurm.py
(parts prepared by SLURM tasks): an uneven JSON-lines corpus, the data.* overrides that prepare it in tiny
shards, the prepare command's body in process, and where its output lands."""

import json
import random


def uneven_corpus(path):
    """Eleven JSON-lines files of different sizes (1 to 19 documents of 1 to 60 sentences): the 4 parts are
    uneven and shards and held-out documents fall across file boundaries."""
    rng = random.Random(7)
    words = "the king a fool my lord queen knave loves fears follows night letter sea stars crown".split()
    path.mkdir()
    for f in range(11):
        with open(path / f"part{f:02d}.jsonl", "w") as out:
            for _ in range(rng.randint(1, 19)):
                text = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize()
                                 + "." for _ in range(rng.randint(1, 60)))
                out.write(json.dumps({"text": text, "id": rng.random()}) + "\n")
    return path


def prepare_overrides(corpus, cache):
    return ["data=files", f"data.data_files=[{corpus}/*.jsonl]", f"data.cache_dir={cache}",
            "data.shard_mb=0.002", "data.num_proc=1", "data.tokenizer.vocab_size=300",
            "data.val_fraction=0.2"]


def prepare(*argv):
    from kimi.data.prepare.__main__ import main

    return main(list(argv))


def prepared_dir(overrides):
    from kimi.data.pack import data_dir_for
    from kimi.summary import compose_config

    return data_dir_for(compose_config(overrides).data)
