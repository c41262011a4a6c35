"""`python -m kimi.data.prepare [Hydra overrides]`: tokenise the configured data into shards before training.

Takes the overrides train.py takes (only the data section matters), e.g.::

    python -m kimi.data.prepare data=files 'data.data_files=[/data/*.jsonl]' data.num_proc=32

and writes the shards, their document index and the manifest where the trainer looks for them
(kimi.data.pack). Killed and run again, it keeps the finished shards and continues after them. Exit codes
as train.py's (kimi.cli): 0 done, 2 bad config or data.
"""

from __future__ import annotations

import sys
from typing import List

from kimi.data.prepare import prepare


def main(argv: List[str]) -> int:
    from omegaconf import OmegaConf

    from kimi.cli.conf_dir import compose
    from kimi.data.rules import validate_data

    cfg = OmegaConf.to_object(compose(["trainer.run_dir=unused", *argv])).data
    validate_data(cfg)
    if cfg.streaming:
        from kimi.errors import DataError

        raise DataError("data.streaming=true reads the source while training, so there are no shards to "
                        "prepare: run train.py with it, or set data.streaming=false to prepare shards")
    data = prepare(cfg, limit=False)
    for part in getattr(data, "parts", [data]):
        shards = {split: len(paths) for split, paths in part.shards.items()}
        print(f"[data] ready: {part.data_dir} ({shards['train']} train / {shards['val']} val shard(s), "
              f"manifest {part.data_dir / 'manifest.json'})", flush=True)
    return 0


def cli() -> None:
    """`kimi-prepare` and `python -m kimi.data.prepare`: the overrides checked first, as training checks
    them."""
    from kimi.cli import check_overrides, run_main
    from kimi.config import register_configs

    register_configs()  # the schema Hydra checks the overrides against
    if any(a in ("-h", "--help") for a in sys.argv[1:]):  # before Hydra, which cannot parse them
        import kimi.data.source_registry  # noqa: F401 (it fills data.source's choices)
        from kimi.cli.config_help import config_help

        print(config_help(__doc__, sys.argv[1:], only=("data",)))
        sys.exit(0)
    sys.exit(run_main(lambda: check_overrides(sys.argv[1:]) or main(sys.argv[1:])))


if __name__ == "__main__":
    cli()
