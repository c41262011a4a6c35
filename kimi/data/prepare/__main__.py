"""`python -m kimi.data.prepare [Hydra overrides]`: tokenise the configured data into shards before training.

Takes the overrides train.py takes (only the data section matters), e.g.::

    python -m kimi.data.prepare data=files 'data.data_files=[/data/*.jsonl]' data.num_proc=32

and writes the shards, their document index and the manifest where the trainer looks for them
(kimi.data.pack). Killed and run again, it keeps the finished shards and continues after them. Exit codes
as train.py's (kimi.cli): 0 done, 2 bad config or data.

Across machines (kimi/data/prepare/parts.py, docs/data.md "Preparing across machines"): with
data.prepare_workers=N, a worker number (data.prepare_worker=I, a SLURM array task or a torchrun rank)
prepares that part of data.data_files; without one the command makes the tokenizer (before the workers) or
merges the finished parts; data.prepare_executor=local|slurm has datatrove run the workers and the merge.
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
    data = _in_parts(cfg, argv) if (cfg.prepare_workers or 1) > 1 or cfg.prepare_executor else prepare(
        cfg, limit=False)
    if data is None:  # a worker's part, the tokenizer made, or SLURM jobs submitted: no data yet
        return 0
    for part in getattr(data, "parts", [data]):
        shards = {split: len(paths) for split, paths in part.shards.items()}
        print(f"[data] ready: {part.data_dir} ({shards['train']} train / {shards['val']} val shard(s), "
              f"manifest {part.data_dir / 'manifest.json'})", flush=True)
    return 0


def _in_parts(cfg, argv: List[str]):
    """data.prepare_workers > 1 (kimi/data/prepare/parts.py): this process's part when it has a worker
    number; else datatrove runs them all (data.prepare_executor); else the tokenizer is made if it is not
    yet (before any worker), or the finished parts are merged."""
    import importlib.util
    import os
    import shlex

    from kimi.data.encode import default_num_proc
    from kimi.data.prepare.merge import merge_parts
    from kimi.data.prepare.parts import make_tokenizer, prepare_part, this_worker
    from kimi.errors import ConfigError

    workers = cfg.prepare_workers or 1
    command = shlex.join(["python", "-m", "kimi.data.prepare",
                          *(a for a in argv if not a.startswith("data.prepare_worker="))])
    worker = this_worker(cfg, os.environ)
    if worker is not None:
        # torchrun starts LOCAL_WORLD_SIZE workers per machine: each gets its share of the cores
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        num_proc = cfg.num_proc or max(1, default_num_proc(None) // per_machine)
        prepare_part(cfg, worker, workers, num_proc, command)
        return None
    if cfg.prepare_executor:
        if importlib.util.find_spec("datatrove") is None:
            raise ConfigError(f"data.prepare_executor={cfg.prepare_executor} needs datatrove, which is not "
                              "installed: pip install 'kimi[prep]' (the prep extra), or launch the workers "
                              "yourself with data.prepare_worker=I (docs/data.md)")
        from kimi.data.prepare.executor import run_executor

        return run_executor(cfg, command)
    if make_tokenizer(cfg):
        print(f"[data] tokenizer ready; now run the {workers} workers: `{command} data.prepare_worker=I` "
              f"for I in 0..{workers - 1} (or as a SLURM array or torchrun ranks), then `{command}` again to "
              "merge", flush=True)
        return None
    return merge_parts(cfg, workers, command)


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
