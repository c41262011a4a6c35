"""`python -m kimi.data.prepare [Hydra overrides]`: tokenise the configured data into shards before training.

Takes the overrides train.py takes (only the data section matters), e.g.::

    python -m kimi.data.prepare data=files 'data.data_files=[/data/*.jsonl]' data.num_proc=32

and writes the shards, their document index and the manifest where the trainer looks for them
(kimi.data.pack). Killed and run again, it keeps the finished shards and continues after them. Exit codes
as train.py's (kimi.cli): 0 done, 2 bad config or data.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

from kimi.data.prepare import prepare

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def main(argv: List[str]) -> int:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kimi.config import register_configs
    from kimi.data.rules import validate_data

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=["trainer.run_dir=unused", *argv])).data
    validate_data(cfg)
    data = prepare(cfg, limit=False)
    for part in getattr(data, "parts", [data]):
        shards = {split: len(paths) for split, paths in part.shards.items()}
        print(f"[data] ready: {part.data_dir} ({shards['train']} train / {shards['val']} val shard(s), manifest "
              f"{part.data_dir / 'manifest.json'})", flush=True)
    return 0


if __name__ == "__main__":
    from kimi.cli import check_overrides, run_main
    from kimi.config import register_configs

    register_configs()  # the schema Hydra checks the overrides against
    sys.exit(run_main(lambda: check_overrides(sys.argv[1:], str(CONF_DIR)) or main(sys.argv[1:])))
